"""`msrewrite apply`: load -> find targets (case) or read plans -> emit -> diff / in-place / patches."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from msrewrite import validate
from msrewrite.analyze.seeds import find_helpers
from msrewrite.analyze.walk import Visitor
from msrewrite.cases import Case, Options, find_targets
from msrewrite.analyze.outline import iter_functions
from msrewrite.emit.engine import apply_plans
from msrewrite.emit.locate import locate
from msrewrite.emit.torchair_config import records_config
from msrewrite.errors import EXIT_OK, BadInput, EmptyFile, NothingToDo
from msrewrite.load import git_root, load, read_source
from msrewrite.modes import resolve_mode
from msrewrite.output.diff import unified_diff
from msrewrite.plan import FlagSpec, MicrobatchPlan, OverlapPlan, StartGate, load_plans


# The documented limits of torch_npu / torchair core budgets (docs: torchair core_limit.md and
# npugraph_ex limit_cores.md), said once whenever an edit splits cores.
CORE_LIMIT_CAVEATS = (
    "core limits: they apply to Ascend C ops only (other ops, and HCCL outside AIV mode, ignore them); "
    "set torch.npu.config.allow_internal_format = False for them to take effect; "
    "if some op on a limited stream cannot be limited, the streams can hang waiting for each other: "
    "check Block Num in the profiler's kernel_details.csv"
)


def _note(message: str) -> None:
    print(f"msrewrite: {message}", file=sys.stderr)


def _relpath(file: Path) -> str:
    """Path for a/ b/ headers: relative to the git work tree, else to the file's folder."""
    root = git_root(file)
    resolved = file.resolve()
    if root is not None:
        try:
            return resolved.relative_to(root.resolve()).as_posix()
        except ValueError:
            pass
    return resolved.name


def _parse_flag(flag: str, flag_default: str, max_tokens: int | None, case_flag: str, gate: str | None = None) -> FlagSpec:
    """`case_flag`: the switch when --flag is not given (`KIND:NAME`, or a bare NAME for env)."""
    if flag_default not in ("on", "off"):
        raise BadInput(f"--flag-default must be on or off, got {flag_default!r}")
    if max_tokens is not None and max_tokens < 1:
        raise BadInput(f"--max-tokens must be a positive token count, got {max_tokens}")
    phase = None
    if gate is not None:
        kind, sep, count = gate.partition("<=")
        if sep:  # tokens<=N is --max-tokens N
            if kind.strip() != "tokens" or not count.strip().isdigit() or int(count) < 1:
                raise BadInput(f"--gate must be capture, prefill, decode or tokens<=N (N >= 1), got {gate!r}")
            if max_tokens is not None and max_tokens != int(count):
                raise BadInput(f"--gate {gate} and --max-tokens {max_tokens} disagree; give one")
            max_tokens = int(count)
        else:
            phase = gate
    try:
        return FlagSpec.parse(flag or (case_flag if ":" in case_flag else f"env:{case_flag}"),
                              default=flag_default == "on", max_tokens=max_tokens, gate=phase)
    except ValueError as exc:
        option = "--gate" if phase is not None and "gate" in str(exc) else "--flag"
        raise BadInput(f"{option}: {exc}") from None


def _checked(check, value, option: str):
    """An option's value through its validator (msrewrite/validate.py), or a one-line BadInput."""
    try:
        return check(value, option)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def _match_target(name: str, target: str) -> bool:
    return name == target or name == f"{target}.forward" or name.endswith("." + target)


def get_known_case(case_name: str) -> Case:
    from msrewrite.codemods import all_cases, get_case

    case = get_case(case_name)
    if case is None:
        known = ", ".join(c.name for c in all_cases())
        raise BadInput(f"unknown case {case_name!r}; known cases: {known}")
    return case


