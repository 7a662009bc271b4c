"""Branch analysis, pyupgrade style: `_fix` snippets get a plan, `_noop` snippets are refused with a reason.

Each snippet is an MoE forward written the way real models write it.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import libcst as cst
import pytest

from msrewrite.cases import get_case
from msrewrite.cases._base import Options
from msrewrite.cases._finder import find_targets
from msrewrite.emit.engine import apply_plans

CASE = get_case("moe-shared-expert")


def targets_of(body: str):
    # Every submodule the snippet calls is a visible, pure nn.Linear (summaries see into it);
    # tests/test_effects.py covers callees that write or cannot be seen into.
    body = textwrap.dedent(body).lstrip("\n")
    subs = sorted(set(re.findall(r"self\.(\w+)\(", body)))
    init = "".join(f"        self.{name} = nn.Linear(8, 8)\n" for name in subs)
    source = (  # __init__ last, so the line numbers below count from `def forward` on line 2
        "class Block(nn.Module):\n    def forward(self, x):\n"
        + textwrap.indent(body, " " * 8)
        + "\n    def __init__(self):\n        super().__init__()\n"
        + init
    )
    module = cst.parse_module(source)
    return source, module, find_targets(CASE, Path("block.py"), module, Options())


def plan_of(body: str):
    source, module, targets = targets_of(body)
    assert len(targets) == 1 and targets[0].plan is not None, targets
    plan = targets[0].plan
    new = apply_plans(module, [plan]).code
    compile(new, "block.py", "exec")
    return source, plan


FIX = {
    "inline_join": (
        """
        residual = x
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        y = y + self.shared_experts(residual)
        return y
        """,
        {"side": [(6, 6)], "fork": 4, "join": 6, "hoist": "shared_experts_output"},
    ),
    "gated_two_statements": (
        """
        s = self.shared_expert(x)
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        s = torch.sigmoid(self.shared_expert_gate(x)) * s
        return y + s
        """,
        {"side": [(3, 3), (6, 6)], "fork": 3, "join": 7},
    ),
    "return_join": (
        """
        w, idx = self.gate(x)
        return self.experts(x, w, idx) + self.shared_experts(x)
        """,
        {"side": [(4, 4)], "fork": 3, "join": 4, "hoist": "shared_experts_output"},  # overlaps the gate
    ),
    "augassign_join": (
        """
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        y += self.shared_mlp(x)
        return y
        """,
        {"side": [(5, 5)], "fork": 3, "join": 5, "hoist": "shared_mlp_output"},
    ),
    "side_written_after_routed_path": (
        """
        x = x.reshape(-1, 8)
        scores = self.router(x)
        routed = self.experts(x * scores)
        out = self.shared_expert(
            x,
        )
        out.add_(routed)
        return out
        """,
        {"side": [(6, 8)], "fork": 4, "join": 9},
    ),
    "fused_op_argument": (
        """
        w, idx = self.gate(x)
        expanded = self.dispatch(x, idx)
        y = self.experts(expanded)
        y = self.combine(y, w, shared_expert_x=self.shared_experts(x))
        return y
        """,
        {"side": [(6, 6)], "fork": 3, "join": 6, "hoist": "shared_experts_output"},
    ),
    "side_reads_router_output": (  # the fork follows the router; the side overlaps the experts
        """
        logits = self.gate(x)
        s = self.shared_experts(x, logits)
        y = self.experts(x, logits)
        return y + s
        """,
        {"side": [(4, 4)], "fork": 4, "join": 6},
    ),
    "input_view_stays_on_main": (  # a view the router reads too is not a side-only buffer
        """
        h = x.view(-1, 8)
        s = self.shared_experts(h)
        w, idx = self.gate(h)
        y = self.experts(h, w, idx)
        return y + s
        """,
        {"side": [(4, 4)], "fork": 4, "join": 7},
    ),
    "recv_buffer_moves_with_the_side": (
        """
        y = self.attn(x)
        dist.send(y, dst=1)
        z = self.mlp(y)
        buf = torch.empty_like(y)
        dist.recv(buf, src=1)
        return z + buf
        """,
        None,  # checked with the afd-overlap case below
    ),
    "conditional_shared_expert": (
        """
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        if self.shared_experts is not None:
            y = y + shared
        return y
        """,
        {"side": [(3, 4)], "fork": 3, "join": 7, "maybe": ("shared",)},
    ),
    "guarded_side_and_main_work": (  # split: guarded fork before the if, guarded join after it
        """
        if self.use_shared:
            s = self.shared_experts(x)
            y = self.experts(x)
        return y + s
        """,
        {"side": [(4, 4)], "fork": 3, "join": 6, "guard": ("self.use_shared", 3)},
    ),
    "guarded_join_in_else": (
        """
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        if self.shared_mlp is None:
            return y
        else:
            return y + self.shared_mlp(x)
        """,
        {
            "side": [(8, 8)],
            "fork": 3,
            "join": 8,
            "hoist": "shared_mlp_output",
            "guard": ("self.shared_mlp is not None", 5),
        },
    ),
    # the same side call in both branches of the join's `if` (transformers HY-V3's fp32 combine)
    # runs on every path: hoisted once, before the `if`
    "same_call_in_both_branches_of_the_join": (
        """
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        if self.fp32:
            y = (y.float() + self.shared_experts(x).float()).to(x.dtype)
        else:
            y = y + self.shared_experts(x)
        return y
        """,
        {"side": [(6, 6)], "fork": 3, "join": 5, "hoist": "shared_experts_output"},
    ),
}


@pytest.mark.parametrize("name", sorted(k for k, v in FIX.items() if v[1]))
def test_fix(name):
    body, expected = FIX[name]
    _, plan = plan_of(body)
    assert [(s.first_line, s.last_line) for s in plan.side] == expected["side"]
    assert plan.fork_line == expected["fork"]
    assert plan.join_line == expected["join"]
    if "hoist" in expected:
        assert plan.side[-1].hoist == expected["hoist"]
    assert plan.outputs_maybe_unbound == expected.get("maybe", ())
    assert (plan.guard, plan.guard_line) == expected.get("guard", ("", 0))


NOOP = {
    "for_with_other_work_names_the_loop": (
        """
        for _ in range(2):
            x = self.experts(x) + self.shared_experts(x)
        return x
        """,
        "the side-branch call sits inside a `for` block that also does other work",
    ),
    "no_main_work": (
        """
        h = x * 2
        s = self.shared_experts(h)
        return h + s
        """,
        "nothing to overlap",
    ),
    "side_reads_routed_result": (
        """
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        return y + self.shared_experts(y)
        """,
        "nothing to overlap",  # it can only start once the routed result exists
    ),
    "main_writes_side_input_in_place": (
        """
        s = self.shared_experts(x)
        w, idx = self.gate(x)
        x.mul_(w.sum())
        y = self.experts(x, w, idx)
        return y + s
        """,
        "in place",
    ),
    "main_writes_alias_in_place": (
        """
        h = x.view(-1, 8)
        s = self.shared_experts(x)
        w, idx = self.gate(h)
        h += 1
        y = self.experts(h, w, idx)
        return y + s
        """,
        "in place",
    ),
    "early_return_in_window": (
        """
        s = self.shared_experts(x)
        w, idx = self.gate(x)
        if w is None:
            return x
        y = self.experts(x, w, idx)
        return y + s
        """,
        "can return before the join",
    ),
    "condition_reads_router_output": (  # the fork would read `w` before the router wrote it
        """
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        if w.sum() > 0:
            y = y + self.shared_experts(x)
        return y
        """,
        "calls `w.sum`, which msrewrite cannot see into",
    ),
    "condition_reads_attribute_the_forward_assigns": (
        """
        w, idx = self.gate(x)
        self.use_shared = w is not None
        y = self.experts(x, w, idx)
        if self.use_shared:
            y = y + self.shared_experts(x)
        return y
        """,
        "which this function assigns",
    ),
    "conditional_expression_in_join": (
        """
        w, idx = self.gate(x)
        y = self.experts(x, w, idx)
        y = y + (self.shared_experts(x) if self.has_shared else 0)
        return y
        """,
        "conditional expression",
    ),
}


@pytest.mark.parametrize("name", sorted(NOOP))
def test_noop(name):
    body, reason = NOOP[name]
    _, _, targets = targets_of(body)
    assert len(targets) == 1 and targets[0].plan is None
    assert reason in targets[0].reason, targets[0].reason


def test_no_seed_means_no_target():
    _, _, targets = targets_of("return self.experts(x)\n")
    assert targets == []


def test_plan_json_round_trip():
    from msrewrite.plan import OverlapPlan, load_plans

    _, plan = plan_of(FIX["conditional_shared_expert"][0])
    assert OverlapPlan.from_json(plan.to_json()) == plan
    assert load_plans(plan.to_json()) == [plan]
    assert load_plans('{"candidates": [{"plan": ' + plan.to_json() + "}]}") == [plan]
    with pytest.raises(ValueError):
        OverlapPlan.from_dict({"case": "x"})


COPY_LAYER_INIT = """
    def __init__(self):
        self.kv_a = nn.Linear(8, 8)
        self.kv_b = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2)
        self.mlp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
