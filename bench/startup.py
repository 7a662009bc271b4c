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

    python bench/startup.py [--pairs 9 | 0] [--file F] [--only apply|suggest|cases] [--instructions] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
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


def timed(argv: list[str], expect: tuple[int, ...]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of argv."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, env=ENV)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in expect:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def paired(tool: list[str], bare: list[str], pairs: int, expect: tuple[int, ...] = (0,)) -> dict:
    timed(tool, expect), timed(bare, (0,))  # warm the page cache
    tool_s, bare_s = [], []
    for k in range(pairs):
        if k % 2:
            bare_s.append(timed(bare, (0,)))
            tool_s.append(timed(tool, expect))
        else:
            tool_s.append(timed(tool, expect))
            bare_s.append(timed(bare, (0,)))
    result: dict[str, Any] = {"pairs": pairs}
    for k, what in enumerate(("wall", "cpu")):
        tool_m = statistics.median(t[k] for t in tool_s)
        bare_m = statistics.median(t[k] for t in bare_s)
        result[what] = {"tool_s": round(tool_m, 4), "bare_s": round(bare_m, 4), "ratio": round(tool_m / bare_m, 3)}
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
            result.update(paired(tool, bare, args.pairs, expect))
            wall, cpu = result["wall"], result["cpu"]
            verdict = "" if target is None else (" ok" if wall["ratio"] <= target else f" OVER {target}x")
            print(
                f"{name:8} wall {wall['tool_s']:.3f} s vs {wall['bare_s']:.3f} s bare: {wall['ratio']:.2f}x{verdict};"
                f" cpu {cpu['tool_s']:.3f} s vs {cpu['bare_s']:.3f} s: {cpu['ratio']:.2f}x (medians of {args.pairs} pairs)"
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
