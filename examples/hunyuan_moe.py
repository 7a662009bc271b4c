"""A HunYuan-style MoE model: model -> decoder layers -> MoE with a shared MLP.

The shared MLP reads the block input while the gate and experts run; the sum joins them.
"""

import torch
import torch.nn.functional as F
from torch import nn


class HunyuanMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_and_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class HunyuanMoE(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts=4, top_k=2, layer_idx=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(HunyuanMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.shared_mlp = HunyuanMLP(hidden_size, intermediate_size)

    def forward(self, hidden_states):
        bsz, seq_len, hidden_size = hidden_states.shape
        hidden_states_mlp = self.shared_mlp(hidden_states)
        reshaped_input = hidden_states.reshape(-1, hidden_size)
        weights, experts = torch.topk(self.gate(reshaped_input).softmax(dim=-1), self.top_k, dim=-1)
        combined_output = torch.zeros_like(reshaped_input)
        for expert_id, expert in enumerate(self.experts):
            token_idx, slot = torch.where(experts == expert_id)
            combined_output.index_add_(0, token_idx, expert(reshaped_input[token_idx]) * weights[token_idx, slot, None])
        combined_output = combined_output.reshape(bsz, seq_len, hidden_size)
        output = hidden_states_mlp + combined_output
        return output


class HunyuanDecoderLayer(nn.Module):
    def __init__(self, hidden_size, intermediate_size, layer_idx):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size)
        self.mlp = HunyuanMoE(hidden_size, intermediate_size, layer_idx=layer_idx)

    def forward(self, hidden_states):
        return hidden_states + self.mlp(self.norm(hidden_states))


class HunyuanModel(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=32, num_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(
            HunyuanDecoderLayer(hidden_size, intermediate_size, layer_idx) for layer_idx in range(num_layers)
        )

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


def make():
    torch.manual_seed(0)
    return HunyuanModel().eval(), (torch.randn(2, 8, 64),)
