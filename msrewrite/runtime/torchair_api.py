"""The stand-in ``torchair`` package: ``torchair.scope`` and ``torchair.ops``.

Eager behaviour copies real torchair: the stream switch is a silent no-op,
npu_wait_tensor raises, tagged events execute (only events made by
npu_create_tagged_event: any other raises ValueError, as torchair's tag lookup
does). Inside ``rt.graph_mode()`` the GE behaviour is modelled instead: the
switch moves to a per-tag stream, npu_wait_tensor returns its input and adds an
ordering edge, tagged events raise.
"""

from __future__ import annotations

import bisect
import contextlib
import dis
import sys
import types
from functools import lru_cache
from typing import Any

from msrewrite.runtime.active import active_runtime
from msrewrite.runtime.frames import location
from msrewrite.runtime.streams import Event, Stream

_WAIT_TENSOR_EAGER_ERROR = (
    "torch.ops.air.wait_tensor kernel_impl is not implemented! "
    "npu_wait_tensor is not support in this mode, only support in max-autotune (GE graph) mode."
)


class _StreamSwitch:
    """``npu_stream_switch``: decides at ``__enter__`` whether it is inside a GE graph."""

    def __init__(self, stream_tag: str, stream_priority: int, enable_inner_parallel: bool):
        self.stream_tag = str(stream_tag)
        self.stream_priority = stream_priority
        self.enable_inner_parallel = enable_inner_parallel
        self._previous: Stream | None = None

    def __enter__(self):
        runtime = active_runtime()
        if runtime.in_graph_mode:
            self._previous = runtime.current_stream()
            runtime.set_current(runtime.tag_stream(self.stream_tag))
        elif runtime.in_aclgraph:  # reduce-overhead: a real stream per tag, no implicit join
            self._previous = runtime.current_stream()
            runtime.set_current(runtime.aclgraph_tag_stream(self.stream_tag))
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            active_runtime().set_current(self._previous)
            self._previous = None


def npu_stream_switch(stream_tag: str, stream_priority: int = 0, enable_inner_parallel: bool = True):
    active_runtime().note_api("torchair", "npu_stream_switch")
    return _StreamSwitch(stream_tag, stream_priority, enable_inner_parallel)


def npu_wait_tensor(self, dependency):
    runtime = active_runtime()
    runtime.note_api("torchair", "npu_wait_tensor")
    if not runtime.in_graph_mode:
        raise NotImplementedError(_WAIT_TENSOR_EAGER_ERROR)
    discarded_at = _discarded_result_site(sys._getframe(1))
    runtime.emit("on_wait_tensor", self, dependency, runtime.current_stream(), discarded_at)
    return self


@contextlib.contextmanager
def limit_core_num(op_aicore_num: int, op_vectorcore_num: int):  # noqa: ARG001 - torchair's signature
    active_runtime().note_api("torchair", "limit_core_num")
    yield  # op-level GE attributes; nothing to do on CPU


@contextlib.contextmanager
def super_kernel(scope: str, options: str = ""):  # noqa: ARG001 - torchair's signature
    active_runtime().note_api("torchair", "super_kernel")
    yield


# --- torchair.ops ------------------------------------------------------------
def _refuse_in_graph_mode(api: str) -> None:
    if active_runtime().in_graph_mode:
        raise NotImplementedError(f"torchair.ops.{api} is not supported in max-autotune (GE graph) mode")


def npu_create_tagged_event(tag: str) -> Event:
    runtime = active_runtime()
    runtime.note_api("torchair", "npu_create_tagged_event")
    if tag in runtime.tagged_events:
        raise ValueError(f"tag {tag!r} is already used by another tagged event")
    event = Event()
    runtime.tagged_events[tag] = event
    return event


def _tag_of(event: Event) -> str:
    """The event's tag; ValueError, as torchair's _get_tag_by_event, for an event not made by
    npu_create_tagged_event (a plain torch.npu.Event)."""
    tag = next((tag for tag, made in active_runtime().tagged_events.items() if made is event), None)
    if tag is None:
        raise ValueError(f"tagged event {event} is not in use")
    return tag


def npu_tagged_event_record(event: Event) -> None:
    runtime = active_runtime()
    runtime.note_api("torchair", "npu_tagged_event_record")
    _tag_of(event)
    _refuse_in_graph_mode("npu_tagged_event_record")
    event.record(runtime.current_stream())


def npu_tagged_event_wait(event: Event) -> None:
    runtime = active_runtime()
    runtime.note_api("torchair", "npu_tagged_event_wait")
    _tag_of(event)
    _refuse_in_graph_mode("npu_tagged_event_wait")
    event.wait(runtime.current_stream())


def npu_record_tagged_stream(input, tagged_stream: str) -> None:
    runtime = active_runtime()
    runtime.note_api("torchair", "npu_record_tagged_stream")
    _refuse_in_graph_mode("npu_record_tagged_stream")
    input.record_stream(runtime.tag_stream(tagged_stream))


