"""What tests share besides fixtures: paths, the CLI in a subprocess or in this process, file
imports, a git work tree.

Tests import these with `from helpers import ...` (pytest puts tests/ on sys.path, since tests/
is not a package); fixtures stay in conftest.py.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import io
import locale
import os
import pickle
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
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


class _ForkServer:
    """The client of tests/forkserver.py: one server per test process, started on first use (a
    fresh interpreter, so nothing this process ran with torch reaches it), ended at exit."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()  # one request at a time (tests may call from a thread pool)
        self.threads_at_start = 0
        self.buffer = b""

    def _start(self) -> subprocess.Popen:
        # Compiled as "<frozen ...>": the sanitizer (msrewrite/runtime/frames.py) attributes an op
        # to the innermost frame outside torch, msrewrite and the standard library, and in a real
        # `python -m msrewrite` the only frames below msrewrite's are <frozen runpy>'s. The
        # server's frames stay below every forked child's, so they must read as that machinery,
        # not as user code (a free after the model returned would name forkserver.py's line).
        import py_compile

        folder = tempfile.mkdtemp(prefix="msrewrite-forkserver-")
        atexit.register(shutil.rmtree, folder, True)
        code = os.path.join(folder, "forkserver.pyc")
        py_compile.compile(
            str(Path(__file__).with_name("forkserver.py")),
            code,
            dfile="<frozen msrewrite tests/forkserver.py>",
            doraise=True,
        )
        process = subprocess.Popen(
            [sys.executable, code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.buffer = b""
        kind, threads = self._read(process)
        assert kind == "ready", kind
        self.threads_at_start = threads
        atexit.register(self.close)
        return process

    def _read(self, process: subprocess.Popen, timeout: float | None = None):
        """The next reply (bytes past it stay in self.buffer for the next call)."""
        assert process.stdout is not None
        fd = process.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self.buffer) < 8 or len(self.buffer) < 8 + int.from_bytes(self.buffer[:8], "little"):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the fork server ended (exit {process.wait()})")
            self.buffer += chunk
        size = int.from_bytes(self.buffer[:8], "little")
        message, self.buffer = pickle.loads(self.buffer[8 : 8 + size]), self.buffer[8 + size :]
        return message

    def run(
        self, args: tuple[str, ...], cwd: Path | None, env: dict | None, timeout: float
    ) -> subprocess.CompletedProcess:
        workdir = os.path.abspath(cwd if cwd is not None else os.getcwd())
        if not os.path.isdir(workdir):  # as subprocess.run would
            raise FileNotFoundError(f"no such directory: {workdir!r}")
        with self.lock, tempfile.TemporaryDirectory(prefix="msrewrite-forked-") as tmp:
            if self.process is None or self.process.poll() is not None:
                self.process = self._start()
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {
                "argv": list(args),
                "cwd": workdir,
                "env": dict(os.environ if env is None else env),
                "stdout": out,
                "stderr": err,
            }
            data = pickle.dumps(request)
            assert self.process.stdin is not None
            self.process.stdin.write(len(data).to_bytes(8, "little") + data)
            self.process.stdin.flush()
            kind, pid = self._read(self.process)
            assert kind == "pid", kind
            try:
                kind, code = self._read(self.process, timeout)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._read(self.process)
                raise subprocess.TimeoutExpired(["msrewrite", *args], timeout) from None
            assert kind == "status", kind
            with open(out, "rb") as fo, open(err, "rb") as fe:
                stdout, stderr = fo.read(), fe.read()
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "msrewrite", *args],
            code,
            _decode(stdout),
            _decode(stderr),
        )

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(timeout=30)


def _decode(data: bytes) -> str:
    """Bytes as subprocess.run(text=True) gives them: the locale's encoding, universal newlines."""
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


_FORK_SERVER = _ForkServer()


def run_forked(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """run_cli's result (exit code, both streams) from a child of the fork server
    (tests/forkserver.py): the same `python -m msrewrite ARGS` with this argv, cwd and environment,
    but forked from a process that has torch and msrewrite imported already, so about 4-5 s
    cheaper per call. For commands that run user code; tests about the process boundary itself
    (signals, pipes, stdin, start-up cost) use run_cli."""
    return _FORK_SERVER.run(args, cwd, env, timeout=300)


def fork_server_threads() -> int:
    """How many threads the fork server had after importing torch and msrewrite (it refuses to
    serve with more than one)."""
    if _FORK_SERVER.process is None:
        run_forked("--version")
    return _FORK_SERVER.threads_at_start


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
    (runs_user_code) goes to run_forked: its fork must start from a process that has not run torch."""
    if runs_user_code(args):
        return run_forked(*args, cwd=cwd)
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


class UnitLayerViolation(BaseException):
    """A test outside the `slow` layer started a process or ran a model through verify.
    (BaseException: an `except Exception` in the code under test must not swallow it.)"""


@contextlib.contextmanager
def unit_layer_guard(found: list[str]):
    """While active, starting a process (subprocess, multiprocessing, os.fork / posix_spawn /
    system, a fork-server request) or running a model through verify (msrewrite.verify's
    reference build, which every verify_files run reaches, and its as-written check) raises
    UnitLayerViolation and is recorded in `found`: the unit layer (`-m "not slow"`) must stay
    a few seconds of in-process analysis and editing. conftest.py wraps every test without the
    `slow` marker in it."""
    import _posixsubprocess

    import msrewrite.verify

    def refuse(what: str):
        def refused(*_args, **_kwargs):
            found.append(what)
            raise UnitLayerViolation(f"{what} in a test of the unit layer: mark the test `slow` (docs/testing.md)")

        return refused

    patches = [
        (subprocess, "_fork_exec", "a subprocess"),
        (_posixsubprocess, "fork_exec", "a subprocess"),
        (os, "fork", "os.fork"),
        (os, "forkpty", "os.forkpty"),
        (os, "posix_spawn", "os.posix_spawn"),
        (os, "posix_spawnp", "os.posix_spawnp"),
        (os, "system", "os.system"),
        (_FORK_SERVER, "run", "a fork-server run"),
        (msrewrite.verify, "_build_reference", "a verify run of the model"),
        (msrewrite.verify, "_verify_as_written", "a verify run of the model"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, what in patches:
        setattr(owner, name, refuse(what))
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
