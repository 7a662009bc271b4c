"""Main work inside the join statement (issue 10): hoisted out of it on the flag-on path only.

Two serving forwards were refused only because their main work sits in the join statement itself:
SGLang's GraniteMoeDecoderLayer (`shared_output = self.shared_mlp(h)` then
`h = self.block_sparse_moe(h) + shared_output`, under `if self.shared_mlp is None: ... else:`) and
vLLM's Ernie4_5_VLMoeMLP (`return self.shared_experts(x) + super().forward(x)` under
`if self.shared_experts is not None:`). When the window holds no other main work and the join
statement's main calls run, in Python's order, before its first read of a side output and after
nothing but names, literals and hoisted calls, the flag-on path computes them into temporaries
right before the join; the flag-off path keeps the statements exactly as they were.

Every model here is a small reduction with `make()` (tests/test_serving_rules.py's PRELUDE), not
framework code. Each rule has a must-edit model (verified: original = flag off = flag on under
every schedule, sanitizer clean) and must-refuse models (the reason named; where the unsafe shape
can change a result, the edit forced through a plan fails verify).
"""

from __future__ import annotations

import json
import re

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.emit.engine import apply_plans
from msrewrite.emit.schedules import ScheduleSource, variant
from msrewrite.errors import BadInput, NothingToDo
from msrewrite.load import load
from msrewrite.plan import OverlapPlan, SideStatement, load_plans
from msrewrite.plancheck import check_plan
from test_serving_rules import (
    FLAG,
    PRELUDE,
    block_forward,
    edit,
    edits_and_verifies,
    forced_fails_verify,
    model_source,
    refusal,
    verified,
    write,
)

# SGLang granitemoe.py's shape: the shared MLP first (its comment says why), the routed experts
# inside the join statement, all under the `if` on the shared MLP.
GRANITE = """
if self.shared_mlp is None:
    h = self.block_sparse_moe(x, *self.route(x))
else:
    # Routed experts consume `x`, so compute shared first
    shared_output = self.shared_mlp(x)
    h = self.block_sparse_moe(x, *self.route(x)) + shared_output
return h * 2
"""

# vLLM ernie45_vl_moe.py's shape: a subclass whose base forward is the main work, `return`ed with
# the side call in one statement.
ERNIE = (
    PRELUDE
    + """    def forward(self, x):
        return self.experts(x, *self.route(x))


class SharedBlock(Block):
    def __init__(self, with_shared=True):
        super().__init__()
        if not with_shared:
            self.shared_expert = None

    def forward(self, x):
        if self.shared_expert is not None:
            return self.shared_expert(x) + super().forward(x)
        else:
            return super().forward(x)


def make():
    torch.manual_seed(0)
    return SharedBlock().eval(), (torch.randn(12, 32),)
"""
)


def join_block(text: str) -> str:
    """The edited forward from its join comment on."""
    forward = block_forward(text)
    return forward[forward.index("with the flag on,") :]


@pytest.mark.slow  # runs the model through verify
def test_granite_shape_hoists_the_routed_experts_on_the_flag_on_path_only(tmp_path):
    step = edits_and_verifies(tmp_path, "granite", model_source(GRANITE))
    (plan,) = step.plans
    assert [(h.source, h.hoist) for h in plan.main_hoists] == [
        ("self.block_sparse_moe(x, *self.route(x))", "block_sparse_moe_output")
    ]
    assert plan.guard == "self.shared_mlp is not None"
    join = join_block(step.new)
    on, off = join.split("            else:\n", 1)
    # flag on: the routed experts run first (the route call with them), then the join, then the sum
    assert (
        on.index("block_sparse_moe_output = self.block_sparse_moe(x, *self.route(x))")
        < on.index("current_stream.wait_stream(shared_expert_stream)")
        < on.index("h = block_sparse_moe_output + shared_output")
    )
    # flag off: the original two statements, in their order, word for word
    assert off.startswith(
        "                shared_output = self.shared_mlp(x)\n"
        "                h = self.block_sparse_moe(x, *self.route(x)) + shared_output\n"
    )
    assert "# Routed experts consume `x`, so compute shared first" in block_forward(step.new)


