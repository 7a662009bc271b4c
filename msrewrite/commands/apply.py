"""`msrewrite apply`: load -> find targets (case) or read plans -> emit -> diff / in-place / patches."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path

from msrewrite import validate
from msrewrite.analyze.walk import Visitor
from msrewrite.cases._base import (
    ALLOW_RNG_REORDER,
    ANCHOR,
    CASE_OPTIONS,
    CORES,
    PROTECT,
    SECOND_COMM_GROUP,
    START_AFTER,
    STREAM_TAG,
    Case,
    EditStep,
    Options,
    match_target,
    microbatch_step,
    plan_step,
)
from msrewrite.emit.engine import apply_plans
from msrewrite.emit.torchair_config import records_config
from msrewrite.errors import EXIT_OK, BadInput, EmptyFile, MsrewriteError, NothingToDo, Refused
from msrewrite.load import git_root, load, read_source
from msrewrite.modes import resolve_mode
from msrewrite.output.diff import unified_diff
from msrewrite.plan import (
    PROTECT_CHOICES,
    FlagSpec,
    MicrobatchPlan,
    OverlapPlan,
    StartGate,
    load_plans,
    protect_choice,
    protects,
)
from msrewrite.records import record

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


def parse_flag(
    flag: str, flag_default: str, max_tokens: int | None, case_flag: str, gate: str | None = None
) -> FlagSpec:
    """`case_flag`: the switch when --flag is not given (`KIND:NAME`, or a bare NAME for env)."""
    if flag_default not in ("on", "off"):
        raise BadInput(f"--flag-default must be on or off, got {flag_default!r}")
    if max_tokens is not None and max_tokens < 1:
        raise BadInput(f"--max-tokens must be a positive token count, got {max_tokens}")
    phase = None
    if gate is not None and gate != "always":  # always: no phase gate, not even a mode's default
        kind, sep, count = gate.partition("<=")
        if sep:  # tokens<=N is --max-tokens N
            if kind.strip() != "tokens" or not count.strip().isdigit() or int(count) < 1:
                raise BadInput(f"--gate must be capture, prefill, decode, always or tokens<=N (N >= 1), got {gate!r}")
            if max_tokens is not None and max_tokens != int(count):
                raise BadInput(f"--gate {gate} and --max-tokens {max_tokens} disagree; give one")
            max_tokens = int(count)
        else:
            phase = gate
    try:
        return FlagSpec.parse(
            flag or (case_flag if ":" in case_flag else f"env:{case_flag}"),
            default=flag_default == "on",
            max_tokens=max_tokens,
            gate=phase,
        )
    except ValueError as exc:
        option = "--gate" if phase is not None and "gate" in str(exc) else "--flag"
        raise BadInput(f"{option}: {exc}") from None


def _checked(check, value, option: str):
    """An option's value through its validator (msrewrite/validate.py), or a one-line BadInput."""
    try:
        return check(value, option)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def get_known_case(case_name: str) -> Case:
    from msrewrite.cases import require_case

    return require_case(case_name)


def plans_for_case(
    file: Path,
    module,
    case_name: str | Case,
    mode: str,
    target: str | None,
    flag: FlagSpec,
    stream_tag: str | None,
    start_gates: tuple[StartGate, ...] = (),
    phase_anchors: tuple[str, ...] = (),
    core_limits: tuple[int, int, int, int] | None = None,
    text: str | None = None,
    protect: str = "",
    assume_pure: tuple[str, ...] = (),
    allow_rng_reorder: bool = False,
) -> list[OverlapPlan]:
    """The case's one plan for `file` (Case.plans), the case named or given."""
    case = get_known_case(case_name) if isinstance(case_name, str) else case_name
    options = Options(
        mode=mode,
        flag=flag,
        stream_tag=stream_tag,
        start_gates=start_gates,
        phase_anchors=phase_anchors,
        core_limits=core_limits,
        protect=protect,
        assume_pure=assume_pure,
        allow_rng_reorder=allow_rng_reorder,
    )
    return case.plans(file, module, options, target, text)


