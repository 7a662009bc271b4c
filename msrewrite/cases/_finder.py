"""The finder of the cases that move calls or copies: a module's functions with the case's side
work, each with its plan (the shared branch analysis, or analyze/effects.py for copies) or the
reason there is none. Case.find() calls it; prefill-microbatch has its own model-level analysis
(analyze/microbatch.py). The finder never edits code.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import libcst as cst

from msrewrite import validate
from msrewrite.analyze.branch import NoBranch, SideBranch, find_side_branch, has_seed
from msrewrite.analyze.budget import OverBudget, function_budget
from msrewrite.analyze.defuse import dotted_name
from msrewrite.analyze.outline import already_applied, iter_functions
from msrewrite.analyze.packages import module_platform_names
from msrewrite.analyze.platforms import other_platform_blocks, outside
from msrewrite.analyze.positions import parsed_tree, positions_for, self_calls
from msrewrite.analyze.seeds import (
    Helpers,
    calls_in,
    find_helpers,
    framework_layers,
    framework_overlap,
    free_function_candidates,
    most_telling,
    stream_calls,
    stream_handing_calls,
    uses_api,
)
from msrewrite.analyze.summaries import ModuleSummaries
from msrewrite.analyze.walk import Visitor
from msrewrite.emit.frameworks import assigned_names, fullgraph_refusal
from msrewrite.emit.templates import code_of, strip_leading
from msrewrite.plan import FlagSpec, OverlapPlan, SideStatement, StartGate, snapshots
from msrewrite.records import record

if TYPE_CHECKING:
    from msrewrite.analyze.effects import CallBuffers
    from msrewrite.cases._base import BranchSpec, Case, Options


@record
class Target:
    """A function with the case's side work: its plan, or the reason there is none."""

    function: str
    plan: OverlapPlan | None = None
    reason: str = ""  # why there is no plan
    applied: bool = False
    # what lets the function's plan through, found by analysing it again with it (`reason` names
    # every blocker met on the way): --assume-pure names beyond those given, and --protect clone
    vouch_to_edit: tuple[str, ...] = ()
    clone_to_edit: bool = False


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
    case: Case,
    path: Path,
    module: cst.Module,
    options: Options,
    branch: BranchSpec | None = None,
    text: str | None = None,
) -> list[Target]:
    """Every function with the case's (or one branch's) side work: a plan each, or why not.
    `text` is the module's source when the caller has it (saves rendering it again)."""
    if case.analysis == "copies":
        return _copy_targets(case, path, module, options, branch, text)
    if case.analysis != "calls":  # prefill-microbatch: a model-level plan (analyze/microbatch.py), no targets
        return []
    return _CallFinder(case, path, module, options, branch, text).targets()


def _copy_targets(
    case: Case,
    path: Path,
    module: cst.Module,
    options: Options,
    branch: BranchSpec | None,
    text: str | None,
) -> list[Target]:
    """Buffer copies (kvcache-offload): analyze/effects.py, loaded only for them."""
    from msrewrite.analyze.effects import find_copy_branch

    if case.is_copy is None:  # our bug: a copy case names its copies
        raise TypeError(f"{case.name}: a copy case needs is_copy")
    summaries = ModuleSummaries(module, options.assume_pure, path=path, mode=options.mode)
    scans = _scan_calls(module, summaries)
    copy_helpers = {
        key
        for scan in scans.values()
        if not isinstance(scan, OverBudget)
        for key, helper in scan.followed.items()
        if _copies_host(helper, case)
    }
    targets = []
    for name, func, _cls in iter_functions(module):
        buffers = scans[id(func)]
        if isinstance(buffers, OverBudget):  # its calls could not be followed: refused if it has copies
            if (_has_copy(func, case.is_copy) or _names_host_method(func, case)) and func.name.value != "__init__":
                targets.append(Target(name, reason=str(buffers)))
            continue
        if id(func) in copy_helpers or not (_has_copy(func, case.is_copy) or _calls_copy_helper(func, buffers, case)):
            continue
        if func.name.value == "__init__":
            continue
        if already_applied(func, marker=branch_marker(case.name, branch)):
            targets.append(Target(name, applied=True, reason="already applied"))
            continue
        positions = positions_for(module, name, func, text)
        try:
            with function_budget(name):
                side = find_copy_branch(func, positions, case.is_copy, buffers, case.is_host_buffer)
            targets.append(Target(name, plan=branch_plan(case, path, name, side, options)))
        except (NoBranch, OverBudget) as exc:
            targets.append(Target(name, reason=str(exc)))
    return targets


