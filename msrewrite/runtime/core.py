"""The stand-in stream runtime: current stream, stream registry, graph mode, listeners.

One runtime serves torch.npu, torch.cuda and torchair, so that a model mixing
them sees one current stream, as on a real device. Every synchronization goes
to the listeners (the sanitizer); the runtime itself executes ops eagerly on CPU.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from msrewrite.runtime.frames import is_runtime, user_frame
from msrewrite.runtime.streams import Event, Stream

if TYPE_CHECKING:
    from msrewrite.runtime.recording import OpRecord

DEFAULT_CORE_LIMIT = {"cube_core_num": 24, "vector_core_num": 48}


class RuntimeListener:
    """Hooks the runtime calls; the sanitizer overrides the ones it needs."""

    def on_event_record(self, event: Event, stream: Stream) -> None: ...
    def on_event_wait(self, event: Event, stream: Stream) -> None: ...
    def on_stream_synchronize(self, stream: Stream) -> None: ...
    def on_event_synchronize(self, event: Event) -> None: ...
    def on_device_synchronize(self) -> None: ...
    def on_record_stream(self, tensor: torch.Tensor, stream: Stream) -> None: ...

    def on_wait_tensor(self, tensor, dependency, stream, discarded_at) -> None:
        """GE npu_wait_tensor; ``discarded_at`` is (file, line) when the result is thrown away."""

    def on_graph_mode(self, entered: bool) -> None: ...

    def on_api_call(self, family: str, api: str, frame) -> None:
        """A user frame called a stream API of ``family`` ("native" or "torchair")."""


class StreamRuntime:
    def __init__(self) -> None:
        self.listeners: list[RuntimeListener] = []
        self._side_streams = 0
        self._tag_streams: dict[str, Stream] = {}
        self._graph_depth = 0
        self._aclgraph: list[dict] = []  # torchair reduce-overhead / npugraph_ex compiles in progress
        self._eager_compiles = 0  # torchair debug.run_eagerly compiles in progress
        self.tagged_events: dict[str, object] = {}  # torchair.ops tag registry
        self.core_limits: dict[int, dict[str, int]] = {}  # by stream_id, as torch_npu keys them
        self.main = Stream(_runtime=self, _name="main")
        self._current = self.main

    # --- streams -----------------------------------------------------------
    def current_stream(self) -> Stream:
        return self._current

    def default_stream(self) -> Stream:
        return self.main

    def set_current(self, stream: Stream) -> None:
        self._current = stream

    def next_side_name(self) -> str:
        self._side_streams += 1
        return f"side:{self._side_streams}"

    def tag_stream(self, tag: str) -> Stream:
        """The one stream per torchair tag, created on first use ("default" is main)."""
        if tag == "default":
            return self.main
        if tag not in self._tag_streams:
            self._tag_streams[tag] = Stream(_runtime=self, _name=f"tag:{tag}")
        return self._tag_streams[tag]

    # --- graph mode --------------------------------------------------------
    @property
    def in_graph_mode(self) -> bool:
        return self._graph_depth > 0

    @contextlib.contextmanager
    def graph_mode(self) -> Iterator[StreamRuntime]:
        """Behave as inside a torchair GE graph until the block ends."""
        self._graph_depth += 1
        entry_stream = self._current
        self.emit("on_graph_mode", True)
        try:
            yield self
        finally:
            self._graph_depth -= 1
            self._current = entry_stream
            self.emit("on_graph_mode", False)

    @property
    def in_aclgraph(self) -> bool:
        return bool(self._aclgraph)

    @property
    def compiling(self) -> bool:
        """torch.compiler.is_compiling() for every torchair mode: GE, aclgraph and run_eagerly."""
        return self.in_graph_mode or self.in_aclgraph or self._eager_compiles > 0

    @contextlib.contextmanager
    def aclgraph_mode(self) -> Iterator[StreamRuntime]:
        """torchair reduce-overhead / npugraph_ex: each stream tag is a real stream; torchair orders
        the tag streams after the graph's start and the output after them, and nothing else."""
        entry_stream = self._current
        start = Event()
        start.record(entry_stream)
        self._aclgraph.append({"start": start, "used": []})
        try:
            yield self
        finally:
            used = self._aclgraph.pop()["used"]
            self._current = entry_stream
            for stream in used:  # the graph's output waits for every side stream it used
                done = Event()
                done.record(stream)
                done.wait(entry_stream)

    def aclgraph_tag_stream(self, tag: str) -> Stream:
        """The tag's stream inside an aclgraph; the first use in a graph waits for the graph's start."""
        stream = self.tag_stream(tag)
        graph = self._aclgraph[-1]
        if stream not in graph["used"] and stream is not self.main:
            graph["start"].wait(stream)
            graph["used"].append(stream)
        return stream

    @contextlib.contextmanager
    def run_eagerly_mode(self) -> Iterator[StreamRuntime]:
        """torchair debug.run_eagerly: traced, then every op runs eagerly (the torchair ops as in eager)."""
        self._eager_compiles += 1
        try:
            yield self
        finally:
            self._eager_compiles -= 1

    # --- recording ---------------------------------------------------------
    @contextlib.contextmanager
    def record_ops(self) -> Iterator[list[OpRecord]]:
        from msrewrite.runtime.recording import RecordOpsMode

        ops: list[OpRecord] = []
        with RecordOpsMode(self, ops):
            yield ops

    # --- listeners ---------------------------------------------------------
    def emit(self, hook: str, *args) -> None:
        for listener in list(self.listeners):
            getattr(listener, hook)(*args)

    def note_api(self, family: str, api: str) -> None:
        """Tell listeners a user frame called ``api``; calls made by the runtime itself are skipped."""
        if not self.listeners:
            return
        caller = sys._getframe(2)  # 0: note_api, 1: the API function, 2: its caller
        if is_runtime(caller.f_code.co_filename):
            return
        self.emit("on_api_call", family, api, user_frame(caller))

    def close(self) -> None:
        self.listeners.clear()
