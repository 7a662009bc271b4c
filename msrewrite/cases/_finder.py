"""The finder of the cases that move calls or copies: a module's functions with the case's side
work, each with its plan (the shared branch analysis, or analyze/effects.py for copies) or the
reason there is none. Case.find() calls it; prefill-microbatch has its own model-level analysis
(analyze/microbatch.py). The finder never edits code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import libcst as cst

from msrewrite.analyze.defuse import dotted_name
from msrewrite.analyze.positions import parsed_tree, positions_for, self_calls
from msrewrite.analyze.branch import NoBranch, SideBranch, find_side_branch, has_seed
from msrewrite.analyze.seeds import (
    Helpers,
    find_helpers,
    framework_layers,
    framework_overlap,
    calls_in,
    free_function_candidates,
    most_telling,
    stream_calls,
    uses_api,
)
from msrewrite.analyze.summaries import ModuleSummaries
from msrewrite.analyze.walk import Visitor
from msrewrite.emit.engine import already_applied, code_of, iter_functions, strip_leading
from msrewrite.plan import FlagSpec, OverlapPlan, SideStatement, StartGate

if TYPE_CHECKING:
    from msrewrite.cases._base import BranchSpec, Case, Options


@dataclass
class Target:
    """A function with the case's side work: its plan, or the reason there is none."""

    function: str
    plan: OverlapPlan | None = None
    reason: str = ""  # why there is no plan
    applied: bool = False


def check_rng_order(branch: SideBranch, options: Options) -> None:
    """Refuse a branch whose move reorders random draws, unless the reviewer allowed it."""
    if branch.rng_reorder and not options.allow_rng_reorder:
        raise NoBranch(
            f"{branch.rng_reorder}; pass --allow-rng-reorder if the model runs in eval only, its dropout "
            "is p=0, or the draws' order does not matter"
        )


def check_main_hoists(case: Case, branch: SideBranch) -> None:
    """A case whose main work gets its own core budget wraps the window's main statements; main
    calls hoisted out of the join statement sit in the join block, outside that budget."""
    calls = ", ".join(" ".join(h.source.split()) for h in branch.main_hoists)
    if branch.main_hoists and case.sync == "async-comm":
        raise NoBranch(
            f"the only main work, {calls}, is inside the join statement; msrewrite does not hoist main work out "
            "of the join of asynchronous send/recv"
        )
    if branch.main_hoists and case.core_limits:
        raise NoBranch(
            f"the only main work, {calls}, is inside the join statement; {case.name} gives the main work between "
            "the fork and the join a core budget of its own, which msrewrite does not put around a call hoisted "
            "out of the join"
        )


def branch_marker(case_name: str, branch: BranchSpec | None) -> str | None:
    """The comment label a branch's emitted code carries; a second apply looks for it."""
    return None if branch is None else f"msrewrite({case_name}: {branch.name})"


