"""A HunYuan-style MoE model: model -> decoder layers -> MoE with a shared MLP.

The shared MLP reads the block input while the gate and experts run; the sum joins them.
"""

import os
import torch
import torch.nn.functional as F
from torch import nn

# msrewrite: multi-stream helpers (cuda mode). With the flag off, or without
# the backend, each one falls back to the original single-stream behaviour.
_MS_SIDE_STREAMS = {}  # tag -> stream, one per process, shared by every layer


def _ms_env_flag(name, default):
    """A boolean switch from the environment: 1/true/yes/on enable it, 0/false/no/off disable it."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in ("1", "true", "yes", "on")


def _ms_side_stream(tag, enabled=True):
    """The side stream for `tag`, created on first use and shared by every layer; None when off."""
    if not enabled or not torch.cuda.is_available():
        return None
    stream = _MS_SIDE_STREAMS.get(tag)
    if stream is None:
        stream = _MS_SIDE_STREAMS[tag] = torch.cuda.Stream()
    return stream


def _ms_record_stream(stream, *values):
    """Mark tensors (also inside tuples and lists) as in use on `stream`, so the caching allocator
    cannot hand their memory out early."""
    for value in values:
        if isinstance(value, torch.Tensor):
            value.record_stream(stream)
        elif isinstance(value, (tuple, list)):
            _ms_record_stream(stream, *value)


class HunyuanMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_and_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class HunyuanMoE(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts=4, top_k=2, layer_idx=None, shared_mlp_stream=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(HunyuanMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.shared_mlp = HunyuanMLP(hidden_size, intermediate_size)
        # msrewrite(moe-shared-mlp-init): ENABLE_SHARED_MLP_STREAM=0 turns the side stream off.
        self.enable_shared_mlp_stream = _ms_env_flag("ENABLE_SHARED_MLP_STREAM", True)
        # Handed down by the model so every layer shares one stream; built directly, the layer
        # falls back to the same process-wide stream, created on first use.
        if shared_mlp_stream is None:
            shared_mlp_stream = _ms_side_stream("shared_mlp", self.enable_shared_mlp_stream)
        self.shared_mlp_stream = shared_mlp_stream

    def forward(self, hidden_states):
        # msrewrite(moe-shared-mlp-init): the shared MLP runs on side stream "shared_mlp" during the routed experts.
        shared_mlp_stream = self.shared_mlp_stream
        if shared_mlp_stream is not None:
            current_stream = torch.cuda.current_stream()
            input_ready_event = torch.cuda.Event()
            input_ready_event.record(current_stream)
            with torch.cuda.stream(shared_mlp_stream):
                input_ready_event.wait(shared_mlp_stream)
                hidden_states_mlp = self.shared_mlp(hidden_states)
        bsz, seq_len, hidden_size = hidden_states.shape
        if shared_mlp_stream is None:
            hidden_states_mlp = self.shared_mlp(hidden_states)
        reshaped_input = hidden_states.reshape(-1, hidden_size)
        weights, experts = torch.topk(self.gate(reshaped_input).softmax(dim=-1), self.top_k, dim=-1)
        combined_output = torch.zeros_like(reshaped_input)
        for expert_id, expert in enumerate(self.experts):
            token_idx, slot = torch.where(experts == expert_id)
            combined_output.index_add_(0, token_idx, expert(reshaped_input[token_idx]) * weights[token_idx, slot, None])
        combined_output = combined_output.reshape(bsz, seq_len, hidden_size)
        # msrewrite(moe-shared-mlp-init): join the side stream before the first use of hidden_states_mlp.
        if shared_mlp_stream is not None:
            shared_mlp_done_event = torch.cuda.Event()
            shared_mlp_done_event.record(shared_mlp_stream)
            shared_mlp_done_event.wait(current_stream)
            # Allocated on the side stream, freed on this one: keep them from early reuse.
            _ms_record_stream(current_stream, hidden_states_mlp)
        output = hidden_states_mlp + combined_output
        return output


class HunyuanDecoderLayer(nn.Module):
    def __init__(self, hidden_size, intermediate_size, layer_idx, shared_mlp_stream=None):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size)
        self.mlp = HunyuanMoE(hidden_size, intermediate_size, layer_idx=layer_idx, shared_mlp_stream=shared_mlp_stream)

    def forward(self, hidden_states):
        return hidden_states + self.mlp(self.norm(hidden_states))


class HunyuanModel(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=32, num_layers=2):
        super().__init__()
        # msrewrite(moe-shared-mlp-init): one side stream for every layer, created once with the model.
        shared_mlp_stream = _ms_side_stream("shared_mlp", _ms_env_flag("ENABLE_SHARED_MLP_STREAM", True))
        self.layers = nn.ModuleList(
            HunyuanDecoderLayer(hidden_size, intermediate_size, layer_idx, shared_mlp_stream=shared_mlp_stream) for layer_idx in range(num_layers)
        )

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


def make():
    torch.manual_seed(0)
    return HunyuanModel().eval(), (torch.randn(2, 8, 64),)
