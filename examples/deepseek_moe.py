"""A DeepSeek-V3-style MoE block: routed experts plus an always-on shared expert.

Small enough to run on a CPU; `make()` builds it with example inputs for `msrewrite verify`.
"""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    def __init__(self, hidden_size, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(num_experts, hidden_size) * 0.02)

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        logits = F.linear(hidden_states, self.weight)
        scores = logits.sigmoid()
        topk_weights, topk_indices = torch.topk(scores, self.top_k, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return logits, topk_weights, topk_indices


class Experts(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts):
        super().__init__()
        self.experts = nn.ModuleList(MLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, hidden_states, topk_indices, topk_weights):
        out = torch.zeros_like(hidden_states)
        for expert_idx, expert in enumerate(self.experts):
            token_idx, slot = torch.where(topk_indices == expert_idx)
            if token_idx.numel() == 0:
                continue
            weighted = expert(hidden_states[token_idx]) * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, weighted)
        return out


class DeepseekMoE(nn.Module):
    """Routed experts plus shared experts, summed at the end."""

    def __init__(self, hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, n_shared_experts=1):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k)
        self.experts = Experts(hidden_size, intermediate_size, num_experts)
        self.shared_experts = MLP(hidden_size, intermediate_size * n_shared_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        orig_shape = hidden_states.shape
        # route every token to its top-k experts
        _, topk_weights, topk_indices = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        hidden_states = hidden_states + self.shared_experts(residuals)  # shared experts see every token
        return hidden_states


def make():
    torch.manual_seed(0)
    return DeepseekMoE().eval(), (torch.randn(2, 8, 64),)
