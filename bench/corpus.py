"""Corpus sweep: msrewrite over every Python file of the installed transformers `models/` package.

    python bench/corpus.py                 # every .py under transformers/models
    python bench/corpus.py --modeling      # only modeling_*.py
    python bench/corpus.py --sample 40     # a fixed, evenly spread sample
    python bench/corpus.py deepseek_v3/modeling_deepseek_v3.py ...   # these files

For each file:
  round trip   libcst parse + codegen gives the file back byte for byte
  suggest      static `suggest` (msrewrite.suggest.pipeline.analyze(static=True)); its best
               candidate, if any, is carried out like `apply --plan --candidate 1`
  apply        every case of msrewrite.codemods.all_cases(): first in eager mode; when that
               edits the file, in every other mode the case supports too
and for every edit: it compiles, its unified diff passes `git apply --check` against the
original in a scratch git repository and `git apply` reproduces the edited text byte for byte,
and (for cases) a second apply on the output finds nothing (every target is `applied`).

A crash is any exception other than an msrewrite.errors.MsrewriteError subclass (those are the
documented one-line refusals: nothing to do, bad input). Exit status 1 if any crash or any
failed check, else 0. Results: a summary on stdout, --json FILE for the per-file records.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _common import models_dir

RELPATH = "model.py"  # the name the file has inside the scratch git repository


def corpus_files(modeling_only: bool = False) -> list[Path]:
    root = models_dir()
    pattern = "*/modeling_*.py" if modeling_only else "**/*.py"
    return sorted(p for p in root.glob(pattern) if p.is_file())


def sample(files: list[Path], n: int) -> list[Path]:
    if n >= len(files):
        return files
    step = len(files) / n
    return [files[int(i * step)] for i in range(n)]


@dataclass
class Check:
    """One edit of one file and what became of it."""

    what: str  # "moe-shared-expert/eager", "suggest-plan/cuda" ...
    outcome: str  # "edited", "nothing", "bad-input", "crash"
    message: str = ""
    compiles: bool | None = None
    git_apply: bool | None = None
    idempotent: bool | None = None


@dataclass
class FileResult:
    file: str
    lines: int = 0
    seconds: float = 0.0
    roundtrip: bool | None = None
    suggest: str = ""  # "N candidates" / "bad-input: ..." / "crash: ..."
    checks: list[Check] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def _crash_text(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} (at {where})"


class Scratch:
    """A scratch git repository in which diffs are checked and applied."""

    def __init__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="msrewrite-corpus-")
        self.root = Path(self.tmp.name)
        subprocess.run(["git", "init", "-q"], cwd=self.root, check=True, capture_output=True)

    def diff_applies(self, old: str, new: str, diff: str) -> tuple[bool, str]:
        model = self.root / RELPATH
        patch = self.root / "edit.diff"
        model.write_bytes(old.encode("utf-8"))
        patch.write_bytes(diff.encode("utf-8"))
        check = subprocess.run(["git", "apply", "--check", "edit.diff"], cwd=self.root, capture_output=True, text=True)
        if check.returncode != 0:
            return False, f"git apply --check: {check.stderr.strip()[:300]}"
        done = subprocess.run(["git", "apply", "edit.diff"], cwd=self.root, capture_output=True, text=True)
        if done.returncode != 0:
            return False, f"git apply: {done.stderr.strip()[:300]}"
        if model.read_bytes() != new.encode("utf-8"):
            return False, "git apply gave a different text than the edit"
        return True, ""


_SCRATCH: Scratch | None = None


def _scratch() -> Scratch:
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = Scratch()
    return _SCRATCH


def _check_edit(result: FileResult, check: Check, path: Path, old: str, new: str, case=None, mode=None) -> None:
    from msrewrite.output.diff import unified_diff

    try:
        compile(new, str(path), "exec")
        check.compiles = True
    except SyntaxError as exc:
        check.compiles = False
        result.failures.append(f"{check.what}: edit does not compile ({exc.msg} at line {exc.lineno})")
    diff = unified_diff(old, new, RELPATH)
    ok, why = _scratch().diff_applies(old, new, diff)
    check.git_apply = ok
    if not ok:
        result.failures.append(f"{check.what}: {why}")
    if case is not None:
        check.idempotent = _idempotent(result, check, path, new, case, mode)


def _idempotent(result: FileResult, check: Check, path: Path, new: str, case, mode: str) -> bool:
    import libcst as cst

    from msrewrite.cases._base import Options
    from msrewrite.cases._finder import find_targets
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.errors import MsrewriteError, NothingToDo
    from msrewrite.plan import FlagSpec

    module = cst.parse_module(new)
    try:
        plans_for_case(path, module, case.name, mode, None, FlagSpec(name=case.flag_name), None, text=new)
    except NothingToDo as exc:
        if "already applied" in str(exc):
            return True
    except MsrewriteError as exc:
        result.failures.append(f"{check.what}: second apply refused with bad input: {exc}")
        return False
    else:
        result.failures.append(f"{check.what}: second apply on the output found more to do")
        return False
    targets = find_targets(case, path, module, Options(mode=mode, flag=FlagSpec(name=case.flag_name)), text=new)
    if not any(t.applied for t in targets):
        result.failures.append(f"{check.what}: second apply does not see the edit as applied")
        return False
    return True


def sweep_file(path_text: str, all_modes: bool = True) -> FileResult:
    """Everything for one file; never raises (a crash is recorded)."""
    path = Path(path_text)
    start = time.perf_counter()
    try:
        shown = path.relative_to(models_dir()).as_posix()
    except ValueError:
        shown = str(path)
    result = FileResult(file=shown)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    result.lines = raw.count(b"\n")
    if text is not None:
        _roundtrip(result, text)
    _sweep_suggest(result, path, all_modes)
    _sweep_cases(result, path, all_modes)
    result.seconds = time.perf_counter() - start
    return result


def _roundtrip(result: FileResult, text: str) -> None:
    import libcst as cst

    try:
        result.roundtrip = cst.parse_module(text).code == text
    except Exception:  # the file itself is not parseable: msrewrite must refuse it cleanly below
        result.roundtrip = None
    if result.roundtrip is False:
        result.failures.append("libcst round trip differs from the file")


def _sweep_suggest(result: FileResult, path: Path, all_modes: bool) -> None:
    """suggest --static, then carry out its best candidate as `apply --plan --candidate 1` would."""
    from msrewrite.errors import BadInput, MsrewriteError
    from msrewrite.load import load
    from msrewrite.suggest.pipeline import analyze
    from msrewrite.suggest.profiles import profile

    try:
        analysis = analyze(path, device=profile("a3"), static=True)
        result.suggest = f"{len(analysis.candidates)} candidates"
        if analysis.candidates:
            src = load(path)
            for mode in ("eager", "cuda") if all_modes else ("eager",):
                _apply_suggested(result, path, src, analysis.candidates[0].plan, mode)
    except MsrewriteError as exc:
        result.suggest = f"{'bad-input' if isinstance(exc, BadInput) else 'nothing'}: {exc}"
    except Exception as exc:
        result.suggest = f"crash: {_crash_text(exc)}"
        result.crashes.append(f"suggest: {_crash_text(exc)}")


def _apply_suggested(result: FileResult, path: Path, src, plan, mode: str) -> None:
    from msrewrite.emit.engine import apply_plans
    from msrewrite.errors import MsrewriteError, NothingToDo

    check = Check(f"suggest-plan/{mode}", "edited")
    result.checks.append(check)
    try:
        new = apply_plans(src.module, [plan.with_changes(mode=mode)], src.text).code
    except MsrewriteError as exc:
        check.outcome, check.message = ("nothing" if isinstance(exc, NothingToDo) else "bad-input"), str(exc)
        return
    except Exception as exc:
        check.outcome, check.message = "crash", _crash_text(exc)
        result.crashes.append(f"suggest-plan/{mode}: {check.message}")
        return
    if new == src.text:
        check.outcome = "nothing"
        return
    _check_edit(result, check, path, src.text, new)


def _sweep_cases(result: FileResult, path: Path, all_modes: bool) -> None:
    """Every case, in eager mode first; in its other modes too when eager edits. The file is read
    and parsed once, as one `apply` run does (libcst trees are immutable: the cases share it)."""
    from msrewrite.cases import all_cases
    from msrewrite.errors import MsrewriteError
    from msrewrite.load import SourceFile, load

    src: SourceFile | MsrewriteError
    try:
        src = load(path)
    except MsrewriteError as exc:
        src = exc
    except Exception as exc:
        result.crashes.append(f"load: {_crash_text(exc)}")
        return
    for case in all_cases():
        modes = ["eager"] + ([m for m in case.modes if m != "eager"] if all_modes else [])
        for mode in modes:
            if not _apply_case(result, path, src, case, mode):
                break  # targets do not depend on the mode: the other modes find nothing too


def _apply_case(result: FileResult, path: Path, src, case, mode: str) -> bool:
    """One case in one mode, checked; False when eager mode found nothing to do. `src` is the
    loaded file, or the refusal loading it gave (every case records it)."""
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.emit.engine import apply_plans
    from msrewrite.errors import MsrewriteError, NothingToDo
    from msrewrite.plan import FlagSpec

    check = Check(f"{case.name}/{mode}", "edited")
    result.checks.append(check)
    try:
        if isinstance(src, MsrewriteError):
            raise src
        plans = plans_for_case(
            path, src.module, case.name, mode, None, FlagSpec(name=case.flag_name), None, text=src.text
        )
        new = apply_plans(src.module, plans, src.text).code
    except MsrewriteError as exc:
        check.outcome = "nothing" if isinstance(exc, NothingToDo) else "bad-input"
        check.message = str(exc)
        return not (mode == "eager" and isinstance(exc, NothingToDo))
    except Exception as exc:
        check.outcome, check.message = "crash", _crash_text(exc)
        result.crashes.append(f"{check.what}: {check.message}")
        return True
    if new == src.text:
        check.outcome = "nothing"
        result.failures.append(f"{check.what}: plans found but the edit changes nothing")
        return True
    _check_edit(result, check, path, src.text, new, case=case, mode=mode)
    return True


def sweep(files: list[Path], jobs: int = 1, progress: bool = False, all_modes: bool = True) -> list[FileResult]:
    """Sweep `files`; all_modes=False applies each case in eager mode only (faster)."""
    names = [str(f) for f in files]
    results: list[FileResult] = []
    if jobs > 1 and len(names) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for i, res in enumerate(
                pool.map(sweep_file, names, [all_modes] * len(names), chunksize=1 if len(names) < 50 else 4), 1
            ):
                results.append(res)
                if progress and i % 100 == 0:
                    print(f"  {i}/{len(names)}", file=sys.stderr, flush=True)
    else:
        for i, name in enumerate(names, 1):
            results.append(sweep_file(name, all_modes))
            if progress and i % 100 == 0:
                print(f"  {i}/{len(names)}", file=sys.stderr, flush=True)
    return results


def summarize(results: list[FileResult]) -> dict:
    checks = [c for r in results for c in r.checks]
    edits = [c for c in checks if c.outcome == "edited"]
    outcomes = Counter(f"{c.what.split('/')[0]}: {c.outcome}" for c in checks)
    return {
        "files": len(results),
        "lines": sum(r.lines for r in results),
        "crashes": sum(len(r.crashes) for r in results),
        "failures": sum(len(r.failures) for r in results),
        "roundtrip_checked": sum(r.roundtrip is not None for r in results),
        "roundtrip_identical": sum(r.roundtrip is True for r in results),
        "suggest_files_with_candidates": sum(
            r.suggest.endswith("candidates") and not r.suggest.startswith("0 ") for r in results
        ),
        "suggest_refused": sum(r.suggest.startswith(("bad-input", "nothing")) for r in results),
        # suggest's best plan, carried out on the unchanged file, refused by apply (a suggest/apply mismatch)
        "suggest_plans_refused": sum(
            c.what.startswith("suggest-plan/eager") and c.outcome == "bad-input" for c in checks
        ),
        "edits": len(edits),
        "edits_by_kind": dict(Counter(c.what for c in edits)),
        "edits_compile": sum(c.compiles is True for c in edits),
        "edits_git_apply": sum(c.git_apply is True for c in edits),
        "case_edits": sum(c.idempotent is not None for c in edits),
        "case_edits_idempotent": sum(c.idempotent is True for c in edits),
        "outcomes": dict(sorted(outcomes.items())),
        "slowest": sorted(((round(r.seconds, 2), r.file) for r in results), reverse=True)[:5],
    }


def print_summary(summary: dict, results: list[FileResult], seconds: float, jobs: int) -> None:
    s = summary
    print(f"corpus: {s['files']} files, {s['lines']} lines, {seconds:.0f} s with {jobs} worker(s)")
    print(f"  crashes (non-MsrewriteError exceptions): {s['crashes']}")
    print(f"  failed checks:                           {s['failures']}")
    print(f"  libcst round trip byte-identical:        {s['roundtrip_identical']}/{s['roundtrip_checked']}")
    print(
        f"  static suggest: files with candidates    {s['suggest_files_with_candidates']} (refused cleanly: {s['suggest_refused']})"
    )
    print(f"  suggest's best plan refused by apply on the unchanged file: {s['suggest_plans_refused']}")
    print(
        f"  edits made: {s['edits']}  compile {s['edits_compile']}/{s['edits']}  "
        f"git apply --check + exact {s['edits_git_apply']}/{s['edits']}  "
        f"idempotent second apply {s['case_edits_idempotent']}/{s['case_edits']} (case edits)"
    )
    print(f"  edits by kind: {s['edits_by_kind']}")
    print(f"  outcomes: {s['outcomes']}")
    print(f"  slowest files: {s['slowest']}")
    for r in results:
        for line in r.crashes:
            print(f"  CRASH {r.file}: {line}")
        for line in r.failures:
            print(f"  FAIL  {r.file}: {line}")
        for c in r.checks:
            if c.what == "suggest-plan/eager" and c.outcome == "bad-input":
                print(f"  REFUSED-PLAN {r.file}: {c.message[:160]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="files (absolute, or relative to transformers/models)")
    parser.add_argument("--modeling", action="store_true", help="only modeling_*.py")
    parser.add_argument("--sample", type=int, default=None, help="an evenly spread sample of N files")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--eager-only", action="store_true", help="apply each case in eager mode only")
    parser.add_argument("--json", type=Path, default=None, help="write the per-file records here")
    args = parser.parse_args(argv)
    if args.files:
        files = [Path(f) if Path(f).is_absolute() else models_dir() / f for f in args.files]
    else:
        files = corpus_files(args.modeling)
        if args.sample:
            files = sample(files, args.sample)
    start = time.perf_counter()
    results = sweep(files, jobs=args.jobs, progress=True, all_modes=not args.eager_only)
    seconds = time.perf_counter() - start
    summary = summarize(results)
    print_summary(summary, results, seconds, args.jobs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"summary": summary, "seconds": seconds, "files": [asdict(r) for r in results]}, indent=1)
        )
    return 1 if summary["crashes"] or summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
