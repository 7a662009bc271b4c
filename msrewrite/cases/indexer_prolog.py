"""indexer-prolog: the prolog sub-chains of a DSA indexer split across two side streams.

GLM-5 / DeepSeek-V3.2 (`Indexer.prefill_decode_ascendc` in cann-recipes): the q path (`wq_b`, its
split and rope) runs on one side stream, the per-head weights projection on a second, the k path
(`wk`, `k_norm`, rope) stays on the main stream; each side stream joins right before the first
consumer of its result (the rope that pairs q with k, the fused scoring op). When the model
quantizes q (`q_quant`), that step re-enters the q stream after the join, next to the k
quantization on main. This is prolog sub-chain overlap, not whole-module parallelism.

The branches are applied in order, one patch each (q, weights, then the optional q quantization).
A branch that cannot move (the weights projection inside a helper such as `forward_normal`, a q
path whose input the k path writes) is reported with its reason and the others are still made:
each side stream is an overlap of its own, proved on its own.

Modes: eager, npugraph-ex, ge-graph, cuda.
"""

from __future__ import annotations

from msrewrite.cases._base import BranchesCase, BranchSpec, Invalid


def _calls(*names: str):
    wanted = frozenset(names)
    return lambda callee: callee.split(".")[0] in wanted


Q_PATH = BranchSpec("q", _calls("wq_b"), "indexer_q", "the q path")
WEIGHTS = BranchSpec("weights", _calls("weights_proj"), "indexer_weights", "the weights projection")
Q_QUANT = BranchSpec("q_quant", _calls("q_quant"), "indexer_q", "the q quantization", optional=True)


# Declared examples (tests/test_case_examples.py runs them; docs/cases.md shows them).
# VALID: the q path and the weights projection on two side streams, k on main.
VALID = """import torch
from torch import nn


class Indexer(nn.Module):
    def __init__(self, hidden=16, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wq_b = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def forward(self, x, qr):
        q = self.wq_b(qr).view(x.shape[0], self.heads, self.head_dim)
        weights = self.weights_proj(x)
        k = self.k_norm(self.wk(x))
        scores = torch.einsum("shd,td->sht", q, k)
        return torch.einsum("sh,sht->st", weights, scores)


def make():
    torch.manual_seed(0)
    return Indexer().eval(), (torch.randn(4, 16), torch.randn(4, 16))
"""
# INVALID: the q path writes its input in place, which the k path reads, and there is no weights
# projection: neither branch can move, so nothing is written (one that can moves alone, the other
# is reported).
INVALID = """import torch
from torch import nn


class Indexer(nn.Module):
    def __init__(self, hidden=16, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wq_b = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)

    def forward(self, x, qr):
        q = self.wq_b(qr.relu_()).view(x.shape[0], self.heads, self.head_dim)
        k = self.wk(x + qr)
        return torch.einsum("shd,td->sht", q, k)
"""


CASE = BranchesCase(
    name="indexer-prolog",
    summary="indexer prolog: q path and weights projection on two side streams, k path on main",
    modes=("eager", "npugraph-ex", "ge-graph", "cuda"),
    is_seed=_calls("wq_b", "weights_proj", "q_quant"),
    stream_tag="indexer_q",
    flag_name="ENABLE_INDEXER_PROLOG_STREAMS",
    what=("the indexer prolog", "the k path"),
    branches=(Q_PATH, WEIGHTS, Q_QUANT),
    order=4,
    golden_examples=("indexer_prolog",),
    mutant_modes=("eager",),
    mutant_examples=("indexer_prolog",),
    valid=(VALID,),
    invalid=(
        Invalid(
            INVALID,
            "the side branch writes its input 'qr' in place, which line 14 on the main path reads; weights: no side call found",
        ),
    ),
)
