"""Serving-code sweep: `apply --case moe-shared-expert` and `suggest --static` over model folders.

Run it on vLLM's and SGLang's model files (read as text, never imported):

    mkdir -p /tmp/serving && cd /tmp/serving
    pip download --no-deps sglang==0.5.23 vllm==0.33.0
    unzip -q -o 'sglang-0.5.23-*.whl' 'sglang/srt/models/*' -d sglang_src
    unzip -q -o 'vllm-0.33.0-*.whl' 'vllm/model_executor/models/*' -d vllm_src
    python bench/serving_sweep.py vllm=/tmp/serving/vllm_src/vllm/model_executor/models \\
        sglang=/tmp/serving/sglang_src/sglang/srt/models -j 2 \\
        --source-path /tmp/serving/sglang_src --source-path /tmp/serving/vllm_src

Each argument is `NAME=FOLDER` (or just FOLDER); every `*.py` in the folder is swept.
`--source-path DIR` (repeat) is `apply --source-path`: the frameworks' own layers (`FusedMoE`,
`ReplicatedLinear`, `fused_moe`) are read from the unpacked wheels, never imported. To unpack
whole wheels for it: `unzip -q -o 'sglang-0.5.23-*.whl' 'sglang/*' -d sglang_src` (same for vllm).

apply: every function that calls a shared expert (`self.shared_expert*(...)`, what the case's own
matcher looks for) is edited, or refused with the analysis' reason, or found already overlapped
(hand-written stream code in the function); a file whose shared expert is only handed to the
framework's fused MoE (`FusedMoE(shared_experts=...)`, which vLLM runs on its `aux_stream()`)
counts as already overlapped by the framework. Every edit must compile and `git apply --check`
against the original. Any exception that is not msrewrite's own one-line error is a crash.

suggest: every candidate `suggest --static` prints is counted, with those whose fork and join are
the same line, those that pull a call out of its `if`/`for`/`with`/`try` or out of a conditional
expression, and those `apply --plan` accepts (the edit compiles and `git apply --check`s).

Prints the table; `--json FILE` writes the per-file details. Exit 1 on a crash, on an edit that
does not compile or apply, or when a printed candidate is not accepted by `apply --plan`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import _common  # noqa: F401 - puts this checkout first on sys.path

STREAM_CODE = re.compile(
    r"wait_stream|torch\.(cuda|npu)\.stream\(|alt_stream|aux_stream|npu_stream_switch|current_stream\("
)
HANDED_TO_FRAMEWORK = re.compile(r"[(,]\s*shared_experts?\s*=\s*self\.\w+")  # a keyword argument
DEEPER_CALL = re.compile(r"\bself(\.\w+)+\.shared_(experts?|mlp)\w*\(")


def _git_apply_check(original: str, diff: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "model.py").write_text(original, encoding="utf-8")
        (Path(tmp) / "edit.diff").write_text(diff, encoding="utf-8")
        done = subprocess.run(["git", "apply", "--check", "edit.diff"], cwd=tmp, capture_output=True)
        return done.returncode == 0


def _edit_ok(original: str, new: str, where: str) -> str | None:
    """None when the edit compiles and its diff applies to the original, else what failed."""
    from msrewrite.output.diff import unified_diff

    try:
        compile(new, where, "exec")
    except SyntaxError as exc:
        return f"does not compile: {exc.msg} at line {exc.lineno}"
    if not _git_apply_check(original, unified_diff(original, new, "model.py")):
        return "git apply --check fails"
    return None


def reason_group(reason: str) -> str:
    """A refusal with its specifics (lines, names) taken out, so equal reasons group together."""
    text = re.sub(r"\bline \d+", "line N", reason)
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\b[A-Z]\w*\.forward\b", "F", text)
    return text


def sweep_apply(path: Path) -> dict:
    from msrewrite.cases import get_case
    from msrewrite.cases._base import Options
    from msrewrite.cases._finder import find_targets
    from msrewrite.emit.engine import apply_plans
    from msrewrite.emit.locate import locate
    from msrewrite.emit.templates import code_of
    from msrewrite.errors import MsrewriteError
    from msrewrite.load import load

    result: dict = {"functions": [], "file_status": None}
    text = path.read_text(encoding="utf-8")
    if "shared_expert" not in text and "shared_mlp" not in text:
        return result
    try:
        src = load(path)
        case = get_case("moe-shared-expert")
        assert case is not None  # a bundled case
        targets = find_targets(case, path, src.module, Options(), text=src.text)
    except MsrewriteError as exc:
        result["file_status"] = ("refused", str(exc))
        return result
    except Exception as exc:  # noqa: BLE001 - a crash is what this sweep is looking for
        result["file_status"] = ("crash", f"{type(exc).__name__}: {exc}")
        return result
    if not targets:
        if HANDED_TO_FRAMEWORK.search(text):
            result["file_status"] = ("already overlapped", "by the framework: FusedMoE(shared_experts=...)")
        elif DEEPER_CALL.search(text):
            result["file_status"] = (
                "no target",
                "shared expert called one module deeper (self.<m>.shared_expert(...))",
            )
        else:  # weight loading, fusion settings, MTP/VL wrappers: no MoE forward here
            result["file_status"] = ("no MoE forward", "mentions shared experts, calls none")
        return result
    for target in targets:
        row = {"function": target.function}
        try:
            func_text = code_of(locate(src.module, target.function).func)
            own_streams = bool(STREAM_CODE.search(func_text))
            if target.plan is not None:
                new = apply_plans(src.module, [target.plan], src.text).code
                problem = _edit_ok(src.text, new, str(path))
                if problem:
                    row["status"], row["reason"] = "bad edit", problem
                elif own_streams:
                    row["status"], row["reason"] = "edited over an existing overlap", "function has stream code"
                else:
                    row["status"] = "edited"
            elif target.applied:
                row["status"], row["reason"] = "already overlapped", "msrewrite's own edit"
            elif own_streams:  # the sweep's reading; msrewrite's own reason is kept next to it
                row["status"], row["reason"] = "already overlapped", "hand-written stream code in the function"
                row["msrewrite_reason"] = target.reason
            else:
                row["status"], row["reason"] = "refused", target.reason
        except MsrewriteError as exc:
            row["status"], row["reason"] = "refused", str(exc)
        except Exception as exc:  # noqa: BLE001
            row["status"], row["reason"] = "crash", f"{type(exc).__name__}: {exc}"
        result["functions"].append(row)
    return result


def _hoisted_out_of_control_flow(module, plan) -> bool:
    """A hoisted call whose join statement is an if/for/with/try, or that sits in a conditional
    expression of it: moving it out changes how often it runs."""
    import libcst as cst

    from msrewrite.analyze.branch import _conditional_calls
    from msrewrite.analyze.positions import positions_for
    from msrewrite.emit.locate import locate
    from msrewrite.emit.templates import code_of

    hoists = [s for s in plan.side if s.hoist]
    if not hoists:
        return False
    func = locate(module, plan.function).func
    positions = positions_for(module, plan.function, func)
    join = next((s for s in func.body.body if positions[s].start.line == plan.join_line), None)
    if join is None:
        return False
    if not isinstance(join, cst.SimpleStatementLine):
        return True
    conditional = _conditional_calls(join)
    calls = []

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            calls.append(call)

    join.visit(_Calls())
    return any(id(c) in conditional and code_of(c) in {h.source for h in hoists} for c in calls)


def sweep_suggest(path: Path) -> dict:
    from msrewrite.commands.apply import run_apply
    from msrewrite.errors import MsrewriteError
    from msrewrite.load import load
    from msrewrite.suggest.pipeline import analyze
    from msrewrite.suggest.profiles import profile

    result: dict[str, Any] = {
        "candidates": 0,
        "fork_is_join": 0,
        "hoisted_out_of_control_flow": 0,
        "accepted": 0,
        "refused_by_finder": 0,
        "rejected": [],
        "crash": None,
    }
    try:
        analysis = analyze(path, device=profile("a3"), static=True)
    except MsrewriteError:
        return result
    except Exception as exc:  # noqa: BLE001
        result["crash"] = f"{type(exc).__name__}: {exc}"
        return result
    result["refused_by_finder"] = len(analysis.refused)
    if not analysis.candidates:
        return result
    src = load(path)
    with tempfile.TemporaryDirectory() as tmp:
        plans = Path(tmp) / "plans.json"
        plans.write_text(json.dumps({"candidates": [c.to_dict() for c in analysis.candidates]}))
        for rank, candidate in enumerate(analysis.candidates, 1):
            plan = candidate.plan
            result["candidates"] += 1
            result["fork_is_join"] += plan.fork_line == plan.join_line
            result["hoisted_out_of_control_flow"] += _hoisted_out_of_control_flow(src.module, plan)
            out, err = io.StringIO(), io.StringIO()
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    run_apply(
                        file=path,
                        case=None,
                        plan_path=plans,
                        candidate=rank,
                        mode="auto",
                        target=None,
                        flag="",
                        flag_default="on",
                        max_tokens=None,
                        stream_tag=None,
                        in_place=False,
                        output=None,
                        verify=False,
                        harness=None,
                    )
            except MsrewriteError as exc:
                result["rejected"].append(f"{plan.function} L{plan.fork_line}-{plan.join_line}: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001
                result["rejected"].append(f"{plan.function}: crash {type(exc).__name__}: {exc}")
                continue
            diff = out.getvalue()
            if _git_apply_check_diff(src.text, diff):
                result["accepted"] += 1
            else:
                result["rejected"].append(f"{plan.function} L{plan.fork_line}-{plan.join_line}: diff does not apply")
    return result


def _git_apply_check_diff(original: str, diff: str) -> bool:
    # the diff names the file by its path relative to its git tree (or its own name): rename it
    lines = diff.splitlines(keepends=True)
    fixed = [
        "--- a/model.py\n" if line.startswith("--- a/") else "+++ b/model.py\n" if line.startswith("+++ b/") else line
        for line in lines
    ]
    return _git_apply_check(original, "".join(fixed))


def sweep_file(args: tuple[str, str]) -> dict:
    corpus, file = args
    path = Path(file)
    start = time.perf_counter()
    record: dict[str, Any] = {"corpus": corpus, "file": path.name}
    record["apply"] = sweep_apply(path)
    record["suggest"] = sweep_suggest(path)
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def outcome(status: str, reason: str) -> str:
    """One of the five outcomes the issue asks for, for one function or file-level verdict."""
    if status in ("edited", "edited over an existing overlap"):
        return "edited"
    if status in ("crash", "bad edit"):
        return "crash or bad edit"
    if status == "already overlapped" or reason.startswith("already overlapped") or "by the framework" in reason:
        return "already overlapped"
    if "not visible to msrewrite" in reason or "cannot see into" in reason:
        return "refused naming a callee"
    return "refused, other reason"


OUTCOMES = ("edited", "already overlapped", "refused naming a callee", "refused, other reason", "crash or bad edit")


def outcomes(records: list[dict], corpus: str) -> Counter:
    """Per function calling a shared expert, plus files whose shared expert is handed to the framework."""
    counts: Counter = Counter()
    for r in records:
        if r["corpus"] != corpus:
            continue
        status = r["apply"]["file_status"]
        if status and status[0] in ("already overlapped", "refused", "crash"):
            counts[outcome(status[0], status[1])] += 1
        for row in r["apply"]["functions"]:
            counts[outcome(row["status"], row.get("reason", ""))] += 1
    return counts


def table(records: list[dict], corpus: str) -> list[str]:
    mine = [r for r in records if r["corpus"] == corpus]
    rows = [f"## {corpus}: {len(mine)} model files"]
    counts = outcomes(records, corpus)
    rows.append("| " + " | ".join(OUTCOMES) + " |")
    rows.append("|" + "---|" * len(OUTCOMES))
    rows.append("| " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    rows.append("")
    statuses: Counter = Counter()
    reasons: Counter = Counter()
    files_with_shared = 0
    for r in mine:
        a = r["apply"]
        if a["file_status"] or a["functions"]:
            files_with_shared += 1
        if a["file_status"]:
            status, why = a["file_status"]
            statuses[f"file: {status}"] += 1
            reasons[(f"file: {status}", reason_group(why))] += 1
        for row in a["functions"]:
            statuses[row["status"]] += 1
            if row["status"] != "edited":
                reasons[(row["status"], reason_group(row.get("reason", "")))] += 1
    functions = sum(len(r["apply"]["functions"]) for r in mine)
    rows.append(
        f"apply --case moe-shared-expert: {files_with_shared} files mention a shared expert, "
        f"{functions} functions call one"
    )
    rows.append("| outcome | count |")
    rows.append("|---|---|")
    for status in (
        "edited",
        "edited over an existing overlap",
        "already overlapped",
        "file: already overlapped",
        "refused",
        "file: refused",
        "file: no target",
        "file: no MoE forward",
        "bad edit",
        "crash",
        "file: crash",
    ):
        if statuses[status]:
            rows.append(f"| {status} | {statuses[status]} |")
    if reasons:
        rows.append("")
        rows.append("| outcome | reason (grouped) | count |")
        rows.append("|---|---|---|")
        for (status, why), n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
            rows.append(f"| {status} | {why} | {n} |")
    s = [r["suggest"] for r in mine]
    total = sum(x["candidates"] for x in s)
    rows.append("")
    rows.append(
        f"suggest --static: {total} candidates in {sum(1 for x in s if x['candidates'])} files, "
        f"fork=join {sum(x['fork_is_join'] for x in s)}, hoisted out of control flow "
        f"{sum(x['hoisted_out_of_control_flow'] for x in s)}, accepted by apply --plan {sum(x['accepted'] for x in s)}"
        f"/{total}; branches the finder refused (listed, not printed): {sum(x['refused_by_finder'] for x in s)}; "
        f"crashes {sum(1 for x in s if x['crash'])}"
    )
    for x, r in zip(s, mine, strict=True):
        for line in x["rejected"][:3]:
            rows.append(f"  not accepted: {r['file']}: {line}")
        if x["crash"]:
            rows.append(f"  crash: {r['file']}: {x['crash']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", help="NAME=FOLDER or FOLDER of model files")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="worker processes (at most 2)")
    parser.add_argument("--json", type=Path, help="write per-file results here")
    parser.add_argument(
        "--source-path",
        type=Path,
        action="append",
        default=[],
        help="package sources to read callees from, as apply --source-path (repeat)",
    )
    args = parser.parse_args(argv)
    from msrewrite.analyze.packages import set_source_path
    from msrewrite.errors import MsrewriteError

    try:
        set_source_path(args.source_path)
    except MsrewriteError as exc:
        print(f"serving_sweep: error: {exc}", file=sys.stderr)
        return 2
    jobs = max(1, min(args.jobs, 2))
    work: list[tuple[str, str]] = []
    corpora: list[str] = []
    for spec in args.folders:
        name, _, folder = spec.rpartition("=")
        folder_path = Path(folder)
        name = name or folder_path.name
        if not folder_path.is_dir():
            print(f"serving_sweep: error: {folder}: not a folder", file=sys.stderr)
            return 2
        corpora.append(name)
        work += [(name, str(p)) for p in sorted(folder_path.glob("*.py")) if p.name != "__init__.py"]
    start = time.perf_counter()
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs, initializer=set_source_path, initargs=(args.source_path,)) as pool:
            records = list(pool.map(sweep_file, work, chunksize=4))
    else:
        records = [sweep_file(w) for w in work]
    for corpus in corpora:
        print("\n".join(table(records, corpus)))
        print()
    print(f"{len(work)} files in {time.perf_counter() - start:.0f} s with -j {jobs}")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    bad = [
        r
        for r in records
        if r["suggest"]["crash"]
        or r["suggest"]["rejected"]
        or (r["apply"]["file_status"] or ("",))[0] == "crash"
        or any(f["status"] in ("crash", "bad edit") for f in r["apply"]["functions"])
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