"""


def copy_plan(body: str, init: str = COPY_LAYER_INIT):
    from msrewrite.cases import get_case as case_named

    source = "class Layer:\n    def forward(self, x, cache):\n" + textwrap.indent(
        textwrap.dedent(body).lstrip("\n"), " " * 8
    )
    source += init
    module = cst.parse_module(source)
    targets = find_targets(case_named("kvcache-offload"), Path("layer.py"), module, Options())
    assert len(targets) == 1
    return targets[0]


def test_copy_joins_before_the_buffer_is_written_again():
    """The join of an offload copy is the write-after-read on the reused buffer, not a data edge."""
    target = copy_plan(
        """
        cache.temp_kv.copy_(self.kv_a(x))
        cache.host_kv[0].copy_(cache.temp_kv)
        y = self.mlp(x)
        cache.temp_kv.copy_(self.kv_b(y))
        return self.out(y)
        """
    )
    plan = target.plan
    assert [(s.first_line, s.last_line) for s in plan.side] == [(4, 4)]
    assert (plan.fork_line, plan.join_line) == (4, 6)  # forks right after the write, joins before the rewrite
    assert plan.side_outputs == ()


def test_copy_joins_before_return_when_nothing_reuses_the_buffer():
    target = copy_plan(
        """
        cache.temp_kv.copy_(self.kv_a(x))
        y = self.attn(x, cache.temp_kv)
        cache.host_kv[0].copy_(cache.temp_kv)
        return self.mlp(y)
        """
    )
    assert (target.plan.fork_line, target.plan.join_line) == (4, 6)  # overlaps attention and the MLP


def test_copy_does_not_move_past_an_unseen_callee_given_its_buffer():
    """A callee msrewrite cannot see into may write the buffer the copy reads: the copy cannot be
    issued before it (here nothing is left to overlap, so it is refused)."""
    body = """
        cache.temp_kv.copy_(self.kv_a(x))
        y = self.attn(x, cache.temp_kv)
        cache.host_kv[0].copy_(cache.temp_kv)
        return self.mlp(y)
        """
    assert copy_plan(body).plan is not None
    target = copy_plan(body, init=COPY_LAYER_INIT.replace("nn.MultiheadAttention(8, 2)", "FusedAttention()"))
    assert target.plan is None and "nothing to overlap" in target.reason, target.reason


def test_copy_is_refused_when_a_statement_reads_its_destination():
    target = copy_plan(
        """
        cache.temp_kv.copy_(self.kv_a(x))
        cache.host_kv[0].copy_(cache.temp_kv)
        total = cache.host_kv[0].sum()
        return self.mlp(x) + total
        """
    )
    assert target.plan is None and "nothing to overlap" in target.reason


def test_recv_buffer_moves_with_the_side_branch():
    from msrewrite.cases import get_case as case_named

    body = FIX["recv_buffer_moves_with_the_side"][0]
    source = "class Node:\n    def forward(self, x):\n" + textwrap.indent(textwrap.dedent(body).lstrip("\n"), " " * 8)
    source += "\n    def __init__(self):\n        self.attn = nn.Linear(8, 8)\n        self.mlp = nn.Linear(8, 8)\n"
    targets = find_targets(case_named("afd-overlap"), Path("node.py"), cst.parse_module(source), Options())
    plan = targets[0].plan
    assert [(s.first_line, s.last_line) for s in plan.side] == [(4, 4), (6, 6), (7, 7)]  # send, buffer, recv
    assert (plan.fork_line, plan.join_line) == (4, 8)


def test_a_compound_statement_is_named_as_written():
    from msrewrite.analyze.branch import _compound_label

    assert _compound_label(cst.parse_statement("if use_fused_gate:\n    pass\n")) == "`if use_fused_gate`"
    assert _compound_label(cst.parse_statement("with ctx:\n    pass\n")) == "a `with` block"
    assert _compound_label(cst.parse_statement("while x:\n    pass\n")) == "a `while` block"
