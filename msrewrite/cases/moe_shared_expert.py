"""moe-shared-expert: run an MoE block's shared expert on a side stream.

The shared expert (`shared_experts`, `shared_expert`, `shared_mlp`, with or without a gate such as
`shared_expert_gate`) reads only the block's input, while the router and routed experts run on
the main stream; both meet at an add (plain, in-place, or a fused op's argument). The side
branch is issued as early as its inputs exist, so it overlaps routing, dispatch and the experts,
and the main stream waits for it right before the first consumer. An inline call in the join
(`h = h + self.shared_experts(x)`) is hoisted into a temporary first.

`--side routed` swaps the streams: the router and routed experts run on the side stream (the
model's own `self.alt_stream` where it has one) while the shared expert stays on the current
stream, as SGLang's engineers write it; `--side shared` is the form above (vLLM, vllm-ascend). By
default the file's own convention decides: routed for a CUDA edit of an SGLang file and for a class
that already runs routed work on its stream, else shared (cases/_placement.py).

Seen in DeepSeek-V3/V3.2/R1, GLM-4.5/5, Qwen2/3-MoE, Qwen3-Next, Hunyuan, Kimi-K2 and others.
Modes: eager, npugraph-ex, ge-graph, cuda.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msrewrite import validate
from msrewrite.cases._base import CaseOption, Invalid, SeedCase, describe_lines
from msrewrite.cliargs import Option
from msrewrite.plan import PLACEMENTS

if TYPE_CHECKING:
    from pathlib import Path

    import libcst as cst

    from msrewrite.cases._base import BranchSpec, Options
    from msrewrite.cases._finder import Target

SHARED_EXPERT_ATTRS = frozenset({"shared_experts", "shared_expert", "shared_mlp", "shared_expert_gate"})


def is_shared_expert_call(callee: str) -> bool:
    """`callee` is the dotted name after "self.", e.g. "shared_expert.down_proj"; a private
    attribute of the same name counts (vllm-ascend's `self._shared_experts(...)`)."""
    return callee.split(".")[0].lstrip("_") in SHARED_EXPERT_ATTRS


def describe(branch) -> str:
    return "shared expert on a side stream: " + describe_lines(branch)


# Declared examples (tests/test_case_examples.py runs them; docs/cases.md shows them).
# VALID: the shared expert reads only the block's input; the routed experts run meanwhile.
VALID = """import torch
from torch import nn


class MoeBlock(nn.Module):
    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.shared_experts = nn.Linear(hidden, hidden)

    def forward(self, x):
        shared = self.shared_experts(x)
        weights = torch.softmax(self.gate(x), dim=-1)
        routed = sum(expert(x) * weights[:, i : i + 1] for i, expert in enumerate(self.experts))
        return routed + shared


def make():
    torch.manual_seed(0)
    return MoeBlock().eval(), (torch.randn(3, 16),)
"""
# INVALID: the main path writes the shared expert's input in place before the join.
INVALID = """import torch
from torch import nn


class MoeBlock(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.experts = nn.Linear(hidden, hidden)
        self.shared_experts = nn.Linear(hidden, hidden)

    def forward(self, x):
        shared = self.shared_experts(x)
        x.mul_(2.0)
        return self.experts(x) + shared
"""


def _placement(value: object, what: str) -> str:
    if value not in PLACEMENTS:
        raise ValueError(f"{what} must be one of {', '.join(PLACEMENTS)}, got {validate.shown(value)}")
    return str(value)


SIDE = CaseOption(
    "--side",
    "--side is for moe-shared-expert; {case} has no shared and routed experts to place",
    (
        (
            "side",
            str | None,
            Option(
                None,
                "--side",
                help="moe-shared-expert: shared (the shared expert on the side stream) or routed (the router and "
                "routed experts on it, the shared expert on the current stream); default: the file's convention "
                "(SGLang, --mode cuda: routed), else shared.",
            ),
        ),
    ),
    check=_placement,
)


def framework_convention(module: cst.Module, function: str, is_seed, mode: str) -> str:
    """Why the file's own convention puts the routed experts on the side stream, or "": a CUDA edit
    of an SGLang file (its engineers run the router and routed experts on `self.alt_stream` in
    their CUDA paths), or the function's class already runs work other than the shared expert on a
    stream of its own."""
    import libcst as cst

    from msrewrite.analyze.outline import iter_functions
    from msrewrite.analyze.walk import Visitor

    for stmt in module.body if mode == "cuda" else ():
        imports = stmt.body if isinstance(stmt, cst.SimpleStatementLine) else []
        for item in imports:
            if isinstance(item, cst.ImportFrom) and item.relative == () and item.module is not None:
                if _dotted(item.module).split(".")[0] == "sglang":
                    return "the file imports sglang, whose engineers run the router and routed experts on alt_stream"
            elif isinstance(item, cst.Import) and any(
                _dotted(alias.name).split(".")[0] == "sglang" for alias in item.names
            ):
                return "the file imports sglang, whose engineers run the router and routed experts on alt_stream"
    owner = function.rsplit(".", 1)[0] if "." in function else ""
    found: list[str] = []

    class _RoutedOnStream(Visitor):
        """`with <api>.stream(self.<attr>):` around calls none of which is the shared expert."""

        def visit_With(self, node: cst.With) -> None:
            for item in node.items:
                call = item.item
                if not (
                    isinstance(call, cst.Call)
                    and isinstance(call.func, cst.Attribute)
                    and call.func.attr.value == "stream"
                    and call.args
                    and _dotted(call.args[0].value).startswith("self.")
                ):
                    continue
                callees = _self_callees(node.body)
                if callees and not any(is_seed(c) for c in callees):
                    found.append(f"{_dotted(call.args[0].value)}")

    for name, func, _cls in iter_functions(module):
        if owner and name.rsplit(".", 1)[0] == owner:
            func.visit(_RoutedOnStream())
            if found:
                return f"{name} already runs routed work on {found[0]}"
    return ""


def _dotted(node) -> str:
    import libcst as cst

    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""


def _self_callees(node) -> list[str]:
    """The dotted callees after "self." of the calls in `node`."""

    from msrewrite.analyze.walk import Visitor

    found: list[str] = []

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            dotted = _dotted(call.func)
            if dotted.startswith("self."):
                found.append(dotted[len("self.") :])

    node.visit(_Calls())
    return found


class SharedExpertCase(SeedCase):
    """The shared expert's plans, each placed (--side): the shared expert on the side stream, or
    the router and routed experts on it (cases/_placement.py swaps the plan's two sets)."""

    def find(
        self,
        path: Path,
        module: cst.Module,
        options: Options,
        text: str | None = None,
        branch: BranchSpec | None = None,
    ) -> list[Target]:
        import dataclasses

        from msrewrite.analyze.summaries import ModuleSummaries
        from msrewrite.cases._placement import routed_plan

        targets = super().find(path, module, options, text, branch)
        summaries: ModuleSummaries | None = None
        asked = options.extra.get("side")
        placed = []
        for target in targets:
            plan = target.plan
            if plan is None:
                placed.append(target)
                continue
            why_routed = "" if asked else framework_convention(module, plan.function, self.is_seed, options.mode)
            if asked == "shared" or not why_routed and not asked:
                chosen = "as asked" if asked else "the default: the file shows no convention of its own"
                note = f"; --side shared ({chosen}; --side routed runs the router and routed experts there instead)"
                placed.append(dataclasses.replace(target, plan=plan.with_changes(summary=plan.summary + note)))
                continue
            if summaries is None:  # read once per file, only when a routed placement is tried
                summaries = ModuleSummaries(module, options.assume_pure, path=path)
            cls, _, name = plan.function.rpartition(".")
            routed, why_not = routed_plan(plan, module, text, summaries.scope_for(cls or None, name))
            if routed is None and asked:
                reason = f"--side routed: {why_not}; --side shared moves the shared expert instead"
                placed.append(dataclasses.replace(target, plan=None, reason=reason))
            elif routed is None:
                note = f"; --side shared (the default would be routed: {why_routed}; but {why_not})"
                placed.append(dataclasses.replace(target, plan=plan.with_changes(summary=plan.summary + note)))
            else:
                chosen = "as asked" if asked else f"the default here: {why_routed}"
                summary = (
                    f"router and routed experts on a side stream, shared expert on the current stream: "
                    f"{', '.join(_lines(s) for s in routed.side)}; --side routed ({chosen}; --side shared moves "
                    "the shared expert instead)"
                )
                # the side stream runs the routed experts: named so where it is not the model's own
                tag = options.stream_tag or "routed_experts"
                placed.append(dataclasses.replace(target, plan=routed.with_changes(summary=summary, stream_tag=tag)))
        return placed


def _lines(side) -> str:
    if side.hoist:
        return f"hoisted {side.source}"
    return f"L{side.first_line}" if side.first_line == side.last_line else f"L{side.first_line}-{side.last_line}"


CASE = SharedExpertCase(
    name="moe-shared-expert",
    summary="MoE shared expert on a side stream, overlapping the router and routed experts",
    modes=("eager", "npugraph-ex", "ge-graph", "cuda"),
    is_seed=is_shared_expert_call,
    stream_tag="shared_expert",
    flag_name="ENABLE_MOE_SHARED_EXPERT_STREAM",
    describe=describe,
    what=("the shared expert", "the routed experts"),
    order=1,
    golden_examples=("deepseek_moe", "qwen_gated_moe", "inplace_moe", "guarded_moe", "serving_moe"),
    mutant_modes=("eager", "cuda", "npugraph-ex"),
    mutant_examples=("deepseek_moe", "qwen_gated_moe", "guarded_moe"),
    valid=(VALID,),
    options=(SIDE,),
    # refused with --protect none; by default (auto) the side stream reads a snapshot of x
    invalid=(
        Invalid(
            INVALID, "writes 'x' in place while the side stream reads it; pass --protect clone", ("--protect", "none")
        ),
    ),
)
