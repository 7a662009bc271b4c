"""The seed target on real serving code: SGLang 0.5.6's `Qwen2MoeSparseMoeBlock._forward_deepep`.

In SGLang 0.5.23 `_forward_deepep` already overlaps its shared expert (msrewrite reports that); in
0.5.6 it is the original shape (`shared_output = None; if hidden_states.shape[0] > 0: ...
shared_output = self._forward_shared_experts(h) ... final_hidden_states.add_(shared_output)`). This
script makes, on that real file, read as text with the whole 0.5.6 wheel on `--source-path`:

  1. moe-shared-expert, with the options a reviewer gives (printed with the trust boundary);
  2. moe-shared-expert-phased (two patches: the inlining refactor, then the phases);
  3. moe-shared-expert with `--flag sglang:SGLANG_NPU_USE_MULTI_STREAM --gate capture` (issue 13):
     it must reuse the model's `self.alt_stream` and read SGLang's flag and capture predicate.

Every edit must compile and `git apply --check` against the file it patches (the phased series
patch by patch). It downloads nothing; get the wheel once with

    pip download --no-deps sglang==0.5.6 -d /tmp/sg056
    unzip -q -o /tmp/sg056/sglang-0.5.6-py3-none-any.whl 'sglang/*' -d /tmp/sg056/src

and run `python bench/serving_seed.py /tmp/sg056/src`. Exit 1 when an edit is refused, does not
compile or does not apply, or (3) does not reuse `self.alt_stream`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET = "Qwen2MoeSparseMoeBlock._forward_deepep"
# What a reviewer vouches for, and why (SGLang 0.5.6 sources): the shared expert's and the
# router's linear layers dispatch to `self.quant_method.apply` (unquantized: a GEMM) and
# SiluAndMul to a fused kernel; none writes its input. `--protect clone` gives the side stream its
# own copy of hidden_states, which the routed experts (DeepEP, not seen into) may write, as SGLang
# does itself (`hidden_states.clone()` in forward_normal_dual_stream).
REVIEWER = (
    "--protect",
    "clone",
    "--assume-pure",
    "MergedColumnParallelLinear",
    "--assume-pure",
    "RowParallelLinear",
    "--assume-pure",
    "SiluAndMul",
    "--assume-pure",
    "ReplicatedLinear",
)
EDITS = {
    "moe-shared-expert": ("--case", "moe-shared-expert", *REVIEWER),
    "moe-shared-expert-phased": ("--case", "moe-shared-expert-phased", *REVIEWER),
    "moe-shared-expert, sglang flag + capture gate": (
        "--case",
        "moe-shared-expert",
        "--flag",
        "sglang:SGLANG_NPU_USE_MULTI_STREAM",
        "--flag-default",
        "off",
        "--gate",
        "capture",
        *REVIEWER,
    ),
}


def _msrewrite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "msrewrite", *args], capture_output=True, text=True, cwd=ROOT)


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def run(source: Path) -> int:
    model = source / "sglang" / "srt" / "models" / "qwen2_moe.py"
    if not model.is_file():
        print(f"serving_seed: error: {model}: not found (unpack the whole 0.5.6 wheel there)", file=sys.stderr)
        return 2
    failed = 0
    for name, options in EDITS.items():
        print(f"## {name}")
        print("options: " + " ".join(options))
        with tempfile.TemporaryDirectory() as tmp:
            repo = Path(tmp)
            _git(repo, "init", "-q")
            (repo / "qwen2_moe.py").write_text(model.read_text(encoding="utf-8"), encoding="utf-8")
            out = repo / "patches"
            done = _msrewrite(
                "apply",
                str(repo / "qwen2_moe.py"),
                "--target",
                TARGET,
                "--source-path",
                str(source),
                "-o",
                str(out),
                *options,
            )
            for line in done.stderr.splitlines():
                print("  " + line)
            if done.returncode != 0:
                failed += 1
                print("  FAILED: refused\n")
                continue
            patches = sorted(out.glob("0*.patch"))
            ok = True
            for patch in patches:  # each patch applies to the file as the previous one left it
                check = _git(repo, "apply", "--check", str(patch))
                applied = check.returncode == 0 and _git(repo, "apply", str(patch)).returncode == 0
                try:
                    compile((repo / "qwen2_moe.py").read_text(encoding="utf-8"), "qwen2_moe.py", "exec")
                    compiles = True
                except SyntaxError:
                    compiles = False
                print(
                    f"  {patch.name}: git apply --check {'ok' if applied else 'FAILS'}, "
                    f"compiles {'ok' if compiles else 'NO'}"
                )
                ok = ok and applied and compiles
            edited = (repo / "qwen2_moe.py").read_text(encoding="utf-8")
            deepep = edited[edited.index("def _forward_deepep") : edited.index("def _forward_router_experts")]
            if "gate" in name:
                reuses = (
                    "shared_expert_stream = self.alt_stream if self.enable_sglang_npu_use_multi_stream and get_is_capture_mode() else None"
                    in deepep
                )
                print(f"  reuses self.alt_stream, SGLang's flag and capture predicate: {'yes' if reuses else 'NO'}")
                ok = ok and reuses
            if "phased" in name:
                phases = deepep.count("re-enters the side stream after")
                print(
                    f"  phases after the fork: {phases} "
                    f"({', '.join(l.split('after ')[-1].rstrip('.') for l in deepep.splitlines() if 're-enters the side stream after' in l)})"
                )
                ok = ok and phases >= 1 and "self._forward_shared_experts(" not in deepep
            failed += not ok
            print("  " + ("ok" if ok else "FAILED") + "\n")
    print(f"{len(EDITS) - failed} of {len(EDITS)} edits made, compiled and applied")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="the unpacked SGLang 0.5.6 wheel (the folder holding sglang/)")
    return run(parser.parse_args(argv).source)


if __name__ == "__main__":
    sys.exit(main())
