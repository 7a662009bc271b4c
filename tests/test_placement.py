"""Placement (issue 27 item 2): `--side shared|routed` for moe-shared-expert.

`shared` runs the shared expert on the side stream (vLLM, vllm-ascend); `routed` runs the router
and routed experts there, on the model's own `self.alt_stream` where it has one, and keeps the
shared expert on the current stream (SGLang's CUDA paths). The default follows the file's own
convention and says which and why. Both get the branch analysis' checks (the routed plan is the
shared plan with its two sets swapped, cases/_placement.py); with routed, a snapshot of what the
routed work may write is read by the shared expert on the current stream. Every routed edit here
that the case makes runs through verify under every schedule (early, late, interleaved).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import ROOT, run_main
from msrewrite.analyze.branch import NoBranch
from msrewrite.commands.apply import case_steps
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec, OverlapPlan, load_plans

FLAG = FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM")
FIXTURES = ROOT / "tests" / "fixtures"

# SGLang's shape: the layer holds the model's alt_stream, the shared expert reads hidden_states
# first, and the routed experts then write their output into hidden_states in place (as
# fused_experts(..., inplace=True) does): with routed on the side stream, the shared expert must
# read a snapshot.
ROUTED_MOE = '''"""SGLang-shaped MoE block whose routed experts write hidden_states in place."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class FusedExperts(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.experts = nn.ModuleList(MLP(d) for _ in range(n))

    def forward(self, hidden_states: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for i, expert in enumerate(self.experts):
            out = out + expert(hidden_states) * weights[:, i : i + 1]
        hidden_states.copy_(out)
        return hidden_states


class SparseMoeBlock(nn.Module):
    def __init__(self, d=16, n=4, alt_stream=None):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = FusedExperts(d, n)
        self.shared_experts = MLP(d)
        self.alt_stream = alt_stream

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        shared_output = self.shared_experts(hidden_states)
        router_logits = self.gate(hidden_states)
        weights = torch.softmax(router_logits, dim=-1)
        final_hidden_states = self.experts(hidden_states, weights)
        final_hidden_states = final_hidden_states + shared_output
        return final_hidden_states.view(num_tokens, hidden_dim)


class Model(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        alt_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.layers = nn.ModuleList(SparseMoeBlock(alt_stream=alt_stream) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + x
        return x


def make():
    torch.manual_seed(0)
    return Model().eval(), (torch.randn(8, 16),)
'''
FORWARD = ROUTED_MOE[ROUTED_MOE.index("    def forward(self, hidden_states: torch.Tensor)") :]
# the routed work rebinds its own input: the tensor made on the current stream loses its name while
# the side stream still reads it, so it is kept alive on the side stream (record_stream)
REBINDS = ROUTED_MOE.replace(
    "        shared_output = self.shared_experts(hidden_states)\n",
    "        residual = hidden_states\n        shared_output = self.shared_experts(residual)\n",
).replace(
    "        final_hidden_states = self.experts(hidden_states, weights)\n",
    "        hidden_states = hidden_states * 1.0\n        final_hidden_states = self.experts(hidden_states, weights)\n",
)
# the routed work rebinds a name the shared expert reads before it in the source: issued first at the
# fork, it would hand the shared expert the new binding
REBINDS_SHARED_INPUT = ROUTED_MOE.replace(
    "        final_hidden_states = self.experts(hidden_states, weights)\n",
    "        hidden_states = hidden_states * 1.0\n        final_hidden_states = self.experts(hidden_states, weights)\n",
)
# the shared expert sits inside an `if` the routed work is outside of: the swap cannot carry it
GUARDED = (ROOT / "examples" / "guarded_moe.py").read_text()
# the shared expert writes its input in place while the routed experts read it: the side branch
# writing what the main path reads, whichever runs on the side stream; no snapshot can help
SHARED_WRITES = ROUTED_MOE.replace(
    "        shared_output = self.shared_experts(hidden_states)\n",
    "        shared_output = self.shared_experts(hidden_states.mul_(2.0))\n",
)
SGLANG_IMPORT = "from sglang.srt.utils import add_prefix  # noqa: F401\n"


def with_sglang_import(source: str) -> str:
    return source.replace("from torch import nn\n", "from torch import nn\n\n" + SGLANG_IMPORT, 1)


def edit(tmp_path: Path, source: str, mode: str = "cuda", side: str | None = "routed", protect: str = "auto"):
    original = tmp_path / "block.py"
    original.write_text(source)
    src = load(original)
    extra = {"side": side} if side else {}
    steps = case_steps(
        original, src.text, src.module, "moe-shared-expert", mode, None, FLAG, None, protect=protect, extra=extra
    )
    edited = tmp_path / f"block_{mode}_ms.py"
    edited.write_text(steps[-1].new)
    return steps[-1], edited, original


def refusal(tmp_path: Path, source: str, **options) -> str:
    with pytest.raises(NothingToDo) as err:
        edit(tmp_path, source, **options)
    return str(err.value)


def verified(tmp_path: Path, source: str, mode: str = "cuda", side: str | None = "routed"):
    from msrewrite.verify import verify_files

    step, edited, original = edit(tmp_path, source, mode, side)
    result = verify_files(edited, original=original, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.schedules == ["early", "late", "interleaved"], result.schedule_note
    assert result.ok and not result.findings, result.problems
    flag_on = next(r for r in result.runs if r.name == "flag on")
    assert any(s != "main" for s in flag_on.streams), flag_on.streams
    return step.plans[0], edited.read_text()


# --- what the routed edit is (fast: no verify) --------------------------------------------------------
def test_routed_puts_the_routed_work_on_the_models_stream_and_the_shared_expert_reads_a_snapshot(tmp_path):
    step, edited, _ = edit(tmp_path, ROUTED_MOE)
    (plan,) = step.plans
    text = edited.read_text()
    assert plan.placement == "routed" and plan.protect_inputs == ("hidden_states",)
    assert [s.source for s in plan.side] == [
        "router_logits = self.gate(hidden_states)",
        "weights = torch.softmax(router_logits, dim=-1)",
        "final_hidden_states = self.experts(hidden_states, weights)",
    ]
    # the model's own stream, SGLang's shape: the snapshot and the fork, the routed work on the
    # stream, the shared expert on the current stream reading the copy, the join
    expected = """
        routed_experts_stream = self.alt_stream if self.enable_moe_shared_expert_stream else None
        if routed_experts_stream is not None:
            # msrewrite(moe-shared-expert): the routed experts' work on the side stream may write hidden_states before the join: the shared expert reads a copy.
            hidden_states_side = hidden_states.clone()
            current_stream = torch.cuda.current_stream()
            routed_experts_stream.wait_stream(current_stream)
            with torch.cuda.stream(routed_experts_stream):
                router_logits = self.gate(hidden_states)
                weights = torch.softmax(router_logits, dim=-1)
                final_hidden_states = self.experts(hidden_states, weights)
        else:
            hidden_states_side = hidden_states
        shared_output = self.shared_experts(hidden_states_side)
"""
    assert expected in text, text
    assert "current_stream.wait_stream(routed_experts_stream)" in text
    assert "_ms_side_stream" not in text  # no second stream next to the model's
    # the flag-off path runs the original statements, in their order, on the same tensors
    off = text[text.index("        else:\n            router_logits") :]
    assert off.index("router_logits = self.gate(hidden_states)") < off.index("final_hidden_states = self.experts")


def test_the_routed_work_keeps_an_input_it_rebinds_alive_on_the_side_stream(tmp_path):
    step, edited, _ = edit(tmp_path, REBINDS)
    (plan,) = step.plans
    assert plan.inputs_rebound_before_join == ("hidden_states",)
    assert "_ms_record_stream(routed_experts_stream, hidden_states)" in edited.read_text()


def test_names_of_a_comprehension_are_no_inputs(tmp_path):
    from msrewrite.cases import require_case

    step, edited, _ = edit(tmp_path, require_case("moe-shared-expert").valid[0])
    (plan,) = step.plans
    assert plan.side_inputs == ("x",) and plan.inputs_rebound_before_join == ()
    assert "_ms_record_stream(routed_experts_stream" not in edited.read_text()


def test_the_routed_plan_round_trips_and_the_shared_one_does_not_name_a_placement(tmp_path):
    step, _, _ = edit(tmp_path, ROUTED_MOE)
    (plan,) = step.plans
    assert load_plans(plan.to_json()) == [plan]
    shared, _, _ = edit(tmp_path, ROUTED_MOE, side="shared")
    assert "placement" not in shared.plans[0].to_dict()
    with pytest.raises(ValueError, match="placement must be one of shared, routed"):
        OverlapPlan.from_dict({**plan.to_dict(), "placement": "middle"})
    with pytest.raises(ValueError, match="a routed placement cannot be combined"):
        plan.with_changes(phase_anchors=("weights",))


# --- the default: the file's own convention ------------------------------------------------------------
@pytest.mark.parametrize(
    "source, mode, placement, said",
    [
        (with_sglang_import(ROUTED_MOE), "cuda", "routed", "the default here: the file imports sglang"),
        (with_sglang_import(ROUTED_MOE), "eager", "shared", ""),  # SGLang's NPU paths: no such convention
        (ROUTED_MOE, "cuda", "shared", ""),
        (
            ROUTED_MOE.replace(
                "    def forward(self, hidden_states: torch.Tensor)",
                "    def warm_up(self, x):\n"
                "        with torch.cuda.stream(self.alt_stream):\n"
                "            self.gate(x)\n\n"
                "    def forward(self, hidden_states: torch.Tensor)",
            ),
            "cuda",
            "routed",
            "SparseMoeBlock.warm_up already runs routed work on self.alt_stream",
        ),
    ],
    ids=["sglang-cuda", "sglang-npu", "plain", "class-convention"],
)
def test_the_default_placement_follows_the_files_convention_and_says_why(tmp_path, source, mode, placement, said):
    step, _, _ = edit(tmp_path, source, mode=mode, side=None)
    (plan,) = step.plans
    assert plan.placement == placement
    if said:
        assert said in plan.summary and "--side shared moves the shared expert instead" in plan.summary
    else:
        assert plan.summary.startswith("shared expert on a side stream")
        assert plan.summary.endswith(
            "--side shared (the default: the file shows no convention of its own; --side routed runs the router "
            "and routed experts there instead)"
        )


def test_side_shared_on_an_sglang_file_keeps_the_shared_expert_on_the_side(tmp_path):
    step, edited, _ = edit(tmp_path, with_sglang_import(ROUTED_MOE), side="shared")
    assert step.plans[0].placement == "shared" and "--side shared (as asked;" in step.plans[0].summary
    assert "shared_expert_stream = self.alt_stream if" in edited.read_text()


def test_a_default_that_cannot_be_routed_falls_back_to_shared_and_says_why(tmp_path):
    step, _, _ = edit(tmp_path, with_sglang_import(GUARDED), side=None)
    (plan,) = step.plans
    assert plan.placement == "shared"
    assert "--side shared (the default would be routed: the file imports sglang" in plan.summary
    assert "but the side work sits inside `if self.shared_experts is not None`" in plan.summary


# --- refusals -------------------------------------------------------------------------------------------
def test_side_routed_refuses_what_the_swap_cannot_carry(tmp_path):
    why = refusal(tmp_path, GUARDED)
    assert (
        "--side routed: the side work sits inside `if self.shared_experts is not None`, and the window outside "
        "it; --side shared moves the shared expert instead"
    ) in why, why


def test_the_window_moves_only_when_it_cannot_leave_the_function():
    """The branch analysis already refuses an exit in the window; the swap checks it again before
    it puts the window inside `with <side stream>:` (a join skipped would race)."""
    import libcst as cst

    from msrewrite.analyze.defuse import node_facts
    from msrewrite.cases._placement import _cannot_move

    def facts(code: str):
        f = node_facts(cst.parse_statement(code))
        f.first_line = 7
        return [f]

    assert _cannot_move(facts("if x is None:\n    raise ValueError('x')\n")) == (
        "line 7 of the window holds `raise`, which must not move onto the side stream"
    )
    assert "`return`" in _cannot_move(facts("for e in es:\n    if e:\n        return e\n"))
    assert _cannot_move(facts("y = [lambda: (yield)]\n")) == ""  # inside a nested scope: not the window's
    assert _cannot_move(facts("def f():\n    return 1\n")) == ""


def test_side_routed_refuses_rebinding_a_name_the_shared_expert_reads_first(tmp_path):
    """Verify caught this one: the routed statements, issued at the fork, ran before the shared
    expert's and handed it the new binding. A snapshot does not help: no tensor is written."""
    why = refusal(tmp_path, REBINDS_SHARED_INPUT)
    assert (
        "--side routed: line 44 rebinds 'hidden_states', which line 41 (kept on the current stream) reads first; "
        "issued at the fork, line 44 would run before it"
    ) in why, why
    step, _, _ = edit(tmp_path, REBINDS_SHARED_INPUT, side="shared")  # the shared placement has no such order
    assert step.plans[0].placement == "shared"


@pytest.mark.slow  # runs the model through verify
def test_the_rebinding_refused_under_routed_races_when_forced(tmp_path, monkeypatch):
    """The twin of the refusal: the swap forced past the check hands the shared expert the new tensor."""
    from msrewrite.cases import _placement
    from msrewrite.verify import verify_files

    monkeypatch.setattr(_placement, "_rebinds_before_read", lambda *_args: "")
    step, edited, original = edit(tmp_path, REBINDS_SHARED_INPUT)
    result = verify_files(edited, original=original, schedule_source=ScheduleSource(step.old, step.plans))
    assert not result.ok, result.problems


def test_the_swap_checks_the_order_of_names_and_module_state_itself():
    """The branch analysis refuses module state the main path changes while the side reads it; the
    swap checks the host-side order again (the window's statements now run first)."""
    import libcst as cst

    from msrewrite.analyze.defuse import node_facts
    from msrewrite.cases._placement import _rebinds_before_read

    def fact(code: str, index: int):
        f = node_facts(cst.parse_statement(code))
        f.index, f.first_line = index, 40 + index
        return f

    seed = [fact("shared = self.shared_experts(x)", 1)]
    assert "line 42 changes self.shared_experts.calls, which line 41" in _rebinds_before_read(
        seed, [fact("self.shared_experts.calls = 1", 2)], set()
    )
    assert _rebinds_before_read(seed, [fact("self.experts.calls = 1", 2)], set()) == ""
    assert "line 42 rebinds 'x', which line 41" in _rebinds_before_read(seed, [fact("x = x * 2", 2)], set())
    assert _rebinds_before_read(seed, [fact("x = x * 2", 2)], {"x"}) == ""  # reads its snapshot, bound at the fork
    assert "binds first" in _rebinds_before_read(seed, [fact("shared = 0", 2)], set())
    assert _rebinds_before_read(seed, [fact("x = x * 2", 0)], set()) == ""  # before it in the source


def test_side_routed_refuses_the_shared_expert_writing_what_the_routed_work_reads(tmp_path):
    """A hazard a snapshot cannot fix is refused whichever branch is on the side stream."""
    why = refusal(tmp_path, SHARED_WRITES)
    assert "hidden_states" in why and "--protect clone" not in why, why
    assert refusal(tmp_path, SHARED_WRITES, side="shared") == why


def test_side_routed_with_protect_none_refuses_the_in_place_write(tmp_path):
    why = refusal(tmp_path, ROUTED_MOE, protect="none")
    assert "writes 'hidden_states' in place while the side stream reads it" in why, why


def test_side_is_an_option_of_moe_shared_expert_alone(tmp_path):
    from msrewrite.cases._base import cli_params

    assert "side" in [name for name, _kind, _spec in cli_params(["--case", "moe-shared-expert"])]
    assert "side" not in [name for name, _kind, _spec in cli_params(["--case", "indexer-prolog"])]
    path = tmp_path / "block.py"
    path.write_text(ROUTED_MOE)
    bad = run_main("apply", "--case", "moe-shared-expert", "--mode", "cuda", "--side", "middle", str(path))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "msrewrite: error: --side must be one of shared, routed, got 'middle'"
    ), bad.stderr
    other = run_main("apply", "--case", "indexer-prolog", "--side", "routed", str(path))
    assert other.returncode == 2
    assert "--side is for moe-shared-expert; indexer-prolog has no shared and routed experts to place" in other.stderr


def test_apply_prints_the_placement_and_why(tmp_path):
    path = tmp_path / "block.py"
    path.write_text(ROUTED_MOE)
    done = run_main("apply", "--case", "moe-shared-expert", "--mode", "cuda", "--side", "routed", str(path))
    assert done.returncode == 0, done.stderr
    assert "router and routed experts on a side stream, shared expert on the current stream" in done.stderr
    assert "--side routed (as asked; --side shared moves the shared expert instead)" in done.stderr


def test_a_routed_plan_file_is_carried_out_as_apply_side_routed_makes_it(tmp_path):
    """apply --plan derives a routed plan again the way `apply --case --side routed` does (the
    case's shared-expert branch, swapped) and holds the file's plan against it: the same edit."""
    from msrewrite.plancheck import check_plan

    step, _, original = edit(tmp_path, ROUTED_MOE)
    plan = step.plans[0]
    src = load(original)
    checked = check_plan(src.module, OverlapPlan.from_json(plan.to_json()), src.text, original)
    assert checked.placement == "routed" and checked.side == plan.side and checked.protect_inputs == ("hidden_states",)
    plans = tmp_path / "plans.json"
    plans.write_text(plan.to_json())
    done = run_main("apply", "--plan", str(plans), str(original))
    assert done.returncode == 0, done.stderr
    assert "self.shared_experts(hidden_states_side)" in done.stdout


def test_a_routed_plan_that_moves_other_work_is_refused(tmp_path):
    from msrewrite.plancheck import check_plan

    step, _, original = edit(tmp_path, ROUTED_MOE)
    plan = step.plans[0]
    src = load(original)
    with pytest.raises(NoBranch, match="is not side work|also needs"):
        check_plan(src.module, plan.with_changes(side=plan.side[:-1]), src.text, original)
    with pytest.raises(NoBranch, match="forks at line"):
        check_plan(src.module, plan.with_changes(fork_line=plan.fork_line - 1), src.text, original)


# --- every routed edit verifies ---------------------------------------------------------------------------
@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["cuda", "eager", "npugraph-ex", "ge-graph"])
def test_routed_edits_with_a_snapshot_verify_in_every_mode(tmp_path, mode):
    plan, text = verified(tmp_path, ROUTED_MOE, mode=mode)
    assert plan.placement == "routed" and plan.protect_inputs == ("hidden_states",)
    assert "shared_output = self.shared_experts(hidden_states_side)" in text


@pytest.mark.slow  # runs the model through verify
def test_the_routed_snapshot_is_needed_forced_without_it_verify_fails(tmp_path):
    """The twin: the same routed plan without its copy races (the routed work, issued at the fork,
    writes hidden_states while the shared expert on the current stream reads it)."""
    from msrewrite.emit.engine import apply_plans
    from msrewrite.verify import verify_files

    step, _, original = edit(tmp_path, ROUTED_MOE)
    bare = [p.with_changes(protect_inputs=()) for p in step.plans]
    src = load(original)
    edited = tmp_path / "bare_ms.py"
    edited.write_text(apply_plans(src.module, bare, src.text).code)
    result = verify_files(edited, original=original, schedule_source=ScheduleSource(src.text, bare))
    assert not result.ok
    assert any("differs" in p for p in result.problems), result.problems


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["cuda", "eager"])
def test_a_routed_edit_that_rebinds_its_input_verifies(tmp_path, mode):
    plan, _text = verified(tmp_path, REBINDS, mode=mode)
    assert plan.inputs_rebound_before_join == ("hidden_states",)


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("example", ["deepseek_moe", "qwen_gated_moe", "inplace_moe", "hunyuan_moe", "deepep_moe"])
def test_the_bundled_examples_verify_routed(tmp_path, example):
    from helpers import EXAMPLES

    plan, _text = verified(tmp_path, (EXAMPLES / f"{example}.py").read_text())
    assert plan.placement == "routed"


@pytest.mark.slow  # runs the model through verify
def test_an_sglang_file_is_routed_by_default_and_verifies(tmp_path, monkeypatch):
    """SGLang's own fixture (tests/fixtures/frameworks stands in for the package), --mode cuda and
    nothing else: the routed experts go to the side stream, and the edit verifies."""
    monkeypatch.syspath_prepend(str(FIXTURES / "frameworks"))
    plan, text = verified(tmp_path, (FIXTURES / "sglang_style_moe.py").read_text(), side=None)
    assert plan.placement == "routed" and "the file imports sglang" in plan.summary
    assert "with torch.cuda.stream(routed_experts_stream):" in text


def test_unknown_case_options_of_a_plan_are_refused(tmp_path):
    """--side with --plan: the plan carries its own placement."""
    step, _, original = edit(tmp_path, ROUTED_MOE, side="shared")
    plans = tmp_path / "plans.json"
    plans.write_text(step.plans[0].to_json())
    done = run_main("apply", "--plan", str(plans), "--side", "routed", str(original))
    assert done.returncode == 2 and "--side" in done.stderr, done.stderr


def test_the_codemod_takes_side_as_apply_does(tmp_path):
    """msrewrite/codemods: the case's own options are the codemod's arguments too."""
    import argparse

    import libcst as cst
    from libcst.codemod import CodemodContext

    from msrewrite.codemods.moe_shared_expert import MoeSharedExpert

    parser = argparse.ArgumentParser()
    MoeSharedExpert.add_args(parser)
    args = vars(parser.parse_args(["--mode", "cuda", "--side", "routed"]))
    path = tmp_path / "block.py"
    path.write_text(ROUTED_MOE)
    command = MoeSharedExpert(CodemodContext(filename=str(path)), **args)
    new = command.transform_module(cst.parse_module(ROUTED_MOE)).code
    step, _, _ = edit(tmp_path, ROUTED_MOE)
    assert new == step.new and "with torch.cuda.stream(routed_experts_stream):" in new
