"""A serving-style MoE block (the vLLM / SGLang shape): the routed experts run one fused call that
writes its result over `hidden_states` (`fused_experts(..., inplace=True)`), and the shared
expert reads the same `hidden_states`. On a side stream the shared expert would race with that
write, so the edit reads a snapshot taken at the fork, as the frameworks' engineers write it.
"""

import torch
import torch.nn.functional as F
from torch import nn


def fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, inplace=False):
    """Every routed expert in one call; with `inplace=True` the result overwrites `hidden_states`."""
    out = torch.zeros_like(hidden_states)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate, up = (hidden_states[token] @ w13[expert].t()).chunk(2, dim=-1)
        out.index_add_(0, token, (F.silu(gate) * up) @ w2[expert].t() * topk_weights[token, slot, None])
    if inplace:
        return hidden_states.copy_(out)
    return out


class SharedExpert(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedMoE(nn.Module):
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size):
        super().__init__()
        self.top_k = top_k
        self.w13 = nn.Parameter(torch.randn(num_experts, 2 * intermediate_size, hidden_size) * 0.05)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden_size, intermediate_size) * 0.05)

    def forward(self, hidden_states, router_logits):
        topk_weights, topk_ids = torch.topk(router_logits.softmax(dim=-1), self.top_k, dim=-1)
        return fused_experts(hidden_states, self.w13, self.w2, topk_weights, topk_ids, inplace=True)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=32, num_experts=8, top_k=2):
        super().__init__()
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size)
        self.shared_expert = SharedExpert(hidden_size, 2 * intermediate_size)

    def forward(self, hidden_states):
        num_tokens, hidden_dim = hidden_states.shape
        hidden_states = self.post_attention_layernorm(hidden_states)
        router_logits = self.gate(hidden_states)
        shared_output = self.shared_expert(hidden_states)
        # the fused routed experts overwrite hidden_states with their output
        final_hidden_states = self.experts(hidden_states, router_logits)
        final_hidden_states = final_hidden_states + shared_output
        return final_hidden_states.view(num_tokens, hidden_dim)


def make():
    torch.manual_seed(0)
    return SparseMoeBlock().eval(), (torch.randn(8, 64),)
