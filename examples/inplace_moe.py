"""A Llama-4-style block: the shared MLP written after the routed path, joined by an in-place add."""

import torch
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size)
        self.down = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Router(nn.Module):
    def __init__(self, hidden_size, num_experts):
        super().__init__()
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, x):
        return torch.sigmoid(self.proj(x))


class InplaceMoe(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=48, num_experts=4):
        super().__init__()
        self.hidden_dim = hidden_size
        self.router = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(FeedForward(hidden_size, intermediate_size) for _ in range(num_experts))
        self.shared_mlp = FeedForward(hidden_size, intermediate_size)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores = self.router(hidden_states)
        routed_out = sum(
            expert(hidden_states) * router_scores[:, i : i + 1] for i, expert in enumerate(self.experts)
        )
        out = self.shared_mlp(
            hidden_states,
        )
        out += routed_out  # in-place join
        return out, router_scores


def make():
    torch.manual_seed(0)
    return InplaceMoe().eval(), (torch.randn(3, 64),)