def plans_for_case(
    file: Path, module, case_name: str | Case, mode: str, target: str | None, flag: FlagSpec, stream_tag: str | None,
    start_gates: tuple[StartGate, ...] = (), phase_anchors: tuple[str, ...] = (),
    core_limits: tuple[int, int, int, int] | None = None,
    text: str | None = None,
    protect: str = "",
    assume_pure: tuple[str, ...] = (),
    allow_rng_reorder: bool = False,
) -> list[OverlapPlan]:
    case = get_known_case(case_name) if isinstance(case_name, str) else case_name
    if mode not in case.modes:
        raise BadInput(f"case {case.name} does not support mode {mode} (supports {', '.join(case.modes)})")
    if case.core_limits and core_limits is None:
        from msrewrite import cores

        core_limits = cores.resolve("a3", None).as_tuple()
    options = Options(
        mode=mode, flag=flag, stream_tag=stream_tag, start_gates=start_gates, phase_anchors=phase_anchors,
        core_limits=core_limits, protect=protect, assume_pure=assume_pure, allow_rng_reorder=allow_rng_reorder,
    )
    targets = find_targets(case, file, module, options, text=text)
    if target:
        chosen = [t for t in targets if _match_target(t.function, target)]
        if not chosen:
            if not any(_match_target(name, target) for name, _f, _c in iter_functions(module)):
                raise BadInput(f"--target {target}: no such function in {file}")
            raise NothingToDo(f"{target}: no {case.name} branch in this function")
        targets = chosen
    if not targets:
        raise NothingToDo(f"{file}: no {case.name} target found")
    plans = [t.plan for t in targets if t.plan is not None]
    if not plans:
        applied = [t.function for t in targets if t.applied]
        if applied:  # the others were refused before the first apply as well
            raise NothingToDo(f"{', '.join(applied)}: already applied, nothing to do")
        reasons = "; ".join(f"{t.function}: {t.reason}" for t in targets if not t.applied)
        raise NothingToDo(f"no safe {case.name} edit: {reasons}")
    if len(plans) > 1:
        names = ", ".join(p.function for p in plans)
        raise BadInput(f"ambiguous target: {len(plans)} functions match ({names}); pick one with --target")
    return plans


@dataclass
class EditStep:
    """One reviewable step of an edit: one patch of a series."""

    subject: str
    body: str
    old: str
    new: str
    plans: list[OverlapPlan | MicrobatchPlan]


def case_steps(
    file: Path, text: str, module, case_name: str, mode: str, target: str | None, flag: FlagSpec,
    stream_tag: str | None, start_gates: tuple[StartGate, ...] = (), phase_anchors: tuple[str, ...] = (),
    core_limits: tuple[int, int, int, int] | None = None, second_group: str | None = None,
    protect: str = "", assume_pure: tuple[str, ...] = (), allow_rng_reorder: bool = False,
) -> list[EditStep]:
    """The edit a case makes, as steps: phased cases first inline and flatten the side branch (a
    refactor that changes no behaviour), then issue it in phases."""
    case = get_known_case(case_name)
    if case.analysis == "microbatch":
        return _microbatch_steps(case, text, module, mode, target, flag, second_group, file, assume_pure,
                                 stream_tag)
    effects = {"protect": protect, "assume_pure": assume_pure, "allow_rng_reorder": allow_rng_reorder}
    if case.branches:
        return _branch_steps(file, text, module, case, mode, target, flag, **effects)
    if not case.phased:
        plans = plans_for_case(file, module, case, mode, target, flag, stream_tag, start_gates, (), core_limits, text,
                               **effects)
        return [_plan_step(plans[0], text, apply_plans(module, plans, text).code)]
    base = dataclasses.replace(case, phased=False)
    if mode not in case.modes:
        raise BadInput(f"case {case.name} does not support mode {mode} (supports {', '.join(case.modes)})")
    function = plans_for_case(file, module, base, mode, target, flag, stream_tag, text=text, **effects)[0].function
    from msrewrite.emit.inline import inline_and_flatten  # phased cases only

    located = locate(module, function)
    # helpers that do only side work (`self._forward_shared_experts(h)`) are inlined too
    is_seed = find_helpers(module, located.cls, case.is_seed, functions=False).seed_predicate(case.is_seed)
    inlined_func = inline_and_flatten(module, located.cls, located.func, is_seed)
    inlined = module.deep_replace(located.func, inlined_func)
    inlined_text = inlined.code
    inlined = _parse_own_edit(inlined_text, f"inlining {case.what[0]} into {function}")
    plans = plans_for_case(file, inlined, case, mode, function, flag, stream_tag, start_gates, phase_anchors,
                           text=inlined_text, **effects)
    steps = []
    if inlined_text != text:
        what = case.what[0]
        steps.append(EditStep(
            subject=f"{case.name}: inline {what} into {function.rsplit('.', 1)[0]}",
            body=(f"Refactor only, no change in behaviour: {what} is written out step by step in\n"
                  f"{function}, each nested call bound to its own name, so the next patch can\n"
                  "issue the steps in phases."),
            old=text, new=inlined_text, plans=[],
        ))
    steps.append(_plan_step(plans[0], inlined_text, apply_plans(inlined, plans, inlined_text).code))
    return steps