class _CallFinder:
    """The targets of a case whose side work is calls on submodules (is_seed)."""

    def __init__(
        self,
        case: Case,
        path: Path,
        module: cst.Module,
        options: Options,
        branch: BranchSpec | None,
        text: str | None,
    ) -> None:
        self.case, self.path, self.module, self.options, self.branch, self.text = (
            case,
            path,
            module,
            options,
            branch,
            text,
        )
        source = text if text is not None else module.code
        self.source = source
        self.calls = self_calls(source)
        self.seeds_of = _SeedsPerClass(
            module, branch.is_seed if branch is not None else case.is_seed, self.calls, source
        )
        self.summaries = ModuleSummaries(module, options.assume_pure, path=path, mode=options.mode, text=source)
        self._platform_names: dict[str, str] | None = None

    def targets(self) -> list[Target]:
        targets = []
        for name, func, cls in iter_functions(self.module):
            is_seed = self.seeds_of.predicate(name, cls)
            if (
                name in self.calls
                and getattr(is_seed, "on_call", None) is None
                and not any(is_seed(callee) for callee in self.calls[name])
            ):
                why = self._reason_without_seed(name, func, cls)
                if why:
                    targets.append(Target(name, reason=why))
                continue  # cheap: ast saw no side call here
            # Only the function that runs the side call matters, not helpers that define it or that
            # a caller reaches it through.
            if not has_seed(func, is_seed) or func.name.value == "__init__" or self.seeds_of.is_helper(name, cls):
                continue
            targets.append(self._target(name, func, cls, is_seed))
        return targets

    def _reason_without_seed(self, name: str, func: cst.FunctionDef, cls: cst.ClassDef | None) -> str:
        """Why a function that calls no seed itself still gets a word: the framework or a refused helper."""
        if func.name.value == "__init__":
            return ""
        seeds_of = self.seeds_of
        why = framework_overlap(seeds_of.layers(name, cls), self.calls.get(name, ())) or seeds_of.refused_helper(
            name, cls
        )
        if why and (existing := stream_calls(func)):  # the helper runs on the model's own stream
            why = _already_overlapped(most_telling(existing), cls, func)
        return why

    def _target(self, name: str, func: cst.FunctionDef, cls: cst.ClassDef | None, is_seed) -> Target:
        case, options, branch = self.case, self.options, self.branch
        if already_applied(func, marker=branch_marker(case.name, branch)):
            return Target(name, applied=True, reason="already applied")
        # a refusal no option lifts comes first and alone: nothing else about the function matters
        compiled = fullgraph_refusal(self.module, name, self.text)
        if compiled is not None:
            return Target(name, reason=compiled)
        # msrewrite's own stream code (a branch done before) is not counted
        # stream code only in another platform's branch (`if _is_npu:` for a CUDA edit) is not
        # an overlap of this platform's path (analyze/platforms.py)
        func_calls = self._this_platform(func, calls_in(func))
        existing = stream_calls(func, func_calls) or [
            c
            for other in self.seeds_of.stream_siblings(name, cls, func)
            for c in stream_calls(other, self._this_platform(other, calls_in(other)))
        ]
        if existing:
            return Target(name, reason=_already_overlapped(most_telling(existing), cls, func))
        handed = stream_handing_calls(func_calls)
        if handed:
            call, keyword = handed[0]
            return Target(
                name,
                reason=f"already overlapped: this function hands a stream to `{code_of(call.func).strip()}` "
                f"(`{keyword}=`), which runs work of its own on it; msrewrite does not stack a second side stream on it",
            )
        family = _other_family(func_calls, options.mode)
        if family:
            return Target(name, reason=family)
        positions = positions_for(self.module, name, func, self.text)
        protect = snapshots(options.protect, options.start_gates)
        try:
            side = self._side_branch(name, func, cls, is_seed, positions, self.summaries, protect)
        except OverBudget as exc:
            return Target(name, reason=str(exc))
        except NoBranch as exc:
            return self._every_blocker(name, func, cls, is_seed, positions, exc)
        plan = graph_decode_default(branch_plan(case, self.path, name, side, options), func, options)
        if branch is not None:
            plan = plan.with_changes(
                stream_tag=branch.stream_tag, case_branch=branch.name, summary=f"{branch.what}: {plan.summary}"
            )
        return Target(name, plan=plan)

    def _this_platform(self, func: cst.FunctionDef, calls: list[cst.Call]) -> list[cst.Call]:
        """`calls` (made in `func`) less those in blocks that never run on the edit's platform."""
        if self._platform_names is None:
            self._platform_names = module_platform_names(self.source)
        blocks = other_platform_blocks(func, self.options.mode, self._platform_names)
        return outside(calls, blocks) if blocks else calls

    def _side_branch(self, name, func, cls, is_seed, positions, summaries: ModuleSummaries, protect: bool):
        """The function's side branch with these summaries (its --assume-pure names) and --protect,
        or NoBranch / OverBudget."""
        case, options = self.case, self.options
        with function_budget(name):
            side = find_side_branch(
                func,
                positions,
                is_seed,
                anchors=tuple(gate.anchor for gate in options.start_gates),
                phase_anchors=options.phase_anchors if case.phased else None,
                scope=summaries.scope_for(cls.name.value if cls is not None else None, func.name.value),
                protect=protect,
            )
        check_rng_order(side, options)
        check_main_hoists(case, side)
        skipped = summaries.skipped_platform_code()
        if skipped:  # what the analysis took on trust: those branches never run where the edit does
            side.trust_boundary.append(
                f"code under {', '.join(f'`if {validate.clipped(test, 60)}:`' for test in skipped[:4])}"
                f"{f' and {len(skipped) - 4} more platform tests' if len(skipped) > 4 else ''} not read: "
                f"it runs only on another platform than {options.mode}'s"
            )
        return side

    def _every_blocker(self, name, func, cls, is_seed, positions, first: NoBranch) -> Target:
        """The refusal of a function, naming every blocker the analysis meets on the way to an
        edit: a refusal that --assume-pure (or --protect clone) lifts is lifted and the function
        analysed again, so that one run names them all, not one per run. It says what is still
        refused at the end, or that with all of them the analysis lets the function through (it
        made the plan). The rounds share one analysis budget: a refusal costs at most twice the
        analysis of the function. A structural refusal met in a later round (nothing to overlap)
        is named alone: no option lifts it, so the earlier ones would only cost a review."""
        reasons, vouched, clone = [str(first)], list(self.options.assume_pure), False
        protect = snapshots(self.options.protect, self.options.start_gates)
        exc: NoBranch | OverBudget = first
        summaries, edits = self.summaries, False
        with function_budget(name):
            for _ in range(MAX_ROUNDS):
                assert isinstance(exc, NoBranch)  # an OverBudget ends the rounds below
                new = [n for n in exc.vouch if n not in vouched]
                lift_clone = exc.clone and not protect and not new
                if not new and not lift_clone:
                    break
                vouched += new
                clone, protect = clone or lift_clone, protect or lift_clone
                try:
                    if new:
                        summaries = ModuleSummaries(
                            self.module, tuple(vouched), path=self.path, mode=self.options.mode, text=self.source
                        )
                    self._side_branch(name, func, cls, is_seed, positions, summaries, protect)
                except (NoBranch, OverBudget) as again:
                    if isinstance(again, NoBranch) and again.structural:
                        # the function's shape refuses it whatever callees do: that alone, no options
                        return Target(name, reason=str(again))
                    exc = again
                    reasons.append(str(again))
                    if isinstance(again, OverBudget):
                        break
                    continue
                edits = True
                break
        extra = tuple(vouched[len(self.options.assume_pure) :])
        why = self._why_unseen(extra)
        if edits:
            return Target(
                name,
                reason=_blockers(reasons, extra, clone, edits=True) + why,
                vouch_to_edit=extra,
                clone_to_edit=clone,
            )
        return Target(name, reason=(reasons[0] if len(reasons) == 1 else _blockers(reasons, extra, clone)) + why)

    def _why_unseen(self, names: tuple[str, ...]) -> str:
        """' (why unknown: FusedMoE, TopK: no source found for vllm.x; searched /a, /b)' for the
        names to vouch for that this file imports from a module msrewrite found no source for;
        '' when it read them all (the refusal's callee chains say what it could not follow)."""
        from msrewrite.analyze import packages

        missing: dict[str, list[str]] = {}  # what was not found, and where it was looked for -> names
        for name in names:
            head = name.split(".")[0]
            summaries = self.summaries
            if head not in summaries.imports or summaries.find_class(name) or summaries.find_function(name):
                continue
            dots, source, _original = summaries.imports[head]
            if dots:
                missing.setdefault(f"{'.' * dots}{source} next to {self.path}", []).append(name)
            elif packages.module_file(source, near=self.path) is None:  # read but not defining it: the chain says more
                roots = packages.search_roots(source, near=self.path)
                where = f"; searched {', '.join(roots)}" if roots else " (never read: msrewrite's tables cover it)"
                missing.setdefault(f"{source}{where}", []).append(name)
        whys = [f"{', '.join(found)}: no source found for {what}" for what, found in missing.items()]
        return f" (why unknown: {'; '.join(whys)})" if whys else ""


