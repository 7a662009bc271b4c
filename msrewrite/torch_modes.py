"""The base of msrewrite's TorchDispatchModes (the tracer, the op recorder, the sanitizer).

torch wraps every TorchDispatchMode subclass's `__torch_dispatch__` in `torch._disable_dynamo`,
so that a torch.compile running under the mode does not trace the handler. That wrapper imports
torch._dynamo on its first call: about 3 s (sympy, torch.distributed.tensor), most of a
`verify` or a traced `suggest` of a small model. Here the handler is wrapped the same way only
once torch._dynamo is loaded: nothing can compile before it is, and once it is, each call goes
through the same disabled handler torch would have made.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _disabled_once_dynamo_loads(handler: Callable[..., Any]) -> Callable[..., Any]:
    disabled: Callable[..., Any] | None = None

    @functools.wraps(handler)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return handler(*args, **kwargs)
        if disabled is None:
            disabled = torch._disable_dynamo(handler, recursive=True)
        return disabled(*args, **kwargs)

    return dispatch


class DispatchMode(TorchDispatchMode):
    """A TorchDispatchMode that does not import torch._dynamo to run its handler."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's own wrapping, replaced by the one below

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_dispatch__")
        if handler is not None and not isinstance(handler, classmethod):
            cls.__torch_dispatch__ = _disabled_once_dynamo_loads(handler)  # type: ignore[method-assign]
