"""``rt.record_ops()``: every aten op with the stand-in stream it ran on and its user frame."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.nn.modules import module as nn_module

from msrewrite.runtime.frames import location, user_frame
from msrewrite.runtime.hooks import observer
from msrewrite.torch_modes import DispatchMode


@dataclass(frozen=True)
class OpRecord:
    name: str  # str(OpOverload), e.g. "aten.mm.default"
    stream: str  # "main", "side:<n>", "tag:<tag>"
    file: str
    line: int
    module_path: str | None  # dotted path from the outermost running module ("" for the root)
    group: str = ""  # a collective's process group (its name), where the op is one


def _group_of(name: str, args) -> str:
    """The process group a torch.distributed op runs on: c10d ops carry the group as a boxed
    object, functional collectives by its name (their last string argument)."""
    if name.startswith("c10d."):
        import torch.distributed as dist

        boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        try:
            return dist.ProcessGroup.unbox(boxed).group_name if boxed is not None else ""
        except (RuntimeError, TypeError):  # a boxed object that is not a group
            return ""
    if name.startswith("_c10d_functional."):
        return next((a for a in reversed(args) if isinstance(a, str)), "")
    return ""


class ModuleStack:
    """The chain of nn.Modules currently inside forward, via global forward hooks."""

    def __init__(self):
        self._stack: list[torch.nn.Module] = []
        self._paths: dict[tuple[int, int], str] = {}
        self._handles = []

    def __enter__(self) -> ModuleStack:
        self._handles = [
            nn_module.register_module_forward_pre_hook(observer(lambda mod, _args: self._stack.append(mod))),
            nn_module.register_module_forward_hook(observer(self._pop), always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._stack.clear()

    def _pop(self, mod, _args, _output) -> None:
        if self._stack and self._stack[-1] is mod:
            self._stack.pop()

    def current_path(self) -> str | None:
        if not self._stack:
            return None
        root, innermost = self._stack[0], self._stack[-1]
        key = (id(root), id(innermost))
        if key not in self._paths:
            self._paths[key] = next(
                (name for name, mod in root.named_modules(remove_duplicate=False) if mod is innermost), "?"
            )
        return self._paths[key]


class RecordOpsMode(DispatchMode):
    def __init__(self, runtime, ops: list[OpRecord]):
        super().__init__()
        self.runtime = runtime
        self.ops = ops
        self.modules = ModuleStack()

    def __enter__(self):
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.modules.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        file, line = location(user_frame(sys._getframe(1)))
        name = str(func)
        group = _group_of(name, args) if name.startswith(("c10d.", "_c10d_functional.")) else ""
        self.ops.append(
            OpRecord(name, self.runtime.current_stream().name, file, line, self.modules.current_path(), group)
        )
        return func(*args, **(kwargs or {}))