# Rounds of lifting a function's refusals (each a fresh analysis): past them the refusal names
# those met so far. SGLang's deepseek_v2 needs three.
MAX_ROUNDS = 6


def _blockers(reasons: list[str], vouched: tuple[str, ...], clone: bool, edits: bool = False) -> str:
    """One refusal for the blockers met in turn: the first as found, each later one as what is
    left once the earlier ones are lifted, then what lifts them all (or what still refuses)."""
    options = " ".join([*(f"--assume-pure {n}" for n in vouched), *(["--protect clone"] if clone else [])])
    text = reasons[0] + "".join(f"; once that is lifted: {r}" for r in reasons[1 : -1 if not edits else None])
    if edits:
        return f"{text}; checked: with {'all of ' if len(reasons) > 1 else ''}{options} the analysis lets it through"
    return f"{text}; even with {options}: {reasons[-1]}"


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
                    qualified[len(prefix) :]
                    for qualified, callees in self.calls.items()
                    if cls is not None
                    and qualified.startswith(prefix)
                    and "." not in qualified[len(prefix) :]
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
        return short in helpers.methods if cls is not None else short in helpers.functions

    def stream_siblings(self, name: str, cls: cst.ClassDef | None, func: cst.FunctionDef) -> list[cst.FunctionDef]:
        """Other methods of the class that run the same side work by hand on a stream."""
        if cls is None or not isinstance(cls.body, cst.IndentedBlock):
            return []
        prefix = name.rsplit(".", 1)[0] + "."
        seeded = {  # cheap (ast): the methods that call the side work at all
            qualified[len(prefix) :]
            for qualified, callees in self.calls.items()
            if qualified.startswith(prefix) and any(self.is_seed(c) for c in callees)
        }
        return [
            s
            for s in cls.body.body
            if isinstance(s, cst.FunctionDef)
            and s is not func
            and s.name.value in seeded
            and not phase_twins(s.name.value, func.name.value)
            and stream_calls(s)
        ]


