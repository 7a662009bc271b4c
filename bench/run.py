"""msrewrite speed suite: every figure is a ratio to a baseline measured in the same run.

    python bench/run.py --quick      # ~1 min: one apply file, 30 suggest files, 1 traced model
    python bench/run.py              # every modeling file, 4 traced models
    python bench/run.py --profile    # also cProfile the apply path (top functions)

Figures (targets from the issue):
  apply      load + find targets + emit + unified diff of deepseek_v3/modeling_deepseek_v3.py
             / libcst parse + codegen of the same text                            target <= 1.3x
  static     suggest --static (msrewrite.suggest.pipeline.analyze) over modeling files
             / libcst parse of the same files                                     target <= 2x
             also with -j workers (the CLI's ProcessPoolExecutor path), and what a cheap `ast`
             pre-scan would save (files the static tier finds nothing in)
  traced     `msrewrite suggest FILE --target LAYER` in a fresh process
             / import the model file and run its tiny decoder layer once in a fresh process
                                                                                  target <= 1.5x
  verify     `msrewrite verify` on a golden edit (early, late and interleaved schedules; eval, train,
             a zero-token batch, 2 random draws) in a fresh process
             / the same command with --schedules early --inputs 0 --no-train (what verify ran
             before issue 11)                                                     target <= 2x
  memory     peak Python allocations (tracemalloc) of each side, in a worker process, and the
             worker's max RSS (resource.getrusage)

Each group runs in its own worker subprocess (`--worker NAME`), so imports and memory of one
group never leak into another. Results: a table on stdout and bench/results/<timestamp>.json.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

from _common import RESULTS, ROOT, TRACED_LAYERS, best_of, models_dir

APPLY_FILE = "deepseek_v3/modeling_deepseek_v3.py"
TARGETS = {"apply": 1.3, "static": 2.0, "traced": 1.5, "verify": 2.0}
VERIFY_EDIT = ("golden/moe-shared-expert/eager/deepseek_moe.py", "examples/deepseek_moe.py")
# verify as it was before issue 11: original, flag off and flag on (early schedule, sanitized), eval only
VERIFY_BEFORE = ["--schedules", "early", "--inputs", "0", "--no-train"]


def modeling_files() -> list[Path]:
    return sorted(models_dir().glob("*/modeling_*.py"))


def sample_files(n: int) -> list[Path]:
    """A fixed, spread-out sample: every k-th modeling file in sorted order (plus the MoE ones)."""
    files = modeling_files()
    must = [models_dir() / f for f, _ in TRACED_LAYERS]
    if n >= len(files):
        return files
    step = len(files) / max(n - len(must), 1)
    picked = {files[int(i * step)] for i in range(n - len(must))} | set(must)
    return sorted(picked)


def peak_alloc(fn) -> int:
    """Peak bytes Python allocated while fn ran (tracemalloc; timed separately, it slows code)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def max_rss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


# Workers (run in a subprocess; print one JSON object) ------------------------------------------
def worker_apply(args) -> dict:
    import libcst as cst

    from msrewrite.commands.apply import plans_for_case
    from msrewrite.emit.engine import apply_plans
    from msrewrite.load import load
    from msrewrite.output.diff import unified_diff
    from msrewrite.plan import FlagSpec

    path = models_dir() / APPLY_FILE
    text = path.read_text(encoding="utf-8")

    def bare():
        assert cst.parse_module(text).code == text

    phases: dict[str, float] = {}

    def full(record: bool = False):
        t0 = time.perf_counter()
        src = load(path)
        t1 = time.perf_counter()
        plans = plans_for_case(
            path, src.module, "moe-shared-expert", "eager", None, FlagSpec(name="X"), None, text=src.text
        )
        t2 = time.perf_counter()
        new = apply_plans(src.module, plans, src.text).code
        t3 = time.perf_counter()
        diff = unified_diff(src.text, new, APPLY_FILE)
        t4 = time.perf_counter()
        assert diff.startswith("---")
        if record:
            for name, dt in (
                ("load (read + libcst parse)", t1 - t0),
                ("find targets (plans_for_case)", t2 - t1),
                ("emit (apply_plans + codegen)", t3 - t2),
                ("unified diff", t4 - t3),
            ):
                phases[name] = min(phases.get(name, float("inf")), dt)

    bare(), full()  # warm up imports and caches
    repeat = args.repeat
    # Interleave so drift (thermal, other load) hits both sides alike.
    base_times, tool_times = [], []
    for _ in range(repeat):
        base_times.append(best_of(bare, 1))
        start = time.perf_counter()
        full(record=True)
        tool_times.append(time.perf_counter() - start)
    out = {
        "file": APPLY_FILE,
        "lines": text.count("\n"),
        "baseline_s": min(base_times),
        "msrewrite_s": min(tool_times),
        "phases_s": phases,
        "baseline_peak_bytes": peak_alloc(bare),
        "msrewrite_peak_bytes": peak_alloc(full),
        "max_rss_mib": max_rss_mib(),
    }
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(full)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(
            r"msrewrite|libcst/metadata|_codegen|parse_module", 25
        )
        out["profile"] = buf.getvalue()
    return out


