"""`msrewrite suggest`: find independent branches, rank them, print a table / JSON, write reports."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from msrewrite.errors import EXIT_NOTHING_TO_DO, EXIT_OK, BadInput, EmptyFile, NothingToDo
from msrewrite.load import read_source

PHASES = ("decode", "prefill")


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    parts = re.split(r"[,x]", text.strip())
    if not all(part.strip().isdigit() for part in parts):
        raise BadInput(f"--input-shape must be integers like 1,8,64, got {text!r}")
    shape = tuple(int(part) for part in parts)
    if any(n <= 0 for n in shape):
        raise BadInput(f"--input-shape must be positive integers, got {text!r}")
    return shape


def _static_worker(args: tuple[str, str, str]):
    from msrewrite.suggest.pipeline import analyze
    from msrewrite.suggest.profiles import profile

    file, device, phase = args
    analysis = analyze(Path(file), device=profile(device), phase=phase, static=True)
    if analysis.module is not None:
        analysis.module.drop_syntax()  # candidates are final; syntax trees are slow to pickle
    return analysis


def run_suggest(
    *,
    files: list[Path],
    static: bool = False,
    harness: str | None = None,
    target: str | None = None,
    input_shape: str | None = None,
    device: str = "a3",
    json_out: bool = False,
    report: Path | None = None,
    phase: str = "decode",
    jobs: int = 1,
    quiet: bool = False,
    timeout: float = 300.0,
    profile_json: Path | None = None,
    assume_pure: tuple[str, ...] = (),
    protect: str = "",
) -> int:
    from msrewrite import validate
    from msrewrite.analyze.stmtgraph import set_vouched, vouched
    from msrewrite.plan import PROTECT_CHOICES, protect_choice

    try:
        validate.vouching(protect, assume_pure, PROTECT_CHOICES)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    previous = vouched()  # this run's, not the process's: a caller's next analysis is its own
    set_vouched(assume_pure, protect_choice(protect))
    try:
        return _suggest(
            files=files,
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
            timeout=timeout,
            profile_json=profile_json,
        )
    finally:
        set_vouched(*previous)


def _suggest(
    *,
    files: list[Path],
    static: bool,
    harness: str | None,
    target: str | None,
    input_shape: str | None,
    device: str,
    json_out: bool,
    report: Path | None,
    phase: str,
    jobs: int,
    quiet: bool,
    timeout: float,
    profile_json: Path | None,
) -> int:
    from msrewrite.suggest.profiles import profile

    try:
        device_profile = profile(device)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if phase not in PHASES:
        raise BadInput(f"--phase must be one of {', '.join(PHASES)}, got {phase!r}")
    files = _readable_files(files)
    _make_report_folder(report)
    shape = parse_shape(input_shape)
    measured = _read_profile(profile_json, report) if profile_json is not None else None

    first, extra = Path(files[0]), [Path(f) for f in files[1:]]
    if harness is None and not static and input_shape is None and re.search(r"^def make\(", read_source(first), re.M):
        harness = f"{first}:make"  # the file builds its own model and inputs, as verify assumes
    progress = _progress(quiet) if not static or (len(extra) and jobs > 1) else None

    def analyze(static_tier: bool) -> tuple[int, str]:
        return _analyze_and_print(
            first,
            extra,
            device,
            device_profile,
            phase,
            static_tier,
            harness,
            target,
            shape,
            jobs,
            json_out,
            report,
            progress,
            quiet,
            measured,
        )

    if not static:  # the traced tier imports and runs user code: all of it in a child, with a timeout
        from msrewrite.harness import ChildFailed, run_in_child

        def traced(_child_progress):  # user prints go to stderr there; our output comes back as text
            return analyze(False)

        try:
            code, text = run_in_child(traced, timeout=timeout)
        except ChildFailed as exc:
            raise BadInput(f"{first}: user code {exc}") from None
    else:
        code, text = analyze(True)
    sys.stdout.write(text)
    return code


def _read_profile(path: Path, report: Path | None) -> dict:
    """`msrewrite profile --json` output, for the report's profile acceptance section."""
    if report is None:
        raise BadInput("--profile fills the report's profile acceptance section: give --report DIR too")
    try:
        data = json.loads(read_source(path, python=False))
    except ValueError as exc:
        raise BadInput(f"--profile {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("regions"), list):
        raise BadInput(f"--profile {path}: not `msrewrite profile --json` output (no regions list)")
    return data


def _readable_files(files: list[Path]) -> list[Path]:
    """The files to analyze: each readable (else one clear line), the empty ones skipped with a note."""
    empty = []
    for file in files:
        try:
            read_source(Path(file))  # missing, directory, binary, not UTF-8: one clear line
        except EmptyFile as exc:  # valid Python with nothing in it
            if len(files) == 1:
                raise exc.as_nothing_to_do() from None
            print(f"msrewrite: {exc}, skipped", file=sys.stderr)
            empty.append(file)
    files = [f for f in files if f not in empty]
    if not files:
        raise NothingToDo("every file is empty, nothing to do")
    return files


def _make_report_folder(report: Path | None) -> None:
    """--report's folder, made if missing; a file in its place or an unwritable parent is bad input."""
    if report is not None and report.exists() and not report.is_dir():
        raise BadInput(f"--report {report}: exists and is not a folder")
    if report is not None:
        try:
            report.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"--report {report}: cannot create the folder ({exc.strerror or exc})") from None


