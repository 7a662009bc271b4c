"""`apply --plan` re-derives every plan with the branch finder `apply --case` uses, and `suggest`
proposes only what it accepts (issue 10, items 1 and 9)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import EXAMPLES, ROOT, run_main
from msrewrite.commands.apply import run_apply
from msrewrite.errors import NothingToDo
from msrewrite.plan import OverlapPlan
from msrewrite.suggest.pipeline import analyze
from msrewrite.suggest.profiles import profile

FIXTURE = ROOT / "tests" / "fixtures" / "unsafe_plans.py"


def line(text: str, after: str | None = None) -> int:
    """1-based line of `text` in the fixture (the first one after the line starting `after`)."""
    lines = FIXTURE.read_text().splitlines()
    start = next(i for i, s in enumerate(lines) if s.strip().startswith(after)) if after else 0
    return next(i for i, s in enumerate(lines[start:], start + 1) if s.strip().startswith(text))


def plan(function: str, side: list[dict], fork: int, join: int, inputs=("x",), outputs=()) -> dict:
    return {
        "case": "generic",
        "file": str(FIXTURE),
        "function": function,
        "side": side,
        "fork_line": fork,
        "join_line": join,
        "side_inputs": list(inputs),
        "side_outputs": list(outputs),
        "stream_tag": "side",
    }


def hoist(source: str, at: int, temp: str) -> dict:
    return {"first_line": at, "last_line": at, "source": source, "hoist": temp}


def forged_plans() -> dict[str, tuple[dict, str]]:
    """Hand-written plans, each something the finder refuses, with the reason it must give."""
    mlp = line("return self.down_proj(", after="class ForkIsJoin")
    guard = line("if self.shared_experts is not None:", after="class GuardedShared")
    loop = line("for i in range(2):", after="class LoopedHeads")
    cond = line("out = out + (self.shared_experts(x)", after="class ConditionalShared")
    shared = line("shared = self.shared_experts(x)", after="class ViewAlias")
    return {
        "fork-is-join": (
            plan(
                "ForkIsJoin.forward",
                [hoist("self.up_proj(x)", mlp, "up_proj_output")],
                mlp,
                mlp,
                outputs=["up_proj_output"],
            ),
            # the seed statement returns: the join, whose gate_proj/act run before the hoisted call
            "never used|nothing to overlap|before the side call in the same statement|which the plan does not",
        ),
        "hoist-out-of-if": (  # drops the `is not None` guard: flag off would raise TypeError too
            plan(
                "GuardedShared.forward",
                [hoist("self.shared_experts(x)", guard, "shared_output")],
                guard - 1,
                guard,
                outputs=["shared_output"],
            ),
            "conditional inside the join|nothing to overlap|also needs the call",
        ),
        "hoist-out-of-for": (  # would run a layer once instead of once per iteration
            plan(
                "LoopedHeads.forward",
                [hoist("self.heads[i](x)", loop, "heads_output")],
                loop - 1,
                loop,
                inputs=["x", "i"],
                outputs=["heads_output"],
            ),
            "inside a `for` block",
        ),
        "hoist-out-of-conditional-expression": (
            plan(
                "ConditionalShared.forward",
                [hoist("self.shared_experts(x)", cond, "shared_output")],
                cond - 1,
                cond,
                outputs=["shared_output"],
            ),
            "conditional expression",
        ),
        "view-alias-written-in-place": (  # flat = x.view(-1); flat.mul_(2) while the side reads x
            plan(
                "ViewAlias.forward",
                [{"first_line": shared, "last_line": shared, "source": "shared = self.shared_experts(x)"}],
                shared,
                shared + 4,
                outputs=["shared"],
            ),
            "writes 'flat' in place",
        ),
    }


def carry_out(tmp_path: Path, plan_dict: dict, file: Path = FIXTURE, protect: str = "") -> str:
    """`apply --plan` in process: the diff, or NothingToDo with the refusal."""
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan_dict))
    run_apply(
        file=file,
        case=None,
        plan_path=plan_file,
        candidate=None,
        mode="auto",
        target=None,
        flag="",
        flag_default="on",
        max_tokens=None,
        stream_tag=None,
        in_place=False,
        output=None,
        verify=False,
        harness=None,
        protect=protect,
    )
    return "edited"


@pytest.mark.parametrize("name", list(forged_plans()))
def test_apply_plan_refuses_a_forged_unsafe_plan(tmp_path: Path, name: str, capsys) -> None:
    plan_dict, reason = forged_plans()[name]
    OverlapPlan.from_dict(plan_dict)  # well-formed: only the analysis can tell it is unsafe
    with pytest.raises(NothingToDo, match=reason) as refused:
        carry_out(tmp_path, plan_dict, protect="none")  # a write a snapshot fixes is refused only without one
    assert str(refused.value).startswith(f"refused plan for {plan_dict['function']}: ")
    assert capsys.readouterr().out == ""  # nothing printed, nothing written


def test_apply_plan_snapshots_the_forged_plans_input_by_default(tmp_path: Path, capsys) -> None:
    """The view-alias plan's only hazard is a main-path write of the side input after the fork:
    --protect auto (the default) carries it out with the side stream reading a copy of x."""
    plan_dict, _reason = forged_plans()["view-alias-written-in-place"]
    carry_out(tmp_path, plan_dict)
    out = capsys.readouterr().out
    assert "x_side = _ms_snapshot(x)" in out and "self.shared_experts(x_side)" in out


def test_cli_refusal_is_one_line_exit_1(tmp_path: Path) -> None:
    plan_dict, _reason = forged_plans()["hoist-out-of-for"]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan_dict))
    result = run_main("apply", "--plan", str(plan_file), str(FIXTURE))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith("msrewrite: error: refused plan for LoopedHeads.forward: ")


def test_plan_differing_from_the_finder_is_refused_and_lifetimes_come_from_the_analysis(tmp_path: Path, capsys) -> None:
    shared = line("shared = self.shared_experts(x)", after="class Safe")
    side = [{"first_line": shared, "last_line": shared, "source": "shared = self.shared_experts(x)"}]
    with pytest.raises(NothingToDo, match=f"joins at line {shared + 2}"):
        carry_out(tmp_path, plan("Safe.forward", side, shared, shared + 1, outputs=["shared"]))
    # a plan that forgets its output still gets the output's lifetime guard: the analysis decides
    carry_out(tmp_path, plan("Safe.forward", side, shared, shared + 2, outputs=[]))
    assert "_ms_record_stream(current_stream, shared)" in capsys.readouterr().out


def test_suggest_never_proposes_what_apply_refuses() -> None:
    from msrewrite.analyze.stmtgraph import set_vouched

    try:
        set_vouched((), "none")  # as apply --protect none: no snapshot lifts the view's write
        analysis = analyze(FIXTURE, device=profile("a3"), static=True)
    finally:
        set_vouched((), "auto")
    functions = {c.plan.function for c in analysis.candidates}
    assert functions == {"Safe.forward"}  # every unsafe shape above is refused, with a reason
    # (ForkIsJoin's calls are all in one statement: not even a choice; these two reach the finder)
    assert {r["function"] for r in analysis.refused} >= {"ConditionalShared.forward", "ViewAlias.forward"}
    (top,) = analysis.candidates
    assert top.case == "moe-shared-expert"
    # with apply's default (--protect auto) the view's write is lifted by a snapshot, as apply does
    protected = analyze(FIXTURE, device=profile("a3"), static=True)
    (view,) = [c.plan for c in protected.candidates if c.plan.function == "ViewAlias.forward"]
    assert view.protect_inputs == ("x",)
    assert "ConditionalShared.forward" not in {c.plan.function for c in protected.candidates}


def _statically_suggested(files: list[Path]):
    for file in files:
        for rank, candidate in enumerate(analyze(file, device=profile("a3"), static=True).candidates, 1):
            yield file, rank, candidate


def test_every_suggested_candidate_on_the_examples_passes_apply_plan(tmp_path: Path, capsys) -> None:
    seen = 0
    for file, _rank, candidate in _statically_suggested(sorted(EXAMPLES.glob("*.py")) + [FIXTURE]):
        seen += 1
        # fork = join only when the window's main work is hoisted out of the join statement itself
        assert candidate.plan.fork_line < candidate.plan.join_line or candidate.plan.main_hoists, candidate.plan
        assert carry_out(tmp_path, candidate.plan.to_dict(), file) == "edited", candidate.plan
        diff = capsys.readouterr().out
        assert diff.startswith("--- a/"), candidate.plan
    assert seen >= 8


@pytest.mark.slow  # the CLI with verify
def test_generic_plan_through_apply_plan_verifies(tmp_path: Path) -> None:
    """The edit a plan makes is proven like a case's: original = flag off = flag on, sanitizer clean."""
    analysis = analyze(FIXTURE, device=profile("a3"), static=True)
    plan_file = tmp_path / "plans.json"
    plan_file.write_text(json.dumps({"candidates": [c.to_dict() for c in analysis.candidates]}))
    # the fixture's make() builds Safe: verify runs that one
    rank = 1 + [c.plan.function for c in analysis.candidates].index("Safe.forward")
    result = run_main("apply", "--plan", str(plan_file), "--candidate", str(rank), str(FIXTURE), "--verify")
    assert result.returncode == 0, result.stderr
    assert "+            with torch.npu.stream(" in result.stdout


@pytest.mark.slow  # traces the model (runs it)
def test_traced_candidates_pass_apply_plan_too(tmp_path: Path, capsys) -> None:
    """The traced tier builds its plans through the same finder and the same check."""
    model = EXAMPLES / "deepseek_moe.py"
    analysis = analyze(model, device=profile("a3"), harness=f"{model}:make", full_size=False)
    assert analysis.tiers["trace"] == "ok" and analysis.candidates
    assert analysis.candidates[0].case == "moe-shared-expert"
    for candidate in analysis.candidates:
        assert carry_out(tmp_path, candidate.plan.to_dict(), model) == "edited", candidate.plan
        assert capsys.readouterr().out.startswith("--- a/")
