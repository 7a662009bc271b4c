"""Whole-process speed, as a user runs it: msrewrite commands vs bare libcst in fresh processes.

Each pair runs the msrewrite command and its bare-libcst baseline back to back, alternating
which goes first, and the ratio of the medians is reported (a loaded machine slows both sides
of a pair alike). Figures:

- apply:   `msrewrite apply --case moe-shared-expert F` vs `import libcst; parse F; codegen`
           (target <= 1.3x)
- suggest: `msrewrite suggest --static F` vs `import libcst; parse F` (target <= 2x)
- cases:   `msrewrite cases` vs `import libcst`

F is transformers' modeling_glm4_moe.py (or --file). Both wall time and CPU time (user + sys of
the process and its children, steadier on a shared machine) are reported. The children run with
bytecode caching on (PYTHONDONTWRITEBYTECODE unset), as an installed package runs: libcst's own
modules are cached in site-packages, so msrewrite's must be too for a fair comparison.

With --instructions, each side runs once more under valgrind (cachegrind, no cache simulation)
and the ratio of instructions executed is reported too: machine load does not move it, so it is
the figure to compare across commits on a shared machine (each run takes about 30 s). Usage:

    python bench/startup.py [--pairs 9 | 0] [--pin CPU] [--file F] [--only apply|suggest|cases] [--instructions] [--json OUT]

Each timed figure is the median of the per-pair ratios with a distribution-free 95% interval;
a target counts as met only when the interval's upper end is within it. `--pin CPU` runs every
timed process on one CPU, away from the scheduler moving it (pick one the machine's other work
is not bound to).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import ROOT


def default_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench/startup.py: transformers is not installed; pass --file")
    return Path(spec.submodule_search_locations[0]) / "models" / "glm4_moe" / "modeling_glm4_moe.py"


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(argv: list[str], expect: tuple[int, ...], cpu: int | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of argv; on CPU `cpu` alone when given."""
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, env=ENV, preexec_fn=pin)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in expect:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval for the median: the order statistics whose
    ranks bound it with probability >= 0.95 under the binomial(n, 1/2) law (the whole range
    when n is too small for that)."""
    ordered, n = sorted(values), len(values)
    below = 0.0
    for k in range(n // 2):
        below += math.comb(n, k) / 2**n  # P(fewer than k+1 values below the median)
        if 2 * (below + math.comb(n, k + 1) / 2**n) > 0.05:
            return ordered[k], ordered[n - 1 - k]
    return ordered[0], ordered[-1]


def paired(
    tool: list[str], bare: list[str], pairs: int, expect: tuple[int, ...] = (0,), cpu: int | None = None
) -> dict:
    """Alternating pairs. The figure is the median of the per-pair ratios (both runs of a pair see
    the same load), with its 95% interval; the ratio of the fastest runs is given too (load only
    ever adds time, so the minimum is the least disturbed run of each side)."""
    timed(tool, expect, cpu), timed(bare, (0,), cpu)  # warm the page cache
    tool_s, bare_s = [], []
    for k in range(pairs):
        if k % 2:
            bare_s.append(timed(bare, (0,), cpu))
            tool_s.append(timed(tool, expect, cpu))
        else:
            tool_s.append(timed(tool, expect, cpu))
            bare_s.append(timed(bare, (0,), cpu))
    result: dict[str, Any] = {"pairs": pairs, "cpu_pinned": cpu}
    for k, what in enumerate(("wall", "cpu")):
        ratios = [t[k] / b[k] for t, b in zip(tool_s, bare_s, strict=True)]
        low, high = median_interval(ratios)
        result[what] = {
            "tool_s": round(statistics.median(t[k] for t in tool_s), 4),
            "bare_s": round(statistics.median(b[k] for b in bare_s), 4),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_95": [round(low, 3), round(high, 3)],
            "ratio_of_fastest": round(min(t[k] for t in tool_s) / min(b[k] for b in bare_s), 3),
        }
    return result


def instructions(argv: list[str], expect: tuple[int, ...]) -> int:
    """Instructions one run of argv executes (valgrind's cachegrind, user space, the whole process)."""
    done = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=ENV,
        text=True,
    )
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode not in expect or found is None:
        raise SystemExit(f"valgrind {' '.join(argv)} exited {done.returncode}: {done.stderr[-500:]}")
    return int(found.group(1).replace(",", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=9, help="timed pairs (0: none, e.g. with --instructions)")
    parser.add_argument("--file", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", choices=("apply", "suggest", "cases"), action="append")
    parser.add_argument("--instructions", action="store_true", help="also count instructions under valgrind")
    parser.add_argument(
        "--pin", type=int, default=None, metavar="CPU", help="run every timed process on this CPU alone"
    )
    args = parser.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("bench/startup.py: --instructions needs valgrind on PATH")
    path = str((args.file or default_file()).resolve())
    py = sys.executable
    env_note = f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    figures = {
        "apply": (
            [py, "-m", "msrewrite", "apply", "--case", "moe-shared-expert", path],
            [py, "-c", f"import libcst; libcst.parse_module(open({path!r}).read()).code"],
            (0, 1),
            1.3,
        ),
        "suggest": (
            [py, "-m", "msrewrite", "suggest", "--static", path],
            [py, "-c", f"import libcst; libcst.parse_module(open({path!r}).read())"],
            (0, 1),
            2.0,
        ),
        "cases": ([py, "-m", "msrewrite", "cases"], [py, "-c", "import libcst"], (0,), None),
    }
    results: dict[str, Any] = {"file": path, "env": env_note}
    for name, (tool, bare, expect, target) in figures.items():
        if args.only and name not in args.only:
            continue
        result: dict = {"target": target}
        if args.pairs:
            result.update(paired(tool, bare, args.pairs, expect, args.pin))
            for what in ("wall", "cpu"):
                fig = result[what]
                low, high = fig["ratio_95"]
                verdict = "" if target is None else (" ok" if high <= target else f" not shown <= {target}x")
                print(
                    f"{name:8} {what:4} {fig['tool_s']:.3f} s vs {fig['bare_s']:.3f} s bare: {fig['ratio']:.3f}x "
                    f"(95% {low:.3f}-{high:.3f}x{verdict}; fastest runs {fig['ratio_of_fastest']:.3f}x; "
                    f"{args.pairs} pairs{'' if args.pin is None else f', CPU {args.pin}'})"
                )
        if args.instructions:
            timed(tool, expect)  # bytecode caches written before the count
            tool_i, bare_i = instructions(tool, expect), instructions(bare, (0,))
            result["instructions"] = {"tool": tool_i, "bare": bare_i, "ratio": round(tool_i / bare_i, 3)}
            print(f"{name:8} instructions {tool_i / 1e6:.0f} M vs {bare_i / 1e6:.0f} M bare: {tool_i / bare_i:.3f}x")
        results[name] = result
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
