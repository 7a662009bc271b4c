"""A DSA indexer prolog shaped like cann-recipes' `Indexer.prefill_decode_ascendc` (GLM-5,
DeepSeek-V3.2): q path, k path and per-head weights, int8 quantization, one fused scoring op."""

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

    def forward(self, x, qr, cos, sin):
        # msrewrite(indexer-prolog: weights): the weights projection runs on side stream "indexer_weights" during the k path.
        use_indexer_weights_stream = _ms_graph_streams(self.enable_indexer_prolog_streams)
        if use_indexer_weights_stream:
            with torchair.scope.npu_stream_switch("indexer_weights", 0):
                weights = self.weights_proj(x) * self.n_heads**-0.5
        bsz, seqlen, _ = x.shape
        # q path
        # msrewrite(indexer-prolog: q): the q path runs on side stream "indexer_q" during the k path.
        use_indexer_q_stream = _ms_graph_streams(self.enable_indexer_prolog_streams)
        if use_indexer_q_stream:
            with torchair.scope.npu_stream_switch("indexer_q", 0):
                q_b = self.wq_b(qr)
                q = q_b.view(bsz, seqlen, self.n_heads, self.head_dim)
                q_pe, q_nope = torch.split(q, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
                q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None])
                q = torch.cat([q_pe, q_nope], dim=-1)
        else:
            q_b = self.wq_b(qr)
            q = q_b.view(bsz, seqlen, self.n_heads, self.head_dim)
            q_pe, q_nope = torch.split(q, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
            q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None])
            q = torch.cat([q_pe, q_nope], dim=-1)
        # msrewrite(indexer-prolog: q_quant): the q quantization runs on side stream "indexer_q" during the k path.
        use_indexer_q_stream_2 = _ms_graph_streams(self.enable_indexer_prolog_streams)
        if use_indexer_q_stream_2:
            with torchair.scope.npu_stream_switch("indexer_q", 0):
                q_int8, q_scale = self.q_quant(q)
        # per-head weights
        if not use_indexer_weights_stream:
            weights = self.weights_proj(x) * self.n_heads**-0.5
        # k path
        k_proj = self.wk(x)
        k = self.k_norm(k_proj)
        k_pe, k_nope = torch.split(k, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe, cos, sin)
        k = torch.cat([k_pe, k_nope], dim=-1)
        # int8 scoring
        if not use_indexer_q_stream_2:
            q_int8, q_scale = self.q_quant(q)
        k_int8, k_scale = self.k_quant(k)
        return self.li_fusion(q_int8, q_scale, k_int8, k_scale, weights)


def make():
    torch.manual_seed(0)
    x, qr = torch.randn(1, 8, 64), torch.randn(1, 8, 32)
    angle = torch.arange(8)[:, None] * torch.arange(8)[None] * 0.1
    cos, sin = torch.cat([angle.cos()] * 2, -1)[None], torch.cat([angle.sin()] * 2, -1)[None]
    return Indexer().eval(), (x, qr, cos, sin)
