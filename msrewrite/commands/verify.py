"""`msrewrite verify` and `apply --verify`: equivalence runs plus the stream sanitizer on CPU.

User code (the harness, the model import, the forwards) runs in a child process (harness.run_in_child)
with a timeout: an exit, a signal or a hang is a one-line failure, never a silent exit 0."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import typer

from msrewrite.errors import EXIT_NOTHING_TO_DO, EXIT_OK, BadInput
from msrewrite.load import encode_source
from msrewrite.plan import FlagSpec
from msrewrite.verify import VerifyResult, summary, verify_files

DEFAULT_TIMEOUT = 300.0
# Where user code dies or hangs decides who is to blame: before the model runs, the harness (bad input).
_HARNESS_PHASES = ("starting", "building the harness")


def _report(result: VerifyResult, json_out: bool) -> int:
    if json_out:
        typer.echo(result.to_json())
    else:
        for line in summary(result):
            typer.echo(line)
        for problem in result.problems:
            typer.echo(f"problem: {problem}")
    return EXIT_OK if result.ok else EXIT_NOTHING_TO_DO


def _isolated(
    fn, timeout: float, json_out: bool, err: bool = False, quiet: bool = False, harness: str | None = None
) -> VerifyResult | int:
    """fn(progress) in a child; a child that died or hung in the model run is a problem (exit 1),
    in the harness bad input (exit 2)."""
    from msrewrite.harness import ChildFailed, run_in_child
    from msrewrite.output.progress import stage_printer

    try:
        return run_in_child(fn, timeout=timeout, on_stage=stage_printer(quiet, "verify: "))
    except ChildFailed as exc:
        if exc.phase in _HARNESS_PHASES:
            named = f" {harness}" if harness else ""  # the one the user gave; else the file's own make()
            raise BadInput(f"bad harness{named}: user code {exc}") from None
        reason = f"user code {exc}"
        if json_out:
            typer.echo(json.dumps({"ok": False, "problems": [reason]}, indent=2))
        elif err:
            typer.echo(f"verify:\n  problem: {reason}", err=True)
        else:
            typer.echo(f"problem: {reason}")
        return EXIT_NOTHING_TO_DO


def _one_thread() -> None:
    """The child runs tiny models: one intra-op thread is faster than a contended pool."""
    import torch

    torch.set_num_threads(1)


def check_tolerances(atol: float, rtol: float) -> None:
    if not (math.isfinite(atol) and math.isfinite(rtol)):
        raise BadInput("--atol and --rtol must be finite numbers")
    if atol < 0 or rtol < 0:
        raise BadInput("--atol and --rtol must not be negative")


def run_verify(
    *,
    rewritten: Path,
    original: Path | None,
    harness: str | None,
    target: str | None,
    flag: str,
    mode: str,
    atol: float,
    rtol: float,
    json_out: bool,
    timeout: float = DEFAULT_TIMEOUT,
    inputs: int = 2,
    plan_path: Path | None = None,
    schedules: str = "early,late,interleaved",
    train: bool = True,
    quiet: bool = False,
) -> int:
    from msrewrite.emit.schedules import SCHEDULES

    check_tolerances(atol, rtol)
    chosen = tuple(s.strip() for s in schedules.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SCHEDULES]
    if unknown or "early" not in chosen:
        raise BadInput(f"--schedules: choose from {', '.join(SCHEDULES)}, early included (got {schedules!r})")
    if not (math.isfinite(timeout) and timeout > 0):
        raise BadInput("--timeout must be a positive number of seconds")
    if inputs < 0:
        raise BadInput("--inputs must not be negative")
    spec = None
    if flag:
        try:
            spec = FlagSpec.parse(flag)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
    source = _plan_source(plan_path, original)

    def work(progress):
        _one_thread()
        return verify_files(
            rewritten,
            original=original,
            harness=harness,
            target=target,
            flag=spec,
            mode=mode,
            atol=atol,
            rtol=rtol,
            schedule_source=source,
            inputs=inputs,
            progress=progress,
            schedules=chosen,
            train=train,
        )

    result = _isolated(work, timeout, json_out, quiet=quiet, harness=harness)
    if isinstance(result, int):
        return result
    return _report(result, json_out)


def _plan_source(plan_path: Path | None, original: Path | None):
    """`--plan PLANS.json`: the plans behind the edit, carried out on --original (for the schedules)."""
    if plan_path is None:
        return None
    from msrewrite.emit.schedules import ScheduleSource
    from msrewrite.load import read_source
    from msrewrite.plan import load_plans

    if original is None:
        raise BadInput("--plan needs --original: the plans address the unedited file's lines")
    try:
        plans = load_plans(read_source(plan_path, python=False))
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{plan_path}: {exc}") from None
    if not plans:
        raise BadInput(f"{plan_path}: no plan")
    # a micro-batch plan too (early schedule only); ScheduleSource is annotated for OverlapPlan
    return ScheduleSource(read_source(original), plans)  # type: ignore[arg-type]  # see above


def verify_edit(
    file: Path,
    new_text: str,
    *,
    function: str | None,
    flag: FlagSpec,
    mode: str,
    harness: str | None,
    schedule_source=None,
    timeout: float = DEFAULT_TIMEOUT,
    quiet: bool = False,
) -> int:
    """`apply --verify`: check the edit just made without writing anything next to the user's file.
    `function` is the edited Class.method (the model's forward for prefill-microbatch)."""
    from msrewrite.harness import package_of

    with tempfile.TemporaryDirectory(prefix="msrewrite-verify-") as folder:
        edited = Path(folder) / file.name
        edited.write_bytes(encode_source(new_text))
        target = function.split(".")[0] if function and "." in function else None

        def work(progress):
            _one_thread()
            return verify_files(
                edited,
                original=file,
                harness=harness,
                target=target,
                flag=flag,
                mode=mode,
                package=package_of(file),
                explicit_target=False,
                schedule_source=schedule_source,
                progress=progress,
            )

        result = _isolated(work, timeout, json_out=False, err=True, quiet=quiet, harness=harness)
    if isinstance(result, int):
        return result
    typer.echo("verify:", err=True)  # after the run: a bad harness is one error line, no header
    for line in summary(result):
        typer.echo(f"  {line}", err=True)
    for problem in result.problems:
        typer.echo(f"  problem: {problem}", err=True)
    return EXIT_OK if result.ok else EXIT_NOTHING_TO_DO