PHASE_WORDS = ("decode", "prefill")


def phase_twins(first: str, second: str) -> bool:
    """`mla_prolog_decode` and `mla_prolog_prefill`: the same work for two phases, each run on its own
    path. An overlap written into one is not an overlap of the other, so each is its own target
    (a sibling that is another variant of the same path, `_forward_dual_stream` beside
    `_forward_single_stream`, still counts as an overlap of it)."""

    def phase(name: str) -> str | None:
        words = name.lower().split("_")
        found = [w for w in words if w in PHASE_WORDS]
        return found[0] if len(found) == 1 else None

    one, other = phase(first), phase(second)
    return one is not None and other is not None and one != other


def _already_overlapped(call: cst.Call, cls: cst.ClassDef | None, func: cst.FunctionDef) -> str:
    where = "this function"
    if cls is not None and isinstance(cls.body, cst.IndentedBlock) and not any(call is c for c in stream_calls(func)):
        owner = next(
            s for s in cls.body.body if isinstance(s, cst.FunctionDef) and any(call is c for c in stream_calls(s))
        )
        where = f"{cls.name.value}.{owner.name.value}"
    return (
        f"already overlapped: {where} runs it on a stream of its own (`{code_of(call.func).strip()}`); "
        "msrewrite does not stack a second side stream on it"
    )


def _other_family(calls: list[cst.Call], mode: str) -> str:
    """Why `mode`'s stream API must not go into the function that makes `calls`, or ''."""
    if mode == "cuda" and (uses_api(calls, "npu") or any("torch_npu" in (dotted_name(c.func) or "") for c in calls)):
        return "the function uses torch.npu; msrewrite never mixes torch.cuda into it (pick an NPU --mode)"
    if mode != "cuda" and uses_api(calls, "cuda"):
        return "the function uses torch.cuda; msrewrite never mixes torch.npu into it (use --mode cuda)"
    return ""


