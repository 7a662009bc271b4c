"""``install()``: put the stand-ins in place for a block and restore everything after."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from msrewrite.runtime import active, npu_api
from msrewrite.runtime.core import StreamRuntime
from msrewrite.runtime.npu_api import build_npu_modules
from msrewrite.runtime.streams import CudaStream, Event, Stream, StreamContext
from msrewrite.runtime.torchair_api import build_failing_torchair_modules, build_torchair_modules

_MISSING = object()


class _Patches:
    """Attribute and sys.modules replacements, undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list = []

    def set_attr(self, owner, name: str, value) -> None:
        # Read the owner's own __dict__ so that an inherited attribute is restored by deletion.
        saved = vars(owner).get(name, _MISSING)
        setattr(owner, name, value)
        self._undo.append(lambda: delattr(owner, name) if saved is _MISSING else setattr(owner, name, saved))

    def set_module(self, name: str, module) -> None:
        saved: Any = sys.modules.get(name, _MISSING)  # a module, or _MISSING
        sys.modules[name] = module
        self._undo.append(
            lambda: sys.modules.pop(name, None) if saved is _MISSING else sys.modules.__setitem__(name, saved)
        )

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


TORCH_NPU_VERSIONS = ("2.14", "2.10")  # how record_stream is lowered inside a compiled npugraph_ex graph


def _record_stream(original, torch_npu_version: str):
    def record_stream(self: torch.Tensor, stream) -> None:
        if not isinstance(stream, Stream):
            return original(self, stream)  # the real op: rejects every stream object on CPU
        runtime = active.active_runtime()
        runtime.note_api("native", "Tensor.record_stream")
        if torch_npu_version == "2.10" and runtime.in_aclgraph:
            # torch_npu 2.10 traces it as torch.npu.fake_record_stream, lowered to
            # record_tagged_stream_(t, <FX node name>): a stream made for that name, not `stream`.
            stream = runtime.tag_stream(f"record_tagged_stream_{stream.stream_id}")
        runtime.emit("on_record_stream", self, stream)

    record_stream.__doc__ = original.__doc__
    return record_stream


def _cuda_functions() -> dict[str, object]:
    return {
        "is_available": lambda: True,
        "Stream": CudaStream,
        "Event": Event,
        "StreamContext": StreamContext,
        "stream": npu_api.stream,
        "current_stream": npu_api.current_stream,
        "default_stream": npu_api.default_stream,
        "set_stream": npu_api.set_stream,
        "synchronize": npu_api.synchronize,
    }


def _fake_record_stream(self, s):  # noqa: ARG001 - torch_npu 2.10's signature
    raise RuntimeError("tensor.record_stream is not supported on torch.compile! (torch_npu 2.10 stand-in)")


def _apply(
    patches: _Patches,
    runtime: StreamRuntime,
    torchair_init_error: BaseException | None,
    torch_npu_version: str = "2.14",
) -> None:
    npu_modules = build_npu_modules()
    torchair_modules = (
        build_torchair_modules() if torchair_init_error is None else build_failing_torchair_modules(torchair_init_error)
    )
    for name, module in {**npu_modules, **torchair_modules}.items():
        patches.set_module(name, module)
    patches.set_attr(torch, "npu", npu_modules["torch.npu"])
    for name, value in _cuda_functions().items():
        patches.set_attr(torch.cuda, name, value)
    patches.set_attr(torch.Tensor, "record_stream", _record_stream(torch.Tensor.record_stream, torch_npu_version))
    if torch_npu_version == "2.10":
        vars(npu_modules["torch.npu"])["fake_record_stream"] = _fake_record_stream
    original_is_compiling = torch.compiler.is_compiling
    patches.set_attr(torch.compiler, "is_compiling", lambda: runtime.compiling or original_is_compiling())


@contextlib.contextmanager
def install(
    graph_mode: bool = False, torchair_init_error: BaseException | None = None, torch_npu_version: str = "2.14"
) -> Iterator[StreamRuntime]:
    """Run torch.npu / torch_npu / torchair / torch.cuda stream code on CPU inside the block.

    ``torch_npu_version`` "2.10" models that release's npugraph_ex lowering of record_stream inside
    a compiled graph (by FX node name, so onto a stream of its own; 2.14 resolves the stream by id).

    ``torchair_init_error`` models a torchair that fails to initialise: ``import torchair`` still
    succeeds (torch_npu's lazy proxy), and the first attribute access raises this error.
    """
    if active.is_installed():
        raise RuntimeError("msrewrite.runtime.install() is already active; nested installs are refused")
    if "torch_npu" in sys.modules or hasattr(torch, "npu"):
        raise RuntimeError("a real torch_npu is loaded; the CPU stand-ins would shadow it")
    runtime = StreamRuntime()
    patches = _Patches()
    try:
        if torch_npu_version not in TORCH_NPU_VERSIONS:
            raise ValueError(f"torch_npu_version must be one of {TORCH_NPU_VERSIONS}, got {torch_npu_version!r}")
        _apply(patches, runtime, torchair_init_error, torch_npu_version)
        active.set_active(runtime)
        with runtime.graph_mode() if graph_mode else contextlib.nullcontext():
            yield runtime
    finally:
        active.set_active(None)
        patches.restore()
        runtime.close()
