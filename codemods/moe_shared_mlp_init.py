"""moe-shared-mlp-init: the shared MLP on a side stream that the model creates once and hands down.

HunyuanImage-3.0's variant of the shared-expert overlap: the side stream is not looked up inside
forward but created when the model is built and passed to every MoE layer through constructor
keyword arguments (each class on the way gets a `shared_mlp_stream=None` keyword; a layer built
directly falls back to the same process-wide stream). Fork and join use fresh events on each
call, recorded on the stream that produced the data. A monkey-patch module that reassigns
`Class.forward = moe_forward` is edited in its free function, which then takes the stream from the
process-wide cache.

Modes: eager and cuda. Not npugraph-ex: events created per call are not stable across graph
capture and replay (use moe-shared-expert, which creates them once). Not ge-graph: torchair
streams are tags, so there is no stream object to hand down.
"""

from __future__ import annotations

from msrewrite.cases import Case
from msrewrite.codemods.moe_shared_expert import describe, is_shared_expert_call

CASE = Case(
    name="moe-shared-mlp-init",
    summary="shared MLP on a side stream created at model construction and handed to every MoE layer",
    modes=("eager", "cuda"),
    is_seed=is_shared_expert_call,
    stream_tag="shared_mlp",
    flag_name="ENABLE_SHARED_MLP_STREAM",
    describe=describe,
    what=("the shared MLP", "the routed experts"),
    stream_source="constructor",
    sync="events",
    notes="not npugraph-ex: per-call events change between capture and replay; not ge-graph: no stream object",
)
