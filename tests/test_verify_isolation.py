"""User code runs in a child process: a harness or model that hangs, exits, dies or prints never
makes `verify` pass silently, hang, or corrupt its --json output. Through the console entry point,
except the bad options at the end (no user code misbehaves there): run_main, forked from the fork
server, gives the same exit code and streams without a start-up."""

from __future__ import annotations

import json
import os

import pytest

from helpers import run_cli, run_main
from msrewrite.commands.apply import case_steps
from msrewrite.load import load
from msrewrite.plan import FlagSpec

pytestmark = pytest.mark.slow  # verify in subprocesses whose user code exits, dies or hangs

MODEL = """
import os
import sys

import torch
from torch import nn

BEHAVIOUR = os.environ.get("MSREWRITE_TEST_BEHAVIOUR", "")


def misbehave(where):
    if BEHAVIOUR == where + ":exit":
        sys.exit(0)
    if BEHAVIOUR == where + ":os_exit":
        os._exit(0)
    if BEHAVIOUR == where + ":kill":
        os.kill(os.getpid(), 9)
    if BEHAVIOUR == where + ":hang":
        while True:
            pass
    if BEHAVIOUR == where + ":print":
        print("chatty user code")
    if BEHAVIOUR == where + ":fork":
        os.fork()


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
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("isolation")
    original = folder / "block.py"
    original.write_text(MODEL)
    src = load(original)
    steps = case_steps(
        original,
        src.text,
        src.module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )
    edited = folder / "block_ms.py"
    edited.write_text(steps[-1].new)
    return edited, original


def verify(files, behaviour: str, *extra: str):
    edited, original = files
    env = {**os.environ, "MSREWRITE_TEST_BEHAVIOUR": behaviour}
    return run_cli("verify", str(edited), "--original", str(original), "--inputs", "0", *extra, env=env)


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("msrewrite: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "behaviour,reason",
    [
        ("make:exit", "sys.exit(0)"),
        ("make:os_exit", "exited with status 0"),
        ("make:kill", "killed by SIGKILL"),
    ],
)
def test_harness_that_exits_or_dies_is_bad_input(files, behaviour, reason):
    proc = verify(files, behaviour)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert "bad harness" in line and reason in line and "building the harness" in line, line


def test_harness_that_hangs_times_out(files):
    proc = verify(files, "make:hang", "--timeout", "3")
    assert proc.returncode == 2
    assert "timed out after 3 s while building the harness" in one_error_line(proc)


@pytest.mark.slow
@pytest.mark.parametrize(
    "behaviour,reason",
    [
        ("forward:os_exit", "exited with status 0 while running the model"),
        ("forward:kill", "killed by SIGKILL while running the model"),
        ("forward:exit", "sys.exit(0) while running the model"),
        ("forward:hang", "timed out after 3 s while running the model"),
    ],
)
def test_model_that_exits_dies_or_hangs_is_a_problem(files, behaviour, reason):
    proc = verify(files, behaviour, "--timeout", "3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("problem: user code ") and reason in lines[0], proc.stdout


def test_printing_harness_keeps_json_clean(files):
    proc = verify(files, "make:print", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["ok"] is True
    assert "chatty user code" in proc.stderr


@pytest.mark.parametrize("where", ["make", pytest.param("forward", marks=pytest.mark.slow)])
def test_forking_user_code_reports_once(files, where):
    proc = verify(files, f"{where}:fork", "--json", "--timeout", "120")
    assert proc.stdout.count('"ok"') == 1, proc.stdout


def verify_in_process(files, *extra: str):
    edited, original = files
    return run_main("verify", str(edited), "--original", str(original), "--inputs", "0", *extra)


def test_misspelled_flag_is_bad_input(files):
    proc = verify_in_process(files, "--flag", "env:ENABLE_MOE_SHARED_EXPERT_STREEM")
    assert proc.returncode == 2
    assert "no such flag" in one_error_line(proc)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_tolerance_is_bad_input(files, value):
    proc = verify_in_process(files, "--atol", value)
    assert proc.returncode == 2
    assert "--atol and --rtol must be finite" in one_error_line(proc)


def test_traced_suggest_survives_an_import_that_never_returns(tmp_path):
    """suggest imports the model file in a child: an import-time `while True` ends in one line."""
    from msrewrite.commands.suggest import run_suggest
    from msrewrite.errors import BadInput

    model = tmp_path / "spins.py"
    model.write_text("while True:\n    pass\n")
    with pytest.raises(BadInput, match=r"user code timed out after 2 s"):
        run_suggest(files=[model], input_shape="1,8,16", timeout=2)
