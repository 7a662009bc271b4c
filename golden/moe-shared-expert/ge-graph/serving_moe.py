"""A serving-style MoE block (the vLLM / SGLang shape): the routed experts run one fused call that
writes its result over `hidden_states` (`fused_experts(..., inplace=True)`), and the shared
expert reads the same `hidden_states`. On a side stream the shared expert would race with that
write, so the edit reads a snapshot taken at the fork, as the frameworks' engineers write it.
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


def fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, inplace=False):
    """Every routed expert in one call; with `inplace=True` the result overwrites `hidden_states`."""
    out = torch.zeros_like(hidden_states)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate, up = (hidden_states[token] @ w13[expert].t()).chunk(2, dim=-1)
        out.index_add_(0, token, (F.silu(gate) * up) @ w2[expert].t() * topk_weights[token, slot, None])
    if inplace:
        return hidden_states.copy_(out)
    return out


class SharedExpert(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedMoE(nn.Module):
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size):
        super().__init__()
        self.top_k = top_k
        self.w13 = nn.Parameter(torch.randn(num_experts, 2 * intermediate_size, hidden_size) * 0.05)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden_size, intermediate_size) * 0.05)

    def forward(self, hidden_states, router_logits):
        topk_weights, topk_ids = torch.topk(router_logits.softmax(dim=-1), self.top_k, dim=-1)
        return fused_experts(hidden_states, self.w13, self.w2, topk_weights, topk_ids, inplace=True)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=32, num_experts=8, top_k=2):
        super().__init__()
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size)
        self.shared_expert = SharedExpert(hidden_size, 2 * intermediate_size)
        # msrewrite(moe-shared-expert): ENABLE_MOE_SHARED_EXPERT_STREAM=0 turns the side stream off.
        self.enable_moe_shared_expert_stream = _ms_env_flag("ENABLE_MOE_SHARED_EXPERT_STREAM", True)

    def forward(self, hidden_states):
        num_tokens, hidden_dim = hidden_states.shape
        hidden_states = self.post_attention_layernorm(hidden_states)
        # msrewrite(moe-shared-expert): the shared expert runs on side stream "shared_expert" during the routed experts.
        use_shared_expert_stream = _ms_graph_streams(self.enable_moe_shared_expert_stream)
        if use_shared_expert_stream:
            # msrewrite(moe-shared-expert): the main path may write hidden_states before the join: the side stream reads a copy.
            hidden_states_side = hidden_states.clone()
            with torchair.scope.npu_stream_switch("shared_expert", 0):
                shared_output = self.shared_expert(hidden_states_side)
        router_logits = self.gate(hidden_states)
        if not use_shared_expert_stream:
            shared_output = self.shared_expert(hidden_states)
        # the fused routed experts overwrite hidden_states with their output
        final_hidden_states = self.experts(hidden_states, router_logits)
        final_hidden_states = final_hidden_states + shared_output
        return final_hidden_states.view(num_tokens, hidden_dim)


def make():
    torch.manual_seed(0)
    return SparseMoeBlock().eval(), (torch.randn(8, 64),)