def test_the_late_schedule_runs_the_side_work_after_the_hoisted_main_call(tmp_path):
    step = edit(write(tmp_path, "granite_late", model_source(GRANITE)))
    source = ScheduleSource(step.old, step.plans)
    late = block_forward(variant(source, "late"))
    assert (
        late.index("block_sparse_moe_output = self.block_sparse_moe(")
        < late.index("late schedule, side work deferred to here")
        < late.index(".wait_stream(shared_expert_stream)")
    )
    # the hoisted call is one main statement of the window, named as written in the join statement
    line = step.plans[0].join_line
    assert source.window_statements == [(line, "self.block_sparse_moe(x, *self.route(x)) (in the join statement)")]
    assert "interleaved schedule" in block_forward(variant(source, "interleaved"))


@pytest.mark.slow  # runs the model through verify
def test_ernie_shape_hoists_super_forward_and_keeps_the_return(tmp_path):
    path = write(tmp_path, "ernie", ERNIE)
    step = edit(path)
    (plan,) = step.plans
    assert plan.function == "SharedBlock.forward"
    assert [s.hoist for s in plan.side] == ["shared_expert_output"]
    assert [(h.source, h.hoist) for h in plan.main_hoists] == [("super().forward(x)", "super_forward_output")]
    forward = step.new[step.new.index("class SharedBlock") :]
    # super() without arguments, in the method body itself (not in a nested function or lambda)
    assert "                super_forward_output = super().forward(x)\n" in forward
    assert "                return shared_expert_output + super_forward_output\n" in forward
    assert "            else:\n                return self.shared_expert(x) + super().forward(x)\n" in forward
    result = verified(tmp_path, path, step.new, step.plans)
    assert result.ok, result.problems
    assert result.schedules == ["early", "late", "interleaved"]
    assert any(stream != "main" for stream in result.runs[2].streams)


@pytest.mark.slow  # runs the model through verify
def test_assignment_form_without_a_guard_and_with_the_side_call_in_the_join(tmp_path):
    plain = edits_and_verifies(
        tmp_path,
        "plain",
        model_source("shared = self.shared_expert(x)\nh = self.experts(x, *self.route(x)) + shared\nreturn h"),
    )
    assert [h.source for h in plain.plans[0].main_hoists] == ["self.experts(x, *self.route(x))"]
    # the side call hoisted too: it is issued at the fork, the main call runs in the window
    both = edits_and_verifies(
        tmp_path, "both", model_source("return self.experts(x, *self.route(x)) + self.shared_expert(x)")
    )
    (plan,) = both.plans
    assert [s.hoist for s in plan.side] == ["shared_expert_output"]
    assert [h.hoist for h in plan.main_hoists] == ["experts_output"]
    assert "return experts_output + shared_expert_output" in block_forward(both.new)
    assert "return self.experts(x, *self.route(x)) + self.shared_expert(x)" in block_forward(both.new)
    # a function looked up on a module before the main call (`torch.relu`) is no work that moves
    wrapped = edits_and_verifies(
        tmp_path,
        "wrapped",
        model_source("shared = self.shared_expert(x)\nreturn torch.relu(self.experts(x, *self.route(x))) + shared"),
    )
    assert "return torch.relu(experts_output) + shared" in block_forward(wrapped.new)


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["cuda", "npugraph-ex", "ge-graph"])
def test_every_mode_edits_and_verifies(tmp_path, mode):
    path = write(tmp_path, f"granite_{mode.replace('-', '_')}", model_source(GRANITE))
    src = load(path)
    step = case_steps(path, src.text, src.module, "moe-shared-expert", mode, None, FLAG, None)[-1]
    assert step.plans[0].main_hoists
    result = verified(tmp_path, path, step.new, step.plans)
    assert result.ok, result.problems


