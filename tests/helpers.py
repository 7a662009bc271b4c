"""What tests share besides fixtures: paths, the CLI in a subprocess or in this process, file
imports, a git work tree.

Tests import these with `from helpers import ...` (pytest puts tests/ on sys.path, since tests/
is not a package); fixtures stay in conftest.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BENCH = ROOT / "bench"


def load_file(path, name: str) -> ModuleType:
    """Import a model file under a name of our choosing (a fresh module each time)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as the module bench_<name>. It is registered in sys.modules before it runs
    (its dataclasses and its worker processes look it up by name), and bench/ goes on sys.path
    for the scripts' `from _common import ...`, as when one runs as `python bench/<name>.py`."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import bench/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_regen() -> ModuleType:
    """golden/regen.py as a module (golden_examples(), the regeneration functions)."""
    return load_file(ROOT / "golden" / "regen.py", "golden_regen")


def free_port() -> int:
    """A free TCP port on loopback, for a gloo process group of this test's own processes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "msrewrite", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def runs_user_code(args: tuple[str, ...] | list[str]) -> bool:
    """Whether `msrewrite ARGS` forks a child that runs user code: verify, apply --verify, a traced
    suggest, bench. The CLI forks it from a fresh process; a test process that has already run
    torch on CPU (OpenMP's thread pool, gloo) cannot fork safely: the child can hang on a lock."""
    command = args[0] if args else ""
    return command in ("verify", "bench") or "--verify" in args or (command == "suggest" and "--static" not in args)


def run_main(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI's main() in this process, with its own argv, cwd, stdout and stderr: run_cli's
    result (exit code, both streams) without a Python start-up per call. For tests that are not
    about the process boundary; what only a process has (signals, pipes, an environment, exit on
    a closed stdout, a start-up budget) stays with run_cli. A command that runs user code
    (runs_user_code) goes to run_cli: its fork must start from a fresh process."""
    if runs_user_code(args):
        return run_cli(*args, cwd=cwd)
    return main_in_process(*args, cwd=cwd)


def main_in_process(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """run_main without the routing: main() in this process whatever the command. test_bad_input
    runs its rows this way: a row that forks runs a harness that fails before torch computes."""
    from msrewrite.cli import main

    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    stderr = io.StringIO()
    saved = sys.argv, sys.stdout, sys.stderr, os.getcwd()
    sys.argv, sys.stdout, sys.stderr = ["msrewrite", *args], stdout, stderr
    if cwd is not None:
        os.chdir(cwd)
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, sys.stdout, sys.stderr = saved[:3]
        os.chdir(saved[3])
    stdout.flush()
    return subprocess.CompletedProcess(
        ["msrewrite", *args], code, stdout.buffer.getvalue().decode("utf-8", "replace"), stderr.getvalue()
    )


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under folder -> sha256 of its bytes (folders "dir", links "link:" and their target,
    anything else, a FIFO say, "special")."""
    out = {}
    for p in sorted(folder.rglob("*")):
        info = p.lstat()
        if stat.S_ISLNK(info.st_mode):
            out[p.relative_to(folder).as_posix()] = "link:" + os.readlink(p)
        elif stat.S_ISDIR(info.st_mode):
            out[p.relative_to(folder).as_posix()] = "dir"
        elif stat.S_ISREG(info.st_mode):
            out[p.relative_to(folder).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[p.relative_to(folder).as_posix()] = "special"
    return out


class GitRepo(type(Path())):  # type: ignore[misc]  # Path's concrete class is chosen at run time
    """A Path to a work tree, with .git(*args) running git inside it."""

    def git(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=self, capture_output=True, text=True, check=True)
