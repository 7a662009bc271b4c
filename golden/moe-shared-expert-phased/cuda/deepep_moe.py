"""An SGLang-style MoE block (Qwen2MoeSparseMoeBlock._forward_deepep): the routed path is
dispatch -> expert compute -> combine, and a gated shared expert is added at the end.

Single-rank stand-ins for the dispatcher keep it runnable on a CPU.
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
        # msrewrite(moe-shared-expert-phased): ENABLE_MOE_SHARED_EXPERT_STREAM=0 turns the side stream off.
        self.enable_moe_shared_expert_stream = _ms_env_flag("ENABLE_MOE_SHARED_EXPERT_STREAM", True)

    def forward(self, hidden_states):
        # msrewrite(moe-shared-expert-phased): the shared expert runs on side stream "shared_expert" during the routed experts.
        shared_expert_stream = _ms_side_stream("shared_expert", self.enable_moe_shared_expert_stream and _ms_runs_as_inlined(self.shared_expert, MergedMLP))
        if shared_expert_stream is not None:
            current_stream = torch.cuda.current_stream()
            shared_expert_stream.wait_stream(current_stream)
            with torch.cuda.stream(shared_expert_stream):
                shared_expert_gate_up = self.shared_expert.gate_up_proj(hidden_states)
                shared_expert_gate_out = self.shared_expert_gate(hidden_states)
        router_logits = self.gate(hidden_states)
        if shared_expert_stream is None:
            shared_output = self.shared_expert(hidden_states)
            shared_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_output
        topk_weights, topk_idx = self.topk(router_logits)
        dispatch_output = self.experts.dispatcher.dispatch(hidden_states, topk_idx, topk_weights)
        # msrewrite(moe-shared-expert-phased): phase 1 of the shared expert re-enters the side stream after dispatch_output.
        if shared_expert_stream is not None:
            shared_expert_stream.wait_stream(current_stream)
            with torch.cuda.stream(shared_expert_stream):
                shared_expert_x = self.shared_expert.act_fn(shared_expert_gate_up)
                sigmoid_out = F.sigmoid(shared_expert_gate_out)
        combine_input = self.experts.run_moe_core(dispatch_output)
        # msrewrite(moe-shared-expert-phased): phase 2 of the shared expert re-enters the side stream after combine_input.
        if shared_expert_stream is not None:
            shared_expert_stream.wait_stream(current_stream)
            with torch.cuda.stream(shared_expert_stream):
                shared_output = self.shared_expert.down_proj(shared_expert_x)
                shared_output = sigmoid_out * shared_output
        final_hidden_states = self.experts.dispatcher.combine(combine_input)
        # msrewrite(moe-shared-expert-phased): join the side stream before the first use of shared_output.
        if shared_expert_stream is not None:
            current_stream.wait_stream(shared_expert_stream)
            # Allocated on the side stream, freed on this one: keep them from early reuse.
            _ms_record_stream(current_stream, shared_output)
        final_hidden_states.add_(shared_output)
        return final_hidden_states


def make():
    torch.manual_seed(0)
    return Qwen2MoeSparseMoeBlock().eval(), (torch.randn(16, 64),)
