"""A Qwen-MoE-style block: a shared expert scaled by a sigmoid gate, written before the router."""

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


def _ms_runs_as_inlined(module, cls):
    """True when calling `module` would run nothing but `cls.forward` as written in this file, so the
    side stream may run that forward's statements inlined: `module` is a `cls` (no subclass), the
    forward is this file's own (not replaced on the class or the instance), and its __call__ has
    nothing else to do (no forward, pre-forward or backward hooks, on it or torch's global ones, no
    torch.compile'd call, no JIT trace; a global hook marked `_ms_observer`, as msrewrite verify's
    sanitizer marks its own, only watches). Otherwise False, and the original call runs instead, on the
    current stream. Checked on every forward: attribute and dict reads only."""
    try:
        forward = vars(cls).get("forward")
        code = getattr(forward, "__code__", None)
        hooks = torch.nn.modules.module
        return not (
            type(module) is not cls
            or code is None
            or code.co_filename != __file__
            or getattr(forward, "__qualname__", None) != cls.__qualname__ + ".forward"
            or hasattr(forward, "__wrapped__")
            or "forward" in vars(module)
            or "_call_impl" in vars(module)
            or cls.__call__ is not torch.nn.Module._wrapped_call_impl
            or module._compiled_call_impl is not None
            or module._forward_hooks
            or module._forward_pre_hooks
            or module._backward_hooks
            or module._backward_pre_hooks
            or any(not getattr(h, "_ms_observer", False) for h in hooks._global_forward_hooks.values())
            or any(not getattr(h, "_ms_observer", False) for h in hooks._global_forward_pre_hooks.values())
            or hooks._global_backward_hooks
            or hooks._global_backward_pre_hooks
            or torch._C._get_tracing_state()
        )
    except Exception:  # another torch, a module without these attributes: keep the call
        return False


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
        # msrewrite(moe-shared-expert-phased): ENABLE_MOE_SHARED_EXPERT_STREAM=0 turns the side stream off.
        self.enable_moe_shared_expert_stream = _ms_env_flag("ENABLE_MOE_SHARED_EXPERT_STREAM", True)

    def route(self, hidden_states):
        routing_weights = F.softmax(self.gate(hidden_states), dim=-1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        return routing_weights.to(hidden_states.dtype), selected_experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        # msrewrite(moe-shared-expert-phased): the shared expert runs on side stream "shared_expert" during the routed experts.
        shared_expert_stream = _ms_side_stream("shared_expert", self.enable_moe_shared_expert_stream and _ms_runs_as_inlined(self.shared_expert, SwiGLU))
        if shared_expert_stream is not None:
            current_stream = torch.cuda.current_stream()
            shared_expert_stream.wait_stream(current_stream)
            with torch.cuda.stream(shared_expert_stream):
                shared_expert_gate_2, shared_expert_up = self.shared_expert.gate_up_proj(hidden_states).chunk(2, dim=-1)
                shared_expert_gate_out = self.shared_expert_gate(hidden_states)
        else:
            shared_expert_output = self.shared_expert(hidden_states)

        routing_weights, selected_experts = self.route(hidden_states)
        # msrewrite(moe-shared-expert-phased): phase 1 of the shared expert re-enters the side stream after selected_experts.
        if shared_expert_stream is not None:
            shared_expert_stream.wait_stream(current_stream)
            with torch.cuda.stream(shared_expert_stream):
                silu_out = F.silu(shared_expert_gate_2)
                mul_out = silu_out * shared_expert_up
                shared_expert_output = self.shared_expert.down_proj(mul_out)
                sigmoid_out = F.sigmoid(shared_expert_gate_out)
                shared_expert_output = sigmoid_out * shared_expert_output
        final_hidden_states = torch.zeros_like(hidden_states)
        for expert_idx in range(len(self.experts)):
            token_idx, slot = torch.where(selected_experts == expert_idx)
            expert_out = self.experts[expert_idx](hidden_states[token_idx])
            final_hidden_states.index_add_(0, token_idx, expert_out * routing_weights[token_idx, slot, None])

        # msrewrite(moe-shared-expert-phased): join the side stream before the first use of shared_expert_output.
        if shared_expert_stream is not None:
            current_stream.wait_stream(shared_expert_stream)
            # Allocated on the side stream, freed on this one: keep them from early reuse.
            _ms_record_stream(current_stream, shared_expert_output)
        else:
            shared_expert_output = (
                F.sigmoid(self.shared_expert_gate(hidden_states))
                * shared_expert_output
            )
        final_hidden_states = final_hidden_states + shared_expert_output
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


def make():
    torch.manual_seed(0)
    return SparseMoeBlock().eval(), (torch.randn(2, 8, 64),)
