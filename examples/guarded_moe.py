"""A serving-style MoE block: the shared expert is optional, built only when the config asks for it.

The block tests `self.shared_experts is not None` where it uses the shared expert, after the
routed experts, as SGLang and vLLM model files do. `make()` builds it with example inputs for
`msrewrite verify`.
"""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts):
        super().__init__()
        self.experts = nn.ModuleList(MLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, hidden_states, topk_weights, topk_ids):
        out = torch.zeros_like(hidden_states)
        for expert_idx, expert in enumerate(self.experts):
            token_idx, slot = torch.where(topk_ids == expert_idx)
            if token_idx.numel() == 0:
                continue
            out.index_add_(0, token_idx, expert(hidden_states[token_idx]) * topk_weights[token_idx, slot, None])
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, n_shared_experts=1):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(hidden_size, intermediate_size, num_experts)
        self.shared_experts = MLP(hidden_size, intermediate_size * n_shared_experts) if n_shared_experts else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden_dim = hidden_states.shape
        router_logits = self.gate(hidden_states)
        topk_weights, topk_ids = torch.topk(router_logits.softmax(dim=-1), self.top_k, dim=-1)
        final_hidden_states = self.experts(hidden_states, topk_weights, topk_ids)
        if self.shared_experts is not None:
            shared_output = self.shared_experts(hidden_states)
            final_hidden_states += shared_output
        return final_hidden_states.view(num_tokens, hidden_dim)


def make():
    torch.manual_seed(0)
    return SparseMoeBlock().eval(), (torch.randn(16, 64),)
