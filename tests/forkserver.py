"""The test suite's fork server: `python -m msrewrite` without a Python start-up and an
`import torch` per call.

helpers.run_forked starts this script once per test process (per xdist worker) as a fresh
interpreter, so its state owes nothing to the test process (which may have run torch on CPU, with
OpenMP's pool and gloo's threads: a fork of that can hang). It imports torch and msrewrite, only
imports, no tensor op, so no OpenMP pool exists, and checks that it is one thread (numpy's
OpenBLAS starts a worker thread at import unless OPENBLAS_NUM_THREADS=1, set here before torch
imports numpy). Then, per request, it forks a child that is what `python -m msrewrite ARGS`
would be: its own argv, cwd, environment and sys.path[0], stdin /dev/null, stdout and stderr on
files the test process reads back, the cyclic collector off (cli.entry), SystemExit turned into
the exit status as the interpreter does, atexit handlers and a final flush (exit 120 when the
flush fails). The child forks its own user-code child exactly as the real CLI does.

Protocol, on the pipes this process got as stdin (requests) and stdout (replies): each message is
an 8-byte little-endian length and a pickle. A request is a dict (argv, cwd, env, stdout, stderr);
the replies are ("pid", pid) as soon as the child exists, then ("status", returncode as
subprocess reports it: -N for a signal). EOF on the request pipe ends the server.
"""

from __future__ import annotations

import os
import pickle
import sys

# Before torch imports numpy: OpenBLAS's pool would be a second thread in the server.
os.environ["OPENBLAS_NUM_THREADS"] = "1"


def _read(fd: int) -> object | None:
    head = _read_exactly(fd, 8)
    if head is None:
        return None
    body = _read_exactly(fd, int.from_bytes(head, "little"))
    return None if body is None else pickle.loads(body)


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _send(fd: int, message: object) -> None:
    data = pickle.dumps(message)
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data) :]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _prepare() -> None:
    """Import what a CLI run imports (torch and the commands), then check the server is one thread."""
    import torch  # noqa: F401

    import msrewrite.cli
    import msrewrite.commands.apply
    import msrewrite.commands.bench
    import msrewrite.commands.suggest
    import msrewrite.commands.verify
    import msrewrite.harness
    import msrewrite.verify  # noqa: F401

    del os.environ["OPENBLAS_NUM_THREADS"]  # requests bring their own environment anyway
    if _threads() != 1:
        raise SystemExit(f"forkserver: {_threads()} threads after import torch: fork is not safe")


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter makes of an uncaught SystemExit (Python/pythonrun.c)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _child(request: dict, main_path: str) -> None:
    """Become `python -m msrewrite ARGV` in request's cwd and environment; never returns."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [main_path, *request["argv"]]
        sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
        from msrewrite.cli import entry

        try:
            entry()
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # noqa: BLE001 - as the interpreter: traceback on stderr, exit 1
            sys.excepthook(*sys.exc_info())
            code = 1
        import atexit
        import threading

        threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads, as at exit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                code = 120  # the interpreter's status when flushing stdout at exit fails
    finally:
        os._exit(code)


def _serve_loop(requests: int, replies: int) -> None:
    import msrewrite

    main_path = os.path.join(os.path.dirname(msrewrite.__file__), "__main__.py")
    _send(replies, ("ready", _threads()))
    while True:
        request = _read(requests)
        if request is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(requests)
            os.close(replies)
            _child(request, main_path)  # type: ignore[arg-type]
        _send(replies, ("pid", pid))
        _, status = os.waitpid(pid, 0)
        _send(replies, ("status", os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    requests_fd, replies_fd = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # nothing the server prints can corrupt the replies
    _prepare()
    _serve_loop(requests_fd, replies_fd)