def _parse_own_edit(text: str, what: str):
    """Parse code msrewrite itself produced: a failure is our bug, never the user's input."""
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise BadInput(f"internal error: {what} produced code that does not parse (line {exc.raw_line}); nothing written") from None


def _branch_steps(
    file: Path, text: str, module, case: Case, mode: str, target: str | None, flag: FlagSpec,
    protect: str = "", assume_pure: tuple[str, ...] = (), allow_rng_reorder: bool = False,
) -> list[EditStep]:
    """Several side streams: each branch is planned on the code the previous one produced, so it
    sees (and may re-enter) the streams already added. One step, and one patch, per branch."""
    if mode not in case.modes:
        raise BadInput(f"case {case.name} does not support mode {mode} (supports {', '.join(case.modes)})")
    steps: list[EditStep] = []
    reasons: list[str] = []
    applied = 0
    for spec in case.branches:
        options = Options(mode=mode, flag=flag, protect=protect, assume_pure=assume_pure,
                          allow_rng_reorder=allow_rng_reorder)
        targets = find_targets(case, file, module, options, branch=spec, text=text)
        if target:
            if not any(_match_target(name, target) for name, _f, _c in iter_functions(module)):
                raise BadInput(f"--target {target}: no such function in {file}")
            targets = [t for t in targets if _match_target(t.function, target)]
        applied += sum(t.applied for t in targets)
        plans = [t.plan for t in targets if t.plan is not None]
        if len(plans) > 1:
            names = ", ".join(p.function for p in plans)
            raise BadInput(f"ambiguous target: {len(plans)} functions match ({names}); pick one with --target")
        if not plans:
            if not spec.optional and not any(t.applied for t in targets):
                reasons += [f"{spec.name}: {t.reason}" for t in targets] or [f"{spec.name}: no side call found"]
            continue
        target = target or plans[0].function  # every later branch edits the same function
        new_text = apply_plans(module, plans, text).code
        steps.append(_plan_step(plans[0], text, new_text))
        text, module = new_text, _parse_own_edit(new_text, f"the {spec.name} edit")
    if not steps:
        if applied:
            raise NothingToDo(f"{case.name}: already applied, nothing to do")
        raise NothingToDo(f"no safe {case.name} edit: {'; '.join(reasons) or 'no target found'}")
    if reasons:
        raise NothingToDo(f"{case.name}: only part of the case applies ({'; '.join(reasons)}); nothing written")
    return steps