def find_targets(
    case: Case, path: Path, module: cst.Module, options: Options, branch: BranchSpec | None = None,
    text: str | None = None,
) -> list[Target]:
    """Every function with the case's (or one branch's) seed calls: a plan each, or why not.
    `text` is the module's source when the caller has it (saves rendering it again)."""
    base_seed = branch.is_seed if branch is not None else case.is_seed
    targets = []
    calls = self_calls(text if text is not None else module.code) if case.analysis == "calls" else {}
    seeds_of = (
        _SeedsPerClass(module, base_seed, calls, text if text is not None else module.code)
        if case.analysis == "calls" else None
    )
    summaries = ModuleSummaries(module, options.assume_pure, path=path)
    if case.analysis == "copies":  # buffer copies (kvcache-offload): analyze/effects.py, loaded only for them
        from msrewrite.analyze.effects import CallBuffers
    copy_helpers = _copy_helpers(module, summaries, case) if case.analysis == "copies" else set()
    for name, func, cls in iter_functions(module):
        is_seed = seeds_of.predicate(name, cls) if seeds_of is not None else base_seed
        if case.analysis == "copies":
            buffers = CallBuffers(summaries, cls.name.value if cls is not None else None, func)
            if id(func) in copy_helpers or not (_has_copy(func, case.is_copy) or _calls_copy_helper(func, buffers, case)):
                continue
        elif (
            name in calls
            and getattr(is_seed, "on_call", None) is None
            and not any(is_seed(callee) for callee in calls[name])
        ):
            if func.name.value != "__init__":
                why = framework_overlap(seeds_of.layers(name, cls), calls.get(name, ())) or seeds_of.refused_helper(name, cls)
                if why and (existing := stream_calls(func)):  # the helper runs on the model's own stream
                    why = _already_overlapped(most_telling(existing), cls, func)
                if why:
                    targets.append(Target(name, reason=why))
            continue  # cheap: ast saw no side call here
        elif not has_seed(func, is_seed):
            continue
        # Only the function that runs the side call matters, not helpers that define it or that
        # a caller reaches it through.
        if func.name.value == "__init__" or (seeds_of is not None and seeds_of.is_helper(name, cls)):
            continue
        if already_applied(func, marker=branch_marker(case.name, branch)):
            targets.append(Target(name, applied=True, reason="already applied"))
            continue
        if case.analysis == "calls":  # msrewrite's own stream code (a branch done before) is not counted
            func_calls = calls_in(func)
            existing = stream_calls(func, func_calls)
            if not existing:
                existing = [c for other in seeds_of.stream_siblings(name, cls, func) for c in stream_calls(other)]
            if existing:
                targets.append(Target(name, reason=_already_overlapped(most_telling(existing), cls, func)))
                continue
            family = _other_family(func, func_calls, options.mode)
            if family:
                targets.append(Target(name, reason=family))
                continue
        positions = positions_for(module, name, func, text)
        try:
            if case.analysis == "copies":
                from msrewrite.analyze.effects import find_copy_branch

                side = find_copy_branch(func, positions, case.is_copy, buffers, case.is_host_buffer)
                targets.append(Target(name, plan=branch_plan(case, path, name, side, options)))
                continue
            anchors = tuple(gate.anchor for gate in options.start_gates)
            side = find_side_branch(
                func,
                positions,
                is_seed,
                anchors=anchors,
                phase_anchors=options.phase_anchors if case.phased else None,
                scope=summaries.scope_for(cls.name.value if cls is not None else None, func.name.value),
                protect=options.protect == "clone",
            )
            check_rng_order(side, options)
            check_main_hoists(case, side)
        except NoBranch as exc:
            targets.append(Target(name, reason=str(exc)))
            continue
        plan = branch_plan(case, path, name, side, options)
        if branch is not None:
            plan = plan.with_changes(
                stream_tag=branch.stream_tag, case_branch=branch.name, summary=f"{branch.what}: {plan.summary}"
            )
        targets.append(Target(name, plan=plan))
    return targets


