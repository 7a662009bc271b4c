"""A Qwen-MoE-style block: a shared expert scaled by a sigmoid gate, written before the router."""

import os
import torch
import torch.nn.functional as F
from torch import nn

# msrewrite: multi-stream helpers (ge-graph mode). With the flag off, or without
# the backend, each one falls back to the original single-stream behaviour.
try:
    import torch_npu  # noqa: F401  (torchair ships inside torch_npu and is registered by it)
    import torchair
    from torchair import scope as _ms_torchair_scope  # noqa: F401  (loads torchair now, not in forward)
except Exception:  # no NPU stack, or torchair fails to initialise: the side stream stays off
    torchair = None

_MS_GE_GRAPH = True  # compiled graphs are GE graphs: this edit's mode, until _ms_torchair_config says


def _ms_env_flag(name, default):
    """A boolean switch from the environment: 1/true/yes/on enable it, 0/false/no/off disable it."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in ("1", "true", "yes", "on")


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


def _ms_torchair_config(config):
    """Record whether torchair compiles GE graphs with `config`, and return it:
    torchair.get_npu_backend(compiler_config=_ms_torchair_config(config)).

    npu_wait_tensor and the implicit join exist only in a GE graph (mode "max-autotune"), and
    torchair has no predicate for it: torch.compiler.is_compiling() is also true under
    reduce-overhead, npugraph_ex and debug.run_eagerly, where the op raises and nothing joins
    the side stream.
    """
    global _MS_GE_GRAPH
    mode = getattr(config.mode, "value", config.mode)
    run_eagerly = getattr(config.debug.run_eagerly, "value", config.debug.run_eagerly)
    _MS_GE_GRAPH = mode == "max-autotune" and not run_eagerly
    return config


def _ms_graph_streams(enabled):
    """GE multi-stream needs torchair, and inside a compiled graph GE graph mode: other graphs do not
    join the side stream. Otherwise the original single-stream path runs (in eager the switch is a no-op)."""
    if not enabled or torchair is None:
        return False
    return _MS_GE_GRAPH or not torch.compiler.is_compiling()


def _ms_wait_tensor(tensor, dependency):
    """Order `tensor`'s consumers after `dependency` inside a GE graph.

    torchair's npu_wait_tensor raises outside a GE graph (prefill runs eager; reduce-overhead,
    npugraph_ex and run_eagerly too), so it is only called while torch.compile traces a GE graph;
    in eager the stream switch is a no-op and the order holds anyway.
    """
    if torchair is None or not (_MS_GE_GRAPH and torch.compiler.is_compiling()):
        return tensor
    while isinstance(dependency, (tuple, list)) and dependency:  # an op's outputs: any one orders it
        dependency = next((d for d in dependency if isinstance(d, torch.Tensor)), dependency[0])
    return torchair.scope.npu_wait_tensor(tensor, dependency)


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
        use_shared_expert_stream = _ms_graph_streams(self.enable_moe_shared_expert_stream and _ms_runs_as_inlined(self.shared_expert, SwiGLU))
        if use_shared_expert_stream:
            with torchair.scope.npu_stream_switch("shared_expert", 0):
                shared_expert_gate_2, shared_expert_up = self.shared_expert.gate_up_proj(hidden_states).chunk(2, dim=-1)
                shared_expert_gate_out = self.shared_expert_gate(hidden_states)
        else:
            shared_expert_output = self.shared_expert(hidden_states)

        routing_weights, selected_experts = self.route(hidden_states)
        # msrewrite(moe-shared-expert-phased): phase 1 of the shared expert re-enters the side stream after selected_experts.
        if use_shared_expert_stream:
            with torchair.scope.npu_stream_switch("shared_expert", 0):
                shared_expert_gate_2 = _ms_wait_tensor(shared_expert_gate_2, selected_experts)
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

        # msrewrite(moe-shared-expert-phased): with the flag off the shared expert runs here, as before.
        if not use_shared_expert_stream:
            shared_expert_output = (
                F.sigmoid(self.shared_expert_gate(hidden_states))
                * shared_expert_output
            )
        final_hidden_states = final_hidden_states + shared_expert_output
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


def make():
    torch.manual_seed(0)
    return SparseMoeBlock().eval(), (torch.randn(2, 8, 64),)