def _scan_calls(module: cst.Module, summaries: ModuleSummaries) -> dict[int, CallBuffers | OverBudget]:
    """id(function) -> its calls followed through the file's summaries (each method once per run),
    or why that went past the function's analysis budget. The methods they reach that copy host
    memory (`self.cache.offload(i)`) move with the call, so they are not targets of their own."""
    from msrewrite.analyze.effects import CallBuffers, buffer_use

    shared: dict = {}
    scans: dict[int, CallBuffers | OverBudget] = {}
    for name, func, cls in iter_functions(module):
        buffers = CallBuffers(summaries, cls.name.value if cls is not None else None, func, shared=shared)
        try:
            with function_budget(name):
                buffer_use(func.body, buffers)
            scans[id(func)] = buffers
        except OverBudget as exc:
            scans[id(func)] = exc
    return scans


def _copies_host(helper, case: Case) -> bool:
    return any(case.is_host_buffer(p) for d, s in helper.copies for p in d | s) if case.is_host_buffer else False


def _calls_copy_helper(func: cst.FunctionDef, buffers: CallBuffers, case: Case) -> bool:
    """Does `func` call a method that copies host memory (`buffers`: its calls, followed), or one
    named for it (`cache.offload(...)`)?"""
    return _names_host_method(func, case) or any(_copies_host(helper, case) for helper in buffers.found)


def _names_host_method(func: cst.FunctionDef, case: Case) -> bool:
    named = False

    class _Calls(Visitor):
        def visit_Call(self, node: cst.Call) -> None:
            nonlocal named
            attr = node.func.attr.value if isinstance(node.func, cst.Attribute) else ""
            named = named or bool(case.is_host_buffer and attr and case.is_host_buffer(attr))

    func.body.visit(_Calls())
    return named


def _has_copy(func: cst.FunctionDef, is_copy) -> bool:
    found = False

    class _Copies(Visitor):
        def visit_Call(self, node: cst.Call) -> None:
            nonlocal found
            found = found or bool(is_copy(node))

    func.body.visit(_Copies())
    return found


GRAPH_MODES = ("ge-graph", "npugraph-ex")
PREFILL_PARAMS = ("is_prefill", "with_prefill")


def graph_decode_default(plan: OverlapPlan, func: cst.FunctionDef, options: Options) -> OverlapPlan:
    """In a graph mode, a function that takes `is_prefill` (`with_prefill`) overlaps in decode only
    unless --gate says otherwise: the recipes switch their graph-mode overlaps on with
    `enable_multi_streams and not is_prefill`, prefill running eagerly beside the graph."""
    flag = plan.flag
    if options.gate_asked or options.mode not in GRAPH_MODES or flag.gate is not None or flag.max_tokens is not None:
        return plan
    params = func.params
    names = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
    found = next((n for n in PREFILL_PARAMS if n in names), None)
    if found is None or found in assigned_names(func):  # reassigned: it cannot tell the phase at the fork
        return plan
    note = (
        f"; --gate decode (the default for {options.mode} where the function takes `{found}`: graph-mode "
        "overlaps run in decode, prefill runs eagerly; --gate always overlaps prefill too)"
    )
    return plan.with_changes(flag=dataclasses.replace(flag, gate="decode"), summary=plan.summary + note)


def branch_plan(case: Case, path: Path, function: str, branch: SideBranch, options: Options) -> OverlapPlan:
    facts = branch.facts
    side = [
        SideStatement(
            f.first_line,
            f.last_line,
            code_of(strip_leading(f.node)).strip(),
            phase=branch.phases.get(f.index, 0),
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
        fork_line=branch.guard.line
        if branch.guard and branch.fork == branch.guard.index
        else facts[branch.fork].first_line,
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
        trust_boundary=tuple(validate.clipped(note) for note in branch.trust_boundary),  # a note may quote long code
        assume_pure=tuple(options.assume_pure),
        allow_rng_reorder=options.allow_rng_reorder and bool(branch.rng_reorder),
        rng_reorder=branch.rng_reorder if options.allow_rng_reorder else "",
        main_hoists=tuple(SideStatement(h.first_line, h.last_line, h.source, hoist=h.temp) for h in branch.main_hoists),
    )