def _microbatch_steps(
    case: Case, text: str, module, mode: str, target: str | None, flag: FlagSpec, second_group: str | None = None,
    file: Path | None = None, assume_pure: tuple[str, ...] = (), stream_tag: str | None = None,
) -> list[EditStep]:
    """The forked micro-batch path: a model-level plan (analyze/microbatch.py), carried out."""
    from msrewrite.analyze.microbatch import microbatch_plan

    if mode not in case.modes:
        raise BadInput(f"case {case.name} does not support mode {mode} (supports {', '.join(case.modes)})")
    plan = microbatch_plan(module, case=case.name, path=file, mode=mode, flag=flag, target=target,
                           stream_tag=stream_tag or case.stream_tag, second_group=second_group,
                           assume_pure=assume_pure, text=text)
    return [_microbatch_step(plan, text, apply_plans(module, [plan], text).code)]


def _microbatch_step(plan: MicrobatchPlan, old: str, new: str) -> EditStep:
    model = plan.function.rsplit(".", 1)[0]
    body = (
        f"{model}.forward gets a forward_microbatch path: the batch runs as two micro-batches\n"
        "through every layer, each layer's collectives on a communication stream one\n"
        "micro-batch behind the other, ordered by events.\n\n"
        f"Mode: {plan.mode}\nSwitch: {plan.flag.describe()}; with it off the original layer loop runs.\n"
        "Generated by msrewrite apply."
    )
    return EditStep(f"{plan.case}: run {model} as two micro-batches", body, old, new, [plan])


def _microbatch_options(protect: str, markers: bool) -> None:
    """The apply options a model-level micro-batch fork cannot honour: refused, never ignored."""
    if protect:
        raise BadInput("--protect is for cases that move calls onto a side stream; prefill-microbatch runs "
                       "each micro-batch on its own slice, with nothing shared to snapshot")
    if markers:
        raise BadInput("--markers: prefill-microbatch has no single side and main window to mark "
                       "(every layer interleaves the stages of two micro-batches)")


def trust_lines(plan: OverlapPlan | MicrobatchPlan) -> list[str]:
    """What the edit takes on trust, and what protecting it costs: printed with every edit."""
    seen = ", ".join(plan.trust_boundary) if plan.trust_boundary else "none: every callee was seen into"
    lines = [f"trust boundary (callees not seen into): {seen}"]
    if isinstance(plan, MicrobatchPlan):  # what no analysis of the source can show
        lines.append("assumed, not checked: every layer treats the sequences of dim 0 independently (no batch "
                     "statistics, no routing capacity shared across the batch); verify compares the outputs")
    if plan.assume_pure:
        lines.append(f"vouched for with --assume-pure: {', '.join(plan.assume_pure)}")
    if plan.rng_reorder:
        lines.append(f"--allow-rng-reorder: {plan.rng_reorder}")
    if plan.protect_inputs:
        lines.append(
            f"--protect clone: the side stream reads a copy of {', '.join(plan.protect_inputs)} made at the fork "
            f"(costs one copy of each, {len(plan.protect_inputs)} per call)"
        )
    return lines


def _recheck(module, plan: OverlapPlan, text: str, path: Path, protect: bool) -> OverlapPlan:
    """The plan as the branch finder derives it, or the finder's reason to refuse it: a plan file
    is never carried out unchecked (it may be stale, edited by hand, or from another version)."""
    from msrewrite.analyze.branch import NoBranch
    from msrewrite.plancheck import check_plan

    if isinstance(plan, MicrobatchPlan):
        from msrewrite.analyze.microbatch import check_microbatch_plan

        case = get_known_case(plan.case)
        if plan.mode not in case.modes:
            raise BadInput(f"case {case.name} does not support mode {plan.mode} (supports {', '.join(case.modes)})")
        return check_microbatch_plan(module, plan, text, path)
    try:
        checked = check_plan(module, plan, text, path, protect=protect or None)
    except NoBranch as exc:
        raise NothingToDo(f"refused plan for {plan.function}: {exc}") from None
    return checked.with_changes(markers=plan.markers)  # ranges are the file's choice, not the analysis'


