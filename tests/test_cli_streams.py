"""What the CLI's output streams do: a reader that goes away (broken pipe), progress lines only on
a terminal, coding cookies honoured in and out, and `-i` on a hard-linked file."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import EXAMPLES, ROOT

pytestmark = pytest.mark.slow  # the CLI in subprocesses: pipes, terminals, hard links

GOLDEN = ROOT / "golden" / "moe-shared-expert" / "eager"
CASE = ("--case", "moe-shared-expert")


def _cli(args, *, stdout=subprocess.PIPE, cwd=ROOT, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "msrewrite", *args], stdout=stdout, stderr=subprocess.PIPE, cwd=cwd, timeout=timeout
    )


def _broken_pipe(args, cwd=ROOT):
    """The command with its stdout a pipe whose reader has already gone."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        return _cli(args, stdout=write_fd, cwd=cwd)
    finally:
        os.close(write_fd)


def _quiet_about_it(stderr: bytes) -> None:
    text = stderr.decode()
    assert "Traceback" not in text and "error" not in text and "Broken pipe" not in text, text
    assert all(line.startswith("msrewrite: ") for line in text.splitlines()), text


# broken pipe ----------------------------------------------------------------------------------
PIPE_COMMANDS = {
    "apply-diff": ["apply", *CASE, str(EXAMPLES / "deepseek_moe.py")],
    "apply-nothing-to-do": ["apply", *CASE, str(GOLDEN / "deepseek_moe.py")],
    "suggest-table": ["suggest", "--static", str(EXAMPLES / "deepseek_moe.py")],
    "suggest-json": ["suggest", "--static", "--json", str(EXAMPLES / "deepseek_moe.py")],
    "suggest-none": ["suggest", "--static", str(EXAMPLES / "kvcache_offload.py")],
    "suggest-jobs": [
        "suggest",
        "--static",
        "-j",
        "2",
        str(EXAMPLES / "deepseek_moe.py"),
        str(EXAMPLES / "hunyuan_moe.py"),
        str(EXAMPLES / "guarded_moe.py"),
    ],
    "cases": ["cases"],
    "version": ["--version"],
    "bad-input": ["apply", "--case", "nosuch", str(EXAMPLES / "deepseek_moe.py")],
}


@pytest.mark.parametrize("name", sorted(PIPE_COMMANDS))
def test_broken_pipe_keeps_the_exit_code_and_says_nothing(name):
    """`| head -1`: the code is the one the run has with a reader, whenever the reader left."""
    args = PIPE_COMMANDS[name]
    normal = _cli(args)
    broken = _broken_pipe(args)
    assert broken.returncode == normal.returncode, broken.stderr.decode()
    assert "Traceback" not in broken.stderr.decode() and "Broken pipe" not in broken.stderr.decode()
    assert broken.stderr == normal.stderr  # the same notes (or one error line): nothing added


def test_broken_pipe_after_the_files_are_written(tmp_path):
    """`-o DIR | head -1`: the series is written, its paths are the dropped output, exit 0."""
    result = _broken_pipe(["apply", *CASE, "-o", str(tmp_path / "patches"), str(EXAMPLES / "deepseek_moe.py")])
    assert result.returncode == 0
    _quiet_about_it(result.stderr)
    assert len(list((tmp_path / "patches").glob("0001-*.patch"))) == 1


def test_broken_pipe_on_stderr_is_quiet_too():
    """`2>&1 | head -1` on a run whose notes go to stderr."""
    args = ["apply", *CASE, str(EXAMPLES / "deepseek_moe.py")]
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "msrewrite", *args], stdout=write_fd, stderr=write_fd, cwd=ROOT, timeout=120
        )
    finally:
        os.close(write_fd)
    assert result.returncode == 0


@pytest.mark.slow
def test_broken_pipe_verify_json():
    args = [
        "verify",
        str(GOLDEN / "deepseek_moe.py"),
        "--original",
        str(EXAMPLES / "deepseek_moe.py"),
        "--json",
        "--inputs",
        "0",
        "--no-train",
        "--schedules",
        "early",
    ]
    result = _broken_pipe(args)
    assert result.returncode == 0
    _quiet_about_it(result.stderr)