def case_steps(
    file: Path,
    text: str,
    module,
    case_name: str,
    mode: str,
    target: str | None,
    flag: FlagSpec | None,
    stream_tag: str | None,
    start_gates: tuple[StartGate, ...] = (),
    phase_anchors: tuple[str, ...] = (),
    core_limits: tuple[int, int, int, int] | None = None,
    second_group: str | None = None,
    protect: str = "",
    assume_pure: tuple[str, ...] = (),
    allow_rng_reorder: bool = False,
    extra: dict | None = None,
    gate_asked: bool = False,
) -> list[EditStep]:
    """The edit the case named makes, as steps (Case.steps): apply's, golden/regen.py's and verify's.
    `extra`: the case's own options, already checked (Case.own_settings)."""
    options = Options(
        mode=mode,
        flag=flag,
        stream_tag=stream_tag,
        start_gates=start_gates,
        phase_anchors=phase_anchors,
        core_limits=core_limits,
        protect=protect,
        assume_pure=assume_pure,
        allow_rng_reorder=allow_rng_reorder,
        second_group=second_group,
        extra=dict(extra or {}),
        gate_asked=gate_asked,
    )
    return get_known_case(case_name).steps(file, text, module, options, target)


def trust_lines(plan: OverlapPlan | MicrobatchPlan) -> list[str]:
    """What the edit takes on trust, and what protecting it costs: printed with every edit."""
    seen = ", ".join(plan.trust_boundary) if plan.trust_boundary else "none: every callee was seen into"
    lines = [f"trust boundary (callees not seen into): {seen}"]
    if plan.trust_boundary and isinstance(plan, OverlapPlan):  # what the order checks cannot see either
        lines.append(
            "assumed of them, not checked: they run no stream code of their own, and no two of them on either "
            "side of the fork both run collectives or both draw random numbers"
        )
    if isinstance(plan, MicrobatchPlan):  # what no analysis of the source can show
        lines.append(
            "assumed, not checked: every layer treats the sequences of dim 0 independently (no batch "
            "statistics, no routing capacity shared across the batch); verify compares the outputs"
        )
    if plan.assume_pure:
        lines.append(f"vouched for with --assume-pure: {', '.join(plan.assume_pure)}")
    if plan.rng_reorder:
        lines.append(f"--allow-rng-reorder: {plan.rng_reorder}")
    if plan.protect_inputs:
        names = plan.protect_inputs
        copies = " and ".join(f"one copy of {n}" for n in names)
        lines.append(
            f"snapshot (--protect): the main path may write {', '.join(names)} before the join, so the side stream "
            f"reads {'a copy' if len(names) == 1 else 'copies'} made at the fork; it costs {copies} per call "
            "(for a [tokens, hidden] activation: hidden x element size bytes per token), paid only while the flag "
            "is on; --protect none refuses the edit instead"
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
        checked = check_plan(module, plan, text, path, protect=protect)
    except NoBranch as exc:
        raise NothingToDo(f"refused plan for {plan.function}: {exc}") from None
    return checked.with_changes(markers=plan.markers)  # ranges are the file's choice, not the analysis'


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
        raise BadInput(
            f"{file}:{exc.lineno}: Python {_python()} cannot compile the file ({exc.msg}){advice}; nothing written"
        ) from None
    except (RecursionError, MemoryError, ValueError):
        pass
    # our bug, never the user's: refuse to write it
    raise BadInput(f"internal error: the edit does not compile ({ours.msg} at line {ours.lineno}); nothing written")


def _python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _needed_python(module) -> str:
    """Which newer Python the file's syntax asks for, where libcst's tree shows it ("" if unknown)."""

    class NewSyntax(Visitor):
        def __init__(self) -> None:
            super().__init__()
            self.found = False

        def visit_TypeAlias(self, _node) -> None:
            self.found = True

        def visit_TypeParameters(self, _node) -> None:
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

    marked, before = [], original
    so_far: list[OverlapPlan] = []
    for step in steps:  # (micro-batch plans never carry markers: --markers is refused for them)
        so_far += [p for p in step.plans if isinstance(p, OverlapPlan) and p.markers and p not in so_far]
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


def _microbatch_markers(markers: bool) -> None:
    """--markers cannot mark a model-level micro-batch fork: refused, never ignored."""
    if markers:
        raise BadInput(
            "--markers: prefill-microbatch has no single side and main window to mark "
            "(every layer interleaves the stages of two micro-batches)"
        )


@record
class ApplyArgs:
    """`msrewrite apply`'s command line, as cli.apply hands it over."""

    file: Path
    case: str | None
    plan_path: Path | None
    candidate: int | None
    mode: str
    target: str | None
    flag: str
    flag_default: str
    max_tokens: int | None
    stream_tag: str | None
    in_place: bool
    output: Path | None
    verify: bool
    harness: str | None
    gate: str | None = None
    start_after: str | None = None
    anchors: tuple[str, ...] = ()
    core_preset: str = "a3"
    core_limit: str | None = None
    second_comm_group: str | None = None
    protect: str = ""
    assume_pure: tuple[str, ...] = ()
    allow_rng_reorder: bool = False
    force: bool = False
    quiet: bool = False
    markers: bool = False
    no_markers: bool = False
    # the options cases declare in their own files (Case.options), as parsed: parameter -> value
    extra: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, **kwargs) -> ApplyArgs:
        """ApplyArgs from apply's parsed options: those that are not its fields are a case's own."""
        names = {f.name for f in dataclasses.fields(cls)}
        extra = {name: kwargs.pop(name) for name in list(kwargs) if name not in names}
        return cls(**kwargs, extra={**kwargs.pop("extra", {}), **extra})

    def case_options(self) -> dict:
        """The per-case options given (each is refused by a case that does not take it): the
        built-in ones, then the cases' own (those of --case when only they were parsed, else all)."""
        given = {
            START_AFTER: self.start_after is not None,
            ANCHOR: bool(self.anchors),
            CORES: self.core_limit is not None or self.core_preset != "a3",
            SECOND_COMM_GROUP: self.second_comm_group is not None,
            ALLOW_RNG_REORDER: self.allow_rng_reorder,
            PROTECT: bool(self.protect),
            STREAM_TAG: self.stream_tag is not None,
        }
        if self.extra:
            from msrewrite.cases._base import own_options

            mine = own_options(self.case or "")
            if not set(self.extra) <= {pname for option in mine for pname, _kind, _spec in option.cli}:
                mine = own_options()
            given.update((option, option.given(self.extra)) for option in mine)
        return given


