"""Read a profiler trace into device spans: kernels per stream, marked regions, steps.

Two formats, read field by field as their writers produce them:

torch.profiler (`export_chrome_trace`, kineto). Read from torch 2.13's
`torch/profiler/_cupti_monitor_trace.py` (which writes the same events kineto does):
  - device work: `{"ph": "X", "cat": "kernel" | "gpu_memcpy" | "gpu_memset", "name", "pid": device,
    "tid": stream, "ts": µs, "dur": µs, "args": {"device", "context", "stream", "correlation", ...}}`
  - a `record_function` range as the device saw it: `{"ph": "X", "cat": "gpu_user_annotation",
    "name", "pid": device, "tid": stream, "ts", "dur", "args": {"External id"}}`, one per stream
    that ran kernels launched inside the range (their first start to their last end);
  - the host side: `{"cat": "user_annotation", "name", "tid": host thread, "ts", "dur"}` (also
    `ProfilerStep#N` from `profiler.step()`), and the launches, `{"cat": "cuda_runtime",
    "args": {"correlation"}}`, whose correlation id the kernel repeats. A range without a
    gpu_user_annotation is mapped to the device through these correlations.
  These events are found by torchscan's C-level scan, the rest of the file never decoded; what
  the scan cannot vouch for is decoded by json (torchscan's docstring says when).

torch_npu (`<worker>_ascend_pt/ASCEND_PROFILER_OUTPUT/`), read from Ascend/pytorch
`torch_npu/profiler/analysis/prof_view/` and its `_csv_headers.py`:
  - `trace_view.json`: a bare event array. torch_npu 2.7.1 writes it
    (`prof_view/_trace_view_parser.py`) as its own host events (`prof_common_func/
    _trace_event_manager.py`: `{"ph": "X", "name", "pid", "tid", "ts": "<µs>", "dur", "cat":
    "cpu_op", "args"}` on a process named "Python") followed by CANN msprof's timeline, the
    `msprof_*.json` files it reads as they are (`prof_parse/_cann_file_parser.py`,
    `get_timeline_all_data`). msprof (MindStudio's msprof, `analysis/csrc/application/
    timeline/`) writes the device lanes: `ascend_hardware_assembler.cpp` a task as `{"name",
    "pid", "tid": <stream>, "ts": "<µs>", "dur", "ph": "X", "args": {"Model Id", "Task Type",
    "Physic Stream Id", "Task Id", "Batch Id", "Subtask Id", "connection_id"}}` under a process
    named "Ascend Hardware" whose threads are named "Stream <id>" (`json_assembler.cpp`,
    GenerateTaskMetaData); `device_tx_assembler.cpp` the device side of an mstx range started
    with a stream (`torch_npu.npu.mstx.range_start(message, stream)`) as an `X` event on the
    same process and the stream's thread, named by the message, `args` only `{"Physic Stream
    Id", "Task Id"}`, from the range's first to its last device record
    (`msproftx_device_processor.cpp`). So: an `X` event of that process named
    `msrewrite:...` or `ProfilerStep#N` is a window; one with `args["Task Type"]` is a task;
    the rest (another tool's mstx ranges, KFC turns, step-trace ranges) is not device work.
    A range's thread is its stream id as recorded; msprof maps a task's GE logic stream to its
    physical one (ge_logic_stream_info), so in GE graph mode the two may differ.
  - `kernel_details.csv`: `Step Id` (when steps were recorded), `Device_id, Name, Type,
    Accelerator Core, Start Time(us), Duration(us), Wait Time(us), Block Num`
    (CsvHeaders.OP_SUMMARY_KERNEL_BASE_HEADERS): steps' device windows and per-name busy time.
  - `op_statistic.csv`: `Device_id, OP Type, Core Type, Count, Total Time(us), Min Time(us),
    Avg Time(us), Max Time(us), Ratio(%)`: busy time per operator type.
"""

from __future__ import annotations

import bisect
import csv
import gc
import json
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import NamedTuple

from msrewrite.errors import BadInput
from msrewrite.profile import torchscan
from msrewrite.profile.jsonstream import CHUNK, TraceFormatError, iter_events