# progress -------------------------------------------------------------------------------------
def _on_a_terminal(args, cwd=ROOT) -> tuple[int, str, bytes]:
    """(exit code, what the terminal showed on stderr, stdout bytes) with stderr a pty and stdout a pipe."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "msrewrite", *args], stdout=subprocess.PIPE, stderr=slave, cwd=cwd
        )
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the pty closed: the child is done with it
                break
            if not chunk:
                break
            seen += chunk
        out = proc.stdout.read()
        proc.wait(timeout=300)
    finally:
        os.close(master)
    return proc.returncode, seen.decode().replace("\r\n", "\n"), out


JOBS = [
    "suggest",
    "--static",
    "-j",
    "2",
    str(EXAMPLES / "deepseek_moe.py"),
    str(EXAMPLES / "hunyuan_moe.py"),
    str(EXAMPLES / "guarded_moe.py"),
]


def test_jobs_sweep_shows_progress_on_a_terminal_only():
    code, shown, _ = _on_a_terminal(JOBS)
    assert code == 0
    assert "msrewrite: [1] static: 1/2 more files read (hunyuan_moe.py)" in shown, shown
    assert "msrewrite: [2] static: 2/2 more files read (guarded_moe.py)" in shown, shown
    code, shown, _ = _on_a_terminal([*JOBS, "--quiet"])
    assert code == 0 and "static:" not in shown, shown
    piped = _cli(JOBS)
    assert piped.returncode == 0 and b"static:" not in piped.stderr


def test_progress_printer_follows_isatty_and_quiet(monkeypatch, capsys):
    from msrewrite.output import progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    say = progress.stage_printer(False, "verify: ")
    say("flag off")
    assert capsys.readouterr().err == "msrewrite: [1] verify: flag off\n"
    assert progress.stage_printer(True) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert progress.stage_printer(False) is None


VERIFY = [
    "verify",
    str(GOLDEN / "deepseek_moe.py"),
    "--original",
    str(EXAMPLES / "deepseek_moe.py"),
    "--inputs",
    "0",
    "--no-train",
    "--schedules",
    "early,late",
]


@pytest.mark.slow
def test_verify_shows_its_stages_on_a_terminal_and_json_stays_clean():
    code, shown, out = _on_a_terminal([*VERIFY, "--json"])
    assert code == 0, shown
    stages = [line for line in shown.splitlines() if line.startswith("msrewrite: [")]
    assert stages[:5] == [
        "msrewrite: [1] verify: building the model",
        "msrewrite: [2] verify: original",
        "msrewrite: [3] verify: flag off",
        "msrewrite: [4] verify: flag on, sanitized",
        "msrewrite: [5] verify: flag on, late schedule",
    ], shown
    assert json.loads(out)["ok"] is True  # stdout is the JSON and nothing else
    code, shown, out = _on_a_terminal([*VERIFY, "--quiet"])
    assert code == 0 and "msrewrite: [" not in shown, shown
    piped = _cli(VERIFY)
    assert piped.returncode == 0 and b"msrewrite: [" not in piped.stderr


# coding cookies -------------------------------------------------------------------------------
def _latin1_model(folder: Path) -> Path:
    """deepseek_moe.py with a latin-1 cookie and latin-1 bytes inside the edited function."""
    text = (EXAMPLES / "deepseek_moe.py").read_bytes()
    text = text.replace(
        b"        residuals = hidden_states\n", b"        residuals = hidden_states  # r\xe9sidu, na\xefve\n", 1
    )
    path = folder / "model.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\n" + text)
    subprocess.run(["git", "init", "-q", str(folder)], check=True)
    return path


def test_latin1_file_is_edited_and_diffed_in_its_own_encoding(tmp_path):
    path = _latin1_model(tmp_path)
    before = path.read_bytes()
    diff = _cli(["apply", *CASE, str(path)], cwd=tmp_path)
    assert diff.returncode == 0, diff.stderr
    assert b"r\xe9sidu, na\xefve" in diff.stdout  # the context line, as the file's bytes
    (tmp_path / "m.diff").write_bytes(diff.stdout)
    check = subprocess.run(["git", "apply", "--check", "m.diff"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    in_place = _cli(["apply", *CASE, "-i", str(path)], cwd=tmp_path)
    assert in_place.returncode == 0, in_place.stderr
    edited = path.read_bytes()
    assert edited.startswith(b"# -*- coding: latin-1 -*-\n") and b"r\xe9sidu, na\xefve" in edited
    compile(edited, str(path), "exec")  # Python reads it back in latin-1
    path.write_bytes(before)
    subprocess.run(["git", "apply", "m.diff"], cwd=tmp_path, check=True)
    assert path.read_bytes() == edited  # the diff makes exactly the in-place edit


def test_latin1_file_verifies(tmp_path):
    path = _latin1_model(tmp_path)
    result = _cli(["apply", *CASE, "--verify", str(path)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr.decode()[-2000:]


# hard links -----------------------------------------------------------------------------------
def test_in_place_keeps_hard_links(tmp_path):
    path = tmp_path / "model.py"
    shutil.copy(EXAMPLES / "deepseek_moe.py", path)
    other = tmp_path / "other_name.py"
    os.link(path, other)
    path.chmod(0o640)
    inode = path.stat().st_ino
    result = _cli(["apply", *CASE, "-i", str(path)])
    assert result.returncode == 0, result.stderr
    assert path.stat().st_ino == inode and path.stat().st_nlink == 2
    assert other.read_bytes() == path.read_bytes() != (EXAMPLES / "deepseek_moe.py").read_bytes()
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py", "other_name.py"]  # no temp file left
    assert b"_ms_side_stream" in path.read_bytes()


def test_in_place_hard_link_changed_since_read_is_refused(tmp_path):
    """The content check runs before the in-place write too: a save in between wins."""
    from msrewrite.errors import BadInput
    from msrewrite.load import file_digest
    from msrewrite.output.inplace import write_in_place

    path = tmp_path / "model.py"
    path.write_bytes(b"x = 1\n")
    os.link(path, tmp_path / "link.py")
    digest = file_digest(b"x = 1\n")
    path.write_bytes(b"x = 2\n")  # saved in an editor
    with pytest.raises(BadInput, match="changed on disk"):
        write_in_place(path, b"x = 3\n", digest)
    assert path.read_bytes() == b"x = 2\n" == (tmp_path / "link.py").read_bytes()


def test_in_place_hard_link_write_failure_restores_the_file(tmp_path, monkeypatch):
    from msrewrite.errors import BadInput
    from msrewrite.load import file_digest
    from msrewrite.output import inplace

    path = tmp_path / "model.py"
    path.write_bytes(b"x = 1\n")
    os.link(path, tmp_path / "link.py")

    def full(_fd, _offset, _length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(inplace.os, "posix_fallocate", full)
    with pytest.raises(BadInput, match="No space left on device.*the file is unchanged"):
        inplace.write_in_place(path, b"x = 1  # longer\n", file_digest(b"x = 1\n"))
    assert path.read_bytes() == b"x = 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.py", "model.py"]


def test_in_place_hard_link_signal_waits_for_the_write(tmp_path):
    """SIGTERM during the in-place write is held until the write is done, then reported."""
    import signal

    from msrewrite.load import file_digest
    from msrewrite.output import inplace

    path = tmp_path / "model.py"
    path.write_bytes(b"x = 1\n")
    os.link(path, tmp_path / "link.py")
    original_fallocate = os.posix_fallocate

    def signal_during(fd, offset, length):
        os.kill(os.getpid(), signal.SIGTERM)  # held: the write goes on
        return original_fallocate(fd, offset, length)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inplace.os, "posix_fallocate", signal_during)
        with pytest.raises(inplace.Interrupted, match="SIGTERM after .* was rewritten in place"):
            inplace.write_in_place(path, b"x = 1  # longer\n", file_digest(b"x = 1\n"))
    assert path.read_bytes() == b"x = 1  # longer\n" == (tmp_path / "link.py").read_bytes()
