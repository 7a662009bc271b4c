"""An SGLang-style MoE block (Qwen2MoeSparseMoeBlock._forward_deepep): the routed path is
dispatch -> expert compute -> combine, and a gated shared expert is added at the end.

Single-rank stand-ins for the dispatcher keep it runnable on a CPU.
"""

import torch
import torch.nn.functional as F
from torch import nn


class MergedMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        x = self.act_fn(gate_up)
        x = self.down_proj(x)
        return x


class SiluAndMul(nn.Module):
    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class TopK(nn.Module):
    def __init__(self, top_k):
        super().__init__()
        self.top_k = top_k

    def forward(self, router_logits):
        weights, idx = torch.topk(router_logits.softmax(dim=-1), self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), idx


class Dispatcher(nn.Module):
    """Sorts tokens by expert (all-to-all dispatch on one rank) and scatters them back (combine)."""

    def dispatch(self, hidden_states, topk_idx, topk_weights):
        flat_idx = topk_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        token_of = order // topk_idx.shape[1]
        return hidden_states[token_of], flat_idx[order], topk_weights.reshape(-1)[order], token_of

    def combine(self, combine_input):
        expert_out, weights, token_of, num_tokens = combine_input
        out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=expert_out.dtype)
        return out.index_add_(0, token_of, expert_out * weights[:, None])


class DeepEPMoE(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts):
        super().__init__()
        self.dispatcher = Dispatcher()
        self.w13 = nn.Parameter(torch.randn(num_experts, hidden_size, 2 * intermediate_size) * 0.05)
        self.w2 = nn.Parameter(torch.randn(num_experts, intermediate_size, hidden_size) * 0.05)

    def run_moe_core(self, dispatch_output):
        tokens, expert_ids, weights, token_of = dispatch_output
        gate, up = torch.bmm(tokens[:, None], self.w13[expert_ids])[:, 0].chunk(2, dim=-1)
        expert_out = torch.bmm((F.silu(gate) * up)[:, None], self.w2[expert_ids])[:, 0]
        return expert_out, weights, token_of, int(token_of.max()) + 1


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=32, num_experts=8, top_k=2):
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.topk = TopK(top_k)
        self.experts = DeepEPMoE(hidden_size, intermediate_size, num_experts)
        self.shared_expert = MergedMLP(hidden_size, 2 * intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        router_logits = self.gate(hidden_states)
        shared_output = self.shared_expert(hidden_states)
        shared_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_output
        topk_weights, topk_idx = self.topk(router_logits)
        dispatch_output = self.experts.dispatcher.dispatch(hidden_states, topk_idx, topk_weights)
        combine_input = self.experts.run_moe_core(dispatch_output)
        final_hidden_states = self.experts.dispatcher.combine(combine_input)
        final_hidden_states.add_(shared_output)
        return final_hidden_states


def make():
    torch.manual_seed(0)
    return Qwen2MoeSparseMoeBlock().eval(), (torch.randn(16, 64),)
