"""From a chosen side branch (statements, maybe one hoisted call) to an OverlapPlan, or a reason why not.

The trace (or the static DAG) says two branches are independent; the source decides whether
the side one can move: it forks right after the last definition of what it reads, joins at the
first statement that reads what it produces, and nothing in between may rebind its outputs,
mutate its inputs in place, or leave the function.
"""

from __future__ import annotations

from dataclasses import dataclass

from msrewrite.analyze.dataflow import CallSite, FunctionInfo, Statement
from msrewrite.plan import FlagSpec, OverlapPlan, SideStatement

SHARED_EXPERT_ATTRS = ("shared_expert", "shared_experts", "shared_mlp", "shared_expert_gate")
CASE_PRIORITY = {"moe-shared-expert": 0, "attn-moe-limit-core": 0, "indexer-prolog": 0, "generic": 1}


class NoPlan(Exception):
    """The branch is independent but the source does not allow the move; the message says why."""


@dataclass(frozen=True)
class SideChoice:
    statements: tuple[int, ...]  # indices of whole statements that move
    hoist: tuple[int, CallSite] | None = None  # (join statement index, call lifted out of it)


def classify(side_attrs: set[str], main_attrs: set[str], qualname: str) -> str:
    if any(a in SHARED_EXPERT_ATTRS or a.startswith("shared_expert") for a in side_attrs):
        return "moe-shared-expert"
    # DSA indexer prolog (DeepSeek-V3.2, GLM-5): the q path or the weights projection on a side stream.
    if side_attrs & {"wq_b", "weights_proj"}:
        return "indexer-prolog"
    # LongCat: the shortcut MoE `self.mlp(...)` runs beside the second attention sublayer.
    if "mlp" in side_attrs and "self_attn" in main_attrs and qualname.endswith("DecoderLayer.forward"):
        return "attn-moe-limit-core"
    return "generic"


def apply_command(case: str, qualname: str, file: str, rank: int) -> str:
    if case == "generic":
        return f"msrewrite suggest --json {file} > plans.json && msrewrite apply --plan plans.json --candidate {rank} {file}"
    return f"msrewrite apply --case {case} --target {qualname} {file}"


def side_attrs(info: FunctionInfo, choice: SideChoice) -> set[str]:
    attrs = {c.attr for i in choice.statements for c in info.statements[i].calls}
    if choice.hoist:
        attrs.add(choice.hoist[1].attr)
    return attrs


def window_attrs(info: FunctionInfo, plan: OverlapPlan) -> set[str]:
    return {c.attr for s in window_statements(info, plan) for c in s.calls}


def window_statements(info: FunctionInfo, plan: OverlapPlan) -> list[Statement]:
    """Main-path statements between the fork and the join: the work the side overlaps with."""
    side_lines = {s.first_line for s in plan.side if s.hoist is None}
    return [
        s
        for s in info.statements
        if plan.fork_line <= s.first_line < plan.join_line and s.first_line not in side_lines
    ]


def _temp_name(callee: str, taken: set[str]) -> str:
    base = callee.split(".")[0].split("[")[0] + "_output"
    name, n = base, 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name


