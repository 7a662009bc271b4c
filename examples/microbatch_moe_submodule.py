"""A prefill MoE decoder stack whose collectives sit one module deeper: the layer calls
`self.moe(x)`, and the MoE block's forward exchanges the tokens with collectives over the
expert-parallel group before and after the experts (all_reduce stands in for the all-to-all, so
it runs with gloo on a CPU). Sequences are independent, so the batch can be split between
micro-batches.
"""

import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    def __init__(self, hidden_size, num_experts):
        super().__init__()
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.Parameter(torch.randn(num_experts, hidden_size, hidden_size) * 0.05)

    def forward(self, hidden_states):
        weights = self.router(hidden_states).softmax(dim=-1)
        tokens = hidden_states.clone()
        dist.all_reduce(tokens)  # dispatch
        expert_out = torch.einsum("bte,ehd,bth->btd", weights, self.experts, tokens)
        dist.all_reduce(expert_out)  # combine
        return expert_out / dist.get_world_size()


class MoEDecoderLayer(nn.Module):
    def __init__(self, hidden_size=64, num_experts=4):
        super().__init__()
        self.input_norm = nn.LayerNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.post_norm = nn.LayerNorm(hidden_size)
        self.moe = MoE(hidden_size, num_experts)

    def forward(self, hidden_states):
        q, k, v = self.qkv(self.input_norm(hidden_states)).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden_states = hidden_states + self.o_proj(attn)
        moe_out = self.moe(self.post_norm(hidden_states))
        return hidden_states + moe_out


class MoEModel(nn.Module):
    def __init__(self, hidden_size=64, num_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(MoEDecoderLayer(hidden_size) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


def make():
    """The model and its input. Run alone (by `msrewrite verify` or `suggest`), it first starts a
    one-process gloo group on loopback, so the collectives run for real."""
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    return MoEModel().eval(), (torch.randn(4, 8, 64),)  # 4 sequences of 8 tokens
