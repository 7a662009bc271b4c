"""A Llama-4-style block: the shared MLP written after the routed path, joined by an in-place add."""

import os
import torch
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
        # msrewrite(moe-shared-expert): ENABLE_MOE_SHARED_EXPERT_STREAM=0 turns the side stream off.
        self.enable_moe_shared_expert_stream = _ms_env_flag("ENABLE_MOE_SHARED_EXPERT_STREAM", True)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        # msrewrite(moe-shared-expert): the shared expert runs on side stream "shared_expert" during the routed experts.
        use_shared_expert_stream = _ms_graph_streams(self.enable_moe_shared_expert_stream)
        if use_shared_expert_stream:
            with torchair.scope.npu_stream_switch("shared_expert", 0):
                out = self.shared_mlp(
                    hidden_states,
                )
        router_scores = self.router(hidden_states)
        routed_out = sum(
            expert(hidden_states) * router_scores[:, i : i + 1] for i, expert in enumerate(self.experts)
        )
        # msrewrite(moe-shared-expert): with the flag off the shared expert runs here, as before.
        if not use_shared_expert_stream:
            out = self.shared_mlp(
                hidden_states,
            )
        out += routed_out  # in-place join
        return out, router_scores


def make():
    torch.manual_seed(0)
    return InplaceMoe().eval(), (torch.randn(3, 64),)