def make_plan(info: FunctionInfo, choice: SideChoice, case: str, file: str, module_names=frozenset()) -> OverlapPlan:
    stmts = info.statements
    side_idx = sorted(choice.statements)
    for i in side_idx:
        if stmts[i].compound:
            raise NoPlan(f"line {stmts[i].first_line}: side work inside a compound statement does not move")
        if stmts[i].exits:
            raise NoPlan(f"line {stmts[i].first_line}: the side branch returns")
    local = set(info.local_names) - {"self"}
    temp = _temp_name(choice.hoist[1].callee, set(info.local_names) | set(module_names)) if choice.hoist else None

    units = [(i, set(stmts[i].uses) & local, set(stmts[i].defs)) for i in side_idx]
    if choice.hoist:
        join_index, call = choice.hoist
        units.append((join_index, set(call.uses) & local, {temp}))

    def reaching(name: str, before: int) -> int | None:
        for s in reversed(stmts[:before]):
            if s.index not in side_idx and (name in s.defs or name in s.mutates):
                return s.index
        return None

    inputs: list[str] = []
    defined: set[str] = set()
    for _, uses, defs in units:
        inputs += [n for n in sorted(uses - defined) if n not in inputs]
        defined |= defs

    fork = 0
    for index, uses, _ in units:
        for name in uses & set(inputs):
            d = reaching(name, index)
            if d is not None:
                fork = max(fork, d + 1)
    first = min([*side_idx, *( [choice.hoist[0]] if choice.hoist else [])])
    if fork > first:
        raise NoPlan(f"the side branch reads '{_late_input(units, inputs, reaching, first)}', computed after it starts")
    for index, uses, _ in units:
        for name in uses & set(inputs):
            if reaching(name, index) != reaching(name, fork):
                raise NoPlan(f"'{name}' is rebound between the fork and line {stmts[index].first_line}")

    side_defs = set().union(*(stmts[i].defs for i in side_idx)) if side_idx else set()
    later = [s for s in stmts if s.index > (side_idx[-1] if side_idx else first) and s.index not in side_idx]
    outputs = sorted(n for n in side_defs if any(n in s.uses for s in later))
    if temp:
        outputs.append(temp)

    join = choice.hoist[0] if choice.hoist else None
    if join is None:
        join = next((s.index for s in stmts if s.index > side_idx[0] and s.index not in side_idx and set(outputs) & s.uses), None)
    if join is None:
        raise NoPlan("the side branch's result is never used in this function")
    if any(i > join for i in side_idx):
        raise NoPlan(f"side work after the join at line {stmts[join].first_line}")

    window = [s for s in stmts[fork:join] if s.index not in side_idx]
    for s in window:
        if s.exits:
            raise NoPlan(f"line {s.first_line} can return before the join")
        if (s.uses | s.defs) & side_defs:
            raise NoPlan(f"line {s.first_line} uses '{sorted((s.uses | s.defs) & side_defs)[0]}' inside the overlap window")
        if s.mutates & set(inputs):
            raise NoPlan(f"line {s.first_line} writes the side input '{sorted(s.mutates & set(inputs))[0]}' in place")
    for i in side_idx:
        if stmts[i].mutates & set(inputs) or stmts[i].writes_self:
            raise NoPlan(f"line {stmts[i].first_line}: the side branch writes shared state")
    if not any(s.has_call for s in window) and not (choice.hoist and any(s.has_call for s in window + [stmts[join]])):
        raise NoPlan("no main-path work between the fork and the join: nothing to overlap")

    side = [SideStatement(stmts[i].first_line, stmts[i].last_line, stmts[i].source) for i in side_idx]
    if choice.hoist:
        call = choice.hoist[1]
        side.append(SideStatement(call.first_line, call.last_line, call.source, hoist=temp))
    rebound = sorted({n for s in window for n in s.defs if n in inputs})
    tag = "shared_expert" if case == "moe-shared-expert" else ("moe_shortcut" if case == "attn-moe-limit-core" else "side")
    summary = f"{info.qualname}: run {', '.join(_side_label(s) for s in side)} on a side stream, join at line {stmts[join].first_line}"
    return OverlapPlan(
        case=case,
        file=file,
        function=info.qualname,
        side=tuple(side),
        fork_line=stmts[fork].first_line if fork < len(stmts) else stmts[-1].first_line,
        join_line=stmts[join].first_line,
        side_inputs=tuple(inputs),
        side_outputs=tuple(outputs),
        stream_tag=tag,
        flag=FlagSpec(name=_flag_name(case, tag)),
        summary=summary,
        inputs_rebound_before_join=tuple(rebound),
    )


def _flag_name(case: str, tag: str) -> str:
    """The case's own switch when msrewrite knows the case, else one named after the stream."""
    from msrewrite.codemods import get_case

    known = get_case(case)
    return known.flag_name if known else f"ENABLE_{tag.upper()}_STREAM"


def _side_label(s: SideStatement) -> str:
    lines = f"L{s.first_line}" if s.first_line == s.last_line else f"L{s.first_line}-{s.last_line}"
    return f"{s.source} ({lines})" if s.hoist else lines


def _late_input(units, inputs, reaching, first) -> str:
    for index, uses, _ in units:
        for name in uses & set(inputs):
            d = reaching(name, index)
            if d is not None and d >= first:
                return name
    return "?"