def _prescan(text: str) -> bool:
    """The cheap `ast` pre-scan the target design asks for: could the static tier find anything?

    A candidate needs one function with two or more `self.<sub>(...)` calls (two independent
    submodule calls); a file without such a function has nothing for libcst to look at.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return True  # let the real parser report it
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "__init__":
            calls = 0
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    func = sub.func
                    while isinstance(func, (ast.Attribute, ast.Subscript)):
                        if isinstance(func.value, ast.Name) and func.value.id == "self":
                            calls += 1
                            break
                        func = func.value
                    if calls >= 2:
                        return True
    return False


def worker_static(args) -> dict:
    import libcst as cst

    from msrewrite.commands.suggest import run_suggest
    from msrewrite.suggest.pipeline import analyze
    from msrewrite.suggest.profiles import profile

    files = sample_files(args.sample) if args.sample else modeling_files()
    texts = {f: f.read_text(encoding="utf-8") for f in files}
    device = profile("a3")

    def bare_all():
        for text in texts.values():
            cst.parse_module(text)

    per_file: dict[Path, float] = {}
    found: dict[Path, int] = {}

    def tool_all():
        for f in files:
            start = time.perf_counter()
            found[f] = len(analyze(f, device=device, static=True).candidates)
            per_file[f] = min(per_file.get(f, float("inf")), time.perf_counter() - start)

    def ast_all():
        return [_prescan(text) for text in texts.values()]

    def cli(jobs: int):
        def run():
            with contextlib.redirect_stdout(io.StringIO()):
                run_suggest(files=list(files), static=True, json_out=True, jobs=jobs)

        return run

    largest = sorted(files, key=lambda f: len(texts[f]))[-3:]
    bare_all(), analyze(files[0], device=device, static=True)  # warm up
    repeat = max(1, args.repeat - 1)
    base = best_of(bare_all, repeat)
    tool = best_of(tool_all, repeat)
    ast_time = best_of(ast_all, repeat)
    passes = dict(zip(files, ast_all(), strict=True))
    jobs = args.jobs
    cli_serial = best_of(cli(1), 1)
    cli_jobs = best_of(cli(jobs), 1)
    empty = [f for f in files if not found[f]]
    missed = [f.name for f in files if found[f] and not passes[f]]
    # With the pre-scan, only files it passes would reach libcst.
    with_prescan = ast_time + sum(per_file[f] for f in files if passes[f])
    return {
        "files": len(files),
        "baseline_s": base,
        "msrewrite_s": tool,
        "cli_serial_s": cli_serial,
        "cli_jobs": jobs,
        "cli_jobs_s": cli_jobs,
        "files_with_candidates": len(files) - len(empty),
        "files_without_candidates": len(empty),
        "time_on_files_without_candidates_s": sum(per_file[f] for f in empty),
        "ast_prescan_s": ast_time,
        "ast_prescan_passes": sum(passes.values()),
        "ast_prescan_false_negatives": missed,
        "msrewrite_with_prescan_s": with_prescan,
        "pipeline_has_prescan": _pipeline_skips_libcst(device),
        "slowest": sorted(
            ((round(t, 3), f.relative_to(models_dir()).as_posix()) for f, t in per_file.items()), reverse=True
        )[:5],
        # Peak memory is per file (nothing is kept between files): measured on the 3 largest.
        "peak_files": [f.name for f in largest],
        "baseline_peak_bytes": peak_alloc(lambda: [cst.parse_module(texts[f]) for f in largest]),
        "msrewrite_peak_bytes": peak_alloc(lambda: [analyze(f, device=device, static=True) for f in largest]),
        "max_rss_mib": max_rss_mib(),
    }


def _pipeline_skips_libcst(device) -> bool:
    """Does the static tier skip libcst on a file with nothing to do (a config file)?"""
    import libcst

    from msrewrite.suggest.pipeline import analyze

    calls = []
    real = libcst.parse_module

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    libcst.parse_module = counting
    try:
        analyze(models_dir() / "deepseek_v3/configuration_deepseek_v3.py", device=device, static=True)
    except Exception:
        pass
    finally:
        libcst.parse_module = real
    return not calls


def worker_run_once(args) -> dict:
    """Baseline of the traced figure: import the model file, build its tiny layer, run it once."""
    start = time.perf_counter()
    from msrewrite.harness import build_harness

    build_harness(models_dir() / args.file, target=args.target).run()
    return {"in_process_s": time.perf_counter() - start, "max_rss_mib": max_rss_mib()}


def worker_traced(args) -> dict:
    start = time.perf_counter()
    from msrewrite.commands.suggest import run_suggest

    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = run_suggest(files=[models_dir() / args.file], target=args.target, json_out=True)
    candidates = len(json.loads(out.getvalue())["candidates"])
    return {
        "in_process_s": time.perf_counter() - start,
        "exit": code,
        "candidates": candidates,
        "max_rss_mib": max_rss_mib(),
    }


def verify_figure(repeat: int) -> dict:
    """`msrewrite verify` on a golden edit with the default schedules, modes and inputs, against the
    same command limited to what verify ran before (early schedule, eval, make()'s inputs): whole
    fresh processes, alternated, best of `repeat`."""
    edited, original = VERIFY_EDIT
    command = [sys.executable, "-m", "msrewrite", "verify", edited, "--original", original]
    walls: dict[str, list[float]] = {"default": [], "before": []}
    for _ in range(repeat):
        for kind, extra in (("before", VERIFY_BEFORE), ("default", [])):
            start = time.perf_counter()
            proc = subprocess.run([*command, *extra], capture_output=True, text=True, cwd=ROOT)
            walls[kind].append(time.perf_counter() - start)
            if proc.returncode != 0:
                raise SystemExit(f"verify failed:\n{proc.stdout}{proc.stderr}")
    best = {k: min(v) for k, v in walls.items()}
    return {
        "file": edited,
        "msrewrite_s": best["default"],
        "baseline_s": best["before"],
        "ratio": best["default"] / best["before"],
    }


WORKERS = {"apply": worker_apply, "static": worker_static, "run-once": worker_run_once, "traced": worker_traced}


def spawn(name: str, *extra: str) -> tuple[dict, float]:
    """Run a worker in a fresh interpreter; its JSON result and the wall time of the whole process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench worker {name} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


# Driver ----------------------------------------------------------------------------------------
def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def verdict(ratio: float, target: float) -> str:
    return "ok" if ratio <= target else "MISS"


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.worker:
        result = WORKERS[args.worker](args)
        print(json.dumps(result, default=str))
        return 0

    common = ["--repeat", str(args.repeat), "--jobs", str(args.jobs)]
    if args.only == "static":
        return _only_static(args, common)
    if args.only == "apply":
        return _only_apply(common)
    if args.only == "verify":
        row = verify_figure(args.repeat)
        print(
            f"verify {row['file']}: {row['msrewrite_s']:.2f}s vs {row['baseline_s']:.2f}s before issue 11's runs "
            f"= {row['ratio']:.2f}x (target {TARGETS['verify']:.1f}x) {verdict(row['ratio'], TARGETS['verify'])}"
        )
        return 0
    results: dict = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "quick": args.quick,
        "targets": TARGETS,
    }
    print("apply ...", file=sys.stderr, flush=True)
    applied, _ = spawn("apply", *common, *(["--profile"] if args.profile else []))
    print("static suggest ...", file=sys.stderr, flush=True)
    static, _ = spawn("static", *common, *(["--sample", str(args.sample)] if args.sample else []))
    traced_rows = _traced_rows(args.quick)
    print("verify ...", file=sys.stderr, flush=True)
    verified = verify_figure(2 if args.quick else 3)
    _add_ratios(applied, static, traced_rows)
    results.update(apply=applied, static=static, traced=traced_rows, verify=verified)
    _print_table(applied, static, traced_rows, verified)
    _print_notes(applied, static)
    if args.profile:
        print("\n" + applied["profile"])
    if not args.no_json:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(results, indent=2, default=str))
        print(f"\nwrote {out.relative_to(ROOT)}")
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fixed 30-file sample, one traced model, fewer repeats")
    parser.add_argument(
        "--sample", type=int, default=None, help="static: number of modeling files (default all; 30 with --quick)"
    )
    parser.add_argument("--jobs", "-j", type=int, default=min(os.cpu_count() or 1, 8), help="workers for the -j figure")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the apply path")
    parser.add_argument("--no-json", action="store_true", help="do not write bench/results/<timestamp>.json")
    parser.add_argument("--only", choices=["static", "apply", "verify"], help="run only this figure (no JSON written)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeat is None:
        args.repeat = 3 if args.quick else 7
    if args.sample is None and args.quick:
        args.sample = 30
    return args


def _traced_rows(quick: bool) -> list[dict]:
    """Traced suggest of each decoder layer vs importing and running it once, fresh processes,
    alternating, best of each."""
    rows = []
    for file, target in TRACED_LAYERS[:1] if quick else TRACED_LAYERS:
        print(f"traced suggest {target} ...", file=sys.stderr, flush=True)
        walls: dict[str, list[float]] = {"run-once": [], "traced": []}
        info = {}
        for _ in range(2 if quick else 3):  # alternate, keep the best of each
            for kind in ("run-once", "traced"):
                res, wall = spawn(kind, "--file", file, "--target", target)
                walls[kind].append(wall)
                info[kind] = res
        rows.append(
            {
                "file": file,
                "target": target,
                "baseline_s": min(walls["run-once"]),
                "msrewrite_s": min(walls["traced"]),
                "candidates": info["traced"]["candidates"],
                "baseline_rss_mib": info["run-once"]["max_rss_mib"],
                "msrewrite_rss_mib": info["traced"]["max_rss_mib"],
            }
        )
    return rows


def _add_ratios(applied: dict, static: dict, traced_rows: list[dict]) -> None:
    applied["ratio"] = applied["msrewrite_s"] / applied["baseline_s"]
    static["ratio"] = static["msrewrite_s"] / static["baseline_s"]
    static["ratio_cli_serial"] = static["cli_serial_s"] / static["baseline_s"]
    static["ratio_cli_jobs"] = static["cli_jobs_s"] / static["baseline_s"]
    static["ratio_with_prescan"] = static["msrewrite_with_prescan_s"] / static["baseline_s"]
    for row in traced_rows:
        row["ratio"] = row["msrewrite_s"] / row["baseline_s"]


# (figure, input, msrewrite s, baseline s, what the baseline is, ratio, target, peak memory)
_Row = tuple[str, str, float, float, str, float, float, str]


def _print_table(applied: dict, static: dict, traced_rows: list[dict], verified: dict) -> None:
    rows: list[_Row] = [
        (
            "apply moe-shared-expert",
            f"{APPLY_FILE} ({applied['lines']} lines)",
            applied["msrewrite_s"],
            applied["baseline_s"],
            "libcst parse+codegen",
            applied["ratio"],
            TARGETS["apply"],
            f"{mib(applied['msrewrite_peak_bytes'])} vs {mib(applied['baseline_peak_bytes'])}",
        ),
        (
            "suggest --static",
            f"{static['files']} modeling files",
            static["msrewrite_s"],
            static["baseline_s"],
            "libcst parse",
            static["ratio"],
            TARGETS["static"],
            f"{mib(static['msrewrite_peak_bytes'])} vs {mib(static['baseline_peak_bytes'])}",
        ),
        (
            "  CLI, 1 process",
            "",
            static["cli_serial_s"],
            static["baseline_s"],
            "libcst parse",
            static["ratio_cli_serial"],
            TARGETS["static"],
            "",
        ),
        (
            f"  CLI, -j {static['cli_jobs']}",
            "",
            static["cli_jobs_s"],
            static["baseline_s"],
            "libcst parse (1 proc)",
            static["ratio_cli_jobs"],
            TARGETS["static"],
            "",
        ),
        (
            "  with an ast pre-scan*",
            "",
            static["msrewrite_with_prescan_s"],
            static["baseline_s"],
            "libcst parse",
            static["ratio_with_prescan"],
            TARGETS["static"],
            "",
        ),
    ]
    for row in traced_rows:
        rows.append(
            (
                "suggest (traced)",
                row["target"],
                row["msrewrite_s"],
                row["baseline_s"],
                "import+run once, fresh proc",
                row["ratio"],
                TARGETS["traced"],
                f"RSS {row['msrewrite_rss_mib']:.0f} vs {row['baseline_rss_mib']:.0f} MiB",
            )
        )
    rows.append(
        (
            "verify (golden edit)",
            verified["file"],
            verified["msrewrite_s"],
            verified["baseline_s"],
            "early/eval only, fresh proc",
            verified["ratio"],
            TARGETS["verify"],
            "",
        )
    )
    print(
        f"\n{'figure':<26}{'input':<50}{'msrewrite':>10}{'baseline':>10}  {'baseline is':<28}{'ratio':>7}{'target':>8}  {'':<5}peak memory (msrewrite vs baseline)"
    )
    for name, what, tool, base, base_name, ratio, target, mem in rows:
        print(
            f"{name:<26}{what:<50}{tool:>9.3f}s{base:>9.3f}s  {base_name:<28}{ratio:>6.2f}x{target:>7.1f}x  {verdict(ratio, target):<5}{mem}"
        )


def _print_notes(applied: dict, static: dict) -> None:
    print(
        "\napply phases (best of runs): " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in applied["phases_s"].items())
    )
    print(
        f"static tier: {static['files_with_candidates']}/{static['files']} files have candidates; "
        f"{static['time_on_files_without_candidates_s']:.2f}s of {static['msrewrite_s']:.2f}s is spent on files without any. "
        f"msrewrite skips libcst on a file with nothing to do (pre-scan): {'yes' if static['pipeline_has_prescan'] else 'NO'}. "
        f"*Prototype ast pre-scan (bench/run.py:_prescan) {static['ast_prescan_s']:.2f}s, passes "
        f"{static['ast_prescan_passes']}/{static['files']} files, false negatives: {static['ast_prescan_false_negatives'] or 'none'}."
    )
    print(f"max RSS of workers: apply {applied['max_rss_mib']:.0f} MiB, static {static['max_rss_mib']:.0f} MiB")