def run_apply(**kwargs) -> int:
    """`msrewrite apply` (cli.apply's options, as ApplyArgs' fields, and the cases' own)."""
    from msrewrite.analyze.packages import forget_reads

    args = ApplyArgs.of(**kwargs)
    if args.no_markers:
        if (
            args.case is not None
            or args.plan_path is not None
            or args.markers
            or args.verify
            or args.output is not None
        ):
            raise BadInput("--no-markers takes only the edited file (and -i): it removes the profiler ranges")
        return _remove_markers(args.file, args.in_place)
    _check_args(args)
    try:
        src = load(args.file)
    except EmptyFile as exc:
        raise exc.as_nothing_to_do() from None
    try:
        chosen_mode, why = resolve_mode(args.mode, src.text)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    forget_reads()
    try:
        if args.case is not None:
            try:
                steps = _case_edit(args, src, chosen_mode, why)
            except Refused as refused:
                raise NothingToDo(f"{refused}{_edit_command(args, src, chosen_mode, refused)}") from None
            plans = [plan for step in steps for plan in step.plans]
        else:
            plans = _plan_file_plans(args, src, chosen_mode, why)
    finally:  # a refusal names callees too: say where their sources were looked for
        _note_sources_read()
    if args.markers:  # through the plans, as a plan file's "markers": true
        plans = [p.with_changes(markers=True) for p in plans]
        for step in steps if args.plan_path is None else ():
            step.plans = [p.with_changes(markers=True) for p in step.plans]
    if args.plan_path is not None:
        steps = _plan_file_steps(src, plans)
    plain_steps = steps  # verify's schedules re-issue the last step's plans on the text they address: unmarked
    if args.plan_path is None and any(p.markers for p in plans):  # plan files are marked by apply_plans itself
        steps = _with_markers(steps, src.text)
    new_text = steps[-1].new
    _compile_check(args.file, src, new_text)
    if new_text == src.text:
        raise NothingToDo(f"{args.file}: nothing to change")
    _report(plans, new_text, steps)
    if args.verify:  # before anything is written: a failed proof leaves every file as it was
        code = _verify(args, src, plans, plain_steps, new_text)
        if code != EXIT_OK:
            _note("verify found problems; nothing written")
            return code
    _write(args, src, steps, new_text)
    return EXIT_OK


