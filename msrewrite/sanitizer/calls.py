"""Where an access stands against the sanitized module's call when no model line is behind it.

An op or a free with no user frame on the stack (or only the caller's) happens outside the model's
code: the caller making the module's inputs before the call (verify's harness clones them there),
the forward's locals freed as it returns (its frame is gone by then), the caller's copies after it.
`ModuleCalls` follows the outermost nn.Module call with global forward hooks and words that place.
"""

from __future__ import annotations

import inspect
import sys
import types

from torch.nn.modules import module as nn_module

from msrewrite.runtime.frames import in_files, is_internal, user_frame
from msrewrite.runtime.hooks import observer


class ModuleCalls:
    """``with ModuleCalls() as calls``: the outermost call's depth, class and caller; ``label()``."""

    def __init__(self) -> None:
        self.depth = 0
        self.outer: str | None = None  # the outermost module's class, once called
        self.outer_is_user = False  # its forward is model code (not torch's)
        self.last_user: tuple[str, int] | None = None  # the last user line an access came from
        self.caller: types.FrameType | None = None  # the frame that called it, while it runs
        self._handles: list = []

    def __enter__(self) -> ModuleCalls:
        self._handles = [
            nn_module.register_module_forward_pre_hook(observer(self._enter)),
            nn_module.register_module_forward_hook(observer(self._exit), always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, module, _args) -> None:
        if self.depth == 0:
            self.caller = user_frame(sys._getframe(1))
            self.outer = type(module).__qualname__
            forward = getattr(inspect.unwrap(type(module).forward), "__code__", None)
            self.outer_is_user = forward is not None and not is_internal(forward.co_filename)
        self.depth += 1

    def _exit(self, _module, _args, _output) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self.caller = None

    def outside(self, frame: types.FrameType, user_files: frozenset[str]) -> bool:
        """Is ``frame``, the innermost user frame behind an access, the module's caller rather than
        model code: the frame that called it (its own frame gone as it returns), or outside the
        call one not in ``user_files`` (a test that makes the inputs and calls the module)?"""
        if self.depth:
            return frame is self.caller
        return bool(user_files) and not in_files(frame, user_files)

    def label(self) -> tuple[str, int]:
        """A location for an access no user frame is behind: line 0, the file a phrase saying where
        (findings.where words it)."""
        if self.outer is None:
            return ("<before the module was called (the caller making its inputs)>", 0)
        last = f" (after its last op at {self.last_user[0]}:{self.last_user[1]})" if self.last_user else ""
        if self.depth == 0:  # the caller's own code: copies of the output, or the next call's inputs
            return (f"<in the caller after {self.outer}.forward returned{last}>", 0)
        if self.outer_is_user:  # its own frame gone while the call is still on: it is returning
            return (f"<at the end of {self.outer}.forward, as it returned{last}>", 0)
        return (f"<inside {self.outer}.forward (torch code)>", 0)
