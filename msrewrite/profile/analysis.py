"""What a trace says about each marked overlap: busy time per stream, overlap, exposed side time,
tail, saving against a baseline trace and against suggest's estimate, operators that slowed down.

Definitions (µs, device time), per occurrence of a region (one layer's fork..join):
  side busy   union of the side stream's kernels inside the side window
  main busy   union of the main stream's kernels inside the main window
  overlap     time both unions run at once
  exposed     side busy - overlap: side work nothing on the main stream hid
  tail        how long the side window runs on after the main window ends (the join waits)
A region's `msrewrite:<case>:<tag>:side` and `...:main` windows pair up in order of start time.
A step sums its occurrences (every layer runs the same code, so every layer is an occurrence).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from msrewrite.errors import BadInput
from msrewrite.profile.trace import MARKER, Span, Trace

DEFAULT_THRESHOLD = 0.10  # an operator's busy time grew by more than 10%: contention
MIN_GROWTH_US = 0.5  # below this an operator's change is noise, whatever the ratio


# Intervals -----------------------------------------------------------------------------------------
def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def clipped(kernels: list[Span], stream: str, window: Span) -> list[tuple[float, float]]:
    """The union of `stream`'s kernels cut to `window`."""
    return union(
        [
            (max(k.start, window.start), min(k.end, window.end))
            for k in kernels
            if k.stream == stream and k.end > window.start and k.start < window.end
        ]
    )


class KernelIndex:
    """The kernels of each stream by start time, to find those that meet a window without
    reading them all: a trace of hundreds of MB has hundreds of thousands of kernels and a
    marked window per layer per step."""

    def __init__(self, kernels: list[Span]) -> None:
        by_stream: dict[str, list[Span]] = defaultdict(list)
        for k in kernels:
            by_stream[k.stream].append(k)
        self.streams = {}
        for stream, ks in by_stream.items():
            ks.sort(key=lambda k: k.start)
            reach, furthest = [], float("-inf")  # reach[i]: the latest end among ks[:i + 1]
            for k in ks:
                furthest = max(furthest, k.end)
                reach.append(furthest)
            self.streams[stream] = ([k.start for k in ks], reach, ks)

    def clipped(self, stream: str, window: Span) -> list[tuple[float, float]]:
        """What `clipped(kernels, stream, window)` gives: the kernels that start before the
        window's end, from the first whose prefix reaches past its start."""
        if stream not in self.streams:
            return []
        starts, reach, ks = self.streams[stream]
        lo, hi = bisect.bisect_right(reach, window.start), bisect.bisect_left(starts, window.end)
        return union([(max(k.start, window.start), min(k.end, window.end)) for k in ks[lo:hi] if k.end > window.start])


# Results -------------------------------------------------------------------------------------------
@dataclass
class Occurrence:
    step: str
    side: Span
    main: Span
    side_busy: float
    main_busy: float
    overlap: float
    tail: float

    @property
    def exposed(self) -> float:
        return self.side_busy - self.overlap


@dataclass
class RegionStep:
    step: str
    occurrences: int
    side_busy: float
    main_busy: float
    overlap: float
    exposed: float
    tail: float

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "occurrences": self.occurrences,
            "side_busy_us": _r(self.side_busy),
            "main_busy_us": _r(self.main_busy),
            "overlap_us": _r(self.overlap),
            "exposed_us": _r(self.exposed),
            "tail_us": _r(self.tail),
        }


