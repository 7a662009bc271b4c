"""A LongCat-Flash-style decoder layer: two attention sublayers with dense MLPs, and a shortcut
MoE that reads the first sublayer's normed output and is added back at the very end."""

import contextlib
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


def _ms_core_limit(enabled, aicore_num, vectorcore_num):
    """torchair's op-level core limit inside a GE graph; a no-op context when off."""
    if not enabled or torchair is None:
        return contextlib.nullcontext()
    return torchair.scope.limit_core_num(aicore_num, vectorcore_num)


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


class SelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states):
        seq, hidden = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(seq, 3, self.num_heads, -1).unbind(1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return self.o_proj(out.transpose(0, 1).reshape(seq, hidden))


class DenseMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class ShortcutMoE(nn.Module):
    """Top-k routed experts plus zero (identity) experts, as LongCat-Flash's MoE."""

    def __init__(self, hidden_size, intermediate_size, num_experts=6, zero_experts=2, top_k=2):
        super().__init__()
        self.top_k, self.num_experts = top_k, num_experts
        self.router = nn.Linear(hidden_size, num_experts + zero_experts, bias=False)
        self.experts = nn.ModuleList(DenseMLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, hidden_states):
        weights, idx = torch.topk(self.router(hidden_states).softmax(dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(hidden_states)
        for slot in range(self.top_k):
            for expert_id in range(self.num_experts + self.router.out_features - self.num_experts):
                rows = torch.where(idx[:, slot] == expert_id)[0]
                if rows.numel() == 0:
                    continue
                x = hidden_states[rows]
                y = self.experts[expert_id](x) if expert_id < self.num_experts else x  # zero expert: identity
                out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


class LongcatDecoderLayer(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=64, moe_intermediate_size=32):
        super().__init__()
        self.input_layernorm = nn.ModuleList(nn.LayerNorm(hidden_size) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(nn.LayerNorm(hidden_size) for _ in range(2))
        self.self_attn = nn.ModuleList(SelfAttention(hidden_size) for _ in range(2))
        self.mlps = nn.ModuleList(DenseMLP(hidden_size, intermediate_size) for _ in range(2))
        self.mlp = ShortcutMoE(hidden_size, moe_intermediate_size)
        # msrewrite(attn-moe-limit-core): ENABLE_MOE_SHORTCUT_STREAM=0 turns the side stream off.
        self.enable_moe_shortcut_stream = _ms_env_flag("ENABLE_MOE_SHORTCUT_STREAM", True)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm[0](hidden_states)
        hidden_states = residual + self.self_attn[0](hidden_states)

        residual = hidden_states
        hidden_states = self.post_attention_layernorm[0](hidden_states)
        # msrewrite(attn-moe-limit-core): the shortcut MoE runs on side stream "moe_shortcut" during attention and the dense MLPs.
        use_moe_shortcut_stream = _ms_graph_streams(self.enable_moe_shortcut_stream)
        if use_moe_shortcut_stream:
            with torchair.scope.npu_stream_switch("moe_shortcut", 0), _ms_core_limit(True, 8, 16):
                shortcut_mlp_output = self.mlp(hidden_states)
        else:
            shortcut_mlp_output = self.mlp(hidden_states)
        # msrewrite(attn-moe-limit-core): the main branch gets its own core budget while the side stream runs.
        with _ms_core_limit(use_moe_shortcut_stream, 16, 32):
            hidden_states = residual + self.mlps[0](hidden_states)

            # shortcut connection after the second sublayer
            residual = hidden_states
            hidden_states = self.input_layernorm[1](hidden_states)
            hidden_states = residual + self.self_attn[1](hidden_states)

            residual = hidden_states
            hidden_states = self.post_attention_layernorm[1](hidden_states)
            hidden_states = self.mlps[1](hidden_states)
        return residual + hidden_states + shortcut_mlp_output


def make():
    torch.manual_seed(0)
    return LongcatDecoderLayer().eval(), (torch.randn(8, 64),)
