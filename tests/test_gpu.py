"""On a CUDA machine: PyTorch's CUDA sanitizer agrees with msrewrite on the golden CUDA edits and
their mutants (bench/gpu_sanitizer.py). Skipped without CUDA; the no-GPU exits are checked always."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import ROOT, load_bench


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device")
def test_cuda_sanitizer_agrees_with_msrewrite():
    sanitizer = load_bench("gpu_sanitizer")
    rows = sanitizer.compare(
        ["deepseek_moe"], ["golden", "fork-wait-removed", "join-removed", "lifetime-guard-removed"], gpu=True
    )
    verdicts = {r["mutant"]: (r["msrewrite"], r["pytorch"]) for r in rows}
    assert verdicts["golden"] == ("clean", "clean"), verdicts
    for mutant in ("fork-wait-removed", "join-removed"):
        assert "race" in verdicts[mutant][0].split(","), verdicts
        assert verdicts[mutant][1] == "race", verdicts
    assert "lifetime" in verdicts["lifetime-guard-removed"][0].split(","), verdicts


@pytest.mark.slow  # starts a process
@pytest.mark.skipif(_has_cuda(), reason="checks the no-GPU exit")
@pytest.mark.parametrize("script", ["gpu_overlap.py", "gpu_sanitizer.py"])
def test_gpu_benches_exit_cleanly_without_a_gpu(script):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU" in result.stdout and "Traceback" not in result.stderr
