"""indexer-prolog: the prolog sub-chains of a DSA indexer split across two side streams.

GLM-5 / DeepSeek-V3.2 (`Indexer.prefill_decode_ascendc` in cann-recipes): the q path (`wq_b`, its
split and rope) runs on one side stream, the per-head weights projection on a second, the k path
(`wk`, `k_norm`, rope) stays on the main stream; each side stream joins right before the first
consumer of its result (the rope that pairs q with k, the fused scoring op). When the model
quantizes q (`q_quant`), that step re-enters the q stream after the join, next to the k
quantization on main. This is prolog sub-chain overlap, not whole-module parallelism.

The branches are applied in order, one patch each (q, weights, then the optional q quantization).

Modes: eager, npugraph-ex, ge-graph, cuda.
"""

from __future__ import annotations

from msrewrite.cases import BranchSpec, Case


def _calls(*names: str):
    wanted = frozenset(names)
    return lambda callee: callee.split(".")[0] in wanted


Q_PATH = BranchSpec("q", _calls("wq_b"), "indexer_q", "the q path")
WEIGHTS = BranchSpec("weights", _calls("weights_proj"), "indexer_weights", "the weights projection")
Q_QUANT = BranchSpec("q_quant", _calls("q_quant"), "indexer_q", "the q quantization", optional=True)

CASE = Case(
    name="indexer-prolog",
    summary="indexer prolog: q path and weights projection on two side streams, k path on main",
    modes=("eager", "npugraph-ex", "ge-graph", "cuda"),
    is_seed=_calls("wq_b", "weights_proj", "q_quant"),
    stream_tag="indexer_q",
    flag_name="ENABLE_INDEXER_PROLOG_STREAMS",
    what=("the indexer prolog", "the k path"),
    branches=(Q_PATH, WEIGHTS, Q_QUANT),
)
