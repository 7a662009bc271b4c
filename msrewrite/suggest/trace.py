"""Record what a model really does: every aten op, its storages, module path and source frames.

The recorder is a TorchDispatchMode. Global forward hooks keep the stack of module paths; a
frame walk keeps the frames that lie in the model file (outer to inner), so an op can be mapped
to the statement of any forward it runs under, not only the innermost frame (with grouped_mm
experts the innermost frame is in transformers/integrations). All tensors are kept alive while
recording, so storage and object ids are never reused.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

from msrewrite.torch_modes import DispatchMode

# Ops that only describe tensors; they cost nothing and order nothing.
METADATA_OPS = {"prim.device.default", "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default"}
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default"}


@dataclass
class OpRecord:
    index: int
    name: str  # "aten.mm.default"
    inputs: list[Any]  # tensors read (kept alive for cost formulas)
    outputs: list[Any]
    args: tuple
    kwargs: dict
    out: Any
    deps: set[int] = field(default_factory=set)
    module_stack: tuple[str, ...] = ()  # module paths, outer to inner ("" is the root)
    frames: tuple[tuple[str, int], ...] = ()  # (code qualname, line) in the model file, outer to inner
    is_view: bool = False
    writes: bool = False  # mutates an input in place
    is_sync: bool = False
    estimate: tuple[float, float] | None = None  # (FLOPs, bytes) of an analytic stand-in op

    def line_in(self, qualname: str) -> int | None:
        """Line of the innermost frame of `qualname` (the function being analyzed)."""
        for name, line in reversed(self.frames):
            if name == qualname:
                return line
        return None


@dataclass
class Trace:
    ops: list[OpRecord]
    model_file: Path
    root: torch.nn.Module
    module_names: dict[int, str]  # id(module) -> path
    modules: dict[str, torch.nn.Module]  # path -> module
    notes: list[str] = field(default_factory=list)


class _Recorder(DispatchMode):
    def __init__(self, model_file: Path, root: torch.nn.Module) -> None:
        super().__init__()
        self.model_file = str(Path(model_file).resolve())
        self.module_names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
        self.stack: list[str] = []
        self.ops: list[OpRecord] = []
        self.keep: list[Any] = []
        self.producer: dict[int, int] = {}  # id(tensor) -> op that produced it (views included)
        self.last_writer: dict[int, int] = {}  # storage -> op that last wrote it
        self.readers: dict[int, list[int]] = {}  # storage -> ops that read it since the last write
        self._file_cache: dict[str, bool] = {}

    # module path ---------------------------------------------------------------------------
    def pre_hook(self, module: torch.nn.Module, _args: Any) -> None:
        name = self.module_names.get(id(module))
        if name is not None:
            self.stack.append(name)

    def post_hook(self, module: torch.nn.Module, _args: Any, _output: Any) -> None:
        name = self.module_names.get(id(module))
        if name is not None and self.stack and self.stack[-1] == name:
            self.stack.pop()

    # ops --------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if name in METADATA_OPS:
            return out
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        record = OpRecord(
            index=len(self.ops),
            name=name,
            inputs=flat_in,
            outputs=flat_out,
            args=args,
            kwargs=kwargs,
            out=out,
            module_stack=tuple(self.stack),
            frames=self._frames(),
            is_view=bool(getattr(func, "is_view", False)) or name.startswith("aten.view") or name.startswith("aten.t."),
            is_sync=name in SYNC_OPS,
        )
        self._link(func, record, args, kwargs)
        self.ops.append(record)
        self.keep.append((args, kwargs, out))
        return out

    def _link(self, func, record: OpRecord, args, kwargs) -> None:
        written = _written_tensors(func, args, kwargs)
        record.writes = bool(written)
        in_storages = set()
        for t in record.inputs:
            key = _storage(t)
            in_storages.add(key)
            if id(t) in self.producer:
                record.deps.add(self.producer[id(t)])
            if key in self.last_writer:
                record.deps.add(self.last_writer[key])
            self.readers.setdefault(key, []).append(record.index)
        for t in written:  # in-place: after every earlier reader of that storage
            key = _storage(t)
            record.deps.update(r for r in self.readers.get(key, []) if r != record.index)
            self.last_writer[key] = record.index
            self.readers[key] = []
        for t in record.outputs:
            self.producer[id(t)] = record.index
            key = _storage(t)
            if key not in in_storages:  # a fresh result; views share their base's writer
                self.last_writer[key] = record.index
                self.readers[key] = []
        record.deps.discard(record.index)

    def _frames(self) -> tuple[tuple[str, int], ...]:
        frames = []
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if self._in_model_file(code.co_filename):
                frames.append((code.co_qualname, frame.f_lineno))
            frame = frame.f_back
        return tuple(reversed(frames))

    def _in_model_file(self, filename: str) -> bool:
        hit = self._file_cache.get(filename)
        if hit is None:
            try:
                hit = str(Path(filename).resolve()) == self.model_file
            except OSError:
                hit = False
            self._file_cache[filename] = hit
        return hit


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def _written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """Arguments the schema marks as written (Tensor(a!))."""
    written = []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written


def record(module: torch.nn.Module, args: tuple, kwargs: dict, model_file: Path) -> Trace:
    """Run `module(*args, **kwargs)` once under the recorder."""
    recorder = _Recorder(model_file, module)
    pre = register_module_forward_pre_hook(recorder.pre_hook)
    post = register_module_forward_hook(recorder.post_hook)
    try:
        with torch.no_grad(), recorder:
            module(*args, **kwargs)
    finally:
        pre.remove()
        post.remove()
    return Trace(
        ops=recorder.ops,
        model_file=Path(model_file),
        root=module,
        module_names=recorder.module_names,
        modules=dict(module.named_modules()),
    )
