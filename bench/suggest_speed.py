"""Benchmark (not a test): how long `suggest` takes next to simply importing and running the model.

Every measurement is a fresh process, so each pays the same interpreter, torch and transformers
start-up (about 2-4 s; an in-process baseline would be cached after the first model):

- run once: import the modeling file, build its tiny decoder layer and run it once;
- traced: `python -m msrewrite suggest FILE --target LAYER --json` (build, record, fx tier,
  analysis, full-size estimate);
- before (with --before DIR): the same command with DIR (a copy of an older `msrewrite` package,
  e.g. `git archive HEAD msrewrite | tar -x -C DIR`) first on PYTHONPATH, measured in the same run;
- static: `suggest --static` in-process, best of 3.

Target: traced within 1.5x of run once; static under 1 s per file.

    python bench/suggest_speed.py [--before DIR] [--repeat N]
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, TRACED_LAYERS, best_of, models_dir
from msrewrite.suggest.pipeline import analyze
from msrewrite.suggest.profiles import profile

MODELS = models_dir()
RUN_ONCE = (
    "from msrewrite.harness import build_harness; import sys; build_harness(sys.argv[1], target=sys.argv[2]).run()"
)


def wall(cmd: list[str], pythonpath: str | None = None) -> float:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, cwd=ROOT)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="folder holding an older msrewrite package")
    parser.add_argument("--repeat", type=int, default=2, help="fresh processes per measurement (best is kept)")
    opts = parser.parse_args()
    device = profile("a3")
    head = f"{'model':<28}{'run once':>10}{'traced':>10}{'ratio':>8}"
    if opts.before:
        head += f"{'before':>10}{'ratio':>8}"
    print(head + f"{'static':>10}  static<1s")
    for file, target in TRACED_LAYERS:
        path = str(MODELS / file)
        suggest = [sys.executable, "-m", "msrewrite", "suggest", path, "--target", target, "--json"]
        best = lambda cmd, pp=None: min(wall(cmd, pp) for _ in range(opts.repeat))  # noqa: E731
        baseline = best([sys.executable, "-c", RUN_ONCE, path, target])
        traced = best(suggest, str(ROOT))
        row = f"{target:<28}{baseline:>9.2f}s{traced:>9.2f}s{traced / baseline:>7.2f}x"
        if opts.before:
            before = best(suggest, str(opts.before.resolve()))
            row += f"{before:>9.2f}s{before / baseline:>7.2f}x"
        static = best_of(functools.partial(analyze, Path(path), device=device, static=True), 3)
        print(row + f"{static:>9.2f}s  {'yes' if static < 1 else 'NO'}")


if __name__ == "__main__":
    main()