def _check_args(args: ApplyArgs) -> None:
    """The checks that need no file: conflicting options and malformed values."""
    if (args.case is None) == (args.plan_path is None):
        raise BadInput("give exactly one of --case or --plan")
    if args.in_place and args.output is not None:
        raise BadInput("--in-place and -o/--output conflict: choose one output")
    if args.candidate is not None and args.plan_path is None:
        raise BadInput("--candidate needs --plan")
    if args.output is not None and args.output.exists() and not args.output.is_dir():
        raise BadInput(f"-o {args.output}: exists and is not a folder")
    if args.force and args.output is None:
        raise BadInput("--force is for -o/--output (replace the patch series in that folder)")
    for value, check, option in (
        (args.target, validate.qualified_name, "--target"),
        (args.stream_tag, validate.stream_tag, "--stream-tag"),
        (args.start_after, validate.identifier, "--start-after"),
        *((name, validate.identifier, "--anchor") for name in args.anchors),
        (args.second_comm_group, validate.attribute, "--second-comm-group"),
    ):
        if value is not None:
            _checked(check, value, option)
    try:
        validate.vouching(args.protect, args.assume_pure, PROTECT_CHOICES)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def case_request(args: ApplyArgs, chosen_mode: str) -> tuple[Case, Options]:
    """The case of --case and its Options from the command line: a per-case option the case does not
    take is refused in one line, never ignored. apply and the libcst codemods (msrewrite/codemods/)
    share it, so both make the same edit."""
    from msrewrite.cases import get_case, require_case

    known = get_case(args.case or "")
    spec = parse_flag(
        args.flag, args.flag_default, args.max_tokens, known.flag_name if known else "ENABLE_SIDE_STREAM", args.gate
    )
    gates: tuple[StartGate, ...] = ()
    if args.start_after:
        if chosen_mode != "ge-graph":
            raise BadInput("--start-after is a ge-graph start gate; native modes order the fork by the stream wait")
        gates = (StartGate("", args.start_after),)
    case = require_case(args.case or "")
    case.check_options(args.case_options())
    if args.markers and case.analysis == "microbatch":
        _microbatch_markers(args.markers)
    budget = None
    if case.core_limits:
        from msrewrite import cores

        budget = cores.resolve(args.core_preset, args.core_limit).as_tuple()
    return case, case.own_settings(
        Options(
            mode=chosen_mode,
            flag=spec,
            stream_tag=args.stream_tag,
            start_gates=gates,
            phase_anchors=tuple(args.anchors),
            core_limits=budget,
            protect=protect_choice(args.protect),
            assume_pure=args.assume_pure,
            allow_rng_reorder=args.allow_rng_reorder,
            second_group=args.second_comm_group,
            gate_asked=args.gate is not None,
        ),
        args.extra,
    )


def _case_edit(args: ApplyArgs, src, chosen_mode: str, why: str) -> list[EditStep]:
    """apply --case: the case's options (case_request), then its steps."""
    if args.markers:
        from msrewrite.emit.markers import MARKER_MODES

        if chosen_mode not in MARKER_MODES:
            raise BadInput(
                f"--markers: {chosen_mode} mode is not supported (eager and cuda only: a range opened "
                "while a graph is captured is not replayed with it)"
            )
    from msrewrite.cases import get_case

    known = get_case(args.case or "")  # a bad flag is refused before the mode is said (case_request parses it again)
    parse_flag(
        args.flag, args.flag_default, args.max_tokens, known.flag_name if known else "ENABLE_SIDE_STREAM", args.gate
    )
    _note(f"mode {chosen_mode} ({'auto: ' if args.mode == 'auto' else ''}{why})")
    return _requested_steps(args, src, chosen_mode)


