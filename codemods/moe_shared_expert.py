"""moe-shared-expert: run an MoE block's shared expert on a side stream.

The shared expert (`shared_experts`, `shared_expert`, `shared_mlp`, with or without a gate such as
`shared_expert_gate`) reads only the block's input, while the router and routed experts run on
the main stream; both meet at an add (plain, in-place, or a fused op's argument). The side
branch is issued as early as its inputs exist, so it overlaps routing, dispatch and the experts,
and the main stream waits for it right before the first consumer. An inline call in the join
(`h = h + self.shared_experts(x)`) is hoisted into a temporary first.

Seen in DeepSeek-V3/V3.2/R1, GLM-4.5/5, Qwen2/3-MoE, Qwen3-Next, Hunyuan, Kimi-K2 and others.
Modes: eager, npugraph-ex, ge-graph, cuda.
"""

from __future__ import annotations

from msrewrite.cases import Case, describe_lines

SHARED_EXPERT_ATTRS = frozenset({"shared_experts", "shared_expert", "shared_mlp", "shared_expert_gate"})


def is_shared_expert_call(callee: str) -> bool:
    """`callee` is the dotted name after "self.", e.g. "shared_expert.down_proj"."""
    return callee.split(".")[0] in SHARED_EXPERT_ATTRS


def describe(branch) -> str:
    return "shared expert on a side stream: " + describe_lines(branch)


CASE = Case(
    name="moe-shared-expert",
    summary="MoE shared expert on a side stream, overlapping the router and routed experts",
    modes=("eager", "npugraph-ex", "ge-graph", "cuda"),
    is_seed=is_shared_expert_call,
    stream_tag="shared_expert",
    flag_name="ENABLE_MOE_SHARED_EXPERT_STREAM",
    describe=describe,
    what=("the shared expert", "the routed experts"),
)
