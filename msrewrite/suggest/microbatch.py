"""suggest's prefill-microbatch candidate: the model-level fork `apply --case prefill-microbatch`
makes, proposed with its plan (`"kind": "microbatch"`), so `suggest --json > plans.json` and
`apply --plan plans.json` carry it out like any other candidate.

Only files whose text holds a layer loop (`for layer in self.layers: h = layer(h)`) and calls a
collective or a named comm helper are parsed (collectives only in another module are left to
`apply --case`, which reads them through the summaries);
the plan comes from the case's own analysis (analyze/microbatch.py) and is emitted once, so what
is proposed is exactly what `apply --plan` accepts. There is no cost model for micro-batching: the
candidate carries no estimate and low confidence (time it with `msrewrite bench`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from msrewrite.plan import MicrobatchPlan
from msrewrite.records import record

CASE = "prefill-microbatch"
_LOOP = re.compile(r"^[ \t]*for (\w+) in self\.\w+:[ \t]*\r?\n[ \t]*\(?[\w, \t]+\)?[ \t]*=[ \t]*\1\(", re.M)
# a collective (or a named comm helper) the file itself calls, as analyze/microbatch.py knows them
_COMM = re.compile(r"(?:all_reduce|all_to_all|all_gather|reduce_scatter|broadcast|dispatch|combine)\w*\s*\(")
NOTE = f"no cost model for micro-batching: time it with `msrewrite bench --case {CASE}`"


@record
class MicrobatchCandidate:
    plan: MicrobatchPlan
    command: str

    @property
    def case(self) -> str:
        return self.plan.case

    def to_dict(self) -> dict[str, Any]:
        from msrewrite.analyze.microbatch import describe_stages

        return {
            "case": self.case,
            "file": self.plan.file,
            "function": self.plan.function,
            "layer": self.plan.layer,
            "stages": describe_stages(self.plan.stages),
            "estimated_saving": None,
            "estimated_saving_us": None,
            "confidence": "low",
            "tier": "static",
            "command": self.command,
            "notes": [NOTE],
            "plan": self.plan.to_dict(),
        }


# `file` is unused; commands/suggest.py (another area) still passes it: drop it together with that call
def microbatch_candidates(file: Path, text: str, display: str, refused: list[dict]) -> list[MicrobatchCandidate]:  # noqa: ARG001
    """The micro-batch fork of each model class with a layer loop (its refusals go to `refused`)."""
    if not (_LOOP.search(text) and _COMM.search(text)):
        return []
    import libcst as cst

    from msrewrite.analyze.microbatch import NotApplicable, find_layer_loop, forward_of, microbatch_plan
    from msrewrite.cases import get_case
    from msrewrite.emit.engine import apply_plans
    from msrewrite.errors import MsrewriteError
    from msrewrite.modes import detect_mode
    from msrewrite.plan import FlagSpec

    try:
        module = cst.parse_module(text)
        mode, _why = detect_mode(text)
    except (cst.ParserSyntaxError, ValueError):
        return []  # the other tiers say why the file cannot be read
    case = get_case(CASE)
    assert case is not None  # CASE is a built-in case
    models = [
        s.name.value
        for s in module.body
        if isinstance(s, cst.ClassDef)
        if (f := forward_of(s)) is not None and find_layer_loop(f) is not None
    ]
    found = []
    for model in models:
        function = f"{model}.forward"
        try:
            plan = microbatch_plan(
                module,
                case=CASE,
                path=display,
                mode=mode if mode in case.modes else "eager",
                flag=FlagSpec(name=case.flag_name),
                target=model,
                stream_tag=case.stream_tag,
                text=text,
            )
            if mode not in case.modes:  # a fork to make, in a file of a mode the case does not emit
                raise MsrewriteError(f"the file is {mode} code; {CASE} supports {', '.join(case.modes)}")
            # what the emitter refuses is not proposed; apply_plans takes a MicrobatchPlan too (alone)
            apply_plans(module, [plan], text)
        except NotApplicable:  # nothing to fork here: not a refusal
            continue
        except MsrewriteError as exc:
            refused.append(
                {"function": function, "side": [f"{CASE} of the layer loop"], "tier": "static", "reason": str(exc)}
            )
            continue
        found.append(MicrobatchCandidate(plan, f"msrewrite apply --case {CASE} --target {model} {display}"))
    return found