def _requested_steps(args: ApplyArgs, src, chosen_mode: str) -> list[EditStep]:
    """The case's steps with every option `args` asks for (case_request settles them)."""
    _case, options = case_request(args, chosen_mode)
    return case_steps(
        args.file,
        src.text,
        src.module,
        args.case or "",
        chosen_mode,
        args.target,
        options.flag,
        options.stream_tag,
        options.start_gates,
        options.phase_anchors,
        options.core_limits,
        options.second_group,
        protect=options.protect,
        assume_pure=options.assume_pure,
        allow_rng_reorder=options.allow_rng_reorder,
        extra=options.extra,
        gate_asked=options.gate_asked,
    )


def _edit_command(args: ApplyArgs, src, chosen_mode: str, refused: Refused) -> str:
    """'; this command edits: msrewrite apply ... --assume-pure A': the command that was run with
    what the analysis found lifts every blocker of a refused function, checked by making the edit
    with it (all functions' remedies at once, else each function's with --target); else why the
    edit is still refused with them."""
    if not refused.remedies:
        return ""
    still = ""
    every = list(dict.fromkeys(n for _f, names, _c in refused.remedies for n in names))
    tries = [(tuple(every), any(c for *_, c in refused.remedies), args.target)]
    if len(refused.remedies) > 1:
        tries += [(names, clone, args.target or function) for function, names, clone in refused.remedies]
    for names, clone, target in tries:
        trial = dataclasses.replace(
            args,
            assume_pure=(*args.assume_pure, *names),
            protect="clone" if clone else args.protect,
            target=target,
        )
        try:
            _requested_steps(trial, src, chosen_mode)
        except MsrewriteError as exc:
            still = still or str(exc)
            continue
        return f"; this command edits: {command_line(names, clone, target if target != args.target else None)}"
    return f"; even with those options apply refuses: {still.removeprefix('no safe ')}"


def command_line(vouch: tuple[str, ...], clone: bool, target: str | None) -> str:
    """The command being run (cliargs.COMMAND_LINE) with `--assume-pure` for each of `vouch`,
    `--protect clone` in place of any --protect given, and `--target`, quoted for a POSIX shell."""
    import shlex

    from msrewrite.cliargs import COMMAND_LINE

    argv, skip = [], False
    for word in COMMAND_LINE:
        if skip:
            skip = False
            continue
        if clone and word == "--protect":
            skip = True
            continue
        if clone and word.startswith("--protect="):
            continue
        argv.append(word)
    argv += [w for n in vouch for w in ("--assume-pure", n)]
    argv += ["--protect", "clone"] if clone else []
    argv += ["--target", target] if target else []
    return shlex.join(["msrewrite", *argv])


def _read_plan_file(args: ApplyArgs, src) -> list:
    """The plans of --plan, checked against the cases and the file (a stale plan is refused)."""
    from msrewrite.cases import get_case

    try:
        plans = load_plans(read_source(args.plan_path, python=False))  # type: ignore[arg-type]  # checked: --plan given
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{args.plan_path}: {exc}") from None
    for plan in plans:
        known = get_case(plan.case) if plan.case != "generic" else None
        if plan.case != "generic" and known is None:
            raise BadInput(f"{args.plan_path}: unknown case {plan.case!r} in the plan")
        if isinstance(plan, MicrobatchPlan) and (known is None or known.analysis != "microbatch"):
            raise BadInput(f"{args.plan_path}: a micro-batch plan for case {plan.case}, which has no micro-batches")
    lines = src.text.count("\n") + (not src.text.endswith("\n"))
    for plan in plans:  # a plan for another file, or for this one before it changed
        try:
            plan.check_lines(lines)
        except ValueError as exc:
            raise BadInput(f"{args.plan_path}: stale plan: {exc}") from None
    if args.candidate is not None:
        if not 1 <= args.candidate <= len(plans):
            raise BadInput(f"--candidate {args.candidate}: the plan file has {len(plans)} candidate(s)")
        plans = [plans[args.candidate - 1]]
    if args.target:
        plans = [p for p in plans if match_target(p.function, args.target)]
    if not plans:
        raise NothingToDo(f"{args.plan_path}: no plan to carry out")
    return plans