@dataclass
class Region:
    case: str
    tag: str
    side_stream: str
    main_stream: str
    occurrences: list[Occurrence]
    steps: list[RegionStep]
    estimate_us: float | None = None  # suggest's saving per occurrence, from the plan's cost

    @property
    def name(self) -> str:
        return f"{self.case}:{self.tag}"

    @property
    def measured_us(self) -> float:
        """The side time the overlap hid, per occurrence: what suggest's estimate predicts."""
        return statistics.fmean(o.overlap for o in self.occurrences)

    def to_dict(self, names: dict[str, str]) -> dict:
        return {
            "region": self.name,
            "case": self.case,
            "tag": self.tag,
            "side_stream": names.get(self.side_stream, self.side_stream),
            "main_stream": names.get(self.main_stream, self.main_stream),
            "occurrences": len(self.occurrences),
            "steps": [s.to_dict() for s in self.steps],
            "measured_overlap_per_occurrence_us": _r(self.measured_us),
            "estimated_saving_per_occurrence_us": None if self.estimate_us is None else _r(self.estimate_us),
            "measured_over_estimate": (None if not self.estimate_us else _r(self.measured_us / self.estimate_us)),
        }


@dataclass
class Growth:
    operator: str
    kind: str  # "kernel" (by name) or "type" (op_statistic.csv)
    baseline_us: float  # per step
    measured_us: float

    @property
    def ratio(self) -> float:
        return (self.measured_us - self.baseline_us) / self.baseline_us

    def to_dict(self) -> dict:
        return {
            "operator": self.operator,
            "kind": self.kind,
            "baseline_us_per_step": _r(self.baseline_us),
            "measured_us_per_step": _r(self.measured_us),
            "growth": _r(self.ratio),
        }


@dataclass
class Profile:
    trace: Trace
    regions: list[Region]
    step_us: list[float]
    baseline_step_us: list[float] | None = None
    contention: list[Growth] = field(default_factory=list)
    threshold: float = DEFAULT_THRESHOLD
    notes: list[str] = field(default_factory=list)

    @property
    def saving_us(self) -> float | None:
        if not self.baseline_step_us or not self.step_us:
            return None
        return statistics.median(self.baseline_step_us) - statistics.median(self.step_us)

    def to_dict(self) -> dict:
        names = self.trace.stream_names
        return {
            "trace": self.trace.source,
            "format": self.trace.format,
            "steps": len(self.step_us),
            "step_us": [_r(s) for s in self.step_us],
            "baseline_step_us": None if self.baseline_step_us is None else [_r(s) for s in self.baseline_step_us],
            "saving_per_step_us": None if self.saving_us is None else _r(self.saving_us),
            "regions": [r.to_dict(names) for r in self.regions],
            "contention_threshold": self.threshold,
            "contention": [g.to_dict() for g in self.contention],
            "notes": self.notes,
        }


def _r(x: float) -> float:
    return round(x, 3)


# Analysis ------------------------------------------------------------------------------------------
def step_windows(trace: Trace) -> list[Span]:
    """The trace's steps; a trace without ProfilerStep ranges is one step over all its kernels."""
    if trace.steps:
        return trace.steps
    if not trace.kernels:
        return []
    return [Span("all", min(k.start for k in trace.kernels), max(k.end for k in trace.kernels))]


def _step_finder(steps: list[Span]):
    """step_of(t): the name of the first step (steps are in start order) whose window holds t,
    or "-". The steps before the first whose prefix of ends reaches past t all end by t."""
    starts = [s.start for s in steps]
    reach, furthest = [], float("-inf")
    for step in steps:
        furthest = max(furthest, step.end)
        reach.append(furthest)

    def step_of(t: float) -> str:
        i = bisect.bisect_right(reach, t)
        return steps[i].name if i < len(steps) and starts[i] <= t else "-"

    return step_of


