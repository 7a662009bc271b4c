"""The stand-in ``torch.npu`` (= ``torch_npu.npu``) module functions."""

from __future__ import annotations

import contextlib
import types

from msrewrite.runtime.active import active_runtime
from msrewrite.runtime.core import DEFAULT_CORE_LIMIT
from msrewrite.runtime.streams import CudaStream, Event, Stream, StreamContext


def stream(stream=None) -> StreamContext:
    active_runtime().note_api("native", "stream")
    return StreamContext(stream)


def current_stream(device=None) -> Stream:  # noqa: ARG001 - torch_npu's signature
    runtime = active_runtime()
    runtime.note_api("native", "current_stream")
    return runtime.current_stream()


def default_stream(device=None) -> Stream:  # noqa: ARG001 - torch_npu's signature
    runtime = active_runtime()
    runtime.note_api("native", "default_stream")
    return runtime.default_stream()


def set_stream(stream) -> None:
    runtime = active_runtime()
    runtime.note_api("native", "set_stream")
    if stream is None:
        return
    if not isinstance(stream, Stream):
        raise TypeError(f"set_stream expects a stand-in Stream, got {type(stream).__name__}")
    runtime.set_current(stream)


def synchronize(device=None) -> None:  # noqa: ARG001 - torch_npu's signature
    runtime = active_runtime()
    runtime.note_api("native", "synchronize")
    runtime.emit("on_device_synchronize")


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device) -> None:
    pass


def is_initialized() -> bool:
    return True


# --- core limits (torch_npu/npu/npu_config.py) ------------------------------
def _check_npu_stream(stream) -> None:
    # The real functions assert isinstance(stream, torch_npu.npu.Stream).
    if not isinstance(stream, Stream) or isinstance(stream, CudaStream):
        raise AssertionError(f"stream must be a torch_npu.npu.Stream, got {type(stream).__name__}")


def set_stream_limit(stream, cube_num: int = -1, vector_num: int = -1) -> None:
    _check_npu_stream(stream)
    runtime = active_runtime()
    runtime.note_api("native", "set_stream_limit")
    limit = dict(get_stream_limit(stream))
    if cube_num != -1:  # -1 leaves that value unchanged
        limit["cube_core_num"] = cube_num
    if vector_num != -1:
        limit["vector_core_num"] = vector_num
    runtime.core_limits[stream.stream_id] = limit


def get_stream_limit(stream) -> dict[str, int]:
    _check_npu_stream(stream)
    return dict(active_runtime().core_limits.get(stream.stream_id, DEFAULT_CORE_LIMIT))


def reset_stream_limit(stream) -> None:
    _check_npu_stream(stream)
    active_runtime().core_limits.pop(stream.stream_id, None)


@contextlib.contextmanager
def npugraph_ex_limit_core_num(op_aicore_num: int, op_vectorcore_num: int, stream=None):
    """``torch.npu.npugraph_ex.scope.limit_core_num``: stream-level cap, restored on exit (2.14 eager)."""
    runtime = active_runtime()
    runtime.note_api("native", "npugraph_ex.scope.limit_core_num")
    target = stream if stream is not None else runtime.current_stream()
    saved = get_stream_limit(target)
    set_stream_limit(target, op_aicore_num, op_vectorcore_num)
    try:
        yield
    finally:
        set_stream_limit(target, saved["cube_core_num"], saved["vector_core_num"])


class mstx:  # noqa: N801 - torch_npu's spelling
    """torch_npu.npu.mstx (torch_npu/npu/mstx.py): profiler ranges; with a stream, marked on the
    device too. The stand-in checks the arguments as the real one does and records nothing."""

    _next_id = 0

    @staticmethod
    def mark(message: str = "") -> None:
        pass

    @staticmethod
    def range_start(message: str, stream=None) -> int:
        if not message:
            raise ValueError("mstx.range_start needs a message")
        if stream is not None:
            _check_npu_stream(stream)
        mstx._next_id += 1
        return mstx._next_id

    @staticmethod
    def range_end(range_id: int) -> None:
        if not isinstance(range_id, int):
            raise TypeError("mstx.range_end takes the id range_start returned")


def build_npu_modules() -> dict[str, types.ModuleType]:
    """Module objects for sys.modules: torch.npu, its npugraph_ex.scope, and torch_npu."""
    npu = types.ModuleType("torch.npu", "msrewrite stand-in for torch_npu.npu (CPU only)")
    for name in (
        "stream",
        "current_stream",
        "default_stream",
        "set_stream",
        "synchronize",
        "is_available",
        "device_count",
        "current_device",
        "set_device",
        "is_initialized",
        "set_stream_limit",
        "get_stream_limit",
        "reset_stream_limit",
    ):
        setattr(npu, name, globals()[name])
    scope = types.ModuleType("torch.npu.npugraph_ex.scope")
    vars(scope)["limit_core_num"] = npugraph_ex_limit_core_num
    npugraph_ex = types.ModuleType("torch.npu.npugraph_ex")
    vars(npugraph_ex)["scope"] = scope
    vars(npu).update(Stream=Stream, Event=Event, StreamContext=StreamContext, mstx=mstx, npugraph_ex=npugraph_ex)
    npu.__path__ = npugraph_ex.__path__ = []  # packages, so dotted imports resolve via sys.modules

    torch_npu = types.ModuleType("torch_npu", "msrewrite stand-in for torch_npu (CPU only)")
    vars(torch_npu)["npu"] = npu
    torch_npu.__path__ = []
    return {
        "torch.npu": npu,
        "torch.npu.npugraph_ex": npugraph_ex,
        "torch.npu.npugraph_ex.scope": scope,
        "torch_npu": torch_npu,
        "torch_npu.npu": npu,
    }
