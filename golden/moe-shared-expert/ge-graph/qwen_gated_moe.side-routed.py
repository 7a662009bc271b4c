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
        use_routed_experts_stream = _ms_graph_streams(self.enable_moe_shared_expert_stream)
        if use_routed_experts_stream:
            with torchair.scope.npu_stream_switch("routed_experts", 0):
                routing_weights, selected_experts = self.route(hidden_states)
                final_hidden_states = torch.zeros_like(hidden_states)
                for expert_idx in range(len(self.experts)):
                    token_idx, slot = torch.where(selected_experts == expert_idx)
                    expert_out = self.experts[expert_idx](hidden_states[token_idx])
                    final_hidden_states.index_add_(0, token_idx, expert_out * routing_weights[token_idx, slot, None])
        shared_expert_output = self.shared_expert(hidden_states)

        if not use_routed_experts_stream:
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
        final_hidden_states = final_hidden_states + shared_expert_output
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


def make():
    torch.manual_seed(0)
    return SparseMoeBlock().eval(), (torch.randn(2, 8, 64),)