# --- compile stubs -------------------------------------------------------------
class CompilerConfig:
    """Minimal ``torchair.CompilerConfig``: attributes only."""

    def __init__(self):
        self.mode = "max-autotune"
        self.ge_config = types.SimpleNamespace(aicore_num=None, enable_single_stream=False, oo_level=None)
        self.experimental_config = types.SimpleNamespace(
            cc_parallel_enable=False, topology_sorting_strategy=None, frozen_parameter=False
        )
        self.debug = types.SimpleNamespace(graph_dump=types.SimpleNamespace(type=None), run_eagerly=False)


_COMPILE_MODES = ("max-autotune", "reduce-overhead", "npugraph_ex")


def get_npu_backend(
    *,
    compiler_config: CompilerConfig | None = None,
    custom_decompositions=None,  # noqa: ARG001 - torchair's signature
):
    """A dynamo backend that runs the captured graph eagerly, with the semantics of the config's mode:
    max-autotune is a GE graph, reduce-overhead and npugraph_ex an aclgraph (a real stream per tag,
    npu_wait_tensor raises), and debug.run_eagerly runs every op eagerly (npu_wait_tensor raises)."""
    config = compiler_config if compiler_config is not None else CompilerConfig()
    if config.mode not in _COMPILE_MODES:
        raise ValueError(f"CompilerConfig.mode must be one of {_COMPILE_MODES}, got {config.mode!r}")

    def semantics(runtime):
        if config.debug.run_eagerly:
            return runtime.run_eagerly_mode()
        return runtime.graph_mode() if config.mode == "max-autotune" else runtime.aclgraph_mode()

    def backend(graph_module, example_inputs):  # noqa: ARG001 - a dynamo backend's signature
        def run(*args, **kwargs):
            with semantics(active_runtime()):
                return graph_module(*args, **kwargs)

        return run

    return backend


# --- discarded-result detection ------------------------------------------------
@lru_cache(maxsize=1024)
def _instructions(code) -> tuple[list[int], dict[int, tuple[str, Any]]]:
    """Sorted instruction offsets and offset -> (opname, argval), caches left out."""
    listing = list(dis.get_instructions(code))
    return [ins.offset for ins in listing], {ins.offset: (ins.opname, ins.argval) for ins in listing}


def _after(code, offset: int) -> int | None:
    offsets, _ = _instructions(code)
    index = bisect.bisect_right(offsets, offset)
    return offsets[index] if index < len(offsets) else None


def _discarded_result_site(frame) -> tuple[str, int] | None:
    """Where the call's result is thrown away (POP_TOP), following ``return helper(...)`` chains."""
    while frame is not None:
        _, table = _instructions(frame.f_code)
        # f_lasti is the CALL (3.12+) or its last cache unit (3.11): the next instruction follows it.
        offset = _after(frame.f_code, frame.f_lasti)
        for _ in range(8):  # follow a few NOPs / forward jumps
            if offset not in table:
                return None
            opname, argval = table[offset]
            if opname == "POP_TOP":
                return location(frame)
            if opname == "RETURN_VALUE":
                break  # a helper returned it: look at the helper's caller
            if opname == "JUMP_FORWARD":
                offset = argval
            elif opname == "NOP":
                offset = _after(frame.f_code, offset)
            else:
                return None
        else:
            return None
        frame = frame.f_back
    return None


def build_torchair_modules() -> dict[str, types.ModuleType]:
    torchair = types.ModuleType("torchair", "msrewrite stand-in for torchair (CPU only)")
    scope = types.ModuleType("torchair.scope")
    ops = types.ModuleType("torchair.ops")
    for name in ("npu_stream_switch", "npu_wait_tensor", "limit_core_num", "super_kernel"):
        setattr(scope, name, globals()[name])
    for name in (
        "npu_create_tagged_event",
        "npu_tagged_event_record",
        "npu_tagged_event_wait",
        "npu_record_tagged_stream",
    ):
        setattr(ops, name, globals()[name])
    vars(torchair).update(scope=scope, ops=ops, CompilerConfig=CompilerConfig, get_npu_backend=get_npu_backend)
    torchair.__path__ = []
    return {"torchair": torchair, "torchair.scope": scope, "torchair.ops": ops}


class _LazyTorchair(types.ModuleType):
    """torch_npu's ``sys.modules["torchair"]`` proxy when the real package cannot initialise.

    ``import torch_npu`` installs a lazy proxy (``_install_lazy_torchair``), so ``import torchair``
    itself succeeds; the first attribute access loads the package and raises its error.
    """

    def __init__(self, error: BaseException):
        super().__init__("torchair", "torch_npu's lazy torchair proxy (stand-in: initialisation fails)")
        object.__setattr__(self, "_init_error", error)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        error = object.__getattribute__(self, "_init_error")
        raise type(error)(*error.args)


def build_failing_torchair_modules(error: BaseException) -> dict[str, types.ModuleType]:
    """Only the proxy: ``import torchair.scope`` finds no loaded submodule and fails like the real load."""
    return {"torchair": _LazyTorchair(error)}
