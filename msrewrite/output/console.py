"""The process's last line of defence: what the operating system refuses becomes one line.

A full disk, a file-size limit, a closed or full stdout, a folder where a file was expected, a
terminal encoding that cannot show a character: each ends as `msrewrite: error: ...` and exit 2.
A reader that goes away (`msrewrite ... | head -1`) ends the run quietly, as for any Unix filter.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Callable, NoReturn

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


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


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
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()  # type: ignore[assignment]
    try:
        try:
            app()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
        code = 0
    except UnicodeEncodeError as exc:
        char = exc.object[exc.start : exc.start + 1]
        code = _error(f"cannot print {char!r} in this terminal's encoding ({exc.encoding}); "
                      "set PYTHONIOENCODING=utf-8 or a UTF-8 locale")
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
