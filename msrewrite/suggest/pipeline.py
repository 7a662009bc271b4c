"""One file through the tiers: trace (tiny eager run), else static dataflow; then full-size costs."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from msrewrite.analyze.dataflow import analyze_file
from msrewrite.errors import BadInput
from msrewrite.suggest import graph as g
from msrewrite.suggest.candidates import Candidate, rank, select_ops, static_candidates, trace_candidates
from msrewrite.suggest.profiles import DeviceProfile
from msrewrite.suggest.report import FileAnalysis


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
) -> FileAnalysis:
    file = Path(file)
    module = analyze_file(file)
    display = str(file)
    analysis = FileAnalysis(file=file, module=module, candidates=[], tiers={}, device=device, phase=phase, target=target)
    if static:
        analysis.tiers = {"trace": "skipped (--static)", "static": "ok"}
        analysis.candidates = rank(static_candidates(module, display))
        return analysis
    from msrewrite.harness import build_harness, one_line  # imports torch: only on the traced path

    # Model code may print; keep stdout clean for --json.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            built = build_harness(file, harness=harness, target=target, input_shape=input_shape)
            from msrewrite.suggest.trace import record

            trace = record(built.module, built.args, built.kwargs, file)
        except BadInput as exc:
            if harness or input_shape:
                raise
            analysis.tiers = {"trace": f"failed ({exc})", "static": "ok"}
            analysis.candidates = rank(static_candidates(module, display))
            return analysis
        except Exception as exc:  # the model's own forward failed on the tiny inputs
            if harness or input_shape:
                raise BadInput(f"{file.name}: the forward failed on the given inputs: {one_line(exc)}") from None
            analysis.tiers = {"trace": f"failed ({one_line(exc)})", "static": "ok"}
            analysis.candidates = rank(static_candidates(module, display))
            return analysis
        analysis.target = built.target
        analysis.trace = trace
        analysis.tiers = {"trace": "ok", "fx": "not needed", "static": "not needed"}
        analysis.scopes = {s.qualname: s for s in g.scopes(trace, module.functions)}
        candidates = trace_candidates(trace, module, display, device)
        if full_size and built.config is not None:
            _full_size_costs(candidates, built, file, module, device, phase, analysis)
    analysis.candidates = rank(candidates)
    return analysis


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
    analysis.tiers["full-size"] = f"ok ({phase}, T={TOKENS.get(phase, 1)}, default config, bf16)"
    scopes = {s.qualname: s for s in g.scopes(full, module.functions)}
    by_index = {op.index: op for op in full.ops}
    for c in candidates:
        scope = scopes.get(c.plan.function)
        if scope is None:
            continue
        side, main = select_ops(scope, module.functions[c.plan.function], c.plan, by_index)
        if side and main:
            c.cost = branch_cost(side, main, scope.ops, device)
            c.cost_shapes = f"full-size {phase} T={TOKENS.get(phase, 1)}"
