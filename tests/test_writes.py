"""Writes you can trust, and diffs git accepts for any line ending.

`-i` never loses a change (a save while it runs, a second run, a signal), follows symlinks and
keeps the mode; `-o` never leaves a partial series; every line separator Python, git and libcst
disagree on gives a diff that `git apply` takes and the same bytes as `-i`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import EXAMPLES, ROOT, main_in_process

pytestmark = pytest.mark.slow  # the CLI in subprocesses: races and signals during -i

CASE = ("apply", "--case", "moe-shared-expert")


def run_in_process(args, cwd: Path):
    """The CLI's main() in this process (helpers.main_in_process), args as one list."""
    return main_in_process(*args, cwd=cwd)


GOOD = (EXAMPLES / "deepseek_moe.py").read_text()
GOLDEN = (ROOT / "golden" / "moe-shared-expert" / "eager" / "deepseek_moe.py").read_text()


def _model(folder: Path, text: str = GOOD, name: str = "moe.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(text.encode("utf-8"))
    return path


def _one_error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("msrewrite: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


# -i --------------------------------------------------------------------------------------------
def test_in_place_edits_a_symlinks_target_and_keeps_the_mode(tmp_path):
    real = _model(tmp_path / "real")
    real.chmod(0o640)
    if os.geteuid() == 0:
        os.chown(real, 65534, 65534)
    link = tmp_path / "link.py"
    link.symlink_to(real)
    result = run_in_process([*CASE, "-i", str(link)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == GOLDEN
    assert oct(real.stat().st_mode & 0o7777) == oct(0o640)
    if os.geteuid() == 0:
        assert (real.stat().st_uid, real.stat().st_gid) == (65534, 65534)
    assert sorted(p.name for p in real.parent.iterdir()) == ["moe.py"]


def test_a_save_while_in_place_runs_is_never_overwritten(tmp_path, monkeypatch):
    path = _model(tmp_path)
    saved = GOOD.replace("route every token", "route each token")
    from msrewrite.commands import apply as apply_command

    real_steps = apply_command.case_steps

    def steps_then_user_saves(*args, **kwargs):
        steps = real_steps(*args, **kwargs)
        path.write_text(saved)  # the user saves in an editor while msrewrite works
        return steps

    monkeypatch.setattr(apply_command, "case_steps", steps_then_user_saves)
    result = run_in_process([*CASE, "-i", str(path)], tmp_path)
    assert result.returncode == 2
    assert "changed on disk since msrewrite read it" in _one_error(result.stderr)
    assert path.read_text() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe.py"]


def test_a_second_run_waits_for_the_lock_then_refuses_the_changed_file(tmp_path):
    """Another -i holds the folder lock and changes the file: this run waits, then fails cleanly."""
    path = _model(tmp_path)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "msrewrite", *CASE, "-i", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        notes = []
        while not any("DeepseekMoE.forward:" in line for line in notes):  # printed right before the write
            line = proc.stderr.readline()
            assert line, notes
            notes.append(line)
        path.write_text(GOLDEN)  # the run holding the lock writes its edit
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "changed on disk" in _one_error(err)
    assert path.read_text() == GOLDEN
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe.py"]


def test_concurrent_in_place_runs_lose_no_edit(tmp_path):
    path = _model(tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "msrewrite", *CASE, "-i", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes.count(0) == 1, results
    for code, err in results:
        if code:
            assert code in (1, 2)
            assert "already applied" in _one_error(err) or "changed on disk" in _one_error(err)
    assert path.read_text() == GOLDEN
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe.py"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_before_the_rename_leaves_no_temp_file(tmp_path, monkeypatch, signum):
    path = _model(tmp_path)
    from msrewrite.output import inplace

    def replace_after_signal(src, dst):
        os.kill(os.getpid(), signum)
        os.replace(src, dst)  # never reached: the handler raises first

    monkeypatch.setattr(inplace.os, "replace", replace_after_signal)
    result = run_in_process([*CASE, "-i", str(path)], tmp_path)
    assert result.returncode == 2
    assert f"interrupted by {signal.Signals(signum).name}" in _one_error(result.stderr)
    assert path.read_text() == GOOD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe.py"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


# -o --------------------------------------------------------------------------------------------
def test_output_force_replaces_the_old_series(tmp_path):
    path = _model(tmp_path / "src")
    out = tmp_path / "patches"
    out.mkdir()
    (out / "0001-old.patch").write_text("old\n")
    (out / "0002-old.patch").write_text("old\n")
    (out / "notes.txt").write_text("mine\n")
    result = run_in_process([*CASE, "-o", str(out), "--force", str(path)], tmp_path)
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == ["0001-moe-shared-expert-overlap-DeepseekMoE-on-side-stream.patch", "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patches", "src"]


def test_output_failure_halfway_leaves_nothing(tmp_path, monkeypatch):
    path = _model(tmp_path / "src")
    out = tmp_path / "new" / "patches"
    from msrewrite.output import patch

    def fail(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(patch.os, "fsync", fail)
    result = run_in_process(
        ["apply", "--case", "indexer-prolog", "-o", str(out), str(shutil.copy(EXAMPLES / "indexer_prolog.py", path))],
        tmp_path,
    )
    assert result.returncode == 2
    assert "No space left on device" in _one_error(result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# --verify before writing ----------------------------------------------------------------------
def test_in_place_verify_failure_writes_nothing(tmp_path, monkeypatch):
    path = _model(tmp_path)
    from msrewrite.commands import verify as verify_command

    monkeypatch.setattr(verify_command, "verify_edit", lambda *_a, **_k: 1)
    result = run_in_process([*CASE, "-i", "--verify", str(path)], tmp_path)
    assert result.returncode == 1
    assert path.read_text() == GOOD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe.py"]


# line endings ----------------------------------------------------------------------------------
SEPARATORS = {
    "form-feed": lambda t: t.replace(
        "        residuals = hidden_states\n", "        residuals = hidden_states\n\f\n", 1
    ),
    "form-feed-in-line": lambda t: t.replace("# route every token", "# route\f every token", 1),
    "nel": lambda t: t.replace("# route every token", "# route\x85 every token", 1),
    "line-separator": lambda t: t.replace("# route every token", "# route\u2028 every token", 1),
    "paragraph-separator": lambda t: t.replace("# shared experts see", "# shared\u2029 experts see", 1),
    "vertical-tab": lambda t: t.replace("# route every token", "# route\v every token", 1),
    "file-separator": lambda t: t.replace("# route every token", "# route\x1c every token", 1),
    "cr-only": lambda t: t.replace("\n", "\r"),
    "crlf": lambda t: t.replace("\n", "\r\n"),
    "one-crlf-line": lambda t: t.replace(
        "        residuals = hidden_states\n", "        residuals = hidden_states\r\n", 1
    ),
    "lone-cr-between-lines": lambda t: t.replace(
        "        residuals = hidden_states\n", "        residuals = hidden_states\r        unused = 0\n", 1
    ),
    "bom": lambda t: "\ufeff" + t,
    "bom-crlf": lambda t: "\ufeff" + t.replace("\n", "\r\n"),
    "no-final-newline": lambda t: t.rstrip("\n"),
}


@pytest.mark.parametrize("name", sorted(SEPARATORS))
def test_diff_applies_with_git_and_matches_in_place(git_repo, name):
    text = SEPARATORS[name](GOOD)
    path = git_repo / "pkg" / "moe.py"
    path.parent.mkdir()
    path.write_bytes(text.encode("utf-8"))
    diff = run_in_process([*CASE, str(path)], git_repo)
    assert diff.returncode == 0, diff.stderr
    assert "--- a/pkg/moe.py" in diff.stdout
    (git_repo / "edit.diff").write_bytes(diff.stdout.encode("utf-8"))
    git = subprocess.run(["git", "apply", "edit.diff"], cwd=git_repo, capture_output=True, text=True)
    assert git.returncode == 0, git.stderr
    by_git = path.read_bytes()
    path.write_bytes(text.encode("utf-8"))
    in_place = run_in_process([*CASE, "-i", str(path)], git_repo)
    assert in_place.returncode == 0, in_place.stderr
    assert path.read_bytes() == by_git
    assert by_git.startswith(b"\xef\xbb\xbf") == text.startswith("\ufeff")
    if name in ("crlf", "bom-crlf"):  # every line, the emitted ones too, ends in CRLF
        assert by_git.count(b"\n") == by_git.count(b"\r\n")
    if name == "cr-only":
        assert b"\n" not in by_git
    compile(by_git.decode("utf-8").lstrip("\ufeff"), "moe.py", "exec")


def test_diff_paths_keep_their_folder_in_a_repository_git_calls_dubious(git_repo):
    path = _model(git_repo / "models")
    os.chown(git_repo / ".git", 65534, 65534) if os.geteuid() == 0 else pytest.skip("needs root to chown")
    os.chown(git_repo, 65534, 65534)
    check = subprocess.run(["git", "-C", str(git_repo), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    assert "dubious ownership" in check.stderr
    diff = run_in_process([*CASE, str(path)], git_repo)
    assert diff.returncode == 0, diff.stderr
    assert "--- a/models/moe.py" in diff.stdout


# stdout ----------------------------------------------------------------------------------------
def test_a_broken_pipe_exits_quietly(tmp_path):
    path = _model(tmp_path)
    result = subprocess.run(
        f"{sys.executable} -m msrewrite apply --case moe-shared-expert {path} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout == "--- a/moe.py\n"
    assert "Error" not in result.stderr and "error" not in result.stderr, result.stderr


def test_the_diff_is_utf8_bytes_on_an_ascii_terminal(tmp_path):
    path = _model(tmp_path, GOOD.replace("# route every token", "# route every token → experts", 1))
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    result = subprocess.run(
        [sys.executable, "-m", "msrewrite", *CASE, str(path)], capture_output=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "→ experts".encode() in result.stdout


def test_diff_paths_keep_their_folder_when_git_cannot_answer(git_repo, monkeypatch):
    path = _model(git_repo / "models")
    with open(git_repo / ".git" / "config", "a") as config:
        config.write("[broken\n")  # git now fails on every command in this repository
    diff = run_in_process([*CASE, str(path)], git_repo)
    assert diff.returncode == 0, diff.stderr
    assert "--- a/models/moe.py" in diff.stdout
    monkeypatch.setenv("PATH", "/nonexistent")  # no git at all
    diff = run_in_process([*CASE, str(path)], git_repo)
    assert diff.returncode == 0, diff.stderr
    assert "--- a/models/moe.py" in diff.stdout


def test_a_signal_while_writing_patches_leaves_nothing(tmp_path, monkeypatch):
    path = _model(tmp_path / "src")
    from msrewrite.output import patch

    monkeypatch.setattr(patch.os, "fsync", lambda _fd: os.kill(os.getpid(), signal.SIGTERM))
    result = run_in_process([*CASE, "-o", str(tmp_path / "out" / "patches"), str(path)], tmp_path)
    assert result.returncode == 2
    assert "interrupted by SIGTERM" in _one_error(result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_what_the_harness_prints_stays_out_of_the_diff(tmp_path):
    path = _model(tmp_path)
    harness = tmp_path / "noisy.py"
    harness.write_text(
        f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nfrom deepseek_moe import make as _make\n\n"
        "def make():\n    print('hello from make')\n    return _make()\n"
    )
    result = run_in_process([*CASE, "--verify", "--harness", f"{harness}:make", str(path)], tmp_path)
    assert result.returncode == 0, result.stderr
    # the harness runs in verify's child process: its prints never reach the diff on stdout
    assert result.stdout.startswith("--- a/moe.py\n") and "hello" not in result.stdout
