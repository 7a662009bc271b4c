"""A bound on the analysis of one function: steps counted by the passes, memory, and a clock.

Each pass that can grow with its input charges steps as it works: every syntax walk
(analyze/walk.py) and every buffer path analyze/effects.py builds. A function whose analysis
takes more than MAX_STEPS steps, or runs out of memory, is refused with a one-line reason that
names it; so is one still running after MAX_SECONDS (a backstop only: the step count is what
keeps the verdict the same from run to run). Outside `function_budget` charging costs a lookup.

Steps are the deterministic bound: the largest analysis in the suite and in the real recipe files
takes well under a tenth of MAX_STEPS (tests/test_analysis_bounds.py). What a run reads once and
shares (summaries, followed copy helpers) is paid for by the first function that needs it, in the
file's order, so the counts too are the same from run to run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

MAX_STEPS = 1_000_000
MAX_SECONDS = 60.0


class OverBudget(Exception):
    """The analysis of one function went past its budget; the message says which and why."""


class _Budget:
    __slots__ = ("function", "left", "steps", "deadline", "seconds")

    def __init__(self, function: str, steps: int, seconds: float) -> None:
        self.function, self.left, self.steps, self.seconds = function, steps, steps, seconds
        self.deadline = time.monotonic() + seconds


_current: _Budget | None = None


def charge(steps: int = 1) -> None:
    """Count `steps` against the function being analysed; OverBudget past its bound."""
    budget = _current
    if budget is None:
        return
    budget.left -= steps
    if budget.left < 0:
        raise OverBudget(
            f"msrewrite stopped analysing {budget.function} after {budget.steps:,} steps (the alias paths and "
            "calls it follows grow too large to bound): refused rather than guessed"
        )
    if time.monotonic() > budget.deadline:
        raise OverBudget(
            f"msrewrite stopped analysing {budget.function} after {budget.seconds:g} s: refused rather than guessed"
        )


@contextmanager
def function_budget(function: str, steps: int | None = None, seconds: float | None = None) -> Iterator[None]:
    """Analyse `function` within a budget. Inside another budget this one adds nothing: the outer
    function's budget counts the work."""
    global _current
    if _current is not None:
        yield
        return
    _current = _Budget(function, MAX_STEPS if steps is None else steps, MAX_SECONDS if seconds is None else seconds)
    try:
        yield
    except MemoryError:
        raise OverBudget(f"msrewrite ran out of memory analysing {function}: refused rather than guessed") from None
    finally:
        _current = None
