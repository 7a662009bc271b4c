"""Stand-in Stream, Event and StreamContext with torch_npu 2.13 signatures.

Ops run eagerly on CPU; these objects only move the runtime's current stream
and report record/wait/synchronize to the runtime's listeners.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from msrewrite.runtime.active import active_runtime

if TYPE_CHECKING:
    from msrewrite.runtime.core import StreamRuntime


class Stream:
    """``torch.npu.Stream(device=None, priority=0, **kwargs)``."""

    device_type = "npu"
    _HIDDEN_KWARGS = {"stream_id", "device_index", "device_type", "is_sync_launch", "stream_ptr"}

    def __init__(
        self, device=None, priority=0, *, _runtime: StreamRuntime | None = None, _name: str | None = None, **kwargs
    ):
        unknown = set(kwargs) - self._HIDDEN_KWARGS
        if unknown:
            raise TypeError(f"Stream() got unexpected keyword argument(s) {sorted(unknown)}")
        self._runtime = _runtime or active_runtime()
        self.name = _name or self._runtime.next_side_name()
        self.device = device
        self.priority = priority
        self._previous: list[Stream] = []
        if _name is None:
            self._runtime.note_api("native", "Stream")

    # ordering
    def wait_event(self, event: Event) -> None:
        self._runtime.note_api("native", "Stream.wait_event")
        if not isinstance(event, Event):
            raise TypeError(f"wait_event expects a stand-in Event, got {type(event).__name__}")
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        # torch_npu: self.wait_event(stream.record_event())
        self._runtime.note_api("native", "Stream.wait_stream")
        if not isinstance(stream, Stream):
            raise TypeError(f"wait_stream expects a stand-in Stream, got {type(stream).__name__}")
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        self._runtime.note_api("native", "Stream.record_event")
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True  # CPU work is already done when the call returns

    def synchronize(self) -> None:
        self._runtime.note_api("native", "Stream.synchronize")
        self._runtime.emit("on_stream_synchronize", self)

    def set_data_preprocess_stream(self, is_data_preprocess_stream: bool = False) -> None:
        pass

    # `with stream:` makes it current, like torch.Stream
    def __enter__(self) -> Stream:
        self._runtime.note_api("native", "Stream.__enter__")
        self._previous.append(self._runtime.current_stream())
        self._runtime.set_current(self)
        return self

    def __exit__(self, *exc) -> None:
        self._runtime.set_current(self._previous.pop())

    @property
    def stream_id(self) -> int:
        return 0 if self.name == "main" else id(self)

    @property
    def device_index(self) -> int:
        return 0

    @property
    def npu_stream(self) -> int:
        return self.stream_id

    cuda_stream = npu_stream

    def __repr__(self) -> str:
        return f"<stand-in {self.device_type} Stream {self.name}>"


class CudaStream(Stream):
    """``torch.cuda.Stream`` while installed: same runtime, separate class for set_stream_limit."""

    device_type = "cuda"


class Event:
    """``torch.npu.Event(enable_timing=False, blocking=False, interprocess=False)``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._runtime = active_runtime()
        self._runtime.note_api("native", "Event")
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self.recorded_on: Stream | None = None
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._runtime.note_api("native", "Event.record")
        stream = stream if stream is not None else self._runtime.current_stream()
        if not isinstance(stream, Stream):
            raise TypeError(f"Event.record expects a stand-in Stream, got {type(stream).__name__}")
        self.recorded_on = stream
        self._time = time.perf_counter()
        self._runtime.emit("on_event_record", self, stream)

    def wait(self, stream: Stream | None = None) -> None:
        self._runtime.note_api("native", "Event.wait")
        stream = stream if stream is not None else self._runtime.current_stream()
        if not isinstance(stream, Stream):
            raise TypeError(f"Event.wait expects a stand-in Stream, got {type(stream).__name__}")
        if self.recorded_on is not None:  # waiting on a never-recorded event is a no-op
            self._runtime.emit("on_event_wait", self, stream)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._runtime.note_api("native", "Event.synchronize")
        if self.recorded_on is not None:
            self._runtime.emit("on_event_synchronize", self)

    def elapsed_time(self, end_event: Event) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time - self._time) * 1000.0

    def recorded_time(self) -> float:
        if self._time is None:
            raise RuntimeError("Event must be recorded before querying its time.")
        return self._time * 1000.0

    def __repr__(self) -> str:
        where = self.recorded_on.name if self.recorded_on else "unrecorded"
        return f"<stand-in Event {where}>"


class StreamContext:
    """``torch.npu.stream(s)``: make ``s`` current inside the block; None does nothing."""

    def __init__(self, stream: Stream | None):
        self.stream = stream
        self._previous: Stream | None = None

    def __enter__(self) -> Stream | None:
        if self.stream is None:
            return None
        if not isinstance(self.stream, Stream):
            raise TypeError(f"expected a stand-in Stream, got {type(self.stream).__name__}")
        runtime = self.stream._runtime
        self._previous = runtime.current_stream()
        runtime.set_current(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        if self.stream is not None and self._previous is not None:  # always both after __enter__
            self.stream._runtime.set_current(self._previous)
