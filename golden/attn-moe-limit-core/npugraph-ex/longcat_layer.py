"""A LongCat-Flash-style decoder layer: two attention sublayers with dense MLPs, and a shortcut
MoE that reads the first sublayer's normed output and is added back at the very end."""

import contextlib
import os
import torch
import torch.nn.functional as F
from torch import nn

# msrewrite: multi-stream helpers (npugraph-ex mode). With the flag off, or without
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


def _ms_stream_events(stream):
    """The (fork, join) event pair of one module, made once and reused by every eager call (a compiled
    npugraph_ex graph replaces each event with a tagged event of its own)."""
    if stream is None:
        return None
    return torch.npu.Event(), torch.npu.Event()


def _ms_capture_safe(stream):
    """`stream`, or None (the original single-stream path) inside a compiled graph whose
    record_stream would not reach it.

    torch_npu 2.10 traces Tensor.record_stream as torch.npu.fake_record_stream, which npugraph_ex
    lowers to record_tagged_stream_(t, <FX node name>): a stream made for that name, not this one,
    so buffers used across the streams would lose their protection. torch_npu 2.14 lowers it by
    stream id (record_tagged_on_stream_) and keeps the side stream; so does eager code, everywhere.
    """
    if stream is not None and torch.compiler.is_compiling() and hasattr(torch.npu, "fake_record_stream"):
        return None
    return stream


def _ms_core_limit(enabled, aicore_num, vectorcore_num):
    """npugraph_ex's stream-level core limit; a no-op context when off."""
    if not enabled or not hasattr(torch, "npu"):
        return contextlib.nullcontext()
    return torch.npu.npugraph_ex.scope.limit_core_num(aicore_num, vectorcore_num)


def _ms_record_stream(stream, *values):
    """Mark tensors (also inside tuples and lists) as in use on `stream`, so the caching allocator
    cannot hand their memory out early."""
    for value in values:
        if isinstance(value, torch.Tensor):
            value.record_stream(stream)
        elif isinstance(value, (tuple, list)):
            _ms_record_stream(stream, *value)


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
        # Made once per module: eager calls reuse them; a compiled graph resolves the stream by id and
        # swaps each event for a tagged event of its own.
        self.moe_shortcut_stream = _ms_side_stream("moe_shortcut", self.enable_moe_shortcut_stream)
        self.moe_shortcut_events = _ms_stream_events(self.moe_shortcut_stream)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm[0](hidden_states)
        hidden_states = residual + self.self_attn[0](hidden_states)

        residual = hidden_states
        hidden_states = self.post_attention_layernorm[0](hidden_states)
        # msrewrite(attn-moe-limit-core): the shortcut MoE runs on side stream "moe_shortcut" during attention and the dense MLPs.
        moe_shortcut_stream = _ms_capture_safe(self.moe_shortcut_stream)
        if moe_shortcut_stream is not None:
            fork_event, join_event = self.moe_shortcut_events
            _ms_record_stream(moe_shortcut_stream, hidden_states)
            fork_event.record()
            with torch.npu.stream(moe_shortcut_stream), _ms_core_limit(True, 8, 16):
                fork_event.wait()
                shortcut_mlp_output = self.mlp(hidden_states)
                join_event.record()
        else:
            shortcut_mlp_output = self.mlp(hidden_states)
        # msrewrite(attn-moe-limit-core): the main branch gets its own core budget while the side stream runs.
        with _ms_core_limit(moe_shortcut_stream is not None, 16, 32):
            hidden_states = residual + self.mlps[0](hidden_states)

            # shortcut connection after the second sublayer
            residual = hidden_states
            hidden_states = self.input_layernorm[1](hidden_states)
            hidden_states = residual + self.self_attn[1](hidden_states)

            residual = hidden_states
            hidden_states = self.post_attention_layernorm[1](hidden_states)
            hidden_states = self.mlps[1](hidden_states)
        # msrewrite(attn-moe-limit-core): join the side stream before the first use of shortcut_mlp_output.
        if moe_shortcut_stream is not None:
            join_event.wait()
            _ms_record_stream(torch.npu.current_stream(), shortcut_mlp_output)
        return residual + hidden_states + shortcut_mlp_output


def make():
    torch.manual_seed(0)
    return LongcatDecoderLayer().eval(), (torch.randn(8, 64),)
