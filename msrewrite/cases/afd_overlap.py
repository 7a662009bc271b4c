"""afd-overlap: attention-FFN disaggregation, the transfers to the remote FFN overlapped with
local compute (LongCat-Flash AFD).

An attention node sends its activations to a remote FFN node and receives the result. Written
with blocking `dist.send` / `dist.recv`, the local work in between waits for both. The edit
issues the send as soon as its tensor exists and the receive as soon as its buffer exists, as
`dist.isend` / `dist.irecv`, and waits on both handles right before the received tensor is first
used, so the transfers and the remote FFN overlap the local compute (the shortcut, dense MLP...).
The order of the transfers is kept, so the remote side needs no change.

Modes: eager and cuda (the same torch.distributed code). Not npugraph-ex or ge-graph: in a
compiled graph the collective ops are placed by the compiler (torchair turns send/recv into HCCL
graph ops); issuing them early there needs the graph-side reordering, not async handles.
"""

from __future__ import annotations

import libcst as cst

from msrewrite.analyze.defuse import dotted_name
from msrewrite.cases._base import AsyncCommCase, Invalid

P2P_MODULES = ("dist", "torch.distributed")


class PointToPoint:
    """Side calls: blocking torch.distributed send/recv (a seed predicate on call nodes)."""

    def __call__(self, _callee: str) -> bool:
        return False  # no submodule call is side work here

    def on_call(self, call: cst.Call) -> bool:
        module, _, name = (dotted_name(call.func) or "").rpartition(".")
        return module in P2P_MODULES and name in ("send", "recv")


# Declared examples (tests/test_case_examples.py runs them; docs/cases.md shows them).
# VALID: the send goes out early and the receive waits until the shortcut MLP ran.
VALID = """import torch
import torch.distributed as dist
from torch import nn


class AttentionNode(nn.Module):
    def __init__(self, hidden=16, ffn_rank=1):
        super().__init__()
        self.ffn_rank = ffn_rank
        self.norm = nn.LayerNorm(hidden)
        self.shortcut_mlp = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        normed = self.norm(hidden_states)
        dist.send(normed, dst=self.ffn_rank)
        shortcut = self.shortcut_mlp(normed)
        ffn_out = torch.empty_like(normed)
        dist.recv(ffn_out, src=self.ffn_rank)
        return hidden_states + ffn_out + shortcut
"""
# INVALID: the shortcut MLP is inside the join statement: no local compute to overlap.
INVALID = """import torch
import torch.distributed as dist
from torch import nn


class AttentionNode(nn.Module):
    def __init__(self, hidden=16, ffn_rank=1):
        super().__init__()
        self.ffn_rank = ffn_rank
        self.norm = nn.LayerNorm(hidden)
        self.shortcut_mlp = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        normed = self.norm(hidden_states)
        dist.send(normed, dst=self.ffn_rank)
        ffn_out = torch.empty_like(normed)
        dist.recv(ffn_out, src=self.ffn_rank)
        return hidden_states + ffn_out + self.shortcut_mlp(normed)
"""


CASE = AsyncCommCase(
    name="afd-overlap",
    summary="sends to a remote FFN issued early and received late (isend/irecv), overlapping local compute",
    modes=("eager", "cuda"),
    is_seed=PointToPoint(),
    stream_tag="afd",
    flag_name="ENABLE_AFD_OVERLAP",
    what=("the transfers to the remote FFN", "the local compute"),
    notes="not npugraph-ex/ge-graph: compiled graphs place the communication ops themselves",
    order=7,
    golden_examples=("afd_attention_node",),
    valid=(VALID,),
    invalid=(Invalid(INVALID, "no main-path work between the fork and the join: nothing to overlap"),),
)