def regions(trace: Trace) -> list[Region]:
    steps = step_windows(trace)
    pairs: dict[tuple[str, str], dict[str, list[Span]]] = defaultdict(lambda: {"side": [], "main": []})
    for marker in trace.markers:
        parts = MARKER.match(marker.name)
        if parts is None:
            raise BadInput(f"{trace.source}: range {marker.name!r} is not msrewrite:<case>:<tag>:side|main")
        pairs[(parts["case"], parts["tag"])][parts["role"]].append(marker)
    out = []
    index = KernelIndex(trace.kernels) if pairs else None
    step_of = _step_finder(steps)
    for (case, tag), roles in pairs.items():
        side, main = roles["side"], roles["main"]
        if len(side) != len(main):
            raise BadInput(
                f"{trace.source}: region {case}:{tag} has {len(side)} side and {len(main)} main "
                f"windows on the device; they must pair up (a range cut off by the trace's end?)"
            )
        occurrences = []
        assert index is not None  # built whenever there are pairs
        for s, m in zip(side, main, strict=True):
            side_u, main_u = index.clipped(s.stream, s), index.clipped(m.stream, m)
            occurrences.append(
                Occurrence(
                    step=step_of(min(s.start, m.start)),
                    side=s,
                    main=m,
                    side_busy=length(side_u),
                    main_busy=length(main_u),
                    overlap=length(intersect(side_u, main_u)),
                    tail=max(0.0, s.end - m.end),
                )
            )
        by_step: dict[str, list[Occurrence]] = defaultdict(list)
        for o in occurrences:
            by_step[o.step].append(o)
        out.append(
            Region(
                case,
                tag,
                side[0].stream,
                main[0].stream,
                occurrences,
                [
                    RegionStep(
                        step,
                        len(os_),
                        sum(o.side_busy for o in os_),
                        sum(o.main_busy for o in os_),
                        sum(o.overlap for o in os_),
                        sum(o.exposed for o in os_),
                        sum(o.tail for o in os_),
                    )
                    for step, os_ in by_step.items()
                ],
            )
        )
    return sorted(out, key=lambda r: r.name)


def _per_step(trace: Trace) -> tuple[dict[str, float], dict[str, float] | None]:
    """Busy time per operator name (and per type on NPU) divided by the number of steps."""
    steps = max(1, len(step_windows(trace)))
    if trace.operator_busy is not None:
        names = dict(trace.operator_busy)
    else:
        names = defaultdict(float)
        for k in trace.kernels:
            names[k.name] += k.dur
    types = None if trace.type_busy is None else {k: v / steps for k, v in trace.type_busy.items()}
    return {k: v / steps for k, v in names.items()}, types


def contention(trace: Trace, baseline: Trace, threshold: float) -> list[Growth]:
    """Operators in both traces whose busy time per step grew by more than `threshold`."""
    names, types = _per_step(trace)
    base_names, base_types = _per_step(baseline)
    grown = []
    for kind, now, before in (("kernel", names, base_names), ("type", types, base_types)):
        if now is None or before is None:
            continue
        for op in sorted(set(now) & set(before)):
            if before[op] > 0 and now[op] - before[op] > max(threshold * before[op], MIN_GROWTH_US):
                grown.append(Growth(op, kind, before[op], now[op]))
    return sorted(grown, key=lambda g: -(g.measured_us - g.baseline_us))


def analyze(
    trace: Trace,
    baseline: Trace | None = None,
    estimates: dict[tuple[str, str], float | None] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
) -> Profile:
    found = regions(trace)
    notes = []
    for region in found:
        if estimates and (region.case, region.tag) in estimates:
            region.estimate_us = estimates[(region.case, region.tag)]
    if estimates:
        missing = sorted(f"{c}:{t}" for c, t in estimates if not any((r.case, r.tag) == (c, t) for r in found))
        if missing:
            notes.append(f"planned but not in the trace (no markers? run apply --markers): {', '.join(missing)}")
    for name in sorted(set(trace.host_only_markers)):
        notes.append(
            f"{name}: a host-only range, never seen on a device stream (NPU: mstx.range_start needs the stream)"
        )
    profile = Profile(trace, found, [s.dur for s in step_windows(trace)], threshold=threshold, notes=notes)
    if baseline is not None:
        profile.baseline_step_us = [s.dur for s in step_windows(baseline)]
        profile.contention = contention(trace, baseline, threshold)
    return profile
