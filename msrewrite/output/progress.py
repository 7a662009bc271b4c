"""Progress lines on stderr for the slow commands (traced suggest, -j sweeps, verify runs).

Only a person watching a terminal sees them: nothing is printed when stderr is not a TTY (a pipe,
a file, CI) or with --quiet, so scripts and `--json` consumers never get them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def stage_printer(quiet: bool, prefix: str = "") -> Callable[[str], None] | None:
    """A function printing `msrewrite: [N] <prefix><stage>` lines, or None when nothing is shown."""
    try:
        shown = not quiet and sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):  # no stderr, or a closed one
        shown = False
    if not shown:
        return None
    step = 0

    def say(stage: str) -> None:
        nonlocal step
        step += 1
        print(f"msrewrite: [{step}] {prefix}{stage}", file=sys.stderr, flush=True)

    return say
