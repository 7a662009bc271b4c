"""`msrewrite suggest`: find independent branches, rank them, print a table / JSON, write reports."""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from msrewrite.errors import EXIT_NOTHING_TO_DO, EXIT_OK, BadInput
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
) -> int:
    from msrewrite.suggest.pipeline import analyze
    from msrewrite.suggest.profiles import profile
    from msrewrite.suggest.report import write_report

    try:
        device_profile = profile(device)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if phase not in PHASES:
        raise BadInput(f"--phase must be one of {', '.join(PHASES)}, got {phase!r}")
    for file in files:
        read_source(Path(file))  # missing, directory, binary, not UTF-8, empty: one clear line
    if report is not None and report.exists() and not report.is_dir():
        raise BadInput(f"--report {report}: exists and is not a folder")
    if report is not None:
        try:
            report.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"--report {report}: cannot create the folder ({exc.strerror or exc})") from None
    shape = parse_shape(input_shape)

    first, extra = Path(files[0]), [Path(f) for f in files[1:]]
    if harness is None and not static and input_shape is None and re.search(r"^def make\(", read_source(first), re.M):
        harness = f"{first}:make"  # the file builds its own model and inputs, as verify assumes
    analyses = [
        analyze(first, device=device_profile, phase=phase, static=static, harness=harness, target=target, input_shape=shape)
    ]
    if extra:  # more files: static tier only
        if jobs > 1:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                analyses += list(pool.map(_static_worker, [(str(f), device, phase) for f in extra]))
        else:
            analyses += [analyze(f, device=device_profile, phase=phase, static=True) for f in extra]

    candidates = [c for a in analyses for c in a.candidates]
    if json_out:
        refused = [r for a in analyses for r in a.refused]
        json.dump({"candidates": [c.to_dict() for c in candidates], "refused": refused}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(analyses)
    if report is not None:
        for analysis in analyses:
            path = write_report(analysis, Path(report))
            print(f"report: {path}", file=sys.stderr)
    return EXIT_OK if candidates else EXIT_NOTHING_TO_DO


def _print_table(analyses) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=160)
    for analysis in analyses:
        tiers = ", ".join(f"{k}: {v}" for k, v in analysis.tiers.items())
        table = Table(title=f"{analysis.file.name}  [{tiers}]", title_justify="left")
        for column in ("#", "function", "side lines", "join", "case", "est. saving", "confidence", "tier"):
            table.add_column(column)
        for rank, c in enumerate(analysis.candidates, 1):
            saving = "N/A" if c.estimated_saving is None else f"{c.estimated_saving * 1e6:.2f} µs"
            if c.cost and c.cost.too_small:
                saving += " (too small)"
            if c.cost and c.cost.same_resource:
                saving += f" (both {c.cost.same_resource}-bound)"
            lines = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in c.plan.side_lines)
            table.add_row(str(rank), c.plan.function, lines, str(c.plan.join_line), c.case, saving, c.confidence, c.tier)
        console.print(table)
        if analysis.candidates:
            console.print(f"best: {analysis.candidates[0].command}", highlight=False, soft_wrap=True)
        else:
            console.print("no candidates found")
