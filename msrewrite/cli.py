"""Command line: `msrewrite apply | suggest | verify | cases`.

Every failure the user can cause ends as one line on stderr and a documented exit code
(0 done, 1 nothing to do / problems found, 2 bad input); tracebacks are for our own bugs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from msrewrite.errors import EXIT_BAD_INPUT, MsrewriteError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Insert multi-stream overlaps into PyTorch model code (Ascend NPU and CUDA).",
)


def _fail(exc: MsrewriteError) -> None:
    typer.echo(f"msrewrite: error: {exc}", err=True)
    raise typer.Exit(exc.exit_code)


@app.command()
def apply(
    file: Path = typer.Argument(..., help="Model source file to edit."),
    case: Optional[str] = typer.Option(None, "--case", help="Case to apply (see `msrewrite cases`)."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="Carry out plans from a JSON file (suggest --json)."),
    candidate: Optional[int] = typer.Option(None, "--candidate", help="With --plan: only this candidate (1-based)."),
    mode: str = typer.Option("auto", "--mode", help="auto, eager, npugraph-ex, ge-graph or cuda."),
    target: Optional[str] = typer.Option(None, "--target", help="Class.method to edit when several match."),
    flag: str = typer.Option("", "--flag", help="Enable flag: env:NAME (default) or attr:NAME."),
    flag_default: str = typer.Option("on", "--flag-default", help="Value when the flag is unset: on or off."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Overlap only for at most N tokens."),
    stream_tag: Optional[str] = typer.Option(None, "--stream-tag", help="Side stream tag (shared by every layer)."),
    start_after: Optional[str] = typer.Option(
        None, "--start-after", help="ge-graph: start the side work only after this main-stream tensor exists."
    ),
    anchor: Optional[List[str]] = typer.Option(
        None, "--anchor", help="Phased cases: a main-stream value after which the next side phase starts (repeat)."
    ),
    core_preset: str = typer.Option("a3", "--cores", help="Core-limit cases: device preset a2, a3 or a3-even."),
    core_limit: Optional[str] = typer.Option(
        None, "--core-limit", help="Core-limit cases: SIDE_AIC/SIDE_AIV,MAIN_AIC/MAIN_AIV, e.g. 8/16,16/32."
    ),
    second_comm_group: Optional[str] = typer.Option(
        None, "--second-comm-group", help="prefill-microbatch: the layer's second process group (self.NAME) for micro-batch 1."
    ),
    protect: str = typer.Option(
        "", "--protect", help="clone: snapshot side inputs the main path may write before the join (one copy each)."
    ),
    assume_pure: Optional[List[str]] = typer.Option(
        None, "--assume-pure", help="A callee msrewrite cannot see into that writes none of its arguments (repeat)."
    ),
    in_place: bool = typer.Option(False, "--in-place", "-i", help="Rewrite the file in place (atomic)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write git format-patch files to this folder."),
    verify: bool = typer.Option(False, "--verify", help="Run `msrewrite verify` on the edit."),
    harness: Optional[str] = typer.Option(None, "--harness", help="With --verify: H.py:make building model and inputs."),
) -> None:
    """Rewrite FILE: move a branch onto a side stream behind an enable flag."""
    from msrewrite.commands.apply import run_apply

    try:
        code = run_apply(
            file=file,
            case=case,
            plan_path=plan,
            candidate=candidate,
            mode=mode,
            target=target,
            flag=flag,
            flag_default=flag_default,
            max_tokens=max_tokens,
            stream_tag=stream_tag,
            start_after=start_after,
            anchors=tuple(anchor or ()),
            core_preset=core_preset,
            core_limit=core_limit,
            second_comm_group=second_comm_group,
            protect=protect,
            assume_pure=tuple(assume_pure or ()),
            in_place=in_place,
            output=output,
            verify=verify,
            harness=harness,
        )
    except MsrewriteError as exc:
        _fail(exc)
    raise typer.Exit(code)


@app.command()
def cases() -> None:
    """List the cases, one line each, with the modes they support."""
    from msrewrite.codemods import all_cases

    items = all_cases()
    width = max(len(item.name) for item in items) + 2
    mode_width = max(len(", ".join(item.modes)) for item in items) + 4
    for item in items:
        modes = f"[{', '.join(item.modes)}]"
        notes = f" ({item.notes})" if item.notes else ""
        typer.echo(f"{item.name:<{width}}{modes:<{mode_width}}{item.summary}{notes}")


@app.command()
def verify(
    rewritten: Path = typer.Argument(..., help="Rewritten model file."),
    original: Optional[Path] = typer.Option(None, "--original", help="Original model file to compare against."),
    harness: Optional[str] = typer.Option(None, "--harness", help="H.py:make returning (module, inputs)."),
    target: Optional[str] = typer.Option(None, "--target", help="Module class to build when the file has several."),
    flag: str = typer.Option("", "--flag", help="Enable flag of the edit: env:NAME or attr:NAME."),
    mode: str = typer.Option("auto", "--mode", help="auto, eager, npugraph-ex, ge-graph or cuda."),
    atol: float = typer.Option(0.0, "--atol", help="Absolute tolerance (default: exact)."),
    rtol: float = typer.Option(0.0, "--rtol", help="Relative tolerance (default: exact)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Prove an edit on CPU: equivalence with the flag off and on, and a stream sanitizer run."""
    from msrewrite.commands.verify import run_verify

    try:
        code = run_verify(
            rewritten=rewritten,
            original=original,
            harness=harness,
            target=target,
            flag=flag,
            mode=mode,
            atol=atol,
            rtol=rtol,
            json_out=json_out,
        )
    except MsrewriteError as exc:
        _fail(exc)
    raise typer.Exit(code)


@app.command()
def suggest(
    file: Path = typer.Argument(..., help="Model source file to analyze."),
    static: bool = typer.Option(False, "--static", help="Static dataflow only: never import or run the file."),
    harness: Optional[str] = typer.Option(None, "--harness", help="H.py:make returning (module, inputs)."),
    target: Optional[str] = typer.Option(None, "--target", help="Module class to analyze."),
    input_shape: Optional[str] = typer.Option(None, "--input-shape", help="Input shape for an nn.Module, e.g. 1,8,64."),
    device: str = typer.Option("a3", "--device", help="Cost-model device profile: a2, a3 or h200."),
    json_out: bool = typer.Option(False, "--json", help="Print candidates as JSON, nothing else on stdout."),
    report: Optional[Path] = typer.Option(None, "--report", help="Write the analysis report into this folder."),
    phase: str = typer.Option("decode", "--phase", help="prefill or decode (report name and cost shapes)."),
    jobs: int = typer.Option(1, "-j", "--jobs", help="Worker processes for several files."),
    extra: Optional[List[Path]] = typer.Argument(None, help="More files (static tier)."),
) -> None:
    """Find independent branches worth overlapping, rank them, and name the case that applies."""
    from msrewrite.commands.suggest import run_suggest

    try:
        code = run_suggest(
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
        )
    except MsrewriteError as exc:
        _fail(exc)
    raise typer.Exit(code)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("msrewrite: interrupted", err=True)
        sys.exit(EXIT_BAD_INPUT)
