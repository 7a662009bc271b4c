"""prefill-microbatch: two micro-batches through every layer, communication on its own stream.

DeepSeek-R1 prefill on cann-recipes (`forward_microbatch`): the batch is split in two (along
sequences, so attention stays within a micro-batch), and every layer runs both micro-batches with
its collectives (dispatch, combine, or any torch.distributed collective or named comm helper) on a
communication stream, one micro-batch behind the other, so one micro-batch's communication
overlaps the other's compute. An event chain orders every stage after the one that produced its
input, every collective goes through one stream in one order on every rank, and both streams meet
before the micro-batches are concatenated in order. The model's loop is forked into
`forward_microbatch`, chosen by the flag at the top of `forward`; the original loop is untouched.

Communicator groups: by default every collective of both micro-batches goes through one stream,
so one group serves both without ever running two collectives at once on it. With
`--second-comm-group NAME` (a process group the layer holds as self.NAME, like R1's `*_stream1`
groups), micro-batch 1 communicates over that group on a second communication stream, so the two
micro-batches' collectives may also overlap each other.

Needs: a model forward with `for layer in self.layers: hidden_states = layer(hidden_states)` and
a layer class whose forward is straight-line statements ending in `return`. Outputs can differ
from the single-batch run in the last bits (kernels see half the rows); verify with a tolerance.

Switch: every flag kind (`env:`, `attr:`, `sglang:`, `vllm-ascend:`), read in the model's
`__init__`; `--gate prefill` reads the model forward's own phase parameter. `capture`, `decode`
and token bounds mean nothing for this fork and are refused with the reason.

The analysis (msrewrite/analyze/microbatch.py) makes a MicrobatchPlan; emit/microbatch.py
carries it out, so `apply --plan` and `verify --plan` take it like any other plan.

Modes: eager and cuda (prefill runs eager). Not npugraph-ex: per-call events change between
capture and replay; not ge-graph: the graph compiler schedules the collectives.
"""

from __future__ import annotations

from msrewrite.cases import Case

CASE = Case(
    name="prefill-microbatch",
    summary="two micro-batches through every layer, collectives on a comm stream one micro-batch behind",
    modes=("eager", "cuda"),
    is_seed=lambda callee: False,
    stream_tag="microbatch_comm",
    flag_name="ENABLE_PREFILL_MICROBATCH",
    what=("the second micro-batch", "the first"),
    analysis="microbatch",
    notes="not npugraph-ex: per-call events change between capture and replay; not ge-graph: GE schedules collectives",
)