class _SeedsPerClass:
    """The case's seed predicate, widened per class to the helpers that do only side work."""

    def __init__(self, module: cst.Module, is_seed, calls: dict[str, frozenset[str]], text: str) -> None:
        self.module, self.is_seed, self.calls = module, is_seed, calls
        self.tree = parsed_tree(text)
        self._layers: dict[str, dict[str, str]] | None = None
        self._helpers: dict[int, Helpers] = {}
        self._functions: Helpers | None = None  # the file's free functions, the same for every class

    def helpers(self, name: str, cls: cst.ClassDef | None) -> Helpers:
        key = id(cls)
        if key not in self._helpers:
            if getattr(self.is_seed, "on_call", None) is not None:  # seeds that are not submodule calls
                self._helpers[key] = Helpers()
            else:
                prefix = name.rsplit(".", 1)[0] + "." if cls is not None else ""
                # cheap: only methods whose own calls (ast) reach a seed can be helpers
                methods = {
                    qualified[len(prefix):]
                    for qualified, callees in self.calls.items()
                    if cls is not None and qualified.startswith(prefix) and "." not in qualified[len(prefix):]
                    and any(self.is_seed(c) for c in callees)
                }
                if self._functions is None:
                    candidates = free_function_candidates(self.tree, self.is_seed)
                    self._functions = find_helpers(self.module, None, self.is_seed, functions=candidates)
                own = find_helpers(self.module, cls, self.is_seed, methods, functions=False)
                own.functions = self._functions.functions
                own.refused = {**self._functions.refused, **own.refused}
                self._helpers[key] = own
        return self._helpers[key]

    def layers(self, name: str, cls: cst.ClassDef | None) -> dict[str, str]:
        """self.<attr> -> the framework layer it is, for the class of `name`."""
        if cls is None:
            return {}
        if self._layers is None:
            self._layers = framework_layers(self.tree, self.is_seed)
        return self._layers.get(name.rsplit(".", 1)[0], {})

    def predicate(self, name: str, cls: cst.ClassDef | None):
        return self.helpers(name, cls).seed_predicate(self.is_seed)

    def refused_helper(self, name: str, cls: cst.ClassDef | None) -> str:
        """Why the side work `name` reaches through a helper method cannot move, or ''."""
        if cls is None:
            return ""
        refused = self.helpers(name, cls).refused
        callee = next((c for c in sorted(self.calls.get(name, ())) if c in refused), None)
        if callee is None:
            return ""
        return f"the side work is reached through self.{callee}(), which is not side work only: {refused[callee]}"

    def is_helper(self, name: str, cls: cst.ClassDef | None) -> bool:
        helpers = self.helpers(name, cls)
        short = name.rsplit(".", 1)[-1]
        return (short in helpers.methods if cls is not None else short in helpers.functions)

    def stream_siblings(self, name: str, cls: cst.ClassDef | None, func: cst.FunctionDef) -> list[cst.FunctionDef]:
        """Other methods of the class that run the same side work by hand on a stream."""
        if cls is None or not isinstance(cls.body, cst.IndentedBlock):
            return []
        prefix = name.rsplit(".", 1)[0] + "."
        seeded = {  # cheap (ast): the methods that call the side work at all
            qualified[len(prefix):] for qualified, callees in self.calls.items()
            if qualified.startswith(prefix) and any(self.is_seed(c) for c in callees)
        }
        return [
            s for s in cls.body.body
            if isinstance(s, cst.FunctionDef) and s is not func and s.name.value in seeded and stream_calls(s)
        ]


def _already_overlapped(call: cst.Call, cls: cst.ClassDef | None, func: cst.FunctionDef) -> str:
    where = "this function"
    if cls is not None and isinstance(cls.body, cst.IndentedBlock) and not any(call is c for c in stream_calls(func)):
        owner = next(s for s in cls.body.body if isinstance(s, cst.FunctionDef) and any(call is c for c in stream_calls(s)))
        where = f"{cls.name.value}.{owner.name.value}"
    return (
        f"already overlapped: {where} runs it on a stream of its own (`{code_of(call.func).strip()}`); "
        "msrewrite does not stack a second side stream on it"
    )


def _other_family(func: cst.FunctionDef, calls: list[cst.Call], mode: str) -> str:
    """Why `mode`'s stream API must not go into `func` (which makes `calls`), or ''."""
    if mode == "cuda" and (uses_api(calls, "npu") or any("torch_npu" in (dotted_name(c.func) or "") for c in calls)):
        return "the function uses torch.npu; msrewrite never mixes torch.cuda into it (pick an NPU --mode)"
    if mode != "cuda" and uses_api(calls, "cuda"):
        return "the function uses torch.cuda; msrewrite never mixes torch.npu into it (use --mode cuda)"
    return ""


