"""A Qwen-MoE-style block: a shared expert scaled by a sigmoid gate, written before the router."""

import os
import torch
import torch.nn.functional as F
from torch import nn

# msrewrite: multi-stream helpers (eager mode). With the flag off, or without
# the backend, each one falls back to the original single-stream behaviour.
try:
    import torch_npu  # noqa: F401  (registers torch.npu)
except ImportError:  # no NPU stack: the side stream stays off
    torch_npu = None

_MS_SIDE_STREAMS = {}  # tag -> stream, one per process, shared by every layer


def _ms_env_flag(name, default):
    """A boolean switch from the environment: 1/true/yes/on enable it, 0/false/no/off disable it."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in ("1", "true", "yes", "on")


def _ms_side_stream(tag, enabled=True):
    """The side stream for `tag`, created on first use and shared by every layer; None when off."""
    if not enabled or not hasattr(torch, "npu"):
        return None
    stream = _MS_SIDE_STREAMS.get(tag)
    if stream is None:
        stream = _MS_SIDE_STREAMS[tag] = torch.npu.Stream()
    return stream


def _ms_record_stream(stream, *values):
    """Mark tensors (also inside tuples and lists) as in use on `stream`, so the caching allocator
    cannot hand their memory out early."""
    for value in values:
        if isinstance(value, torch.Tensor):
            value.record_stream(stream)
        elif isinstance(value, (tuple, list)):
            _ms_record_stream(stream, *value)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=32, num_experts=8, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden_size, intermediate_size) for _ in range(num_experts))
        self.shared_expert = SwiGLU(hidden_size, 2 * intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        # msrewrite(moe-shared-expert): ENABLE_MOE_SHARED_EXPERT_STREAM=0 turns the side stream off.
        self.enable_moe_shared_expert_stream = _ms_env_flag("ENABLE_MOE_SHARED_EXPERT_STREAM", True)

    def route(self, hidden_states):
        routing_weights = F.softmax(self.gate(hidden_states), dim=-1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        return routing_weights.to(hidden_states.dtype), selected_experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        # msrewrite(moe-shared-expert): the routed experts' work runs on side stream "routed_experts" during the shared expert.
        routed_experts_stream = _ms_side_stream("routed_experts", self.enable_moe_shared_expert_stream)
        if routed_experts_stream is not None:
            current_stream = torch.npu.current_stream()
            routed_experts_stream.wait_stream(current_stream)
            with torch.npu.stream(routed_experts_stream):
                routing_weights, selected_experts = self.route(hidden_states)
                final_hidden_states = torch.zeros_like(hidden_states)
                for expert_idx in range(len(self.experts)):
                    token_idx, slot = torch.where(selected_experts == expert_idx)
                    expert_out = self.experts[expert_idx](hidden_states[token_idx])
                    final_hidden_states.index_add_(0, token_idx, expert_out * routing_weights[token_idx, slot, None])
        shared_expert_output = self.shared_expert(hidden_states)

        if routed_experts_stream is None:
            routing_weights, selected_experts = self.route(hidden_states)
            final_hidden_states = torch.zeros_like(hidden_states)
            for expert_idx in range(len(self.experts)):
                token_idx, slot = torch.where(selected_experts == expert_idx)
                expert_out = self.experts[expert_idx](hidden_states[token_idx])
                final_hidden_states.index_add_(0, token_idx, expert_out * routing_weights[token_idx, slot, None])

        shared_expert_output = (
            F.sigmoid(self.shared_expert_gate(hidden_states))
            * shared_expert_output
        )
        # msrewrite(moe-shared-expert): join the side stream before the first use of final_hidden_states.
        if routed_experts_stream is not None:
            current_stream.wait_stream(routed_experts_stream)
            # Allocated on the side stream, freed on this one: keep them from early reuse.
            _ms_record_stream(current_stream, final_hidden_states)
        final_hidden_states = final_hidden_states + shared_expert_output
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


def make():
    torch.manual_seed(0)
    return SparseMoeBlock().eval(), (torch.randn(2, 8, 64),)
