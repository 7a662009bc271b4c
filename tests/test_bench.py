"""msrewrite bench: without a device one line and exit 2; --dry-run end to end on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "msrewrite", *args], capture_output=True, text=True, timeout=300)


def test_without_a_device_says_so_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = run_cli("bench", str(EXAMPLES / "deepseek_moe.py"), "--case", "moe-shared-expert")
    assert out.returncode == 2
    assert out.stderr.startswith("msrewrite: error: no CUDA or NPU device") and out.stderr.count("\n") == 1
    assert out.stdout == ""


def test_dry_run_variants_end_to_end_prints_the_ranking_and_commands():
    out = run_cli("bench", str(EXAMPLES / "deepseek_moe.py"), "--case", "moe-shared-expert", "--variants",
                  "--dry-run", "--iters", "3", "--warmup", "0")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "CPU dry run" in text and "flag off (original path)" in text
    for label in ("fork as early as possible (default)", "side work at its original place (late)",
                  "overlap up to 8 tokens", "overlap up to 512 tokens"):
        assert label in text
    assert "msrewrite apply --case moe-shared-expert --mode cuda --max-tokens 64 " in text
    assert "no apply option makes this arrangement" in text  # the late schedule is a finding only
    winner = [line for line in text.splitlines() if line.startswith("winner: msrewrite apply --case ")]
    assert len(winner) == 1
    assert max(len(line) for line in text.splitlines() if not line.startswith(("  ", "winner"))) <= 80


def test_dry_run_core_presets_and_json():
    out = run_cli("bench", str(EXAMPLES / "longcat_layer.py"), "--case", "attn-moe-limit-core", "--mode", "eager",
                  "--variants", "--dry-run", "--iters", "3", "--warmup", "0", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    labels = [v["label"] for v in data["variants"]]
    assert {"core limits a2", "core limits a3-even"} <= set(labels)
    # the a3 preset is the default edit: timed once, and said so
    default = next(v for v in data["variants"] if v["label"].startswith("fork as early"))
    assert "same code as: core limits a3" in default["notes"]
    for v in data["variants"]:
        lo, hi = v["ci95_ms"]
        assert lo <= v["median_ms"] <= hi
    assert data["winner"].startswith("msrewrite apply --case attn-moe-limit-core --mode eager")


def test_median_interval_brackets_the_median():
    from msrewrite.profile.bench import Timing

    t = Timing([5.0, 1.0, 3.0, 2.0, 4.0, 9.0, 6.0, 7.0, 8.0, 10.0, 11.0])
    lo, hi = t.interval
    assert t.median == 6.0 and lo <= 6.0 <= hi and (lo, hi) != (1.0, 11.0)
