"""Operator registrations a model file makes when verify loads it again in the same process.

verify loads the original file and the edited file, and the edited file afresh for every run.
A file that registers an operator at import time registers it again on each load, and torch
answers in two ways, both wrong for us:
- `torch.library.custom_op` destroys the earlier registration and makes a new one. The module
  loaded before still holds the old operator handle; calling it reads freed memory (a segfault
  or, worse, the wrong kernel).
- `Library.define` refuses a name already defined, so the second load fails to import, and
  `Library.impl` overrides the kernel with a warning the user did not cause.

While verify loads a file, both keep the first registration when the later one is the same
(same function source, same schema text) and refuse one that differs with a one-line error,
so every loaded module calls an operator that is alive and does what its file says.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from msrewrite.errors import BadInput

# Libraries that hold a definition made while loading: kept alive, or their finalizer would
# remove the operator that a later load skipped defining.
_KEPT_LIBRARIES: list[Any] = []
_DEFINED: dict[tuple[str, str], str] = {}  # (namespace, op name) -> schema text, from our loads
_IMPLEMENTED: dict[tuple[str, str, str], Callable[..., Any]] = {}  # (namespace, op, key) -> kernel


def _source(fn: Callable[..., Any]) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def _same_function(kept: Callable[..., Any], new: Callable[..., Any]) -> bool:
    kept_source, new_source = _source(kept), _source(new)
    if kept_source is not None and new_source is not None:
        return kept_source == new_source
    kept_code, new_code = getattr(kept, "__code__", None), getattr(new, "__code__", None)
    if kept_code is None or new_code is None:
        return False
    return (kept_code.co_code, kept_code.co_consts, kept_code.co_names) == (
        new_code.co_code,
        new_code.co_consts,
        new_code.co_names,
    )


def _redefined(qualname: str) -> BadInput:
    return BadInput(
        f"operator {qualname} is registered twice with different code (the original and the edited"
        " file differ there); verify loads both in one process and cannot keep both"
    )


@contextmanager
def kept_registrations() -> Iterator[None]:
    """While a model file runs its module code: reuse the operators an earlier load registered."""
    import torch
    import torch._library.custom_ops as custom_ops

    real_custom_op = custom_ops.custom_op
    real_define = torch.library.Library.define
    real_impl = torch.library.Library.impl

    def custom_op(name: str, fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
        def register(body: Callable[..., Any]) -> Any:
            kept = custom_ops.OPDEFS.get(name)
            if kept is None:
                return real_custom_op(name, body, **options)
            if not _same_function(kept._init_fn, body):
                raise _redefined(name)
            return kept

        return register if fn is None else register(fn)

    def define(self: Any, schema: str, *args: Any, **kwargs: Any) -> Any:
        op_name = schema.split("(", 1)[0].strip()
        kept = _DEFINED.get((self.ns, op_name))
        if kept is not None:
            if kept != schema.strip():
                raise _redefined(f"{self.ns}::{op_name}")
            return op_name
        result = real_define(self, schema, *args, **kwargs)
        _DEFINED[(self.ns, op_name)] = schema.strip()
        _KEPT_LIBRARIES.append(self)
        return result

    def impl(self: Any, op_name: Any, fn: Callable[..., Any], dispatch_key: str = "", **kwargs: Any) -> Any:
        key = (self.ns, str(op_name).split("::")[-1], dispatch_key or self.dispatch_key)
        kept = _IMPLEMENTED.get(key)
        if kept is not None:
            if not _same_function(kept, fn):
                raise _redefined(f"{self.ns}::{key[1]}")
            return None
        result = real_impl(self, op_name, fn, dispatch_key, **kwargs)
        _IMPLEMENTED[key] = fn
        _KEPT_LIBRARIES.append(self)
        return result

    torch.library.custom_op = custom_op  # type: ignore[assignment]
    custom_ops.custom_op = custom_op  # type: ignore[assignment]
    torch.library.Library.define = define  # type: ignore[method-assign]
    torch.library.Library.impl = impl  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.library.custom_op = real_custom_op
        custom_ops.custom_op = real_custom_op
        torch.library.Library.define = real_define  # type: ignore[method-assign]
        torch.library.Library.impl = real_impl  # type: ignore[method-assign]
