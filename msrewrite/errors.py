"""Errors that end a command with a one-line message and a documented exit code."""

EXIT_OK = 0
EXIT_NOTHING_TO_DO = 1  # apply: no target or already applied; verify: problems found
EXIT_BAD_INPUT = 2


class MsrewriteError(Exception):
    """A user-facing failure: printed as one line on stderr, never as a traceback."""

    exit_code = EXIT_BAD_INPUT


class BadInput(MsrewriteError):
    exit_code = EXIT_BAD_INPUT


class NothingToDo(MsrewriteError):
    exit_code = EXIT_NOTHING_TO_DO
