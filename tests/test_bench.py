"""msrewrite bench: without a device one line and exit 2; --dry-run end to end on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli

pytestmark = pytest.mark.slow  # bench --dry-run end to end in subprocesses

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_without_a_device_says_so_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = run_cli("bench", str(EXAMPLES / "deepseek_moe.py"), "--case", "moe-shared-expert")
    assert out.returncode == 2
    assert out.stderr.startswith("msrewrite: error: no CUDA or NPU device") and out.stderr.count("\n") == 1
    assert out.stdout == ""


def test_dry_run_variants_end_to_end_prints_the_ranking_and_commands():
    out = run_cli(
        "bench",
        str(EXAMPLES / "deepseek_moe.py"),
        "--case",
        "moe-shared-expert",
        "--variants",
        "--dry-run",
        "--iters",
        "3",
        "--warmup",
        "0",
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "CPU dry run" in text and "flag off (original path)" in text
    for label in (
        "fork as early as possible (default)",
        "side work at its original place (late)",
        "overlap up to 8 tokens",
        "overlap up to 512 tokens",
    ):
        assert label in text
    assert "msrewrite apply --case moe-shared-expert --mode cuda --max-tokens 64 " in text
    assert "no apply option makes this arrangement" in text  # the late schedule is a finding only
    winner = [line for line in text.splitlines() if line.startswith("winner: msrewrite apply --case ")]
    assert len(winner) == 1
    assert max(len(line) for line in text.splitlines() if not line.startswith(("  ", "winner"))) <= 80


def test_dry_run_core_presets_and_json():
    out = run_cli(
        "bench",
        str(EXAMPLES / "longcat_layer.py"),
        "--case",
        "attn-moe-limit-core",
        "--mode",
        "eager",
        "--variants",
        "--dry-run",
        "--iters",
        "3",
        "--warmup",
        "0",
        "--json",
    )
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


# user code runs in a child process ---------------------------------------------------------------
MISBEHAVING = """
import os
import sys

import torch
from torch import nn

BEHAVIOUR = os.environ.get("MSREWRITE_TEST_BEHAVIOUR", "")


def misbehave(where):
    if BEHAVIOUR == where + ":exit":
        sys.exit(3)
    if BEHAVIOUR == where + ":os_exit":
        os._exit(0)
    if BEHAVIOUR == where + ":kill":
        os.kill(os.getpid(), 9)
    if BEHAVIOUR == where + ":hang":
        while True:
            pass
    if BEHAVIOUR == where + ":raise":
        raise RuntimeError("broken model")
    if BEHAVIOUR == where + ":print":
        print("chatty user code")
    if BEHAVIOUR == where + ":flag-on-raise" and os.environ.get("ENABLE_MOE_SHARED_EXPERT_STREAM") == "1":
        raise RuntimeError("broken only with the flag on")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        misbehave("forward")
        s = self.shared_experts(x)
        h = self.gate(x)
        return h + s


def make():
    misbehave("make")
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "block.py"
    path.write_text(MISBEHAVING)
    return path


def bench_run(block: Path, behaviour: str, *extra: str) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "MSREWRITE_TEST_BEHAVIOUR": behaviour}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "msrewrite",
            "bench",
            str(block),
            "--case",
            "moe-shared-expert",
            "--dry-run",
            "--iters",
            "3",
            "--warmup",
            "0",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("msrewrite: error: "), proc.stderr
    assert proc.stdout == ""
    return lines[0]


@pytest.mark.parametrize(
    "behaviour, reason",
    [
        ("make:exit", "bad harness: user code called sys.exit(3) while building the harness"),
        ("make:os_exit", "bad harness: user code exited with status 0 while building the harness"),
        ("make:kill", "bad harness: user code killed by SIGKILL while building the harness"),
        ("make:raise", "block.py:make failed: RuntimeError: broken model"),  # the harness builder's own line
    ],
)
def test_a_harness_that_exits_dies_or_raises_is_one_line_of_bad_input(block, behaviour, reason):
    proc = bench_run(block, behaviour)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert reason in line, line


def test_a_harness_that_hangs_is_killed_after_the_timeout(block):
    proc = bench_run(block, "make:hang", "--timeout", "5")
    assert proc.returncode == 2
    assert "timed out after 5 s while building the harness" in one_error_line(proc)


@pytest.mark.parametrize(
    "behaviour, reason",
    [
        ("forward:exit", "called sys.exit(3) while timing the model, flag off"),
        ("forward:kill", "killed by SIGKILL while timing the model, flag off"),
        (
            "forward:flag-on-raise",
            "crashed while timing the model, fork as early as possible (default): "
            "RuntimeError: broken only with the flag on",
        ),
    ],
)
def test_a_model_that_fails_while_timed_is_one_line_naming_the_arrangement(block, behaviour, reason):
    proc = bench_run(block, behaviour)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert line.startswith("msrewrite: error: bench: user code ") and reason in line, line


def test_user_code_printing_keeps_json_clean(block):
    proc = bench_run(block, "make:print", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["device"] == "cpu"
    assert "chatty user code" in proc.stderr


def test_the_device_is_looked_for_in_the_child_only():
    """torch.cuda.is_available() is not safe to fork after: the parent never calls it."""
    import ast

    source = (Path(__file__).resolve().parents[1] / "msrewrite" / "commands" / "bench.py").read_text()
    tree = ast.parse(source)
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_bench")
    child = next(n for n in ast.walk(run) if isinstance(n, ast.FunctionDef) and n.name == "measure")

    def called(node, skip=None):
        names, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n is skip:
                continue
            if isinstance(n, ast.Call):
                names.add(getattr(n.func, "attr", getattr(n.func, "id", None)))
            todo.extend(ast.iter_child_nodes(n))
        return names

    in_child, in_parent = called(child), called(run, skip=child)
    assert {"device_kind", "run_variants"} <= in_child
    assert "run_in_child" in in_parent and not in_parent & {"device_kind", "run_variants", "is_available"}
