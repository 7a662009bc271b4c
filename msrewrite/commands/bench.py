"""`msrewrite bench`: flag off vs flag on on the device present, and the ranking of the variants.

User code (the harness, the model imports, the forwards) runs in a child process
(harness.run_in_child) with a timeout, and so does finding the device: torch.cuda.is_available()
is not safe to fork after. A harness that exits, dies or hangs is bad input (exit 2); a model that
does so while it is timed, one error line naming the arrangement (exit 1). Either way one line,
no traceback, and the child's output never reaches stdout (--json stays clean)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from msrewrite.errors import EXIT_NOTHING_TO_DO, EXIT_OK, BadInput, MsrewriteError

DEFAULT_TIMEOUT = 600.0
_HARNESS_PHASES = ("starting", "building the harness")


class NoDevice(BadInput):
    """No CUDA or NPU device: said in one line, exit 2."""


class UserCodeFailed(MsrewriteError):
    """The model exited, died, hung or raised while an arrangement was timed: one line, exit 1."""

    exit_code = EXIT_NOTHING_TO_DO


def run_bench(
    *,
    file: Path,
    harness: str | None,
    case: str | None,
    mode: str,
    variants: bool,
    iters: int,
    warmup: int,
    dry_run: bool,
    json_out: bool,
    timeout: float = DEFAULT_TIMEOUT,
) -> int:
    from msrewrite.harness import ChildFailed, run_in_child
    from msrewrite.load import read_source

    if iters < 3 or warmup < 0:
        raise BadInput(f"--iters must be at least 3 and --warmup not negative, got {iters} and {warmup}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise BadInput("--timeout must be a positive number of seconds")
    text = read_source(file)
    named = harness
    if harness is None:
        import re

        if not re.search(r"^def make\(", text, re.M):
            raise BadInput(f"{file}: pass --harness H.py:make (what builds the model and its inputs)")
        harness = f"{file}:make"
    edited = "# msrewrite(" in text
    if edited:  # an edit already: time it as it is
        if case is not None or variants:
            raise BadInput(f"{file} is already edited: --case and --variants take the original file")
        from msrewrite.verify import detect_flag

        flag = detect_flag(text)
        if flag is None or flag.kind != "env":
            raise BadInput(f"{file}: bench switches env flags; no env:NAME flag found in the edit")
        flag_name = flag.name
    else:
        if case is None:
            raise BadInput("give --case CASE (the edit to time), or an edited file")
        from msrewrite.cases import get_case

        known = get_case(case)
        if known is None:
            raise BadInput(f"unknown case {case!r} (see `msrewrite cases`)")
        flag_name = known.flag_name

    def measure(progress):
        from msrewrite.profile import bench

        kind = "cpu" if dry_run else bench.device_kind()
        if kind is None:
            raise NoDevice("no CUDA or NPU device here: bench times on a device (--dry-run runs every step on CPU)")
        chosen = {"cuda": "cuda", "npu": "eager", "cpu": "cuda"}[kind] if mode == "auto" else mode
        items = (
            [bench.Variant("as edited", None, text)]
            if edited
            else bench.variants(file, text, case or "", chosen, variants)
        )  # case: given, checked above
        off = bench.run_variants(file, harness, items, flag_name, kind, iters, warmup, dry_run, phase=progress.phase)
        return kind, chosen, off, items

    try:
        kind, mode, off, items = run_in_child(measure, timeout=timeout)
    except ChildFailed as exc:
        if exc.phase in _HARNESS_PHASES:
            shown = f" {named}" if named else ""  # the one the user gave; else the file's own make()
            raise BadInput(f"bad harness{shown}: user code {exc}") from None
        raise UserCodeFailed(f"bench: user code {exc}") from None
    ranked = sorted(items, key=lambda v: v.timing.median)
    if json_out:
        json.dump(_as_json(kind, mode, off, ranked), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(kind, mode, off, ranked, dry_run, iters, warmup)
    return EXIT_OK


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _as_json(kind, mode, off, ranked) -> dict:
    def timing(t):
        lo, hi = t.interval
        return {"median_ms": t.median * 1e3, "ci95_ms": [lo * 1e3, hi * 1e3], "iters": len(t.times)}

    return {
        "device": kind,
        "mode": mode,
        "flag_off": timing(off),
        "variants": [
            {
                "label": v.label,
                "command": v.command,
                **timing(v.timing),
                "speedup_vs_off": off.median / v.timing.median,
                "notes": v.notes,
            }
            for v in ranked
        ],
        "winner": next((v.command for v in ranked if v.command), None),
    }


def _print(kind, mode, off, ranked, dry_run, iters, warmup) -> None:
    from msrewrite.commands.suggest import fit_table

    where = "CPU dry run under the stream stand-ins (times say nothing about a device)" if dry_run else kind
    print(f"bench: {where}")
    print(f"mode {mode}, {warmup} warm-up + {iters} timed forwards each, synchronised")
    lo, hi = off.interval
    rows = [["-", "flag off (original path)", _ms(off.median), f"{_ms(lo)}-{_ms(hi)}", "1.00x"]]
    for rank, v in enumerate(ranked, 1):
        lo, hi = v.timing.interval
        rows.append(
            [str(rank), v.label, _ms(v.timing.median), f"{_ms(lo)}-{_ms(hi)}", f"{off.median / v.timing.median:.2f}x"]
        )
    for line in fit_table(["#", "variant (flag on)", "median ms", "95% CI ms", "vs off"], rows, shrink={1: 20}):
        print(line)
    for v in ranked:
        print(f"  {v.label}: {v.command or 'no apply option makes this arrangement'}")
        for note in v.notes:
            print(f"    ({note})")
    winner = next((v for v in ranked if v.command), None)
    if winner is not None:
        print(f"winner: {winner.command}")
