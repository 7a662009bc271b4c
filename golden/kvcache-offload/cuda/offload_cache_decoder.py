"""A prefill decoder stack whose KV offload lives in the cache object, as in cann-recipes'
OffloadCache: the layer writes its KV into one device buffer shared by all layers through
`offload_cache.write(...)`, and `offload_cache.offload(i)` copies it to this layer's host buffer
(pinned memory on the NPU, hence non_blocking). Later in the layer the indexer keys reuse the
same device buffer, so the copy must be done by then."""

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


class OffloadCache:
    def __init__(self, num_layers, tokens, kv_dim):
        self.temp_kv = torch.zeros(tokens, kv_dim)  # device buffer shared by every layer
        self.host_kv = [torch.zeros(tokens, kv_dim) for _ in range(num_layers)]

    def write(self, kv):
        self.temp_kv.copy_(kv)

    def offload(self, layer_idx):
        """This layer's KV to host memory."""
        dst = self.host_kv[layer_idx]
        dst.copy_(self.temp_kv, non_blocking=True)


class Attention(nn.Module):
    def __init__(self, hidden_size, kv_dim):
        super().__init__()
        self.q_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(kv_dim, hidden_size, bias=False)

    def forward(self, hidden_states, kv):
        q = self.q_proj(hidden_states)
        causal = torch.ones(q.shape[0], kv.shape[0], dtype=torch.bool).tril()
        scores = (q @ kv.T).masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.o_proj(scores @ kv)


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size, kv_dim, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_norm = nn.LayerNorm(hidden_size)
        self.kv_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        self.attn = Attention(hidden_size, kv_dim)
        self.post_norm = nn.LayerNorm(hidden_size)
        self.index_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        self.index_out = nn.Linear(kv_dim, hidden_size, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size))
        # msrewrite(kvcache-offload): ENABLE_KV_OFFLOAD_STREAM=0 turns the side stream off.
        self.enable_kv_offload_stream = _ms_env_flag("ENABLE_KV_OFFLOAD_STREAM", True)

    def forward(self, hidden_states, offload_cache: OffloadCache):
        normed = self.input_norm(hidden_states)
        offload_cache.write(self.kv_proj(normed))
        # msrewrite(kvcache-offload): the KV copy runs on side stream "kv_copy" during the layer's compute.
        kv_copy_stream = _ms_side_stream("kv_copy", self.enable_kv_offload_stream)
        if kv_copy_stream is not None:
            current_stream = torch.cuda.current_stream()
            input_ready_event = torch.cuda.Event()
            input_ready_event.record(current_stream)
            with torch.cuda.stream(kv_copy_stream):
                input_ready_event.wait(kv_copy_stream)
                offload_cache.offload(self.layer_idx)
        else:
            offload_cache.offload(self.layer_idx)
        attn_out = self.attn(normed, offload_cache.temp_kv)
        hidden_states = hidden_states + attn_out
        mlp_in = self.post_norm(hidden_states)
        # msrewrite(kvcache-offload): the KV copy must finish before its buffers are reused: join here.
        if kv_copy_stream is not None:
            kv_copy_done_event = torch.cuda.Event()
            kv_copy_done_event.record(kv_copy_stream)
            kv_copy_done_event.wait(current_stream)
        # the indexer keys reuse the device KV buffer
        offload_cache.write(self.index_proj(mlp_in))
        hidden_states = hidden_states + self.mlp(mlp_in) + self.index_out(offload_cache.temp_kv)
        return hidden_states


class OffloadModel(nn.Module):
    def __init__(self, hidden_size=64, kv_dim=32, num_layers=3):
        super().__init__()
        self.kv_dim = kv_dim
        self.layers = nn.ModuleList(DecoderLayer(hidden_size, kv_dim, i) for i in range(num_layers))

    def forward(self, hidden_states):
        cache = OffloadCache(len(self.layers), hidden_states.shape[0], self.kv_dim)
        for layer in self.layers:
            hidden_states = F.layer_norm(layer(hidden_states, cache), hidden_states.shape[-1:])
        return hidden_states, torch.stack(cache.host_kv)


def make():
    torch.manual_seed(0)
    return OffloadModel().eval(), (torch.randn(8, 64),)
