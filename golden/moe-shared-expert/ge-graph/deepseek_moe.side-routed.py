"""A DeepSeek-V3-style MoE block: routed experts plus an always-on shared expert.

Small enough to run on a CPU; `make()` builds it with example inputs for `msrewrite verify`.
"""

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
        # msrewrite(moe-shared-expert): ENABLE_MOE_SHARED_EXPERT_STREAM=0 turns the side stream off.
        self.enable_moe_shared_expert_stream = _ms_env_flag("ENABLE_MOE_SHARED_EXPERT_STREAM", True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        # msrewrite(moe-shared-expert): the routed experts' work runs on side stream "routed_experts" during the shared expert.
        use_routed_experts_stream = _ms_graph_streams(self.enable_moe_shared_expert_stream)
        if use_routed_experts_stream:
            with torchair.scope.npu_stream_switch("routed_experts", 0):
                orig_shape = hidden_states.shape
                _, topk_weights, topk_indices = self.gate(hidden_states)
                hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
                hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        else:
            orig_shape = hidden_states.shape
            # route every token to its top-k experts
            _, topk_weights, topk_indices = self.gate(hidden_states)
            hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
            hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        # msrewrite(moe-shared-expert): with the flag on, self.shared_experts runs here, during the routed experts' work.
        if use_routed_experts_stream:
            shared_experts_output = self.shared_experts(residuals)
            hidden_states = hidden_states + shared_experts_output  # shared experts see every token
        else:
            hidden_states = hidden_states + self.shared_experts(residuals)  # shared experts see every token
        return hidden_states


def make():
    torch.manual_seed(0)
    return DeepseekMoE().eval(), (torch.randn(2, 8, 64),)