def _analyze_and_print(
    first,
    extra,
    device,
    device_profile,
    phase,
    static,
    harness,
    target,
    shape,
    jobs,
    json_out,
    report,
    progress,
    quiet,
    measured=None,
) -> tuple[int, str]:
    """(exit code, what goes to stdout) of the analysis; stdout is gathered as text so that a traced
    run can hand it back from its child process."""
    import contextlib
    import io

    from msrewrite.suggest.pipeline import analyze
    from msrewrite.suggest.report import write_report

    analyses = [
        analyze(
            first,
            device=device_profile,
            phase=phase,
            static=static,
            harness=harness,
            target=target,
            input_shape=shape,
            progress=progress,
        )
    ]
    trace_tier = analyses[0].tiers.get("trace", "")
    if trace_tier.startswith("failed") and not quiet:  # said even when stderr is not a terminal
        print(f"msrewrite: {first.name}: trace {trace_tier}; fell back to the static tier", file=sys.stderr)
    if extra:  # more files: static tier only
        if jobs > 1:
            from concurrent.futures import ProcessPoolExecutor  # only here: multiprocessing is slow to import

            with ProcessPoolExecutor(max_workers=jobs) as pool:
                for done, analysis in enumerate(pool.map(_static_worker, [(str(f), device, phase) for f in extra]), 1):
                    if progress is not None:
                        progress(f"static: {done}/{len(extra)} more files read ({analysis.file.name})")
                    analyses.append(analysis)
        else:
            analyses += [analyze(f, device=device_profile, phase=phase, static=True) for f in extra]

    from msrewrite.suggest.microbatch import microbatch_candidates

    for analysis in analyses:  # the model-level fork: read from the text, after each file's branches
        analysis.microbatch = microbatch_candidates(
            analysis.file, read_source(analysis.file), str(analysis.file), analysis.refused
        )
    candidates = [c for a in analyses for c in [*a.candidates, *a.microbatch]]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        if json_out:
            refused = [r for a in analyses for r in a.refused]
            json.dump({"candidates": [c.to_dict() for c in candidates], "refused": refused}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            _print_table(analyses)
    if report is not None:
        for analysis in analyses:
            if measured is not None and analysis is analyses[0]:  # the profiled model is the first file
                analysis.profile = measured
            path = write_report(analysis, Path(report))
            print(f"report: {path}", file=sys.stderr)
    return (EXIT_OK if candidates else EXIT_NOTHING_TO_DO), out.getvalue()


def _progress(quiet: bool):
    """Stage lines on stderr while the traced path runs (it can take a minute): only for a person
    watching a terminal, never with --quiet."""
    from msrewrite.output.progress import stage_printer

    return stage_printer(quiet)


TABLE_WIDTH = 80


def fit_table(header: list[str], rows: list[list[str]], shrink: dict[int, int], width: int = TABLE_WIDTH) -> list[str]:
    """Rows as aligned text lines of at most `width` columns. `shrink` maps the columns that may
    give up characters, in order, to the width each keeps at least; cut cells end with "…"."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    gap = 2
    excess = sum(widths) + gap * (len(widths) - 1) - width
    for k, least in shrink.items():
        if excess <= 0:
            break
        give = min(excess, max(0, widths[k] - least))
        widths[k] -= give
        excess -= give

    def cell(text: str, w: int) -> str:
        return text if len(text) <= w else text[: w - 1] + "…"

    return [
        (" " * gap).join(cell(t, w).ljust(w) for t, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def _print_table(analyses) -> None:
    for analysis in analyses:
        tiers = ", ".join(f"{k}: {v}" for k, v in analysis.tiers.items())
        print(fit_table([f"{analysis.file.name}  [{tiers}]"], [], shrink={0: 20})[0])
        rows = []
        for rank, c in enumerate(analysis.candidates, 1):
            saving = "N/A" if c.estimated_saving is None else f"{c.estimated_saving * 1e6:.2f} µs"
            if c.cost and c.cost.too_small:
                saving += " (too small)"
            if c.cost and c.cost.same_resource:
                saving += f" (both {c.cost.same_resource}-bound)"
            lines = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in c.plan.side_lines)
            rows.append(
                [str(rank), c.plan.function, lines, str(c.plan.join_line), c.case, saving, c.confidence, c.tier]
            )
        for rank, mb in enumerate(analysis.microbatch, len(rows) + 1):  # the model-level fork: no estimate
            layer = mb.plan.statements
            rows.append(
                [
                    str(rank),
                    mb.plan.function,
                    f"layer {layer[0].first_line}-{layer[-1].last_line}",
                    "-",
                    mb.case,
                    "N/A",
                    "low",
                    "static",
                ]
            )
        if rows:
            header = ["#", "function", "side", "join", "case", "saving", "conf.", "tier"]
            if len({row[-1] for row in rows}) == 1:  # one tier for all: the title says which
                header, rows = header[:-1], [row[:-1] for row in rows]
            for line in fit_table(header, rows, shrink={2: 6, 1: 20, 4: 10, 5: 10, 6: 4}):
                print(line)
            best = analysis.candidates[0] if analysis.candidates else analysis.microbatch[0]
            print(f"best: {best.command}")
            if analysis.microbatch and analysis.candidates:
                print(f"best: {analysis.microbatch[0].command}  (model-level fork)")
        else:
            print("no candidates found")
