"""Global module hooks verify registers to watch a run, marked so that edits do not count them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def observer(hook: Callable[..., Any]) -> Callable[..., None]:
    """`hook` as a global module hook that only watches: marked `_ms_observer`, so a phased edit's
    _ms_runs_as_inlined does not count it as something an inlined forward would skip (it changes no
    argument or result, and runs in every call of the model's own code anyway)."""

    def watch(*args: Any, **kwargs: Any) -> None:
        hook(*args, **kwargs)  # returns None: the call's arguments and result stay as they are

    watch._ms_observer = True  # type: ignore[attr-defined]
    return watch
