"""`msrewrite profile`: what a device trace says about the overlaps an edit made."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from msrewrite.errors import EXIT_NOTHING_TO_DO, EXIT_OK, BadInput

EDIT_MARKER = re.compile(r"msrewrite:([A-Za-z0-9_.-]+):([A-Za-z0-9_-]+):(?:side|main)")


def estimates_from(path: Path) -> dict[tuple[str, str], float | None]:
    """(case, region tag: the stream tag, or the branch) -> suggest's estimated saving per
    occurrence (µs), from a plan file written
    by `suggest --json` (cost kept with each candidate); from an edited model file, the regions its
    markers name, without an estimate."""
    from msrewrite.load import read_source

    text = read_source(path)
    if path.suffix == ".py":
        return {(case, tag): None for case, tag in EDIT_MARKER.findall(text)}
    from msrewrite.plan import MicrobatchPlan, load_plans, plan_from_dict

    try:
        load_plans(text)  # the same checks apply --plan makes, field by field
        data = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"--edit {path}: {exc}") from None
    out: dict[tuple[str, str], float | None] = {}
    for candidate in data.get("candidates", []) if isinstance(data, dict) else []:
        plan = plan_from_dict(candidate["plan"])
        if isinstance(plan, MicrobatchPlan):  # a model-level fork marks no region (no --markers)
            continue
        out.setdefault((plan.case, plan.region_tag), _saving(candidate.get("cost")))
    return out


def _saving(cost: dict | None) -> float | None:
    """suggest's estimate, recomputed by its own cost model from the costs the plan file keeps."""
    if not cost:
        return None
    from msrewrite.suggest.cost import BranchCost

    branch = BranchCost(
        side_time=cost["side_us"] / 1e6,
        main_time=cost["main_us"] / 1e6,
        scope_time=cost["function_us"] / 1e6,
        side_flops=cost["side_flops"],
        main_flops=cost["main_flops"],
        side_bytes=cost["side_bytes"],
        main_bytes=cost["main_bytes"],
        sync_time=cost["sync_us"] / 1e6,
        launches=0,
    )
    return branch.saving * 1e6


def run_profile(
    *,
    trace: Path,
    edit: Path | None = None,
    baseline: Path | None = None,
    json_out: bool = False,
    threshold: float = 0.1,
    gantt: bool = False,
    step: int | None = None,
) -> int:
    from msrewrite.profile.analysis import analyze
    from msrewrite.profile.gantt import gantt as make_gantt
    from msrewrite.profile.trace import dropped_summary, load_trace

    if not (0 <= threshold < 100):
        raise BadInput(f"--threshold must be a fraction such as 0.1 (10%), got {threshold}")
    if step is not None and step < 1:
        raise BadInput(f"--step must be a step number from 1, got {step}")
    estimates = estimates_from(edit) if edit is not None else None
    measured = load_trace(trace)
    before = load_trace(baseline) if baseline is not None else None
    for read in (measured, before):
        if read is not None and read.dropped:
            print(f"msrewrite: {read.source}: dropped {dropped_summary(read)}", file=sys.stderr)
    profile = analyze(measured, before, estimates, threshold)
    chart = make_gantt(profile, None if step is None else step - 1)
    if json_out:
        data = profile.to_dict()
        data["gantt"] = chart
        # marker events that could not be placed: reason -> count, per trace read
        data["dropped_events"] = {
            "trace": dict(sorted(measured.dropped.items())),
            "baseline": dict(sorted(before.dropped.items())) if before is not None else None,
        }
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_profile(profile)
        if gantt:
            print("\n```mermaid\n" + chart + "\n```")
    return EXIT_OK if profile.regions else EXIT_NOTHING_TO_DO


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _say(text: str, indent: str = "") -> None:
    import textwrap

    print(
        textwrap.fill(
            text,
            width=79,
            initial_indent=indent,
            subsequent_indent=indent + "    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    )


def print_profile(profile) -> None:
    """The table and the lines under it, each at most 80 columns."""
    from msrewrite.commands.suggest import fit_table

    trace = profile.trace
    title = f"{Path(trace.source).name}  [{trace.format}, {len(profile.step_us)} step(s), {len(trace.kernels)} kernels]"
    print(fit_table([title], [], shrink={0: 20})[0])
    if profile.regions:
        rows = []
        for region in profile.regions:
            for s in region.steps:
                rows.append(
                    [
                        region.name,
                        s.step.replace("ProfilerStep#", "#"),
                        str(s.occurrences),
                        _us(s.side_busy),
                        _us(s.main_busy),
                        _us(s.overlap),
                        _us(s.exposed),
                        _us(s.tail),
                    ]
                )
        header = ["region", "step", "n", "side", "main", "overlap", "exposed", "tail"]
        for line in fit_table(header, rows, shrink={0: 12, 1: 4}):
            print(line)
        print("(µs of device time per step; n = occurrences, one per layer)")
        for region in profile.regions:
            if region.estimate_us is not None:
                ratio = region.measured_us / region.estimate_us if region.estimate_us else float("nan")
                _say(
                    f"{region.name}: overlap {region.measured_us:.1f} µs per occurrence vs suggest's estimate "
                    f"{region.estimate_us:.1f} µs ({ratio:.2f}x)"
                )
    else:
        _say("no msrewrite regions in the trace (apply --markers, then profile the edited model)")
    if profile.saving_us is not None:
        import statistics

        base = statistics.median(profile.baseline_step_us)
        _say(
            f"step (median): {statistics.median(profile.step_us):.1f} µs vs baseline {base:.1f} µs: "
            f"saving {profile.saving_us:.1f} µs ({profile.saving_us / base:.1%})"
            if base
            else "step: baseline is empty"
        )
        if profile.contention:
            print(f"operators whose busy time grew by more than {profile.threshold:.0%} (contention):")
            for g in profile.contention[:10]:
                name = g.operator if len(g.operator) <= 40 else g.operator[:39] + "…"
                _say(f"{name} ({g.kind}): {g.baseline_us:.1f} -> {g.measured_us:.1f} µs/step (+{g.ratio:.0%})", "  ")
        else:
            print(f"no operator grew by more than {profile.threshold:.0%}")
    for note in profile.notes:
        _say(f"note: {note}")