def _plan_step(plan: OverlapPlan, old: str, new: str) -> EditStep:
    cls = plan.function.rsplit(".", 1)[0]
    phases = f" in {len(plan.phase_anchors) + 1} phases" if plan.phase_anchors else ""
    branch = f" {plan.case_branch}" if plan.case_branch else ""
    subject = f"{plan.case}: overlap {cls}{branch}{phases} on side stream {plan.stream_tag}"
    anchors = f"Phases start after: {', '.join(plan.phase_anchors)}\n" if plan.phase_anchors else ""
    body = (
        f"{plan.summary or plan.case}.\n\n"
        f"Function: {plan.function}\n"
        f"Mode: {plan.mode}\n"
        f"{anchors}"
        f"Switch: {plan.flag.describe()}; with it off the original statements run in\n"
        "their original order on the current stream.\n"
        "Generated by msrewrite apply."
    )
    return EditStep(subject=subject, body=body, old=old, new=new, plans=[plan])


def _compile_check(file: Path, src, new_text: str) -> None:
    """The edit must compile under this Python. When the file itself does not (newer syntax than
    the running interpreter), say so: that is the user's setup, not an internal error."""
    try:
        compile(new_text, str(file), "exec")
        return
    except SyntaxError as exc:
        ours = exc
    except (RecursionError, MemoryError, ValueError):
        raise BadInput(f"{file}: too deeply nested for Python {_python()} to compile; nothing written") from None
    try:
        compile(src.text, str(file), "exec")
    except SyntaxError as exc:
        needed = _needed_python(src.module)
        advice = f": the file {needed}; run msrewrite with that Python" if needed else ""
        raise BadInput(f"{file}:{exc.lineno}: Python {_python()} cannot compile the file ({exc.msg}){advice}; "
                       "nothing written") from None
    except (RecursionError, MemoryError, ValueError):
        pass
    # our bug, never the user's: refuse to write it
    raise BadInput(f"internal error: the edit does not compile ({ours.msg} at line {ours.lineno}); nothing written")


def _python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _needed_python(module) -> str:
    """Which newer Python the file's syntax asks for, where libcst's tree shows it ("" if unknown)."""
    import libcst as cst

    class NewSyntax(Visitor):
        def __init__(self) -> None:
            super().__init__()
            self.found = False

        def visit_TypeAlias(self, node) -> None:
            self.found = True

        def visit_TypeParameters(self, node) -> None:
            self.found = True

    finder = NewSyntax()
    module.visit(finder)
    if finder.found and sys.version_info < (3, 12):
        return "needs Python 3.12 (type parameters or a type statement)"
    return ""


def _write_stdout(text: str, src=None) -> None:
    """A diff is data: its bytes are the file's bytes (its coding cookie's encoding, else UTF-8),
    whatever the terminal's encoding; the `---`/`+++` paths are the file system's bytes."""
    if src is not None and src.encoding != "utf-8":
        at = text.find("\n@@")
        head, body = (text[: at + 1], text[at + 1 :]) if at >= 0 else (text, "")
        data = os.fsencode(head) + src.encode(body)
    else:
        data = text.encode("utf-8")
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        sys.stdout.write(data.decode("utf-8", "replace"))
        return
    sys.stdout.flush()
    buffer.write(data)
    buffer.flush()


def _with_markers(steps: list[EditStep], original: str) -> list[EditStep]:
    """Each step's edit with profiler ranges around the windows of its plans and the earlier ones."""
    from msrewrite.emit import markers

    marked, before, so_far = [], original, []
    for step in steps:
        so_far += [p for p in step.plans if p.markers and p not in so_far]
        new = markers.add(step.new, so_far) if so_far else step.new
        marked.append(dataclasses.replace(step, old=before, new=new))
        before = new
    return marked


def _remove_markers(file: Path, in_place: bool) -> int:
    """apply --no-markers: the edit without its profiler ranges, exactly as apply wrote it without them."""
    from msrewrite.emit import markers

    src = load(file)
    new_text = markers.remove(src.text)
    if new_text == src.text:
        raise NothingToDo(f"{file}: no msrewrite profiler ranges to remove")
    _compile_check(file, src, new_text)
    if in_place:
        from msrewrite.output.inplace import write_in_place  # tempfile, signals: only for -i

        write_in_place(file, src.encode(src.on_disk(new_text)), src.digest)
        _note(f"rewrote {file}")
    else:
        _write_stdout(unified_diff(src.on_disk(src.text), src.on_disk(new_text), _relpath(file)), src)
    return EXIT_OK


