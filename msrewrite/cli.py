"""Command line: `msrewrite apply | suggest | verify | cases | profile | bench`.

Every failure the user can cause ends as one line on stderr and a documented exit code
(0 done, 1 nothing to do / problems found, 2 bad input); tracebacks are for our own bugs.
Options are declared as typer would (`Option(default, "--name", help=...)`), but parsed by
msrewrite/cliargs.py without importing typer: only `--help` loads it. apply's per-case options
(--start-after, --anchor, --cores, ...) are declared by the cases that take them
(msrewrite/cases/_base.py) and listed in apply's signature through `Declared(...)`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, Optional

from msrewrite import __version__
from msrewrite.cliargs import Argument, Declared, Option, UsageError, command
from msrewrite.cliargs import main as cliargs_main
from msrewrite.errors import EXIT_BAD_INPUT, MsrewriteError

SUMMARY = "Insert multi-stream overlaps into PyTorch model code (Ascend NPU and CUDA)."


def _case_option_params(argv: list[str] | None) -> list:
    from msrewrite.cases._base import cli_params

    return cli_params(argv)  # built-in ones and the own options of the case --case names (all: None)


@command
def apply(
    file: Path = Argument(..., help="Model source file to edit."),
    case: Optional[str] = Option(None, "--case", help="Case to apply (see `msrewrite cases`)."),
    plan: Optional[Path] = Option(None, "--plan", help="Carry out plans from a JSON file (suggest --json)."),
    candidate: Optional[int] = Option(None, "--candidate", help="With --plan: only this candidate (1-based)."),
    mode: str = Option("auto", "--mode", help="auto, eager, npugraph-ex, ge-graph or cuda."),
    target: Optional[str] = Option(None, "--target", help="Class.method to edit when several match."),
    flag: str = Option(
        "", "--flag", help="Enable flag: env:NAME (default), attr:NAME, sglang:NAME or vllm-ascend:NAME."
    ),
    flag_default: str = Option(
        "on", "--flag-default", help="Value when the flag is unset: on or off (off for upstream patches)."
    ),
    max_tokens: Optional[int] = Option(None, "--max-tokens", help="Overlap only for at most N tokens."),
    gate: Optional[str] = Option(
        None,
        "--gate",
        help="capture, prefill, decode, always or tokens<=N: overlap only then, by the file's own predicate (graph modes default to decode where the function takes is_prefill).",
    ),
    stream_tag: Optional[str] = Option(None, "--stream-tag", help="Side stream tag (shared by every layer)."),
    # --start-after, --anchor, --cores, --core-limit, --second-comm-group, --protect, --assume-pure,
    # --allow-rng-reorder: declared by the cases that take them (msrewrite/cases/_base.py); then the
    # options a case declares in its own file (Case.options), which reach run_apply in per_case
    case_options: Any = Declared(_case_option_params),
    source_path: Optional[List[Path]] = Option(
        None,
        "--source-path",
        help="A folder of package sources (an unpacked wheel) to read callees from, never imported (repeat).",
    ),
    in_place: bool = Option(False, "--in-place", "-i", help="Rewrite the file in place (atomic)."),
    output: Optional[Path] = Option(None, "-o", "--output", help="Write git format-patch files to this folder."),
    verify: bool = Option(False, "--verify", help="Run `msrewrite verify` on the edit."),
    harness: Optional[str] = Option(None, "--harness", help="With --verify: H.py:make building model and inputs."),
    force: bool = Option(False, "--force", help="With -o: replace a patch series already in the folder."),
    max_bytes: Optional[int] = Option(
        None, "--max-bytes", help="Refuse input files larger than this (default 16 MiB)."
    ),
    quiet: bool = Option(
        False, "--quiet", "-q", help="With --verify: no progress lines on stderr (shown only on a terminal)."
    ),
    markers: bool = Option(
        False, "--markers", help="Profiler ranges msrewrite:<case>:<tag>:side|main around the windows (eager, cuda)."
    ),
    no_markers: bool = Option(False, "--no-markers", help="Remove the profiler ranges from an edited FILE."),
    **per_case: Any,
) -> int:
    """Rewrite FILE: move a branch onto a side stream behind an enable flag."""
    options = dict(locals())  # the options as run_apply names them
    del options["case_options"]
    options.update(options.pop("per_case"))
    from msrewrite.analyze.packages import set_source_path
    from msrewrite.commands.apply import run_apply
    from msrewrite.load import set_max_bytes

    set_max_bytes(options.pop("max_bytes"))
    set_source_path(options.pop("source_path") or ())
    options["plan_path"] = options.pop("plan")
    options["anchors"] = tuple(options.pop("anchor") or ())
    options["assume_pure"] = tuple(options["assume_pure"] or ())
    return run_apply(**options)


@command
def cases() -> int:
    """List the cases with the modes they support (and why a mode is left out)."""
    import textwrap

    from msrewrite.cases import all_cases

    items = all_cases()
    width = max(len(item.name) for item in items) + 2
    for item in items:
        print(f"{item.name:<{width}}{', '.join(item.modes)}")
        notes = f" ({item.notes})" if item.notes else ""
        print(textwrap.fill(item.summary + notes, width=79, initial_indent="    ", subsequent_indent="    "))
    return 0


@command
def verify(
    rewritten: Path = Argument(..., help="Rewritten model file."),
    original: Optional[Path] = Option(None, "--original", help="Original model file to compare against."),
    harness: Optional[str] = Option(None, "--harness", help="H.py:make returning (module, inputs)."),
    target: Optional[str] = Option(None, "--target", help="Module class to build when the file has several."),
    flag: str = Option(
        "", "--flag", help="Enable flag of the edit: env:NAME, attr:NAME, sglang:NAME or vllm-ascend:NAME."
    ),
    mode: str = Option("auto", "--mode", help="auto, eager, npugraph-ex, ge-graph or cuda."),
    atol: float = Option(0.0, "--atol", help="Absolute tolerance (default: exact)."),
    rtol: float = Option(0.0, "--rtol", help="Relative tolerance (default: exact)."),
    json_out: bool = Option(False, "--json", help="Print the result as JSON."),
    max_bytes: Optional[int] = Option(
        None, "--max-bytes", help="Refuse input files larger than this (default 16 MiB)."
    ),
    timeout: float = Option(300.0, "--timeout", help="Seconds before user code (harness, model) is stopped."),
    inputs: int = Option(2, "--inputs", help="Random input draws (with outliers) besides make()'s own."),
    plan_path: Optional[Path] = Option(None, "--plan", help="Plans behind the edit (with --original): schedules."),
    schedules: str = Option("early,late,interleaved", "--schedules", help="Side-work schedules to run."),
    train: bool = Option(True, "--train/--no-train", help="Also run in train mode (grad, buffers compared)."),
    quiet: bool = Option(False, "--quiet", "-q", help="No progress lines on stderr (shown only on a terminal)."),
) -> int:
    """Prove an edit on CPU: equivalence with the flag off and on, and a stream sanitizer run."""
    from msrewrite.commands.verify import run_verify
    from msrewrite.load import set_max_bytes

    set_max_bytes(max_bytes)
    return run_verify(
        rewritten=rewritten,
        original=original,
        harness=harness,
        target=target,
        flag=flag,
        mode=mode,
        atol=atol,
        rtol=rtol,
        json_out=json_out,
        timeout=timeout,
        inputs=inputs,
        plan_path=plan_path,
        schedules=schedules,
        train=train,
        quiet=quiet,
    )


@command
def suggest(
    file: Path = Argument(..., help="Model source file to analyze."),
    static: bool = Option(False, "--static", help="Static dataflow only: never import or run the file."),
    harness: Optional[str] = Option(None, "--harness", help="H.py:make returning (module, inputs)."),
    target: Optional[str] = Option(None, "--target", help="Module class to analyze."),
    input_shape: Optional[str] = Option(None, "--input-shape", help="Input shape for an nn.Module, e.g. 1,8,64."),
    device: str = Option("a3", "--device", help="Cost-model device profile: a2, a3 or h200."),
    json_out: bool = Option(False, "--json", help="Print candidates as JSON, nothing else on stdout."),
    report: Optional[Path] = Option(None, "--report", help="Write the analysis report into this folder."),
    phase: str = Option("decode", "--phase", help="prefill or decode (report name and cost shapes)."),
    jobs: int = Option(1, "-j", "--jobs", help="Worker processes for several files."),
    quiet: bool = Option(False, "--quiet", "-q", help="No progress lines on stderr (shown only on a terminal)."),
    source_path: Optional[List[Path]] = Option(
        None,
        "--source-path",
        help="A folder of package sources (an unpacked wheel) to read callees from, never imported (repeat).",
    ),
    extra: Optional[List[Path]] = Argument(None, help="More files (static tier)."),
    max_bytes: Optional[int] = Option(
        None, "--max-bytes", help="Refuse input files larger than this (default 16 MiB)."
    ),
    profile_json: Optional[Path] = Option(
        None, "--profile", help="msrewrite profile --json output: fills the report's profile acceptance section."
    ),
    assume_pure: Optional[List[str]] = Option(
        None,
        "--assume-pure",
        help="As for apply: a callee msrewrite cannot see into that writes none of its arguments (repeat).",
    ),
    protect: str = Option("", "--protect", help="As for apply: auto (the default), clone or none."),
) -> int:
    """Find independent branches worth overlapping, rank them, and name the case that applies."""
    from msrewrite.analyze.packages import set_source_path
    from msrewrite.commands.suggest import run_suggest
    from msrewrite.load import set_max_bytes

    set_max_bytes(max_bytes)
    set_source_path(source_path or ())
    return run_suggest(
        files=[file, *(extra or [])],
        static=static,
        harness=harness,
        target=target,
        input_shape=input_shape,
        device=device,
        json_out=json_out,
        report=report,
        phase=phase,
        jobs=jobs,
        quiet=quiet,
        profile_json=profile_json,
        assume_pure=tuple(assume_pure or ()),
        protect=protect,
    )


def entry() -> None:
    """The `msrewrite` command (and `python -m msrewrite`): main() with the cyclic garbage
    collector off. A run is one short pass over syntax trees, which hold no reference cycles, so
    the collector would only walk libcst's many nodes again and again (about 3% of a run). User
    code (verify, traced suggest, bench) runs in a child process that turns it back on."""
    import gc

    gc.disable()
    main()


@command
def profile(
    trace: Path = Argument(..., help="torch.profiler Chrome trace (.json) or torch_npu profiler output folder."),
    edit: Optional[Path] = Option(
        None, "--edit", help="Plans (suggest --json) for the estimate, or the edited model file (its markers)."
    ),
    baseline: Optional[Path] = Option(None, "--baseline", help="Trace of the same run with the flag off."),
    json_out: bool = Option(False, "--json", help="Print the result as JSON (the gantt included)."),
    threshold: float = Option(0.1, "--threshold", help="Busy-time growth that counts as contention (0.1 = 10%)."),
    gantt: bool = Option(False, "--gantt", help="Also print a Mermaid gantt of one step."),
    step: Optional[int] = Option(None, "--step", help="Step of the gantt (1-based; default the first marked one)."),
) -> int:
    """Read a device trace: overlap, exposed side time and tail of each marked region; saving and contention."""
    from msrewrite.commands.profile import run_profile

    return run_profile(
        trace=trace, edit=edit, baseline=baseline, json_out=json_out, threshold=threshold, gantt=gantt, step=step
    )


@command
def bench(
    file: Path = Argument(..., help="Original model file (with --case), or an edited one."),
    harness: Optional[str] = Option(None, "--harness", help="H.py:make returning (module, inputs)."),
    case: Optional[str] = Option(None, "--case", help="The edit to time (its default options)."),
    mode: str = Option("auto", "--mode", help="auto (cuda on CUDA, eager on NPU), or a mode of the case."),
    variants: bool = Option(False, "--variants", help="Also time the other arrangements and rank them."),
    iters: int = Option(20, "--iters", help="Timed forwards per arrangement."),
    warmup: int = Option(3, "--warmup", help="Untimed forwards first."),
    dry_run: bool = Option(False, "--dry-run", help="Run every step on CPU under the stream stand-ins."),
    json_out: bool = Option(False, "--json", help="Print the timings as JSON."),
    timeout: float = Option(600.0, "--timeout", help="Seconds before the child running user code is killed."),
) -> int:
    """Time flag off vs flag on on the device present; with --variants, rank msrewrite's arrangements."""
    from msrewrite.commands.bench import run_bench

    return run_bench(
        file=file,
        harness=harness,
        case=case,
        mode=mode,
        variants=variants,
        iters=iters,
        warmup=warmup,
        dry_run=dry_run,
        json_out=json_out,
        timeout=timeout,
    )


def main(argv: list[str] | None = None) -> None:
    from msrewrite.cliargs import COMMAND_LINE
    from msrewrite.output.console import run_guarded

    args = sys.argv[1:] if argv is None else argv
    COMMAND_LINE[:] = args

    def run() -> None:
        try:
            code = cliargs_main(args, __version__, SUMMARY)
        except UsageError as exc:
            print(f"msrewrite: error: {exc}", file=sys.stderr)
            code = EXIT_BAD_INPUT
        except MsrewriteError as exc:
            print(f"msrewrite: error: {exc}", file=sys.stderr)
            code = exc.exit_code
        except KeyboardInterrupt:
            print("msrewrite: interrupted", file=sys.stderr)
            code = EXIT_BAD_INPUT
        sys.exit(code)

    # run_guarded turns OS-level failures (full disk, closed stdout, broken pipe) into one line.
    run_guarded(run)
