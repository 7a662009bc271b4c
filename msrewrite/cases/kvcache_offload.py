"""kvcache-offload: device-to-host KV copies (and next-layer prefetch) on a copy stream.

cann-recipes DeepSeek-V3.2 / GLM-5 prefill: each layer writes its KV into one device buffer shared
by all layers, then copies it to host memory. The copy moves to a copy stream created once per
process (non_blocking), starting as soon as the buffer is written, so it overlaps attention and
the MLP. Nothing reads the copy on the main stream, so the join is not a data edge: it is the
buffer's reuse. The main stream waits for the copy right before it next writes the buffer it
reads (a write-after-read hazard) or touches the host copy, or before the layer returns, since the
next layer overwrites the shared buffer. A host-to-device prefetch of the next layer's KV in the
same function rides the same stream. Events are recorded per call, as the offload cache does.

Which copies: `dst.copy_(src)` where one side is a host buffer, by its name (`host_kv`,
`cpu_cache`, `offload_buffer`, `swap_*`, `pinned_*`), written in the function or in a method of a
cache object it calls (`self.cache.offload(i)`, `cache.offload(i, k, v)`, followed through the
file's summaries): that call moves to the copy stream as it is, and the method is not edited, so
the flag-off path stays the original. Its copies must already be `non_blocking=True` (a blocking
copy on the copy stream would hold the host and overlap nothing), and everything it calls must be
visible; otherwise it is refused, naming what could not be seen. Transformers' OffloadedCache already prefetches on its own
stream (torch.Stream) and is the reference for the pattern, not a target.

Modes: eager and cuda (offload runs in eager prefill). Not npugraph-ex: per-call events change
between capture and replay; not ge-graph: the copies are not graph ops.
"""

from __future__ import annotations

import libcst as cst

from msrewrite.analyze.effects import buffer_path
from msrewrite.cases._base import CopyCase, Invalid

HOST_WORDS = ("host", "cpu", "offload", "swap", "pinned")


def is_host_buffer(path: str) -> bool:
    """The buffer itself (the last name of its path, `host_kv` in cache.host_kv) is host memory; also
    a method named for it (`offload`, `swap_out`)."""
    buffer = path.split(".")[-1].lower()
    return any(word in buffer for word in HOST_WORDS)


def _names_host(expr: cst.BaseExpression) -> bool:
    return is_host_buffer(buffer_path(expr) or "")


def is_host_copy(call: cst.Call) -> bool:
    """dst.copy_(src) with host memory on either side."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "copy_" and call.args):
        return False
    return _names_host(func.value) or _names_host(call.args[0].value)


# Declared examples (tests/test_case_examples.py runs them; docs/cases.md shows them).
# VALID: the device-to-host copy overlaps the layer's compute.
VALID = """import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.kv_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Linear(hidden, hidden)

    def forward(self, x, temp_kv, host_kv):
        temp_kv.copy_(self.kv_proj(x))
        host_kv.copy_(temp_kv)
        out = self.mlp(x) + temp_kv
        return out, host_kv


class Model(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.layer = Layer(hidden)

    def forward(self, x):
        temp_kv, host_kv = torch.zeros_like(x), torch.zeros_like(x)
        return self.layer(x, temp_kv, host_kv)


def make():
    torch.manual_seed(0)
    return Model().eval(), (torch.randn(4, 16),)
"""
# INVALID: a cache helper's blocking copy would hold the host on the copy stream.
INVALID = """import torch
from torch import nn


class Cache:
    def __init__(self, host_kv):
        self.host_kv = host_kv

    def offload(self, kv):
        self.host_kv.copy_(kv)


class Layer(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.kv_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Linear(hidden, hidden)

    def forward(self, x, cache: Cache):
        kv = self.kv_proj(x)
        cache.offload(kv)
        return self.mlp(x) + kv
"""


CASE = CopyCase(
    name="kvcache-offload",
    summary="KV-cache offload and prefetch copies on a copy stream, joined where the buffer is reused",
    modes=("eager", "cuda"),
    is_seed=lambda _callee: False,
    stream_tag="kv_copy",
    flag_name="ENABLE_KV_OFFLOAD_STREAM",
    what=("the KV copy", "the layer's compute"),
    is_copy=is_host_copy,
    is_host_buffer=is_host_buffer,
    notes="not npugraph-ex: per-call events change between capture and replay; not ge-graph: copies are not graph ops",
    order=5,
    golden_examples=("offload_decoder", "offload_cache_decoder"),
    mutant_modes=("eager",),
    mutant_examples=("offload_decoder", "offload_cache_decoder"),
    valid=(VALID,),
    invalid=(Invalid(INVALID, "copies without non_blocking=True"),),
)