MARKER_PREFIX = "msrewrite:"
# <tag>: a stream tag, or a branch of a several-stream case (a case name: may hold "-")
MARKER = re.compile(r"^msrewrite:(?P<case>[A-Za-z0-9_.-]+):(?P<tag>[A-Za-z0-9_-]+):(?P<role>side|main)$")
STEP = re.compile(r"^ProfilerStep#(\d+)$")
_DEVICE_CATS = torchscan.DEVICE_CATS
_RANGE_CATS = ("gpu_user_annotation", "user_annotation")
NPU_OUTPUT = "ASCEND_PROFILER_OUTPUT"


class Span(NamedTuple):
    name: str
    start: float  # µs
    end: float
    stream: str = ""  # "" for a window over every stream (a step)

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    source: str
    format: str  # "torch" or "torch_npu"
    kernels: list[Span] = field(default_factory=list)
    markers: list[Span] = field(default_factory=list)  # device windows of msrewrite:<case>:<tag>:<role>
    steps: list[Span] = field(default_factory=list)  # device windows of ProfilerStep#N, in order
    stream_names: dict[str, str] = field(default_factory=dict)
    host_only_markers: list[str] = field(default_factory=list)  # ranges never seen on a device
    # busy time per operator name (kernel_details.csv) and per operator type (op_statistic.csv), µs
    operator_busy: dict[str, float] | None = None
    type_busy: dict[str, float] | None = None
    # msrewrite marker events that cannot be placed (a ts that is no number, a negative dur, a
    # tid that is no integer): reason -> how many were dropped; `marker_events`: those kept
    dropped: dict[str, int] = field(default_factory=dict)
    marker_events: int = 0

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def dropped_summary(trace: Trace) -> str:
    """ "3 marker events (2 with a negative dur, 1 with a tid that is not an integer)"."""
    total = sum(trace.dropped.values())
    reasons = ", ".join(f"{n} with {why}" for why, n in sorted(trace.dropped.items()))
    return f"{total} msrewrite marker event{'s' if total != 1 else ''} ({reasons})"


def _marker_problem(ts, dur, tid) -> str | None:
    """Why a marker event cannot be placed in time or on a stream (it is then dropped and
    counted, never read as a region of another length or on another stream), or None."""
    import math

    for value, what in ((ts, "ts"), (0 if dur is None else dur, "dur")):
        try:
            number = float(value)
        except (TypeError, ValueError):
            return f"a {what} that is not a number"
        if isinstance(value, bool) or not math.isfinite(number):
            return f"a {what} that is not a finite number"
        if what == "dur" and number < 0:
            return "a negative dur"
    if isinstance(tid, bool) or not isinstance(tid, int):
        return "a tid that is not an integer"
    return None


def load_trace(path: Path) -> Trace:
    """The trace at `path`: a Chrome trace file, or a torch_npu profiler output folder."""
    path = Path(path)
    if not path.exists():
        raise BadInput(f"{path}: no such file or folder")
    # The reader makes hundreds of thousands of tuples and keeps them, none in a reference
    # cycle: the cyclic collector would only walk them again and again (a fifth of the time).
    collecting = gc.isenabled()
    gc.disable()
    try:
        trace = _load_npu(path) if path.is_dir() else _load_torch(path)
        if trace.dropped and not trace.marker_events:
            raise BadInput(f"{path}: no usable marker event: dropped {dropped_summary(trace)}")
        return trace
    except TraceFormatError as exc:
        raise BadInput(f"{path}: {exc}") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise BadInput(f"{path}: cannot read the trace ({exc})") from None
    finally:
        if collecting:
            gc.enable()


def _stream_key(pid, tid) -> str:
    return f"{pid}:{tid}"


