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


class Refused(NothingToDo):
    """No safe edit, with what lets each refused function through, found by the analysis
    (`remedies`: (function, --assume-pure names to add, whether --protect clone is needed)):
    apply turns it into the command line to run."""

    def __init__(self, message: str, remedies: tuple[tuple[str, tuple[str, ...], bool], ...] = ()) -> None:
        super().__init__(message)
        self.remedies = remedies


class EmptyFile(BadInput):
    """An empty (or whitespace-only) source file: valid Python with nothing to do. Commands that
    edit or analyze source report it as NothingToDo; a plan or harness file that is empty stays
    bad input."""

    def as_nothing_to_do(self) -> NothingToDo:
        return NothingToDo(f"{self}, nothing to do")
