"""The fork server (tests/forkserver.py) gives what a real `python -m msrewrite` subprocess gives.

helpers.run_main sends every command that runs user code to helpers.run_forked; this file runs a
handful of commands both ways, through run_cli (a true subprocess) and run_forked, and compares
exit code, stdout and stderr byte for byte: an edit proved, a refusal, bad input, a verify that
finds a race, a usage error, a harness relative to the working directory, an environment flag.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from helpers import EXAMPLES, ROOT, fork_server_threads, run_cli, run_forked

pytestmark = pytest.mark.slow  # each row is two whole CLI runs, one in a fresh interpreter

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "handwritten_moe.py"


def _folder(tmp_path: Path) -> Path:
    shutil.copy(EXAMPLES / "deepseek_moe.py", tmp_path / "model.py")
    broken = FIXTURE.read_text().replace("JOIN = True", "JOIN = False")
    assert broken != FIXTURE.read_text()
    (tmp_path / "racy.py").write_text(broken)
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "h.py").write_text(
        "import os\nimport torch\nfrom model import DeepseekMoE\n\n"
        "def make():\n"
        "    torch.manual_seed(int(os.environ['SEED_FOR_TEST']))\n"
        "    return DeepseekMoE().eval(), (torch.randn(2, 8, 64),)\n"
    )
    return tmp_path


ROWS = {
    "apply-verify-ok": (["apply", "--case", "moe-shared-expert", "model.py", "--verify"], 0),
    "apply-refused": (["apply", "--case", "moe-shared-expert", "empty.py", "--verify"], 1),
    "verify-race": (["verify", "racy.py"], 1),
    "verify-json-race": (["verify", "racy.py", "--json"], 1),
    "bad-input": (["verify", "missing.py"], 2),
    "usage-error": (["verify", "model.py", "--timeout", "soon"], 2),
    "harness-in-cwd": (
        ["apply", "--case", "moe-shared-expert", "model.py", "--verify", "--harness", "h.py:make"],
        None,
    ),
    "suggest-traced": (["suggest", "model.py"], 0),
}


@pytest.mark.parametrize("row", ROWS)
def test_forked_run_equals_a_real_subprocess(tmp_path, row):
    args, code = ROWS[row]
    folder = _folder(tmp_path)
    env = {**os.environ, "SEED_FOR_TEST": "3"}
    real = run_cli(*args, cwd=folder, env=env)
    forked = run_forked(*args, cwd=folder, env=env)
    if code is not None:
        assert real.returncode == code, real.stderr
    assert forked.returncode == real.returncode, (forked.stderr, real.stderr)
    assert forked.stdout == real.stdout
    assert forked.stderr == real.stderr
    assert real.stdout or real.stderr  # a row that says nothing compares nothing


def test_the_environment_is_the_requests_own(tmp_path):
    """A harness that reads an unset variable fails the same way in both, and passes in both with it."""
    folder = _folder(tmp_path)
    args = ["apply", "--case", "moe-shared-expert", "model.py", "--verify", "--harness", "h.py:make"]
    env = {k: v for k, v in os.environ.items() if k != "SEED_FOR_TEST"}
    real, forked = run_cli(*args, cwd=folder, env=env), run_forked(*args, cwd=folder, env=env)
    assert real.returncode == forked.returncode != 0
    assert "SEED_FOR_TEST" in real.stderr + real.stdout
    assert (forked.stdout, forked.stderr) == (real.stdout, real.stderr)
    ok = run_forked(*args, cwd=folder, env={**env, "SEED_FOR_TEST": "1"})
    assert ok.returncode == 0, ok.stderr


def test_the_server_is_one_thread_after_importing_torch():
    """The condition for forking it at all; numpy's OpenBLAS pool would be a second thread."""
    assert fork_server_threads() == 1


def test_a_missing_working_directory_raises_as_subprocess_does(tmp_path):
    with pytest.raises(FileNotFoundError):
        run_cli("cases", cwd=tmp_path / "gone")
    with pytest.raises(FileNotFoundError):
        run_forked("cases", cwd=tmp_path / "gone")


def test_the_child_exits_by_the_interpreters_rules():
    """A clean run is 0 with its output flushed."""
    real, forked = run_cli("cases", cwd=ROOT), run_forked("cases", cwd=ROOT)
    assert forked.returncode == real.returncode == 0
    assert forked.stdout == real.stdout and forked.stderr == real.stderr
