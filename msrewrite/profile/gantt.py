"""A Mermaid gantt of one step: a section per stream, its kernels, and the marked windows.

Times are µs from the step's start, written as integers under `dateFormat x`; task labels are
cleaned to what msrewrite.suggest.mermaid's strict gantt grammar accepts.
"""

from __future__ import annotations

import re

from msrewrite.profile.analysis import Profile, step_windows
from msrewrite.profile.trace import MARKER

MAX_TASKS_PER_STREAM = 30  # the rest of a stream's kernels are merged into one "… more" task


def _label(text: str) -> str:
    """A short task label: a CUDA kernel's signature shortened to its function's name."""
    short = text.replace("(anonymous namespace)", "").removeprefix("void ")
    short = re.split(r"[<(]", short, maxsplit=1)[0].rsplit("::", 1)[-1] or text
    return re.sub(r"[^A-Za-z0-9_ .+-]", "_", short)[:40].strip() or "kernel"


def gantt(profile: Profile, step_index: int | None = None) -> str:
    """The gantt body (without ``` fences) of the first step holding a marked region, or of
    `step_index` (0-based)."""
    trace = profile.trace
    steps = step_windows(trace)
    if not steps:
        return "gantt\n    title no kernels in the trace\n    dateFormat x\n    axisFormat %L"
    if step_index is None:
        marked = {o.step for r in profile.regions for o in r.occurrences}
        step_index = next((k for k, s in enumerate(steps) if s.name in marked), 0)
    step = steps[min(step_index, len(steps) - 1)]
    lines = ["gantt", f"    title {_label(step.name)} in us from its start", "    dateFormat x", "    axisFormat %L"]
    inside = [k for k in trace.kernels if k.end > step.start and k.start < step.end]
    markers = [m for m in trace.markers if m.end > step.start and m.start < step.end]
    counter = 0

    def task(label: str, start: float, end: float, tags: str = "") -> str:
        nonlocal counter
        counter += 1
        a = max(0, round(start - step.start))
        b = max(a + 1, round(end - step.start))
        return f"    {label} :{tags}t{counter}, {a}, {b}"

    for stream in sorted({k.stream for k in inside} | {m.stream for m in markers}):
        lines.append(f"    section {_label(trace.stream_names.get(stream, stream))}")
        for m in (m for m in markers if m.stream == stream):
            role = MARKER.match(m.name)
            lines.append(
                task(_label(f"{role['tag']} {role['role']} window" if role else m.name), m.start, m.end, "crit, ")
            )
        kernels = [k for k in inside if k.stream == stream]
        for k in kernels[:MAX_TASKS_PER_STREAM]:
            lines.append(task(_label(k.name), k.start, k.end))
        if len(kernels) > MAX_TASKS_PER_STREAM:
            rest = kernels[MAX_TASKS_PER_STREAM:]
            lines.append(task(f"{len(rest)} more kernels", rest[0].start, max(k.end for k in rest)))
    return "\n".join(lines)
