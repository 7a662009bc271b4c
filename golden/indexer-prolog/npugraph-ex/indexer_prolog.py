"""A DSA indexer prolog shaped like cann-recipes' `Indexer.prefill_decode_ascendc` (GLM-5,
DeepSeek-V3.2): q path, k path and per-head weights, int8 quantization, one fused scoring op."""

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


def _ms_record_stream(stream, *values):
    """Mark tensors (also inside tuples and lists) as in use on `stream`, so the caching allocator
    cannot hand their memory out early."""
    for value in values:
        if isinstance(value, torch.Tensor):
            value.record_stream(stream)
        elif isinstance(value, (tuple, list)):
            _ms_record_stream(stream, *value)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class Quantize(nn.Module):
    """Per-token symmetric int8 quantization (npu_dynamic_quant on the NPU)."""

    def forward(self, x):
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / 127
        return torch.round(x / scale).to(torch.int8), scale


class LightningIndexer(nn.Module):
    """Scores every key for every query: the fused li_fusion op."""

    def __init__(self, n_heads, head_dim):
        super().__init__()
        self.softmax_scale = head_dim**-0.5
        self.n_heads = n_heads

    def forward(self, q_int8, q_scale, k_int8, k_scale, weights):
        q = q_int8.float() * q_scale
        k = k_int8.float() * k_scale
        scores = F.relu(torch.einsum("bshd,btd->bsht", q, k)) * self.softmax_scale
        return torch.einsum("bsh,bsht->bst", weights, scores)


class Indexer(nn.Module):
    def __init__(self, hidden_size=64, q_lora_rank=32, n_heads=4, head_dim=32, rope_head_dim=16):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_head_dim = n_heads, head_dim, rope_head_dim
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        self.q_quant = Quantize()
        self.k_quant = Quantize()
        self.li_fusion = LightningIndexer(n_heads, head_dim)
        # msrewrite(indexer-prolog): ENABLE_INDEXER_PROLOG_STREAMS=0 turns the side stream off.
        self.enable_indexer_prolog_streams = _ms_env_flag("ENABLE_INDEXER_PROLOG_STREAMS", True)
        # Made once per module: eager calls reuse them; a compiled graph resolves the stream by id and
        # swaps each event for a tagged event of its own.
        self.indexer_q_stream = _ms_side_stream("indexer_q", self.enable_indexer_prolog_streams)
        self.indexer_q_events = _ms_stream_events(self.indexer_q_stream)
        # Made once per module: eager calls reuse them; a compiled graph resolves the stream by id and
        # swaps each event for a tagged event of its own.
        self.indexer_weights_stream = _ms_side_stream("indexer_weights", self.enable_indexer_prolog_streams)
        self.indexer_weights_events = _ms_stream_events(self.indexer_weights_stream)
        # Made once per module: eager calls reuse them; a compiled graph resolves the stream by id and
        # swaps each event for a tagged event of its own.
        self.indexer_q_stream_2 = _ms_side_stream("indexer_q", self.enable_indexer_prolog_streams)
        self.indexer_q_events_2 = _ms_stream_events(self.indexer_q_stream_2)

    def forward(self, x, qr, cos, sin):
        # msrewrite(indexer-prolog: weights): the weights projection runs on side stream "indexer_weights" during the k path.
        indexer_weights_stream = _ms_capture_safe(self.indexer_weights_stream)
        if indexer_weights_stream is not None:
            fork_event_2, join_event_2 = self.indexer_weights_events
            _ms_record_stream(indexer_weights_stream, x)
            fork_event_2.record()
            with torch.npu.stream(indexer_weights_stream):
                fork_event_2.wait()
                weights = self.weights_proj(x) * self.n_heads**-0.5
                join_event_2.record()
        bsz, seqlen, _ = x.shape
        # q path
        # msrewrite(indexer-prolog: q): the q path runs on side stream "indexer_q" during the k path.
        indexer_q_stream = _ms_capture_safe(self.indexer_q_stream)
        if indexer_q_stream is not None:
            fork_event, join_event = self.indexer_q_events
            _ms_record_stream(indexer_q_stream, qr, bsz, seqlen, cos, sin)
            fork_event.record()
            with torch.npu.stream(indexer_q_stream):
                fork_event.wait()
                q_b = self.wq_b(qr)
                q = q_b.view(bsz, seqlen, self.n_heads, self.head_dim)
                q_pe, q_nope = torch.split(q, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
                q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None])
                q = torch.cat([q_pe, q_nope], dim=-1)
                join_event.record()
        else:
            q_b = self.wq_b(qr)
            q = q_b.view(bsz, seqlen, self.n_heads, self.head_dim)
            q_pe, q_nope = torch.split(q, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
            q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None])
            q = torch.cat([q_pe, q_nope], dim=-1)
        # msrewrite(indexer-prolog: q_quant): the q quantization runs on side stream "indexer_q" during the k path.
        indexer_q_stream_2 = _ms_capture_safe(self.indexer_q_stream_2)
        if indexer_q_stream_2 is not None:
            fork_event_3, join_event_3 = self.indexer_q_events_2
            _ms_record_stream(indexer_q_stream_2, q)
            fork_event_3.record()
            with torch.npu.stream(indexer_q_stream_2):
                fork_event_3.wait()
                q_int8, q_scale = self.q_quant(q)
                join_event_3.record()
        # per-head weights
        if indexer_weights_stream is None:
            weights = self.weights_proj(x) * self.n_heads**-0.5
        # k path
        k_proj = self.wk(x)
        k = self.k_norm(k_proj)
        k_pe, k_nope = torch.split(k, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe, cos, sin)
        k = torch.cat([k_pe, k_nope], dim=-1)
        # msrewrite(indexer-prolog: q): join the side stream before the first use of q.
        if indexer_q_stream is not None:
            join_event.wait()
            _ms_record_stream(torch.npu.current_stream(), q)
        # int8 scoring
        if indexer_q_stream_2 is None:
            q_int8, q_scale = self.q_quant(q)
        k_int8, k_scale = self.k_quant(k)
        # msrewrite(indexer-prolog: weights): join the side stream before the first use of weights.
        if indexer_weights_stream is not None:
            join_event_2.wait()
            _ms_record_stream(torch.npu.current_stream(), weights)
        # msrewrite(indexer-prolog: q_quant): join the side stream before the first use of q_int8, q_scale.
        if indexer_q_stream_2 is not None:
            join_event_3.wait()
            _ms_record_stream(torch.npu.current_stream(), q_int8, q_scale)
        return self.li_fusion(q_int8, q_scale, k_int8, k_scale, weights)


def make():
    torch.manual_seed(0)
    x, qr = torch.randn(1, 8, 64), torch.randn(1, 8, 32)
    angle = torch.arange(8)[:, None] * torch.arange(8)[None] * 0.1
    cos, sin = torch.cat([angle.cos()] * 2, -1)[None], torch.cat([angle.sin()] * 2, -1)[None]
    return Indexer().eval(), (x, qr, cos, sin)