# Refusals: each names why, in one line ---------------------------------------------------------
REFUSED = {
    "conditional": (
        "shared = self.shared_expert(x)\nreturn (self.experts(x, *self.route(x)) if self.top_k > 1 else x) + shared",
        "self.experts(x, *self.route(x)) runs only on some paths of it (a conditional expression); hoisting it "
        "would change how often it runs",
    ),
    "short_circuit": (
        "shared = self.shared_expert(x)\nreturn (self.has_experts and self.experts(x, *self.route(x))) + shared",
        "runs only on some paths of it (an and/or)",
    ),
    "after_side_read": (
        "shared = self.shared_expert(x)\nreturn shared + self.experts(x, *self.route(x))",
        "self.experts(x, *self.route(x)) runs after the statement reads the side output 'shared'",
    ),
    "reads_side_output": (
        "shared = self.shared_expert(x)\nreturn self.experts(shared, *self.route(x)) + x",
        "self.experts(shared, *self.route(x)) reads the side output 'shared', so it can only run after the join",
    ),
    "evaluated_before": (
        "h = x * 2\nshared = self.shared_expert(h)\nreturn x * 1 + self.bump(h * 0, x) + shared",
        "`x * 1` is evaluated before self.bump(h * 0, x); hoisting the call ahead of it could change what either computes",
    ),
    "walrus": (
        "shared = self.shared_expert(x)\nreturn self.experts(y := x * 1, *self.route(x)) + shared + y",
        "it binds a name with :=",
    ),
    "self_attribute": (
        "shared = self.shared_expert(x)\nreturn self.top_k * self.experts(x, *self.route(x)) + shared",
        "`self.top_k` is evaluated before self.experts(x, *self.route(x))",
    ),
    "twice": (
        "shared = self.shared_expert(x)\nreturn self.experts(x, *self.route(x)) + self.experts(x, *self.route(x)) + shared",
        "appears more than once in it",
    ),
    "later_main_call": (
        "shared = self.shared_expert(x)\nreturn self.experts(x, *self.route(x)) + shared + self.bump(x * 0, x)",
        "self.bump(x * 0, x) runs after the statement reads the side output 'shared'",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsafe_join_statements_are_refused_with_the_reason(tmp_path, name):
    forward, reason = REFUSED[name]
    why = refusal(write(tmp_path, name, model_source(forward)))
    assert "msrewrite does not hoist it out of that statement: " in why and reason in why, why
    assert "\n" not in why


@pytest.mark.slow  # runs the model through verify
def test_a_ternary_hoist_forced_through_a_plan_is_caught(tmp_path):
    """`(self.bump(x * 0, x) if c else x * 1) + shared` with c false never runs bump; hoisted, it
    runs anyway and doubles x in place: the edit the rule refuses, carried out, changes the result."""
    safe = edit(
        write(
            tmp_path,
            "ternary_safe",
            model_source("h = x * 2\nshared = self.shared_expert(h)\nreturn self.bump(x * 0, x) + shared"),
        )
    )
    (plan,) = safe.plans
    hoist = plan.main_hoists[0]
    unsafe = write(
        tmp_path,
        "ternary_unsafe",
        model_source(
            "h = x * 2\nshared = self.shared_expert(h)\nreturn (self.bump(x * 0, x) if self.top_k > 5 else x * 1) + shared"
        ),
    )
    assert "runs only on some paths" in refusal(unsafe)
    problems = forced_fails_verify(tmp_path, unsafe, plan.with_changes(main_hoists=(hoist,)))
    assert any("differs" in p for p in problems), problems


@pytest.mark.slow  # starts a process or runs verify
def test_a_call_hoisted_past_an_earlier_operand_forced_through_a_plan_is_caught(tmp_path):
    path = write(tmp_path, "before", model_source(REFUSED["evaluated_before"][0]))
    src = load(path)
    safe = edit(
        write(
            tmp_path,
            "before_safe",
            model_source("h = x * 2\nshared = self.shared_expert(h)\nreturn self.bump(h * 0, x) + x * 1 + shared"),
        )
    )
    line = safe.plans[0].join_line
    plan = safe.plans[0].with_changes(
        main_hoists=(SideStatement(line, line, "self.bump(h * 0, x)", hoist="bump_output"),)
    )
    text = apply_plans(src.module, [plan], src.text).code
    assert "bump_output = self.bump(h * 0, x)" in text
    result = verified(tmp_path, path, text, [plan])
    assert not result.ok and any("differs" in p for p in result.problems), result.problems


# Effects: a main call hoisted out of the join is main work like any other ------------------------
WRITES_INPUT = "shared = self.shared_expert(x)\nreturn self.bump(x * 1, x) + shared"


@pytest.mark.slow  # starts a process or runs verify
def test_a_hoisted_main_call_that_writes_the_side_input_is_refused_protected_or_caught(tmp_path):
    """bump doubles x in place; the shared expert reads x. Refused (naming the write), edited with
    --protect clone (the side stream reads a copy made at the fork), and forced without the copy,
    verify sees the race."""
    path = write(tmp_path, "writes_input", model_source(WRITES_INPUT))
    why = refusal(path)
    assert "writes 'x' in place while the side stream reads it (inside self.bump(...)" in why, why
    assert "pass --protect clone to snapshot it at the fork" in why, why
    protected = edit(path, protect="clone")
    (plan,) = protected.plans
    assert plan.protect_inputs == ("x",) and [h.hoist for h in plan.main_hoists] == ["bump_output"]
    result = verified(tmp_path, path, protected.new, protected.plans)
    assert result.ok, result.problems
    problems = forced_fails_verify(tmp_path, path, plan.with_changes(protect_inputs=()))
    assert any("differs" in p or "race" in p or "write" in p for p in problems), problems


UNSEEN = """
def _kernel_class():
    # built at run time: msrewrite cannot read its source (like a kernel library's FusedMoE)
    class FusedMoE(Experts):
        def forward(self, x, weights, ids):
            out = super().forward(x, weights, ids)
            if INPLACE:
                x.copy_(out)  # SGLang's fused_moe(..., inplace=True)
                return x
            return out

    return FusedMoE


FusedMoE = _kernel_class()
INPLACE = False
"""


def unseen_source(inplace: bool) -> str:
    source = model_source(GRANITE).replace("\n\nclass Block(nn.Module):", UNSEEN + "\n\nclass Block(nn.Module):", 1)
    source = source.replace(
        "self.block_sparse_moe = Experts(hidden, inter, num_experts)",
        "self.block_sparse_moe = FusedMoE(hidden, inter, num_experts)",
    )
    return source.replace("INPLACE = False", f"INPLACE = {inplace}")


@pytest.mark.slow  # starts a process or runs verify
def test_an_unseen_routed_experts_call_is_refused_naming_it_and_edited_when_vouched_or_protected(tmp_path):
    """SGLang's granitemoe block_sparse_moe is a FusedMoE msrewrite cannot see into: it may write
    hidden_states, which the shared MLP reads. The refusal names it; --assume-pure and
    --protect clone each give an edit that verifies."""
    path = write(tmp_path, "unseen", unseen_source(inplace=False))
    why = refusal(path)
    assert (
        "self.block_sparse_moe (FusedMoE, not visible to msrewrite) may write 'x' which the side stream reads" in why
    ), why
    assert "pass --protect clone or --assume-pure FusedMoE" in why
    vouched = edit(path, assume_pure=("FusedMoE",))
    assert vouched.plans[0].main_hoists and vouched.plans[0].protect_inputs == ()
    assert verified(tmp_path, path, vouched.new, vouched.plans).ok
    protected = edit(path, protect="clone")
    assert protected.plans[0].protect_inputs == ("x",)
    assert verified(tmp_path, path, protected.new, protected.plans).ok
    # the same kernel writing its input in place (fused_moe's inplace=True): vouching for it
    # wrongly is what verify is there for; the protected edit stays right
    inplace = write(tmp_path, "unseen_inplace", unseen_source(inplace=True))
    problems = forced_fails_verify(tmp_path, inplace, vouched.plans[0])
    assert any("differs" in p or "race" in p for p in problems), problems
    assert verified(
        tmp_path, inplace, apply_plans(load(inplace).module, protected.plans, load(inplace).text).code, protected.plans
    ).ok


# Cases that cannot take it say so ------------------------------------------------------------------
def test_phased_and_core_limit_cases_refuse_main_work_in_the_join(tmp_path):
    path = write(
        tmp_path,
        "phased",
        model_source("shared = self.shared_expert(x)\nh = self.experts(x, *self.route(x)) + shared\nreturn h"),
    )
    src = load(path)
    with pytest.raises(NothingToDo) as refused:
        case_steps(path, src.text, src.module, "moe-shared-expert-phased", "eager", None, FLAG, None)
    assert (
        "msrewrite does not hoist it out of that statement: a phased side branch needs main work between the "
        "fork and the join to anchor its phases"
    ) in str(refused.value), refused.value
    longcat = write(
        tmp_path,
        "limit",
        model_source("shared = self.mlp(x)\nreturn self.experts(x, *self.route(x)) + shared").replace(
            "self.shared_experts = nn.Sequential",
            "self.mlp = MLP(hidden, inter)\n        self.shared_experts = nn.Sequential",
        ),
    )
    src = load(longcat)
    with pytest.raises(NothingToDo) as refused:
        case_steps(
            longcat, src.text, src.module, "attn-moe-limit-core", "eager", None, FLAG, None, core_limits=(8, 16, 16, 32)
        )
    assert "is inside the join statement; attn-moe-limit-core gives the main work" in str(refused.value), refused.value


# The plan carries the hoists: JSON, apply --plan's re-check ----------------------------------------
def test_main_hoists_round_trip_and_apply_plan_rederives_them(tmp_path):
    path = write(tmp_path, "granite_plan", model_source(GRANITE))
    step = edit(path)
    (plan,) = step.plans
    data = plan.to_dict()
    line = plan.join_line
    assert list(data["main_hoists"]) == [
        {
            "first_line": line,
            "last_line": line,
            "hoist": "block_sparse_moe_output",
            "source": "self.block_sparse_moe(x, *self.route(x))",
        }
    ]
    (back,) = load_plans(json.dumps(data))
    assert back == plan
    # a plan without main work in the join has no such field at all (older plan files read the same)
    assert "main_hoists" not in plan.with_changes(main_hoists=()).to_dict()
    src = load(path)
    checked = check_plan(src.module, back, src.text, path)
    assert checked.main_hoists == plan.main_hoists
    assert apply_plans(src.module, [checked], src.text).code == step.new
    # the re-check refuses a plan that leaves the main call in the join, or hoists one it does not
    from msrewrite.analyze.branch import NoBranch

    with pytest.raises(NoBranch, match="the analysis hoists the main call self.block_sparse_moe"):
        check_plan(src.module, back.with_changes(main_hoists=()), src.text, path)
    extra = SideStatement(line, line, "self.route(x)", hoist="route_output")
    with pytest.raises(NoBranch, match="the plan hoists the main call self.route"):
        check_plan(src.module, back.with_changes(main_hoists=(*plan.main_hoists, extra)), src.text, path)


def test_the_emitter_refuses_a_stale_or_clashing_main_hoist(tmp_path):
    path = write(tmp_path, "granite_stale", model_source(GRANITE))
    (plan,) = edit(path).plans
    src = load(path)
    line = plan.join_line
    for hoist, words in [
        (
            SideStatement(line, line, "self.experts(x)", hoist="experts_output"),
            "does not contain 'self.experts(x)' exactly once",
        ),
        (
            SideStatement(line, line, plan.main_hoists[0].source, hoist="shared_output"),
            "is a name the function already uses",
        ),
    ]:
        with pytest.raises(BadInput, match=re.escape(words)):
            apply_plans(src.module, [plan.with_changes(main_hoists=(hoist,))], src.text)
    with pytest.raises(ValueError, match="hoisted temporaries must differ"):
        plan.with_changes(main_hoists=(plan.main_hoists[0], plan.main_hoists[0]))
    with pytest.raises(ValueError, match="main_hoists cannot be combined with phase_anchors"):
        plan.with_changes(phase_anchors=("h",))
    assert isinstance(plan, OverlapPlan)


def test_markers_close_the_main_range_after_the_hoisted_call(tmp_path):
    path = write(tmp_path, "granite_markers", model_source(GRANITE))
    step = edit(path)
    from msrewrite.emit import markers

    marked = markers.add(step.new, [p.with_changes(markers=True) for p in step.plans])
    join = join_block(marked)
    assert (
        join.index("block_sparse_moe_output = self.block_sparse_moe(")
        < join.index("_ms_range_end(main_range)")
        < join.index(".wait_stream(shared_expert_stream)")
    )
    assert markers.remove(marked) == step.new
