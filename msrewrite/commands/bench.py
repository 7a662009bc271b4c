"""`msrewrite bench`: flag off vs flag on on the device present, and the ranking of the variants."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from msrewrite.errors import EXIT_OK, BadInput


class NoDevice(BadInput):
    """No CUDA or NPU device: said in one line, exit 2."""


def run_bench(*, file: Path, harness: str | None, case: str | None, mode: str, variants: bool, iters: int,
              warmup: int, dry_run: bool, json_out: bool) -> int:
    from msrewrite.load import read_source
    from msrewrite.profile import bench

    if iters < 3 or warmup < 0:
        raise BadInput(f"--iters must be at least 3 and --warmup not negative, got {iters} and {warmup}")
    text = read_source(file)
    if harness is None:
        import re

        if not re.search(r"^def make\(", text, re.M):
            raise BadInput(f"{file}: pass --harness H.py:make (what builds the model and its inputs)")
        harness = f"{file}:make"
    kind = "cpu" if dry_run else bench.device_kind()
    if kind is None:
        raise NoDevice("no CUDA or NPU device here: bench times on a device (--dry-run runs every step on CPU)")
    if mode == "auto":
        mode = {"cuda": "cuda", "npu": "eager", "cpu": "cuda"}[kind]
    if "# msrewrite(" in text:  # an edit already: time it as it is
        if case is not None or variants:
            raise BadInput(f"{file} is already edited: --case and --variants take the original file")
        from msrewrite.verify import detect_flag

        flag = detect_flag(text)
        if flag is None or flag.kind != "env":
            raise BadInput(f"{file}: bench switches env flags; no env:NAME flag found in the edit")
        items = [bench.Variant("as edited", None, text)]
        flag_name = flag.name
    else:
        if case is None:
            raise BadInput("give --case CASE (the edit to time), or an edited file")
        from msrewrite.codemods import get_case

        known = get_case(case)
        if known is None:
            raise BadInput(f"unknown case {case!r} (see `msrewrite cases`)")
        items = bench.variants(file, text, case, mode, variants)
        flag_name = known.flag_name
    off = bench.run_variants(file, harness, items, flag_name, kind, iters, warmup, dry_run)
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

    return {"device": kind, "mode": mode, "flag_off": timing(off),
            "variants": [{"label": v.label, "command": v.command, **timing(v.timing),
                          "speedup_vs_off": off.median / v.timing.median, "notes": v.notes} for v in ranked],
            "winner": next((v.command for v in ranked if v.command), None)}


def _print(kind, mode, off, ranked, dry_run, iters, warmup) -> None:
    from msrewrite.commands.suggest import fit_table

    where = "CPU dry run under the stream stand-ins (times say nothing about a device)" if dry_run else kind
    print(f"bench: {where}")
    print(f"mode {mode}, {warmup} warm-up + {iters} timed forwards each, synchronised")
    lo, hi = off.interval
    rows = [["-", "flag off (original path)", _ms(off.median), f"{_ms(lo)}-{_ms(hi)}", "1.00x"]]
    for rank, v in enumerate(ranked, 1):
        lo, hi = v.timing.interval
        rows.append([str(rank), v.label, _ms(v.timing.median), f"{_ms(lo)}-{_ms(hi)}",
                     f"{off.median / v.timing.median:.2f}x"])
    for line in fit_table(["#", "variant (flag on)", "median ms", "95% CI ms", "vs off"], rows, shrink={1: 20}):
        print(line)
    for v in ranked:
        print(f"  {v.label}: {v.command or 'no apply option makes this arrangement'}")
        for note in v.notes:
            print(f"    ({note})")
    winner = next((v for v in ranked if v.command), None)
    if winner is not None:
        print(f"winner: {winner.command}")