def run_apply(
    *,
    file: Path,
    case: str | None,
    plan_path: Path | None,
    candidate: int | None,
    mode: str,
    target: str | None,
    flag: str,
    flag_default: str,
    max_tokens: int | None,
    gate: str | None = None,
    stream_tag: str | None,
    in_place: bool,
    start_after: str | None = None,
    anchors: tuple[str, ...] = (),
    core_preset: str = "a3",
    core_limit: str | None = None,
    second_comm_group: str | None = None,
    protect: str = "",
    assume_pure: tuple[str, ...] = (),
    allow_rng_reorder: bool = False,
    output: Path | None,
    verify: bool,
    harness: str | None,
    force: bool = False,
    quiet: bool = False,
    markers: bool = False,
    no_markers: bool = False,
) -> int:
    if no_markers:
        if case is not None or plan_path is not None or markers or verify or output is not None:
            raise BadInput("--no-markers takes only the edited file (and -i): it removes the profiler ranges")
        return _remove_markers(file, in_place)
    if (case is None) == (plan_path is None):
        raise BadInput("give exactly one of --case or --plan")
    if in_place and output is not None:
        raise BadInput("--in-place and -o/--output conflict: choose one output")
    if candidate is not None and plan_path is None:
        raise BadInput("--candidate needs --plan")
    if output is not None and output.exists() and not output.is_dir():
        raise BadInput(f"-o {output}: exists and is not a folder")
    if force and output is None:
        raise BadInput("--force is for -o/--output (replace the patch series in that folder)")
    if target is not None:
        _checked(validate.qualified_name, target, "--target")
    if stream_tag is not None:
        _checked(validate.stream_tag, stream_tag, "--stream-tag")
    if start_after is not None:
        _checked(validate.identifier, start_after, "--start-after")
    for name in anchors:
        _checked(validate.identifier, name, "--anchor")
    if second_comm_group is not None:
        _checked(validate.attribute, second_comm_group, "--second-comm-group")
    if protect not in ("", "clone"):
        raise BadInput(f"--protect must be clone, got {protect!r}")
    bad_names = [n for n in assume_pure if not all(part.isidentifier() for part in n.split("."))]
    if bad_names:
        raise BadInput(f"--assume-pure needs a class, function or attribute name, got {bad_names[0]!r}")
    try:
        src = load(file)
    except EmptyFile as exc:
        raise exc.as_nothing_to_do() from None
    try:
        chosen_mode, why = resolve_mode(mode, src.text)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if markers and case is not None:
        from msrewrite.emit.markers import MARKER_MODES

        if chosen_mode not in MARKER_MODES:
            raise BadInput(f"--markers: {chosen_mode} mode is not supported (eager and cuda only: a range opened "
                           "while a graph is captured is not replayed with it)")

    if case is not None:
        from msrewrite.codemods import get_case

        known = get_case(case)
        spec = _parse_flag(flag, flag_default, max_tokens, known.flag_name if known else "ENABLE_SIDE_STREAM", gate)
        _note(f"mode {chosen_mode} ({'auto: ' if mode == 'auto' else ''}{why})")
        gates: tuple[StartGate, ...] = ()
        if start_after:
            if chosen_mode != "ge-graph":
                raise BadInput("--start-after is a ge-graph start gate; native modes order the fork by the stream wait")
            gates = (StartGate("", start_after),)
        if anchors and not (known and known.phased):
            raise BadInput(f"--anchor is for phased cases; {case} runs its side branch in one piece")
        budget = None
        if known and known.core_limits:
            from msrewrite import cores

            budget = cores.resolve(core_preset, core_limit).as_tuple()
        elif core_limit or core_preset != "a3":
            raise BadInput(f"--cores and --core-limit are for core-limit cases; {case} does not split cores")
        if second_comm_group and not (known and known.analysis == "microbatch"):
            raise BadInput(f"--second-comm-group is for prefill-microbatch; {case} has no micro-batches")
        if allow_rng_reorder and not (known and known.analysis == "calls" and known.sync != "async-comm"):
            raise BadInput(f"--allow-rng-reorder is for cases that move calls onto a side stream; {case} moves none")
        if known and known.analysis == "microbatch":
            _microbatch_options(protect, markers)
        steps = case_steps(file, src.text, src.module, case, chosen_mode, target, spec, stream_tag, gates,
                           tuple(anchors), budget, second_comm_group, protect=protect, assume_pure=assume_pure,
                           allow_rng_reorder=allow_rng_reorder)
        plans = [plan for step in steps for plan in step.plans]
    else:
        try:
            plans = load_plans(read_source(plan_path, python=False))  # type: ignore[arg-type]
        except (ValueError, KeyError, TypeError) as exc:
            raise BadInput(f"{plan_path}: {exc}") from None
        from msrewrite.codemods import get_case

        for plan in plans:
            if plan.case != "generic" and get_case(plan.case) is None:
                raise BadInput(f"{plan_path}: unknown case {plan.case!r} in the plan")
            if isinstance(plan, MicrobatchPlan) and get_case(plan.case).analysis != "microbatch":
                raise BadInput(f"{plan_path}: a micro-batch plan for case {plan.case}, which has no micro-batches")
        lines = src.text.count("\n") + (not src.text.endswith("\n"))
        for plan in plans:  # a plan for another file, or for this one before it changed
            try:
                plan.check_lines(lines)
            except ValueError as exc:
                raise BadInput(f"{plan_path}: stale plan: {exc}") from None
        if candidate is not None:
            if not 1 <= candidate <= len(plans):
                raise BadInput(f"--candidate {candidate}: the plan file has {len(plans)} candidate(s)")
            plans = [plans[candidate - 1]]
        if target:
            plans = [p for p in plans if _match_target(p.function, target)]
        if not plans:
            raise NothingToDo(f"{plan_path}: no plan to carry out")
        if any(isinstance(p, MicrobatchPlan) for p in plans):
            if len(plans) > 1:
                raise BadInput(f"{plan_path}: a prefill-microbatch plan forks the whole model: carry it out alone "
                               "(--candidate N)")
            if allow_rng_reorder:
                raise BadInput("--allow-rng-reorder is for cases that move calls onto a side stream; "
                               "a prefill-microbatch plan moves none")
            _microbatch_options(protect, markers)
        overrides: dict = {}
        if mode != "auto":
            overrides["mode"] = chosen_mode
        if flag or flag_default != "on" or max_tokens is not None or gate is not None:
            base = plans[0].flag
            overrides["flag"] = _parse_flag(flag, flag_default, max_tokens, f"{base.kind}:{base.name}", gate)
        if stream_tag:
            overrides["stream_tag"] = stream_tag
        if second_comm_group is not None:  # a micro-batch plan's choice; no other plan has micro-batches
            if not all(isinstance(p, MicrobatchPlan) for p in plans):
                raise BadInput("--second-comm-group is for prefill-microbatch; the plan file's plans have no "
                               "micro-batches")
            overrides["second_group"] = second_comm_group
        if assume_pure:
            overrides["assume_pure"] = assume_pure
        if allow_rng_reorder:
            overrides["allow_rng_reorder"] = True
        try:
            plans = [p.with_changes(**overrides) for p in plans]
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        _note(f"mode {plans[0].mode} ({'from the plan' if mode == 'auto' else why})")
        # re-derived by the branch finder with the file's summaries: --protect clone snapshots
        # exactly the inputs the analysis finds written, as with --case
        plans = [_recheck(src.module, plan, src.text, file, protect == "clone") for plan in plans]

    if markers:  # through the plans, as a plan file's "markers": true
        plans = [p.with_changes(markers=True) for p in plans]
        for step in steps if plan_path is None else ():
            step.plans = [p.with_changes(markers=True) for p in step.plans]
    if plan_path is not None:
        steps = []
        before = src.text
        for k in range(1, len(plans) + 1):  # one patch per plan, each on top of the previous
            after = apply_plans(src.module, plans[:k], src.text).code
            plan = plans[k - 1]
            steps.append(_microbatch_step(plan, before, after) if isinstance(plan, MicrobatchPlan)
                         else _plan_step(plan, before, after))
            before = after
    plain_steps = steps  # verify's schedules re-issue the last step's plans on the text they address: unmarked
    if plan_path is None and any(p.markers for p in plans):  # plan files are marked by apply_plans itself
        steps = _with_markers(steps, src.text)
    new_text = steps[-1].new
    _compile_check(file, src, new_text)
    if new_text == src.text:
        raise NothingToDo(f"{file}: nothing to change")

    for plan in plans:
        _note(f"{plan.function}: {plan.summary or plan.case} [{plan.mode}, flag {plan.flag.describe()}]")
        for line in trust_lines(plan):
            _note(f"{plan.function}: {line}")
    if any(plan.core_limits for plan in plans):
        _note(CORE_LIMIT_CAVEATS)
    if any(plan.mode == "ge-graph" for plan in plans) and not records_config(new_text):
        _note("ge-graph: this file does not build torchair's backend; where it is built, write "
              "get_npu_backend(compiler_config=<this module>._ms_torchair_config(config)) so that "
              "reduce-overhead, npugraph_ex and debug.run_eagerly compiles keep the side stream off")
    if verify:  # before anything is written: a failed proof leaves every file as it was
        from msrewrite.commands.verify import verify_edit
        from msrewrite.emit.schedules import ScheduleSource

        function, flag_spec, edit_mode = plans[0].function, plans[0].flag, plans[0].mode

        # the plans and the text they address, so verify can issue the side work under other schedules
        several = sum(1 for step in steps if step.plans) > 1
        last = ScheduleSource(src.text, plans) if plan_path is not None else (
            ScheduleSource(plain_steps[-1].old, plain_steps[-1].plans,
                           "later schedules move the last side stream's work only" if several else "",
                           marked=tuple(p for step in plain_steps[:-1] for p in step.plans if p.markers))
            if plain_steps[-1].plans else None
        )
        with contextlib.redirect_stdout(sys.stderr):  # what the user's code prints must not enter the diff
            code = verify_edit(file, new_text, function=function, flag=flag_spec, mode=edit_mode, harness=harness,
                               schedule_source=last, quiet=quiet)
        if code != EXIT_OK:
            _note("verify found problems; nothing written")
            return code
    if in_place:
        from msrewrite.output.inplace import write_in_place  # tempfile, signals: only for -i

        write_in_place(file, src.encode(src.on_disk(new_text)), src.digest)
        _note(f"rewrote {file}")
    elif output is not None:
        if src.encoding != "utf-8":  # mail-format patches carry one charset, and git am reads UTF-8
            raise BadInput(f"-o: {file} is written in {src.encoding} (its coding cookie); patch files are "
                           "UTF-8: take the diff (without -o) or -i instead; nothing written")
        from msrewrite.output.patch import PatchStep, is_stage_folder, write_apply_script, write_series

        relpath = _relpath(file)
        series = [
            PatchStep(step.subject, step.body, src.on_disk(step.old), src.on_disk(step.new), relpath)
            for step in steps
        ]
        paths = write_series(series, output, force=force)
        if is_stage_folder(output):  # SGLang-style patches/stageN/: one script applies every stage
            paths.append(write_apply_script(output.parent))
        _write_stdout("".join(f"{path}\n" for path in paths))
    else:
        _write_stdout(unified_diff(src.on_disk(src.text), src.on_disk(new_text), _relpath(file)), src)
    return EXIT_OK
