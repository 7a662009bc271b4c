"""PyTorch's CUDA sanitizer next to msrewrite's verdict, on the CUDA golden edits and mutants of them.

    python bench/gpu_sanitizer.py                  # needs CUDA; exits 0 with a message without
    python bench/gpu_sanitizer.py --msrewrite-only # msrewrite's column only (runs on CPU)

For every golden/moe-shared-expert/cuda/<example>.py (the CUDA-mode edit of examples/<example>.py,
which defines make()) and a few mutants of it (fork wait removed, join removed, lifetime guard
removed): msrewrite's verdict is msrewrite.verify.verify_files(edited, original=example) on CPU;
PyTorch's is a flag-on run of make()'s model on the GPU in a subprocess with
TORCH_CUDA_SANITIZER=1 (CSAN reports unsynchronized accesses between streams as errors).
Expected: both flag the race mutants; only msrewrite flags the lifetime mutant (CSAN does not
track record_stream lifetimes); the golden edits are clean under both.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import ROOT

GOLDEN = ROOT / "golden" / "moe-shared-expert" / "cuda"
EXAMPLES = ROOT / "examples"
FLAG_ENV = "ENABLE_MOE_SHARED_EXPERT_STREAM"


def drop_line(pattern: str):
    def mutate(text: str) -> str:
        lines = text.splitlines(keepends=True)
        hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        if len(hits) != 1:
            raise ValueError(f"mutant pattern {pattern!r} matches {len(hits)} lines")
        del lines[hits[0]]
        return "".join(lines)

    return mutate


MUTANTS = {
    "golden": lambda text: text,
    "fork-wait-removed": drop_line(r"shared_expert_stream\.wait_stream\(current_stream\)"),
    "join-removed": drop_line(r"current_stream\.wait_stream\(shared_expert_stream\)"),
    "lifetime-guard-removed": drop_line(r"_ms_record_stream\(current_stream, "),
}
# What each verdict should be (None: no expectation, reported only).
EXPECT_PYTORCH = {
    "golden": "clean",
    "fork-wait-removed": "race",
    "join-removed": "race",
    "lifetime-guard-removed": None,
}
EXPECT_MSREWRITE = {
    "golden": "clean",
    "fork-wait-removed": "race",
    "join-removed": "race",
    "lifetime-guard-removed": "lifetime",
}

CHILD = r"""
import importlib.util, os, sys, torch
os.environ[{flag!r}] = "1"
spec = importlib.util.spec_from_file_location("edited_under_csan", {path!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
model, inputs = mod.make()
model = model.cuda()
inputs = tuple(i.cuda() if isinstance(i, torch.Tensor) else i for i in inputs)
with torch.no_grad():
    for _ in range(3):
        out = model(*inputs)
        out = out * 2  # a main-stream consumer of the joined output
torch.cuda.synchronize()
print("CSAN-CLEAN")
"""


def examples() -> list[str]:
    return sorted(p.stem for p in GOLDEN.glob("*.py"))


def msrewrite_verdict(edited: Path, example: str) -> str:
    from msrewrite.verify import verify_files

    result = verify_files(edited, original=EXAMPLES / f"{example}.py")
    if result.ok and not result.findings:
        return "clean"
    kinds = sorted({f.kind for f in result.findings})
    if kinds:
        return ",".join("race" if k.startswith("race") else k for k in kinds)
    return "problem: " + (result.problems[0][:80] if result.problems else "?")


def pytorch_verdict(edited: Path, timeout: int = 180) -> str:
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    code = CHILD.format(flag=FLAG_ENV, path=str(edited))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out ({timeout}s)"
    if proc.returncode == 0 and "CSAN-CLEAN" in proc.stdout:
        return "clean"
    text = proc.stdout + proc.stderr
    if "CSAN detected a possible data race" in text or "data race" in text.lower():
        return "race"
    last = [line for line in text.strip().splitlines() if line.strip()]
    return "error: " + (last[-1][:100] if last else f"exit {proc.returncode}")


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def compare(example_names: list[str], mutant_names: list[str], gpu: bool) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="msrewrite-csan-") as folder:
        for example in example_names:
            golden = (GOLDEN / f"{example}.py").read_text(encoding="utf-8")
            for name in mutant_names:
                try:
                    text = MUTANTS[name](golden)
                except ValueError as exc:
                    rows.append({"example": example, "mutant": name, "msrewrite": f"n/a ({exc})", "pytorch": "n/a"})
                    continue
                edited = Path(folder) / name / f"{example}.py"
                edited.parent.mkdir(parents=True, exist_ok=True)
                edited.write_text(text, encoding="utf-8")
                row: dict[str, Any] = {
                    "example": example,
                    "mutant": name,
                    "msrewrite": msrewrite_verdict(edited, example),
                    "pytorch": pytorch_verdict(edited) if gpu else "skipped (no GPU)",
                }
                row["agree_expected"] = _expected(row)
                rows.append(row)
    return rows


def _expected(row: dict) -> bool:
    ok = EXPECT_MSREWRITE[row["mutant"]] in row["msrewrite"].split(",")
    want = EXPECT_PYTORCH[row["mutant"]]
    if want is not None and not row["pytorch"].startswith("skipped"):
        ok = ok and row["pytorch"] == want
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--msrewrite-only", action="store_true", help="skip the GPU column (runs on CPU)")
    parser.add_argument("--examples", nargs="*", default=None, help=f"default: {' '.join(examples())}")
    parser.add_argument("--mutants", nargs="*", default=list(MUTANTS), choices=list(MUTANTS))
    args = parser.parse_args(argv)
    gpu = has_cuda()
    if not gpu and not args.msrewrite_only:
        print(
            "gpu_sanitizer: no CUDA GPU here; skipped (PyTorch's CUDA sanitizer needs one). "
            "--msrewrite-only prints msrewrite's verdicts alone."
        )
        return 0
    rows = compare(args.examples or examples(), args.mutants, gpu and not args.msrewrite_only)
    print(f"{'example':<16}{'edit':<24}{'msrewrite verify':<28}{'PyTorch CSAN':<28}as expected")
    for r in rows:
        print(
            f"{r['example']:<16}{r['mutant']:<24}{r['msrewrite']:<28}{r['pytorch']:<28}{'yes' if r.get('agree_expected') else 'NO'}"
        )
    return 0 if all(r.get("agree_expected") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