def _only_static(args, common: list[str]) -> int:
    """`--only static`: the static figure alone, for iterating on the static tier."""
    static, _ = spawn("static", *common, *(["--sample", str(args.sample)] if args.sample else []))
    ratio = static["msrewrite_s"] / static["baseline_s"]
    print(
        f"suggest --static over {static['files']} modeling files: {static['msrewrite_s']:.3f}s vs libcst parse "
        f"{static['baseline_s']:.3f}s = {ratio:.2f}x (target {TARGETS['static']:.1f}x, {verdict(ratio, TARGETS['static'])}); "
        f"CLI 1 process {static['cli_serial_s'] / static['baseline_s']:.2f}x, -j {static['cli_jobs']} "
        f"{static['cli_jobs_s'] / static['baseline_s']:.2f}x; skips libcst on a file with nothing to do: "
        f"{'yes' if static['pipeline_has_prescan'] else 'NO'}; "
        f"{static['files_with_candidates']}/{static['files']} files have candidates; "
        f"peak {mib(static['msrewrite_peak_bytes'])} vs {mib(static['baseline_peak_bytes'])}"
    )
    print("slowest: " + ", ".join(f"{f} {t}s" for t, f in static["slowest"]))
    return 0


def _only_apply(common: list[str]) -> int:
    """`--only apply`: the apply figure alone, for iterating on the emitter."""
    applied, _ = spawn("apply", *common)
    ratio = applied["msrewrite_s"] / applied["baseline_s"]
    print(
        f"apply --case moe-shared-expert: {applied['msrewrite_s']:.3f}s vs libcst parse + codegen "
        f"{applied['baseline_s']:.3f}s = {ratio:.2f}x (target {TARGETS['apply']:.1f}x, {verdict(ratio, TARGETS['apply'])})"
    )
    return 0


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
