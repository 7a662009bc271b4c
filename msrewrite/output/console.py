"""The process's last line of defence: what the operating system refuses becomes one line.

A full disk, a file-size limit, a closed or full stdout, a folder where a file was expected, a
terminal encoding that cannot show a character: each ends as `msrewrite: error: ...` and exit 2.
A reader that goes away (`msrewrite ... | head -1`) is not an error: the rest of that stream's
output is dropped, nothing is said, and the run ends with the exit code it would have had anyway,
so the code never depends on when the reader left.

stderr carries only notes and errors, so a stderr that is closed (`2>&-`), full or gone is
ignored: its lines are dropped, never sent to stdout, and the exit code is the one the run has
with a working stderr. A standard descriptor the shell closed is pointed at /dev/null first
thing, so a file or pipe opened later (the pipe to verify's child, say) cannot land on it.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from msrewrite.errors import EXIT_BAD_INPUT


def _error(message: str) -> int:
    try:
        sys.stderr.write(f"msrewrite: error: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return EXIT_BAD_INPUT


def _os_error(exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EBADF and exc.filename is None:
        return reason
    if exc.filename is not None:
        return f"{exc.filename}: {reason}"
    return f"cannot write the output ({reason})"


def _quiet_stdout(fd: int | None = None) -> None:
    """After a broken pipe: point the stream's descriptor (stdout's by default) at /dev/null, so
    what is still written, and the interpreter's final flush, go nowhere, silently."""
    try:
        target = sys.stdout.fileno() if fd is None else fd
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, target)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


class _PipeGuard:
    """A stdout or stderr (text, or its binary buffer) that drops its output once the reader has
    gone: the first broken pipe points the descriptor at /dev/null and the write is retried there,
    so the command finishes and exits as it would have."""

    def __init__(self, stream, fd: int) -> None:
        self._stream, self._fd = stream, fd

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            _quiet_stdout(self._fd)
            try:
                return call(*args)
            except OSError:  # a stream that cannot be redirected: the output is lost either way
                return None

    def write(self, data):
        return self._guarded(self._stream.write, data)

    def writelines(self, lines):
        return self._guarded(self._stream.writelines, lines)

    def flush(self):
        return self._guarded(self._stream.flush)

    @property
    def buffer(self):
        return _PipeGuard(self._stream.buffer, self._fd)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _StderrGuard(_PipeGuard):
    """stderr: any failure to write (closed, full disk, I/O error, a reader gone) drops the line
    and points fd 2 at /dev/null, so notes never decide the exit code."""

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except (OSError, ValueError):
            _quiet_stdout(self._fd)
            try:
                return call(*args)
            except (OSError, ValueError):
                return None

    @property
    def buffer(self):
        return _StderrGuard(self._stream.buffer, self._fd)


def reserve_standard_fds() -> None:
    """Point each of fds 0, 1 and 2 the shell closed at /dev/null, before anything opens a file:
    otherwise the next file or pipe opened takes the lowest free number, and what is written to
    "stderr" (ours, or a child's that inherits it) lands in that pipe or file. sys.stdout stays
    None where fd 1 was closed (printing still fails in one line, _ClosedStdout); a closed stderr
    becomes a stream into /dev/null, since print(file=None) would write to stdout."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                devnull = os.open(os.devnull, os.O_RDWR)
            except OSError:
                continue
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
    if sys.stderr is None:
        try:
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        except OSError:
            pass


def _guard_pipes() -> None:
    for name, fd, guard in (("stdout", 1, _PipeGuard), ("stderr", 2, _StderrGuard)):
        stream = getattr(sys, name)
        try:
            owns_fd = stream.fileno() == fd
        except (OSError, ValueError, AttributeError):  # an in-memory stream (tests): nothing to guard
            owns_fd = False
        if owns_fd and not isinstance(stream, _PipeGuard):
            setattr(sys, name, guard(stream, fd))


class _ClosedStdout:
    """Stands in for a stdout the shell closed (`>&-`): only a run that prints fails, in one line."""

    encoding = "utf-8"

    def write(self, _text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def run_guarded(app: Callable[[], object]) -> NoReturn:
    reserve_standard_fds()
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()  # type: ignore[assignment]  # not a TextIO: only what print and we use
    _guard_pipes()
    try:
        try:
            app()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush()
    except BrokenPipeError:  # a write the guards did not see (a stream replaced since): still quiet
        _quiet_stdout()
        _quiet_stdout(2)
        code = 0
    except UnicodeEncodeError as exc:
        char = exc.object[exc.start : exc.start + 1]
        code = _error(
            f"cannot print {char!r} in this terminal's encoding ({exc.encoding}); "
            "set PYTHONIOENCODING=utf-8 or a UTF-8 locale"
        )
    except RecursionError:
        code = _error("the input is nested too deeply for msrewrite (Python's recursion limit)")
    except OSError as exc:
        _quiet_stdout()
        code = _error(_os_error(exc))
    except ValueError as exc:  # a write to a closed stdout
        if "closed file" not in str(exc):
            raise
        code = _error("standard output is closed")
    sys.exit(code)
