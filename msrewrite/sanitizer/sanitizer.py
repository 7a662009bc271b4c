"""The stream sanitizer: races, lifetimes, unjoined work and GE misuse on the CPU runtime.

Accesses are tracked per storage. Eager mode follows CSAN: a conflicting access
on another stream must be ordered by the vector clocks. In GE graph mode the
compiler orders data dependencies itself, so a conflict becomes a join instead.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves

from msrewrite.runtime import RuntimeListener, Stream, StreamRuntime
from msrewrite.runtime.frames import location, normalize_files, user_frame
from msrewrite.sanitizer.access import classify
from msrewrite.sanitizer.calls import ModuleCalls
from msrewrite.sanitizer.clocks import VectorClocks
from msrewrite.sanitizer.findings import Finding, Location, fmt, where
from msrewrite.sanitizer.host import HostReads
from msrewrite.torch_modes import DispatchMode

_HOST_SYNC_OPS = {"aten._local_scalar_dense.default"}  # .item() waits for the current stream
# a constant made from Python data just now (`x[:4] = 0`, `torch.tensor(...)` in a forward): on a
# device it is copied in on the current stream, not made before the sanitizer on the default one
_LIFTED_CONSTANT_OPS = {"aten.lift_fresh.default", "aten.lift_fresh_copy.default"}


@dataclass
class Access:
    stream: Stream
    seq: int
    loc: Location
    snapshot: dict  # the stream's clock at the access: what a GE data edge waits for


@dataclass
class StorageInfo:
    alloc_stream: Stream
    last_write: Access | None = None
    reads: dict = field(default_factory=dict)  # stream -> latest read since last write
    uses: dict = field(default_factory=dict)  # stream (not alloc) -> latest eager use
    recorded: set = field(default_factory=set)  # streams passed to record_stream
    lifetime_reported: bool = False
    host: bool = False  # a copy made to the host (`.cpu()`, `.to("cpu")`), not device memory
    host_copy: Access | None = None  # that copy, while non_blocking and not yet waited for by the host


class _DispatchMode(DispatchMode):
    def __init__(self, sanitizer: Sanitizer):
        super().__init__()
        self.sanitizer = sanitizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.sanitizer._on_op(func, args, kwargs, out)
        return out


class Sanitizer(RuntimeListener):
    """``with Sanitizer(rt, user_files=[...]) as san: ...; san.findings``.

    Run the model under ``torch.no_grad()``: autograd keeps intermediates alive,
    so their frees, and the lifetime bugs around them, only happen in inference.
    """

    def __init__(self, runtime: StreamRuntime, user_files=()):
        self.runtime = runtime
        self.user_files = normalize_files(user_files)
        self.findings: list[Finding] = []
        self.clocks = VectorClocks()
        self._storages: dict[int, StorageInfo] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self._launches: dict[Stream, list[tuple[int, Location]]] = {}
        self._wait_edges: dict[tuple[int, object], dict] = {}
        self._discarded_waits: dict[tuple[int, object], Location] = {}
        self._api_calls: dict[object, dict[str, tuple[Location, str]]] = {}
        self._reported: set = set()
        self._mode = _DispatchMode(self)
        self._host_reads = HostReads(self)
        self._calls = ModuleCalls()
        self._active = False

    # --- context -----------------------------------------------------------------
    def __enter__(self) -> Sanitizer:
        self.runtime.listeners.append(self)
        self._storage_hooks = _StorageHooks(self)
        self._storage_hooks.install()
        self._calls.__enter__()
        self._mode.__enter__()
        self._host_reads.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._host_reads.__exit__(*exc)
        self._mode.__exit__(*exc)
        self._calls.__exit__(*exc)
        self._storage_hooks.remove()
        try:
            if exc[0] is None:
                self._check_unjoined(self.runtime.default_stream(), self._here(), "the sanitized block ends")
        finally:
            self._active = False
            self.runtime.listeners.remove(self)
            for finalizer in self._finalizers.values():
                finalizer.detach()
            self._finalizers.clear()

    def check_output(self, output) -> None:
        """Call where the module returns: side work must be joined, returned tensors safe to free."""
        stream, here = self.runtime.current_stream(), self._here()
        self._check_unjoined(stream, here, "the output is returned")
        if self.runtime.in_graph_mode:
            return  # GE joins every stream before the graph output and plans memory itself
        for tensor in tree_leaves(output):
            if not isinstance(tensor, torch.Tensor):
                continue
            info = self._info(tensor)
            if info is None:
                continue
            self._check_lifetime(info, here, "returned")
            if info.alloc_stream is not stream and stream not in info.recorded and not info.lifetime_reported:
                info.lifetime_reported = True
                self._report(
                    "lifetime",
                    here,
                    here,
                    f"tensor allocated on {info.alloc_stream.name} is returned {where(here)} to "
                    f"{stream.name} without record_stream({stream.name}): its memory can be reused by "
                    f"{info.alloc_stream.name} while {stream.name} still reads it",
                )

    # --- ops -----------------------------------------------------------------------
    def _on_op(self, func, args, kwargs, out) -> None:
        stream = self.runtime.current_stream()
        loc = self._here()
        if str(func) in _LIFTED_CONSTANT_OPS and args and isinstance(args[0], torch.Tensor):
            self._info(args[0], alloc_stream=stream)
        reads, writes, fresh = classify(func, args, kwargs, out)
        seq = self._launch(stream, loc)
        for tensor in fresh:
            self._info(tensor, alloc_stream=stream)
        for tensor in reads:
            self._read(tensor, stream, seq, loc)
        for tensor in writes + fresh:
            self._write(tensor, stream, seq, loc)
        if str(func) in _HOST_SYNC_OPS:
            self.clocks.sync_stream(stream)

    def _launch(self, stream, loc) -> int:
        seq = self.clocks.launch(stream)
        self._launches.setdefault(stream, []).append((seq, loc))
        return seq

    def _read(self, tensor, stream, seq, loc) -> None:
        key, info = self._key(tensor), self._info(tensor)
        if info is None:
            return
        if self.runtime.in_graph_mode:
            self._apply_ge_wait(key, stream, loc)
        write = info.last_write
        if write is not None and not self.clocks.covers(stream, write.seq, write.stream):
            self._conflict("race-raw", write, stream, loc, "reads", "written")
        info.reads[stream] = Access(stream, seq, loc, dict(self.clocks.clock(stream)))
        self._note_use(info, stream, seq, loc)

    def _write(self, tensor, stream, seq, loc) -> None:
        info = self._info(tensor)
        if info is not None:
            self._write_info(info, stream, seq, loc)

    def _write_info(self, info: StorageInfo, stream, seq, loc) -> None:
        if info.reads:
            for read in info.reads.values():
                if not self.clocks.covers(stream, read.seq, read.stream):
                    self._conflict("race-war", read, stream, loc, "writes", "read")
        elif info.last_write is not None and not self.clocks.covers(
            stream, info.last_write.seq, info.last_write.stream
        ):
            self._conflict("race-waw", info.last_write, stream, loc, "writes", "written")
        info.last_write = Access(stream, seq, loc, dict(self.clocks.clock(stream)))
        info.reads = {}
        self._note_use(info, stream, seq, loc)

    def _conflict(self, kind, earlier: Access, stream, loc, verb, past) -> None:
        if self.runtime.in_graph_mode:
            self.clocks.merge(stream, earlier.snapshot)  # GE inserts the cross-stream edge itself
            return
        self._report(
            kind,
            earlier.loc,
            loc,
            f"{stream.name} {verb} {where(loc)} a tensor {past} on {earlier.stream.name} "
            f"{where(earlier.loc)} with no event or wait_stream ordering them",
        )

    def _note_use(self, info: StorageInfo, stream, seq, loc) -> None:
        if stream is not info.alloc_stream and not self.runtime.in_graph_mode:
            info.uses[stream] = Access(stream, seq, loc, {})

    # --- lifetimes ---------------------------------------------------------------------
    def _on_free(self, key: int) -> None:
        info = self._storages.pop(key, None)
        self._finalizers.pop(key, None)
        if info is not None and self._active:
            self._check_lifetime(info, self._here(), "freed")

    def _check_lifetime(self, info: StorageInfo, here: Location, how: str) -> None:
        if info.lifetime_reported:
            return
        for stream, use in info.uses.items():
            if stream in info.recorded or self.clocks.covers(info.alloc_stream, use.seq, stream):
                continue
            info.lifetime_reported = True
            alloc = info.alloc_stream.name
            self._report(
                "lifetime",
                use.loc,
                here,
                f"tensor allocated on {alloc} is used on {stream.name} {where(use.loc)} and {how} "
                f"{where(here)} with neither record_stream({stream.name}) nor {alloc} waiting for "
                f"{stream.name}: its memory can be reused while {stream.name} may still run",
            )
            return

    # --- storages ----------------------------------------------------------------------
    @staticmethod
    def _key(tensor) -> int | None:
        try:
            return tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None  # sparse, nested or storage-less tensors are not tracked

    def _info(self, tensor, alloc_stream=None) -> StorageInfo | None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return self._storage_info(storage, alloc_stream)

    def _storage_info(self, storage, alloc_stream=None) -> StorageInfo:
        key = storage._cdata
        info = self._storages.get(key)
        if info is None:
            # Tensors first seen here were allocated before the sanitizer: on the default stream.
            info = StorageInfo(alloc_stream or self.runtime.default_stream())
            self._storages[key] = info
            self._finalizers[key] = weakref.finalize(storage, self._on_free, key)
        return info

    # --- storage operations outside the dispatcher ------------------------------------
    def on_storage_change(self, storage, what: str) -> None:
        """`untyped_storage().resize_(n)` or `t.data = other`, seen before it happens: a write to the
        storage (its contents change under every tensor using it) and, for a resize, a free of its
        memory while another stream may still use it."""
        if not self._active:
            return
        stream, loc = self.runtime.current_stream(), self._here()
        seq = self._launch(stream, loc)
        info = self._storage_info(storage)
        self._write_info(info, stream, seq, loc)
        if what == "resize":
            self._check_lifetime(info, loc, "freed by untyped_storage().resize_")

    # --- host reads outside the dispatcher (host.HostReads) -----------------------------
    def on_host_read(self, tensor) -> None:
        """`t.tolist()`, `t.numpy()`, `np.asarray(t)`, `print(t)`: on a device a copy to the host on
        the current stream, which the host waits for; of a host copy, a read the host makes itself."""
        info = self._info(tensor)
        if info is None:
            return
        stream, loc = self.runtime.current_stream(), self._here()
        if info.host:
            self._check_host_copy(info, loc)
            return
        self._read(tensor, stream, self._launch(stream, loc), loc)
        self.clocks.sync_stream(stream)

    def on_host_copy(self, copy, non_blocking: bool) -> None:
        """`copy` was just made from device memory by `.cpu()` / `.to("cpu")` (an aten `_to_copy`
        on the current stream); a blocking copy makes the host wait for that stream."""
        info = self._info(copy)
        if info is None:
            return
        info.host = True
        if non_blocking:
            info.host_copy = info.last_write
        else:
            self.clocks.sync_stream(self.runtime.current_stream())

    def is_host(self, tensor) -> bool:
        key = self._key(tensor)
        info = self._storages.get(key) if key is not None else None
        return info is not None and info.host

    def _check_host_copy(self, info: StorageInfo, loc: Location) -> None:
        copy, info.host_copy = info.host_copy, None
        if copy is None or self.clocks.host_covers(copy.stream, copy.seq):
            return
        self._report(
            "race-raw",
            copy.loc,
            loc,
            f"the host reads {where(loc)} a tensor copied to it on {copy.stream.name} {where(copy.loc)} "
            f"with non_blocking=True and no synchronize between them: the copy may not have landed",
        )

    # --- runtime hooks -----------------------------------------------------------------
    def on_event_record(self, event, stream) -> None:
        self.clocks.record_event(event, stream)

    def on_event_wait(self, event, stream) -> None:
        self.clocks.wait_event(event, stream)

    def on_stream_synchronize(self, stream) -> None:
        self.clocks.sync_stream(stream)

    def on_event_synchronize(self, event) -> None:
        self.clocks.sync_event(event)

    def on_device_synchronize(self) -> None:
        self.clocks.sync_all()

    def on_record_stream(self, tensor, stream) -> None:
        info = self._info(tensor)
        if info is not None:
            info.recorded.add(stream)

    def on_graph_mode(self, entered: bool) -> None:
        if not entered and not self.runtime.in_graph_mode:
            # The GE graph ends: its output waits for every stream the graph used.
            current = self.runtime.current_stream()
            for stream in self.clocks.streams():
                self.clocks.merge(current, self.clocks.clock(stream))

    def on_wait_tensor(self, tensor, dependency, stream, discarded_at) -> None:
        key = self._key(tensor)
        if key is None:
            return
        self._info(tensor)
        if discarded_at is not None:
            self._discarded_waits[(key, stream)] = discarded_at
            return
        self._discarded_waits.pop((key, stream), None)
        dep = self._info(dependency)
        if dep is not None and dep.last_write is not None:
            edge = self._wait_edges.setdefault((key, stream), {})
            for other, seq in dep.last_write.snapshot.items():
                edge[other] = max(edge.get(other, 0), seq)

    def _apply_ge_wait(self, key, stream, loc) -> None:
        if (key, stream) in self._wait_edges:
            self.clocks.merge(stream, self._wait_edges[(key, stream)])
        discarded = self._discarded_waits.pop((key, stream), None)
        if discarded is not None:
            self._report(
                "ge-discarded-wait",
                discarded,
                loc,
                f"npu_wait_tensor result is discarded at {fmt(discarded)} but the original tensor is "
                f"used on {stream.name} at {fmt(loc)}: GE drops the unused wait; rebind "
                f"`x = npu_wait_tensor(x, dep)` and use the result",
            )

    def on_api_call(self, family, api, frame) -> None:
        if frame is None:
            return
        seen = self._api_calls.setdefault(frame.f_code, {})
        seen.setdefault(family, (location(frame), api))
        others = [f for f in seen if f != family]
        if others and frame.f_code not in self._reported:
            self._reported.add(frame.f_code)
            first_loc, first_api = seen[others[0]]
            here = location(frame)
            self._report(
                "mixed-api",
                first_loc,
                here,
                f"{frame.f_code.co_name}() mixes {others[0]} {first_api} at {fmt(first_loc)} with "
                f"{family} {api} at {fmt(here)}: use one mode family per function",
            )

    # --- reporting ---------------------------------------------------------------------
    def _check_unjoined(self, stream, here: Location, when: str) -> None:
        if self.runtime.in_graph_mode:
            return
        clock = self.clocks.clock(stream)
        for other, launches in self._launches.items():
            if other is stream:
                continue
            pending = [loc for seq, loc in launches if seq > clock.get(other, 0)]
            if pending and ("unjoined", other, pending[0]) not in self._reported:
                self._reported.add(("unjoined", other, pending[0]))
                self._report(
                    "unjoined",
                    pending[0],
                    here,
                    f"work on {other.name} from {fmt(pending[0])} ({len(pending)} op(s)) is not joined "
                    f"into {stream.name} when {when} {where(here)}",
                )

    def _report(self, kind: str, first: Location, second: Location, message: str) -> None:
        key = (kind, first, second)
        if key not in self._reported:
            self._reported.add(key)
            self.findings.append(Finding(kind, message, first, second))

    def _here(self) -> Location:
        frame = user_frame(sys._getframe(1), self.user_files)
        if frame is None or self._calls.outside(frame, self.user_files):
            # No model line behind it, only the caller's: say where it is against the module call
            # (its inputs made before it, its locals freed as it returns).
            return self._calls.label()
        self._calls.last_user = loc = (frame.f_code.co_filename, frame.f_lineno)
        return loc


class _StorageHooks:
    """Storage changes that never reach a TorchDispatchMode, patched while a sanitizer runs:
    `UntypedStorage.resize_` and the `Tensor.data` setter."""

    def __init__(self, sanitizer: Sanitizer) -> None:
        self.sanitizer = sanitizer
        self._saved: list[tuple[type, str, object]] = []

    def install(self) -> None:
        sanitizer = self.sanitizer
        resize = torch.UntypedStorage.resize_

        def resize_(storage, size, *args, **kwargs):
            sanitizer.on_storage_change(storage, "resize")
            return resize(storage, size, *args, **kwargs)

        base = vars(torch._C.TensorBase)["data"]  # the getset descriptor itself

        def set_data(tensor, value):
            with contextlib.suppress(RuntimeError, NotImplementedError):
                sanitizer.on_storage_change(tensor.untyped_storage(), "data")
            base.__set__(tensor, value)

        self._patch(torch.UntypedStorage, "resize_", resize_)
        self._patch(torch.Tensor, "data", property(base.__get__, set_data))

    def _patch(self, owner: type, name: str, value: object) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def remove(self) -> None:
        for owner, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._saved.clear()


_MISSING = object()
