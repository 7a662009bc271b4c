"""The one installed stand-in runtime, if any (set by ``install()``).

A module of its own so that the stand-in objects (streams.py) and the runtime that creates them
(core.py) both reach it without importing each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from msrewrite.runtime.core import StreamRuntime

_active: StreamRuntime | None = None


def active_runtime() -> StreamRuntime:
    if _active is None:
        raise RuntimeError("msrewrite.runtime is not installed: use `with msrewrite.runtime.install():`")
    return _active


def is_installed() -> bool:
    return _active is not None


def set_active(runtime: StreamRuntime | None) -> None:
    global _active
    _active = runtime
