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

from msrewrite import validate
from msrewrite.cases._base import CaseOption, Invalid, MicrobatchCase
from msrewrite.cliargs import Option

# Declared examples (tests/test_case_examples.py runs them; docs/cases.md shows them).
# VALID: a straight-line layer with its collectives, under a layer loop.
VALID = """import torch
import torch.distributed as dist
from torch import nn


class Layer(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.attn = nn.Linear(hidden, hidden)
        self.experts = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attn(hidden_states)
        routed = hidden_states * 1.0
        dist.all_reduce(routed)
        expert_out = self.experts(routed)
        dist.all_reduce(expert_out)
        return hidden_states + expert_out


class Model(nn.Module):
    def __init__(self, hidden=16, num_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden) for _ in range(num_layers))

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states
"""
# INVALID: a layer forward with an `if`: micro-batching needs straight-line statements.
INVALID = """import torch
import torch.distributed as dist
from torch import nn


class Layer(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.attn = nn.Linear(hidden, hidden)
        self.experts = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        if hidden_states.shape[0] > 1:
            hidden_states = hidden_states + self.attn(hidden_states)
        routed = hidden_states * 1.0
        dist.all_reduce(routed)
        expert_out = self.experts(routed)
        dist.all_reduce(expert_out)
        return hidden_states + expert_out


class Model(nn.Module):
    def __init__(self, hidden=16, num_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden) for _ in range(num_layers))

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states
"""


# What the layer loop passes beside the hidden states: msrewrite cannot tell from the source whether
# a value holds one row per sequence, so the user says so (constants and scalar parameters need not).
SPLIT_ARG = CaseOption(
    "--split-arg",
    "--split-arg is for prefill-microbatch; {case} has no micro-batches",
    (
        (
            "split_arg",
            list[str] | None,
            Option(
                None,
                "--split-arg",
                help="prefill-microbatch: a value the layer loop passes (the layer's parameter or the variable) "
                "that holds one row per sequence: each micro-batch gets its half (repeat).",
            ),
        ),
    ),
    check=validate.identifier,
)
SHARED_ARG = CaseOption(
    "--shared-arg",
    "--shared-arg is for prefill-microbatch; {case} has no micro-batches",
    (
        (
            "shared_arg",
            list[str] | None,
            Option(
                None,
                "--shared-arg",
                help="prefill-microbatch: a value the layer loop passes that is the same for every sequence: "
                "both micro-batches get it whole (repeat).",
            ),
        ),
    ),
    check=validate.identifier,
)

CASE = MicrobatchCase(
    name="prefill-microbatch",
    summary="two micro-batches through every layer, collectives on a comm stream one micro-batch behind",
    modes=("eager", "cuda"),
    is_seed=lambda _callee: False,
    stream_tag="microbatch_comm",
    flag_name="ENABLE_PREFILL_MICROBATCH",
    what=("the second micro-batch", "the first"),
    notes="not npugraph-ex: per-call events change between capture and replay; not ge-graph: GE schedules collectives",
    order=8,
    golden_examples=("microbatch_moe", "microbatch_moe_submodule"),
    valid=(VALID,),
    invalid=(Invalid(INVALID, "micro-batching needs a straight-line layer forward"),),
    options=(SPLIT_ARG, SHARED_ARG),
)