# the per-case options a plan file decides itself: refused with --plan, never ignored
_PLAN_DECIDES = {
    START_AFTER: "--start-after: a plan file carries its own start gates; give --start-after with --case",
    ANCHOR: "--anchor: a plan file carries its own phase anchors; give --anchor with --case",
    CORES: "--cores and --core-limit: a plan file carries its own core budgets; give them with --case",
}


def _refuse_case_decisions(args: ApplyArgs) -> None:
    """With --plan: refuse a per-case option the plan file decides itself, and a case's own option."""
    given = args.case_options()
    for option, refusal in _PLAN_DECIDES.items():
        if given[option]:
            raise BadInput(refusal)
    for option, present in given.items():
        if present and option not in CASE_OPTIONS:  # a case's own option (Case.options)
            raise BadInput(
                f"{option.name} is an option of the case that declares it; give it with --case "
                "(a plan file carries its plans' own settings)"
            )


def _plan_overrides(args: ApplyArgs, plans: list, chosen_mode: str) -> dict:
    """What the command line changes in the plans of --plan."""
    _refuse_case_decisions(args)
    if any(isinstance(p, MicrobatchPlan) for p in plans):
        if len(plans) > 1:
            raise BadInput(
                f"{args.plan_path}: a prefill-microbatch plan forks the whole model: carry it out alone (--candidate N)"
            )
        if args.allow_rng_reorder:
            raise BadInput(
                "--allow-rng-reorder is for cases that move calls onto a side stream; "
                "a prefill-microbatch plan moves none"
            )
        if args.protect:
            raise BadInput(
                "--protect is for cases that move calls onto a side stream; prefill-microbatch runs "
                "each micro-batch on its own slice, with nothing shared to snapshot"
            )
        _microbatch_markers(args.markers)
    overrides: dict = {}
    if args.mode != "auto":
        overrides["mode"] = chosen_mode
    if args.flag or args.flag_default != "on" or args.max_tokens is not None or args.gate is not None:
        base = plans[0].flag
        overrides["flag"] = parse_flag(
            args.flag, args.flag_default, args.max_tokens, f"{base.kind}:{base.name}", args.gate
        )
    if args.stream_tag:
        overrides["stream_tag"] = args.stream_tag
    if args.second_comm_group is not None:  # a micro-batch plan's choice; no other plan has micro-batches
        if not all(isinstance(p, MicrobatchPlan) for p in plans):
            raise BadInput("--second-comm-group is for prefill-microbatch; the plan file's plans have no micro-batches")
        overrides["second_group"] = args.second_comm_group
    if args.assume_pure:
        overrides["assume_pure"] = args.assume_pure
    if args.allow_rng_reorder:
        overrides["allow_rng_reorder"] = True
    return overrides


def _plan_file_plans(args: ApplyArgs, src, chosen_mode: str, why: str) -> list:
    """apply --plan: the plan file's plans, with the command line's changes, re-derived by the finder."""
    plans = _read_plan_file(args, src)
    overrides = _plan_overrides(args, plans, chosen_mode)
    try:
        plans = [p.with_changes(**overrides) for p in plans]
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    _note(f"mode {plans[0].mode} ({'from the plan' if args.mode == 'auto' else why})")
    # re-derived by the branch finder with the file's summaries: --protect (auto by default)
    # snapshots exactly the inputs the analysis finds written, as with --case
    return [_recheck(src.module, plan, src.text, args.file, protects(protect_choice(args.protect))) for plan in plans]