def _num(value, what: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TraceFormatError(f"event {what} is not a number: {value!r}") from None


# torch.profiler ------------------------------------------------------------------------------------
# An event the analysis reads holds one of these words, or spells it with a \u escape; the exact
# reader decodes only those.
_torch_keep = re.compile(rb"kernel|gpu_mem|annotation|cuda_runtime|\\u").search


def _load_torch(path: Path, chunk: int = CHUNK) -> Trace:
    trace = Trace(source=str(path), format="torch")
    reader = _TorchEvents(trace)
    try:
        for segment in torchscan.chunks(path, chunk):
            if segment.rows is None:
                reader.events(segment.events)
                continue
            try:
                reader.rows(segment.rows)
            except torchscan.Decode:
                reader.events(segment.decode())
    except torchscan.Unusual:  # a trace the scan cannot cut into whole events: decode it all
        trace = Trace(source=str(path), format="torch")
        reader = _TorchEvents(trace)
        reader.events(iter_events(path, keep=_torch_keep, chunk=chunk))
    reader.finish()
    return trace


def torch_trace_from_events(events, source: str = "") -> Trace:
    """The Trace of already decoded events (the exact path; the tests' reference)."""
    trace = Trace(source=source, format="torch")
    reader = _TorchEvents(trace)
    reader.events(events)
    reader.finish()
    return trace


def _wanted(name: str) -> bool:
    return name.startswith(MARKER_PREFIX) or STEP.match(name) is not None


def _correlation(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TraceFormatError(f"event correlation is not a number: {value!r}") from None


def _hashable(value, what: str):
    if isinstance(value, (list, dict)):
        raise TraceFormatError(f"event {what} is not a number or a string: {value!r}")
    return value


class _TorchEvents:
    """What the analysis takes from the events: kernels per stream, the device and host sides of
    marked ranges and steps, launches. Fed decoded events (`events`) or a chunk's raw rows from
    torchscan (`rows`, all fields converted before any is kept, so a Decode leaves nothing
    behind), in file order; both give the same result for the same events."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.device_ranges: dict[tuple[str, object], list[Span]] = defaultdict(list)
        self.host_ranges: list[tuple[str, float, float, object]] = []
        self.launches: dict[object, list[tuple[float, int]]] = defaultdict(list)  # host tid -> (ts, correlation)
        self.kernel_of: dict[int, Span] = {}
        self.values = torchscan.Values()
        self.stream_of: dict[tuple[bytes, bytes], str] = {}
        self.unnamed = 0

    def _range_id(self, args: dict) -> object:
        """How gpu_user_annotation events of one range are told apart: its External id."""
        if "External id" not in args:
            self.unnamed += 1
            return ("no External id", self.unnamed)
        value = args["External id"]
        return ("json", json.dumps(value, sort_keys=True)) if isinstance(value, (list, dict)) else value

    def events(self, events) -> None:
        trace = self.trace
        for ev in events:
            if not isinstance(ev, dict) or ev.get("ph") != "X":
                continue
            cat = ev.get("cat")
            if not isinstance(cat, str) or cat not in torchscan.CATS:
                continue
            name, args = str(ev.get("name", "")), ev.get("args")
            if not isinstance(args, dict):
                args = {}
            if cat in _RANGE_CATS and name.startswith(MARKER_PREFIX):
                problem = _marker_problem(ev.get("ts"), ev.get("dur"), ev.get("tid"))
                if problem:
                    trace.drop(problem)
                    continue
                trace.marker_events += 1
            start = _num(ev.get("ts"), "ts")
            end = start + _num(ev.get("dur", 0), "dur")
            if cat in _DEVICE_CATS:
                # keyed as the gpu_user_annotation ranges are: pid = device, tid = stream
                stream = _stream_key(ev.get("pid"), ev.get("tid"))
                trace.stream_names.setdefault(stream, f"stream {args.get('stream', ev.get('tid'))}")
                span = Span(name, start, end, stream)
                trace.kernels.append(span)
                if "correlation" in args:
                    self.kernel_of[_correlation(args["correlation"])] = span
            elif cat == "gpu_user_annotation":
                if _wanted(name):
                    stream = _stream_key(ev.get("pid"), ev.get("tid"))
                    self.device_ranges[(name, self._range_id(args))].append(Span(name, start, end, stream))
            elif cat == "user_annotation":
                if _wanted(name):
                    self.host_ranges.append((name, start, end, _hashable(ev.get("tid"), "tid")))
            elif "correlation" in args:  # cuda_runtime
                self.launches[_hashable(ev.get("tid"), "tid")].append((start, _correlation(args["correlation"])))

    def rows(self, columns: dict[str, torchscan.Columns]) -> None:
        """One chunk's columns (torchscan.Segment.rows); raises torchscan.Decode before keeping
        anything when a raw field is not what the scan took it for."""
        commit = []
        device = columns.get("device")
        if device:
            commit.append(self._device_rows(device))
        runtime = columns.get("cuda_runtime")
        if runtime:
            commit.append(self._runtime_rows(runtime))
        keep_ranges = self._range_rows(columns)
        if keep_ranges is not None:
            commit.append(keep_ranges)
        for keep in commit:
            keep()

    def _device_rows(self, device: torchscan.Columns) -> Callable[[], None]:
        """Decodes the kernels of a chunk; returns what keeps them."""
        values = self.values
        starts = torchscan.floats(device.ts, "ts", _num)
        ends = torchscan.ends(starts, torchscan.floats(device.dur, "dur", _num))
        pairs = list(zip(device.pids, device.tids, strict=False))
        new_streams = []
        for pair in dict.fromkeys(pairs):
            if pair not in self.stream_of:
                pid, tid = values.value(pair[0]), values.value(pair[1])
                first = json_object(device.args[pairs.index(pair)])
                new_streams.append((pair, _stream_key(pid, tid), f"stream {first.get('stream', tid)}"))
        stream_of = dict(self.stream_of)
        stream_of.update((pair, key) for pair, key, _ in new_streams)
        spans = list(
            map(
                tuple.__new__,
                repeat(Span),
                zip(values.name_list(device.names), starts, ends, map(stream_of.__getitem__, pairs), strict=False),
            )
        )
        correlated = list(
            zip(torchscan.ints(device.correlations, _correlation), compress(spans, device.has), strict=False)
        )

        def keep_device() -> None:
            self.stream_of.update((pair, key) for pair, key, _ in new_streams)
            for _, key, label in new_streams:
                self.trace.stream_names.setdefault(key, label)
            self.trace.kernels.extend(spans)
            self.kernel_of.update(correlated)

        return keep_device

    def _runtime_rows(self, runtime: torchscan.Columns) -> Callable[[], None]:
        """Decodes the kernel launches (cuda_runtime) of a chunk; returns what keeps them."""
        starts = torchscan.floats(runtime.ts, "ts", _num)
        torchscan.floats(runtime.dur, "dur", _num)
        tids = list(compress(runtime.tids, runtime.has))
        tid_of = {t: _hashable(self.values.value(t), "tid") for t in dict.fromkeys(tids)}
        calls = list(
            zip(
                map(tid_of.__getitem__, tids),
                compress(starts, runtime.has),
                torchscan.ints(runtime.correlations, _correlation),
                strict=False,
            )
        )

        def keep_launches() -> None:
            if len(tid_of) == 1:
                (tid,) = tid_of.values()
                self.launches[tid].extend(zip(map(itemgetter(1), calls), map(itemgetter(2), calls), strict=True))
                return
            for tid, start, correlation in calls:
                self.launches[tid].append((start, correlation))

        return keep_launches

    def _range_rows(self, columns: dict[str, torchscan.Columns]) -> Callable[[], None] | None:
        """Decodes the wanted host and device ranges of a chunk; returns what keeps them, or None."""
        values = self.values
        converted: list[tuple] = []  # (cat, name, start, end, tid) or (cat, name, start, end, stream, args)
        markers = 0
        for cat in ("gpu_user_annotation", "user_annotation"):
            got = columns.get(cat)
            if not got:
                continue
            try:
                starts = torchscan.floats(got.ts, "ts", _num)
                durs = torchscan.floats(got.dur, "dur", _num)
            except TraceFormatError:  # a marker is dropped, a step refused: the decoded path says which
                raise torchscan.Decode from None
            ends = torchscan.ends(starts, durs)
            for i, name in enumerate(values.name_list(got.names)):
                if not _wanted(name):
                    continue
                tid = values.value(got.tids[i])
                if name.startswith(MARKER_PREFIX):
                    if _marker_problem(starts[i], durs[i], tid):
                        raise torchscan.Decode  # counted where the chunk is decoded
                    markers += 1
                if cat == "user_annotation":
                    converted.append((cat, name, starts[i], ends[i], _hashable(tid, "tid")))
                else:
                    stream = _stream_key(values.value(got.pids[i]), tid)
                    converted.append((cat, name, starts[i], ends[i], stream, json_object(got.args[i])))
        if not converted:
            return None

        def keep_ranges() -> None:
            self.trace.marker_events += markers
            # the two kinds fill different tables, so their order between each other is free
            for cat, name, start, end, *rest in converted:
                if cat == "user_annotation":
                    self.host_ranges.append((name, start, end, rest[0]))
                else:
                    stream, args = rest
                    self.device_ranges[(name, self._range_id(args))].append(Span(name, start, end, stream))

        return keep_ranges

    def finish(self) -> None:
        trace = self.trace
        on_device = {name for name, _ in self.device_ranges}
        windows: list[list[Span]] = list(self.device_ranges.values())
        for calls in self.launches.values():
            calls.sort()
        kernel_of = self.kernel_of
        for name, start, end, tid in self.host_ranges:
            if name in on_device:
                continue
            calls = self.launches.get(tid, [])
            first, last = bisect.bisect_left(calls, (start, -1)), bisect.bisect_right(calls, (end, float("inf")))
            spans = [kernel_of[c] for _, c in calls[first:last] if c in kernel_of]
            if not spans:
                if name.startswith(MARKER_PREFIX):
                    trace.host_only_markers.append(name)
                continue
            by_stream: dict[str, list[Span]] = defaultdict(list)
            for span in spans:
                by_stream[span.stream].append(span)
            windows.append(
                [Span(name, min(s.start for s in ks), max(s.end for s in ks), st) for st, ks in by_stream.items()]
            )
        _add_windows(trace, windows)
        trace.kernels.sort(key=_by_time)


def json_object(text: bytes) -> dict:
    """An `args` object's inner text (from the scan) decoded."""
    try:
        value = json.loads(b"{" + text + b"}")
    except ValueError:
        raise torchscan.Decode from None
    return value


_by_time = attrgetter("start", "end")


def _add_windows(trace: Trace, windows: list[list[Span]]) -> None:
    """One range seen on several streams: a step covers all of them; a marker is the range on the
    stream that ran most of it (the side range runs only on the side stream)."""
    for spans in windows:
        name = spans[0].name
        if STEP.match(name):
            trace.steps.append(Span(name, min(s.start for s in spans), max(s.end for s in spans)))
        else:
            trace.markers.append(max(spans, key=lambda s: (s.dur, -s.start)))
    trace.steps.sort(key=lambda s: s.start)
    trace.markers.sort(key=lambda s: (s.start, s.end))


# torch_npu -----------------------------------------------------------------------------------------
def npu_output_folder(path: Path) -> Path:
    """The ASCEND_PROFILER_OUTPUT folder at, or one level under, `path`."""
    if (path / "trace_view.json").is_file():
        return path
    if (path / NPU_OUTPUT / "trace_view.json").is_file():
        return path / NPU_OUTPUT
    found = sorted(path.glob(f"*/{NPU_OUTPUT}/trace_view.json"))
    if len(found) == 1:
        return found[0].parent
    if len(found) > 1:
        raise BadInput(f"{path}: {len(found)} profiler outputs (one per rank?); name one of them")
    raise BadInput(f"{path}: no {NPU_OUTPUT}/trace_view.json (not a torch_npu profiler output)")


# What _load_npu reads: the process and thread names, the tasks (args["Task Type"]) and the ranges
# named msrewrite:... or ProfilerStep#N; each holds one of these words, or spells it with a \u
# escape. The rest of trace_view.json (torch_npu's host ops, the CANN layer) is not decoded.
_npu_keep = re.compile(rb"process_name|thread_name|Task Type|msrewrite:|ProfilerStep#|\\u").search


def _load_npu(path: Path, keep=_npu_keep) -> Trace:
    folder = npu_output_folder(path)
    trace = Trace(source=str(folder), format="torch_npu")
    process: dict[object, str] = {}
    threads: dict[tuple, str] = {}
    events: list[dict] = []
    for ev in iter_events(folder / "trace_view.json", keep=keep):
        ph = ev.get("ph")
        if ph == "M" and ev.get("name") == "process_name":
            process[ev.get("pid")] = str((ev.get("args") or {}).get("name", ""))
        elif ph == "M" and ev.get("name") == "thread_name":
            threads[(ev.get("pid"), ev.get("tid"))] = str((ev.get("args") or {}).get("name", ""))
        elif ph == "X":
            events.append(ev)  # the process table may come after the events
    hardware = {pid for pid, name in process.items() if name == "Ascend Hardware"}
    if not hardware:
        raise BadInput(
            f"{folder / 'trace_view.json'}: no 'Ascend Hardware' process (profiled without the NPU activity?)"
        )
    windows: list[list[Span]] = []
    for ev in events:  # only the events used are timed (so only their ts and dur must be numbers)
        name = str(ev.get("name", ""))
        if ev.get("pid") not in hardware:
            if name.startswith(MARKER_PREFIX):
                trace.host_only_markers.append(name)
            continue
        window = name.startswith(MARKER_PREFIX) or STEP.match(name) is not None
        if name.startswith(MARKER_PREFIX):
            problem = _marker_problem(ev.get("ts"), ev.get("dur"), ev.get("tid"))
            if problem:
                trace.drop(problem)
                continue
            trace.marker_events += 1
        args = ev.get("args")
        if not window and "Task Type" not in (args if isinstance(args, dict) else {}):
            continue  # another tool's mstx range on the stream, a KFC turn, a step-trace range: not a task
        start = _num(ev.get("ts"), "ts")
        span_end = start + _num(ev.get("dur", 0), "dur")
        stream = _stream_key(ev.get("pid"), ev.get("tid"))
        (
            windows.append([Span(name, start, span_end, stream)])
            if window
            else trace.kernels.append(Span(name, start, span_end, stream))
        )
        trace.stream_names.setdefault(stream, threads.get((ev.get("pid"), ev.get("tid")), f"stream {ev.get('tid')}"))
    on_device = {w[0].name for w in windows}
    trace.host_only_markers = sorted(set(trace.host_only_markers) - on_device)
    _add_windows(trace, windows)
    trace.kernels.sort(key=lambda s: (s.start, s.end))
    details = folder / "kernel_details.csv"
    if details.is_file():
        trace.operator_busy, steps = _kernel_details(details)
        if steps and not trace.steps:
            trace.steps = steps
    statistic = folder / "op_statistic.csv"
    if statistic.is_file():
        trace.type_busy = _op_statistic(statistic)
    return trace


def _rows(path: Path, needed: tuple[str, ...]) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = [c for c in needed if c not in (reader.fieldnames or [])]
        if missing:
            raise BadInput(f"{path}: missing column(s) {', '.join(missing)}")
        return list(reader)


def _kernel_details(path: Path) -> tuple[dict[str, float], list[Span]]:
    """Busy time per operator name, and each step's device window (first start to last end)."""
    busy: dict[str, float] = defaultdict(float)
    steps: dict[str, list[float]] = {}
    for row in _rows(path, ("Name", "Start Time(us)", "Duration(us)")):
        start, dur = _csv_num(row, "Start Time(us)", path), _csv_num(row, "Duration(us)", path)
        busy[row["Name"]] += dur
        step = (row.get("Step Id") or "").strip()
        if step:
            window = steps.setdefault(step, [start, start + dur])
            window[0], window[1] = min(window[0], start), max(window[1], start + dur)
    spans = [Span(f"ProfilerStep#{k}", a, b) for k, (a, b) in steps.items()]
    return dict(busy), sorted(spans, key=lambda s: s.start)


def _op_statistic(path: Path) -> dict[str, float]:
    busy: dict[str, float] = defaultdict(float)
    for row in _rows(path, ("OP Type", "Total Time(us)")):
        busy[row["OP Type"]] += _csv_num(row, "Total Time(us)", path)
    return dict(busy)


def _csv_num(row: dict[str, str], column: str, path: Path) -> float:
    try:
        return float(row[column])
    except (TypeError, ValueError):
        raise BadInput(f"{path}: {column} is not a number: {row[column]!r}") from None
