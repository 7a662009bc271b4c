"""One file through the tiers: trace (tiny eager run), else static dataflow; then full-size costs."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

from msrewrite.analyze.stmtgraph import analyze_file, analyze_static
from msrewrite.errors import BadInput
from msrewrite.suggest import graph as g
from msrewrite.suggest.candidates import Candidate, rank, select_ops, static_candidates, trace_candidates
from msrewrite.suggest.profiles import DeviceProfile
from msrewrite.suggest.report import FileAnalysis
from msrewrite.suggest.source import analyze_kept, traced_roots


def analyze(
    file: Path,
    *,
    device: DeviceProfile,
    phase: str = "decode",
    static: bool = False,
    harness: str | None = None,
    target: str | None = None,
    input_shape: tuple[int, ...] | None = None,
    full_size: bool = True,
    progress: Callable[[str], None] | None = None,
) -> FileAnalysis:
    """`progress`, when given, hears each stage of the traced path before it starts."""
    say = progress or (lambda _stage: None)
    file = Path(file)
    display = str(file)
    if static:
        module = analyze_static(file)  # only the forwards that can hold a candidate (see analyze/stmtgraph.py)
        analysis = FileAnalysis(
            file=file, module=module, candidates=[], tiers={}, device=device, phase=phase, target=target
        )
        analysis.tiers = {"trace": "skipped (--static)", "static": "ok"}
        analysis.candidates = rank(static_candidates(module, display, analysis.refused))
        return analysis
    if not file.is_file():
        analyze_file(file)  # raises the one-line error
    analysis = FileAnalysis(file=file, module=None, candidates=[], tiers={}, device=device, phase=phase, target=target)
    from msrewrite.harness import build_harness, one_line  # imports torch: only on the traced path

    # Model code may print; keep stdout clean for --json.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            say(f"building the model in {file.name} (imports torch and the file)")
            built = build_harness(file, harness=harness, target=target, input_shape=input_shape)
            from msrewrite.suggest.trace import record

            say("tracing one forward on tiny inputs")
            trace = record(built.module, built.args, built.kwargs, file)
        except BadInput as exc:
            if harness or input_shape:
                raise
            analysis.tiers = {"trace": f"failed ({exc})", "static": "ok"}
            analysis.module = module = analyze_file(file)
            analysis.candidates = rank(static_candidates(module, display, analysis.refused))
            return analysis
        except Exception as exc:  # the model's own forward failed on the tiny inputs
            if harness or input_shape:
                raise BadInput(f"{file.name}: the forward failed on the given inputs: {one_line(exc)}") from None
            analysis.tiers = {"trace": f"failed ({one_line(exc)})", "static": "ok"}
            analysis.module = module = analyze_file(file)
            analysis.candidates = rank(static_candidates(module, display, analysis.refused))
            return analysis
        # Only the classes the trace ran are parsed (see suggest/source.py).
        analysis.module = module = analyze_kept(file, traced_roots(trace, file))
        analysis.target = built.target
        analysis.trace = trace
        analysis.tiers = {"trace": "ok", "fx": "no candidate function to trace", "static": "not needed"}
        analysis.scopes = {s.qualname: s for s in g.scopes(trace, module.functions)}
        candidates = trace_candidates(trace, module, display, device, analysis.refused)
        say("cross-checking candidates with torch.fx")
        _fx_tier(candidates, built, trace, module, analysis)
        if full_size and built.config is not None:
            say(f"estimating full-size {phase} costs")
            _full_size_costs(candidates, built, file, module, device, phase, analysis)
    analysis.candidates = rank(candidates)
    return analysis


def _fx_tier(candidates: list[Candidate], built, trace, module, analysis: FileAnalysis) -> None:
    """Module-level fx graphs of the functions holding candidates; cross-check each candidate."""
    from msrewrite.harness import one_line
    from msrewrite.suggest import fxgraph
    from msrewrite.suggest.candidates import fx_cross_check

    # Functions of the named cases and of the best candidate: tracing every generic candidate's
    # function (attention, expert loops) would cost more than it tells (see bench/suggest_speed.py).
    ranked = sorted(candidates, key=Candidate.sort_key)
    qualnames = list(dict.fromkeys(c.plan.function for i, c in enumerate(ranked) if i == 0 or c.case != "generic"))
    wanted = {q: analysis.scopes[q].path for q in qualnames if q in analysis.scopes}
    if not wanted:
        return
    try:
        captures = fxgraph.capture(built.module, built.args, built.kwargs, list(set(wanted.values())))
    except Exception as exc:  # the forward ran under the recorder, so this is unexpected
        analysis.tiers["fx"] = f"failed ({one_line(exc)[:160]})"
        return
    for qualname, path in wanted.items():
        cap = captures.get(path)
        if cap is None or not cap.seen:
            continue
        analysis.fx[qualname] = fxgraph.trace_module(qualname, path, trace.modules[path], cap)
    analysis.tiers["fx"] = "; ".join(r.summary() for r in analysis.fx.values()) or "not run"
    for c in candidates:
        result = analysis.fx.get(c.plan.function)
        if result is None:
            continue
        if result.ok:
            fx_cross_check(c, module.functions[c.plan.function], result.dag)
        else:
            c.fx_check = f"unavailable (fx failed on {c.plan.function.rsplit('.', 1)[0]})"


def _full_size_costs(candidates: list[Candidate], built, file: Path, module, device, phase, analysis) -> None:
    from msrewrite.harness import load_module, one_line
    from msrewrite.suggest.cost import branch_cost
    from msrewrite.suggest.fullsize import TOKENS, record_full_size

    try:
        full = record_full_size(built, load_module(file), file, phase)
    except Exception as exc:
        analysis.tiers["full-size"] = f"failed ({one_line(exc)[:120]}); costs from the tiny trace"
        for c in candidates:
            c.notes.append("cost from tiny shapes: the full-size fake run failed")
        return
    notes = "".join(f"; {n}" for n in full.notes)
    analysis.tiers["full-size"] = f"ok ({phase}, T={TOKENS.get(phase, 1)}, default config, bf16{notes})"
    scopes = {s.qualname: s for s in g.scopes(full, module.functions)}
    for c in candidates:
        scope = scopes.get(c.plan.function)
        if scope is None:
            continue
        side, main = select_ops(scope, module.functions[c.plan.function], c.plan)
        if side and main:
            c.cost = branch_cost(side, main, scope.ops, device, syncs=c.min_syncs)
            c.cost_shapes = f"full-size {phase} T={TOKENS.get(phase, 1)}"
            c.notes += [n for n in full.notes if any(o.estimate for o in side + main)]