def _plan_file_steps(src, plans: list) -> list[EditStep]:
    steps = []
    before = src.text
    for k in range(1, len(plans) + 1):  # one patch per plan, each on top of the previous
        after = apply_plans(src.module, plans[:k], src.text).code
        plan = plans[k - 1]
        steps.append(
            microbatch_step(plan, before, after) if isinstance(plan, MicrobatchPlan) else plan_step(plan, before, after)
        )
        before = after
    return steps


def _note_sources_read() -> None:
    from msrewrite.analyze.packages import roots_read

    for where in roots_read():
        _note(f"package sources read (never imported): {where}")


def _report(plans: list, new_text: str, steps: list[EditStep] | None = None) -> None:
    for plan in plans:
        _note(f"{plan.function}: {plan.summary or plan.case} [{plan.mode}, flag {plan.flag.describe()}]")
        for line in trust_lines(plan):
            _note(f"{plan.function}: {line}")
    if any(plan.core_limits for plan in plans):
        _note(CORE_LIMIT_CAVEATS)
    if any(plan.mode == "ge-graph" for plan in plans) and not records_config(new_text):
        _note(
            "ge-graph: this file does not build torchair's backend; where it is built, write "
            "get_npu_backend(compiler_config=<this module>._ms_torchair_config(config)) so that "
            "reduce-overhead, npugraph_ex and debug.run_eagerly compiles keep the side stream off"
        )
    for step in steps or ():  # what the case could not do beside the edit (a branch it could not move)
        for note in step.notes:
            _note(note)


def _verify(args: ApplyArgs, src, plans: list, plain_steps: list[EditStep], new_text: str) -> int:
    from msrewrite.commands.verify import verify_edit
    from msrewrite.emit.schedules import ScheduleSource

    function, flag_spec, edit_mode = plans[0].function, plans[0].flag, plans[0].mode
    # the plans and the text they address, so verify can issue the side work under other schedules
    several = sum(1 for step in plain_steps if step.plans) > 1
    # (ScheduleSource takes a micro-batch plan too, for the early schedule only; it is annotated OverlapPlan)
    last = (
        ScheduleSource(src.text, plans)
        if args.plan_path is not None
        else (
            ScheduleSource(
                plain_steps[-1].old,
                plain_steps[-1].plans,  # type: ignore[arg-type]  # see above
                "later schedules move the last side stream's work only" if several else "",
                marked=tuple(
                    p for step in plain_steps[:-1] for p in step.plans if isinstance(p, OverlapPlan) and p.markers
                ),
                finish=plain_steps[-1].finish,
            )
            if plain_steps[-1].plans
            else None
        )
    )
    with contextlib.redirect_stdout(sys.stderr):  # what the user's code prints must not enter the diff
        return verify_edit(
            args.file,
            new_text,
            function=function,
            flag=flag_spec,
            mode=edit_mode,
            harness=args.harness,
            schedule_source=last,
            quiet=args.quiet,
        )


def _write(args: ApplyArgs, src, steps: list[EditStep], new_text: str) -> None:
    file = args.file
    if args.in_place:
        from msrewrite.output.inplace import write_in_place  # tempfile, signals: only for -i

        write_in_place(file, src.encode(src.on_disk(new_text)), src.digest)
        _note(f"rewrote {file}")
    elif args.output is not None:
        if src.encoding != "utf-8":  # mail-format patches carry one charset, and git am reads UTF-8
            raise BadInput(
                f"-o: {file} is written in {src.encoding} (its coding cookie); patch files are "
                "UTF-8: take the diff (without -o) or -i instead; nothing written"
            )
        from msrewrite.output.patch import PatchStep, is_stage_folder, write_apply_script, write_series

        relpath = _relpath(file)
        series = [
            PatchStep(step.subject, step.body, src.on_disk(step.old), src.on_disk(step.new), relpath) for step in steps
        ]
        paths = write_series(series, args.output, force=args.force)
        if is_stage_folder(args.output):  # SGLang-style patches/stageN/: one script applies every stage
            paths.append(write_apply_script(args.output.parent))
        _write_stdout("".join(f"{path}\n" for path in paths))
    else:
        _write_stdout(unified_diff(src.on_disk(src.text), src.on_disk(new_text), _relpath(file)), src)