def _copy_helpers(module: cst.Module, summaries: ModuleSummaries, case: Case) -> set[int]:
    """The methods other functions of the file call (`self.cache.offload(i)`) that copy host memory:
    their copies move with the call, so they are not targets of their own."""
    from msrewrite.analyze.effects import CallBuffers, buffer_use

    found: set[int] = set()
    for _, func, cls in iter_functions(module):
        buffers = CallBuffers(summaries, cls.name.value if cls is not None else None, func)
        buffer_use(func.body, buffers)
        found |= {key for key, helper in buffers.followed.items() if _copies_host(helper, case)}
    return found


def _copies_host(helper, case: Case) -> bool:
    return any(case.is_host_buffer(p) for d, s in helper.copies for p in d | s) if case.is_host_buffer else False


def _calls_copy_helper(func: cst.FunctionDef, buffers: CallBuffers, case: Case) -> bool:
    """Does `func` call a method that copies host memory, or one named for it (`cache.offload(...)`)?"""
    from msrewrite.analyze.effects import buffer_use

    named = False

    class _Calls(Visitor):
        def visit_Call(self, node: cst.Call) -> None:
            nonlocal named
            attr = node.func.attr.value if isinstance(node.func, cst.Attribute) else ""
            named = named or bool(case.is_host_buffer and attr and case.is_host_buffer(attr))

    func.body.visit(_Calls())
    buffer_use(func.body, buffers)
    return named or any(_copies_host(helper, case) for helper in buffers.found)


def _has_copy(func: cst.FunctionDef, is_copy) -> bool:
    found = False

    class _Copies(Visitor):
        def visit_Call(self, node: cst.Call) -> None:
            nonlocal found
            found = found or bool(is_copy(node))

    func.body.visit(_Copies())
    return found


def branch_plan(case: Case, path: Path, function: str, branch: SideBranch, options: Options) -> OverlapPlan:
    facts = branch.facts
    side = [
        SideStatement(
            f.first_line, f.last_line, code_of(strip_leading(f.node)).strip(), phase=branch.phases.get(f.index, 0),
            inner_phases=branch.inner_phases.get(f.index, ()),
        )
        for f in branch.statements
    ]
    side += [SideStatement(h.first_line, h.last_line, h.source, hoist=h.temp) for h in branch.hoists]
    flag = options.flag or FlagSpec(kind="env", name=case.flag_name)
    return OverlapPlan(
        case=case.name,
        file=str(path),
        function=function,
        side=tuple(side),
        # a guarded branch that forks right at its `if` forks before the `if`
        fork_line=branch.guard.line if branch.guard and branch.fork == branch.guard.index else facts[branch.fork].first_line,
        # a join past the last statement (a copy joined when the function ends) names the line after it
        join_line=facts[branch.join].first_line if branch.join < len(facts) else facts[-1].last_line + 1,
        side_inputs=tuple(branch.inputs),
        side_outputs=tuple(branch.outputs),
        stream_tag=options.stream_tag or case.stream_tag,
        flag=flag,
        mode=options.mode,
        start_gates=tuple(
            StartGate(gate.tensor or branch.inputs[0], gate.anchor) for gate in options.start_gates if branch.inputs
        ),
        summary=case.describe(branch),
        inputs_rebound_before_join=tuple(branch.rebound_inputs),
        outputs_maybe_unbound=tuple(branch.maybe_outputs),
        stream_source=case.stream_source,
        sync=case.sync,
        phase_anchors=tuple(branch.phase_anchors),
        non_blocking=case.non_blocking,
        core_limits=options.core_limits if case.core_limits else None,
        guard=branch.guard.condition if branch.guard else "",
        guard_line=branch.guard.line if branch.guard else 0,
        protect_inputs=tuple(branch.protected_inputs),
        trust_boundary=tuple(branch.trust_boundary),
        assume_pure=tuple(options.assume_pure),
        allow_rng_reorder=options.allow_rng_reorder and bool(branch.rng_reorder),
        rng_reorder=branch.rng_reorder if options.allow_rng_reorder else "",
        main_hoists=tuple(SideStatement(h.first_line, h.last_line, h.source, hoist=h.temp) for h in branch.main_hoists),
    )
