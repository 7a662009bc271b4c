"""Guarded shared experts: the `if`s serving code wraps them in, one small runnable model per shape.

Each safe shape is edited and verifies clean (original = flag off = flag on, sanitizer clean);
each condition msrewrite cannot show invariant over the window is refused with its reason; and a
shared expert whose guard is false never runs, flag on or off.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.harness import load_module
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.runtime import install
from msrewrite.verify import verify_files

FLAG = FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM")

PRELUDE = """
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.down(F.silu(self.up(x)))


class Experts(nn.Module):
    def __init__(self, hidden, inter, num_experts):
        super().__init__()
        self.experts = nn.ModuleList(MLP(hidden, inter) for _ in range(num_experts))

    def forward(self, x, weights, ids):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class Block(nn.Module):
    def __init__(self, hidden=32, inter=16, num_experts=4, top_k=2, num_shared_experts=1, use_shared=True):
        super().__init__()
        self.top_k = top_k
        self.num_shared_experts = num_shared_experts
        self.use_shared = use_shared
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(hidden, inter, num_experts)
        self.shared_experts = MLP(hidden, inter) if num_shared_experts else None
        self.shared_mlp = self.shared_experts
        self.dense_mlp = MLP(hidden, inter)

    def route(self, h):
        return torch.topk(self.gate(h).softmax(dim=-1), self.top_k, dim=-1)

"""


def model_source(forward: str, make_kwargs: str = "") -> str:
    body = textwrap.indent(textwrap.dedent(forward).strip("\n"), " " * 8)
    return (
        PRELUDE
        + "    def forward(self, x):\n"
        + body
        + "\n\n\ndef make():\n    torch.manual_seed(0)\n"
        + f"    return Block({make_kwargs}).eval(), (torch.randn(12, 32),)\n"
    )


# name -> (forward body, Block(...) keywords)
SAFE = {
    "if_not_none_with_consumer": (
        """
        h = x.view(-1, 32)
        weights, ids = self.route(h)
        out = self.experts(h, weights, ids)
        if self.shared_experts is not None:
            shared = self.shared_experts(h)
            out += shared
        return out
        """,
        "",
    ),
    "default_none_then_if": (
        """
        shared = None
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if shared is not None:
            out = out + shared
        return out
        """,
        "",
    ),
    "count_greater_than_zero": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.num_shared_experts > 0:
            out = out + self.shared_experts(x)
        return out
        """,
        "",
    ),
    "is_none_else": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_mlp is None:
            return out
        else:
            return out + self.shared_mlp(x)
        """,
        "",
    ),
    "conditional_expression": (
        """
        shared = self.shared_experts(x) if self.use_shared else None
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if shared is not None:
            out = out + shared
        return out
        """,
        "",
    ),
    "token_count_shape": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if x.shape[0] > 0:
            out = out + self.shared_experts(x)
        return out
        """,
        "",
    ),
    "side_and_main_work_in_one_if": (
        """
        num_tokens = x.shape[0]
        if num_tokens > 0:
            shared = self.shared_experts(x)
            weights, ids = self.route(x)
            out = self.experts(x, weights, ids)
        else:
            shared = torch.zeros_like(x)
            out = torch.zeros_like(x)
        return out + shared
        """,
        "",
    ),
    "nested_invariant_ifs": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            if self.num_shared_experts > 0:
                out = out + self.shared_experts(x)
        return out
        """,
        "",
    ),
    "elif_chain": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.top_k > 4:
            out = out * 2
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        else:
            out = out - 1
        return out
        """,
        "",
    ),
    "elif_chain_into_else": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.top_k > 4:
            out = out * 2
        elif x.shape[0] == 0:
            out = out * 0
        else:
            out = out + self.shared_experts(x)
        return out
        """,
        "",
    ),
    "both_branches_side_work": (
        """
        if self.use_shared:
            shared = self.shared_experts(x)
        else:
            shared = self.dense_mlp(x)
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        return out + shared
        """,
        "use_shared=False",
    ),
}
SAFE["both_branches_side_work_shared_taken"] = (SAFE["both_branches_side_work"][0], "")
# the other branch writes x in place: not side work, so the `if` is split instead (fork only under
# `self.use_shared`); with it false the original runs, relu_ included
SAFE["other_branch_writes_its_input"] = (
    """
        if self.use_shared:
            shared = self.shared_experts(x)
        else:
            shared = self.dense_mlp(torch.relu_(x))
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        return out + shared
        """,
    "",
)


# name -> (forward body, the reason's words)
UNSAFE = {
    "other_branch_under_a_condition_on_data": (
        """
        if x.sum() > 0:
            shared = self.shared_experts(x)
        else:
            shared = self.dense_mlp(x)
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        return out + shared
        """,
        "calls `x.sum`, which msrewrite cannot see into",
    ),
    "nested_inner_condition_reads_data": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            if weights.sum() > 0:
                out = out + self.shared_experts(x)
        return out
        """,
        "calls `weights.sum`, which msrewrite cannot see into",
    ),
    "elif_after_a_condition_on_data": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if out.sum() > 0:
            out = out * 2
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
        """,
        "calls `out.sum`, which msrewrite cannot see into",
    ),
    "condition_reads_tensor_data": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if weights.sum() > 0:
            out = out + self.shared_experts(x)
        return out
        """,
        "calls `weights.sum`, which msrewrite cannot see into",
    ),
    "condition_reads_a_local_computed_from_data": (
        """
        use = x.shape[0] > 0
        use = bool(x.sum() > 0)
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if use:
            out = out + self.shared_experts(x)
        return out
        """,
        "calls `bool`",
    ),
    "condition_reads_an_attribute_the_forward_sets": (
        """
        weights, ids = self.route(x)
        self.use_shared = bool(ids.numel())
        out = self.experts(x, weights, ids)
        if self.use_shared:
            out = out + self.shared_experts(x)
        return out
        """,
        "reads `self.use_shared`, which this function assigns",
    ),
    "condition_reads_main_path_object": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if out.requires_grad:
            out = out + self.shared_experts(x)
        return out
        """,
        "an attribute of a value that may change",
    ),
    "side_call_conditional_in_the_join": (
        """
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        out = out + (self.shared_experts(x) if self.use_shared else 0)
        return out
        """,
        "hoisting it would run it unconditionally",
    ),
}


def write_model(folder: Path, name: str, source: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(source)
    return path


def edit(path: Path, mode: str = "eager", case: str = "moe-shared-expert") -> Path:
    src = load(path)
    steps = case_steps(path, src.text, src.module, case, mode, None, FLAG, None)
    edited = path.with_name(f"{path.stem}_ms.py")
    edited.write_text(steps[-1].new)
    return edited


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", sorted(SAFE))
def test_guarded_shape_is_edited_and_verifies(tmp_path, name):
    forward, kwargs = SAFE[name]
    original = write_model(tmp_path, name, model_source(forward, kwargs))
    edited = edit(original)
    result = verify_files(edited, original=original)
    assert result.ok, result.problems
    on = result.runs[2]
    assert on.name == "flag on" and any(stream != "main" for stream in on.streams), on.streams


@pytest.mark.slow  # starts a process or runs verify
def test_a_split_if_whose_other_branch_writes_verifies_with_that_branch_taken(tmp_path):
    """use_shared=False: no fork, the original else (relu_ on x included) runs on the main stream."""
    forward, _ = SAFE["other_branch_writes_its_input"]
    original = write_model(tmp_path, "else_taken", model_source(forward, "use_shared=False"))
    edited = edit(original)
    assert "and self.use_shared:" in edited.read_text()
    result = verify_files(edited, original=original)
    # outputs equal and sanitizer clean; verify only notes that the side stream never ran
    assert result.problems == ["flag on: no op ran on a side stream (is the flag wired?)"], result.problems


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["npugraph-ex", "ge-graph", "cuda"])
def test_guarded_split_verifies_in_every_mode(tmp_path, mode):
    forward, kwargs = SAFE["if_not_none_with_consumer"]
    original = write_model(tmp_path, "split", model_source(forward, kwargs))
    edited = edit(original, mode)
    text = edited.read_text()
    assert "and self.shared_experts is not None:" in text  # the guarded fork
    result = verify_files(edited, original=original)
    assert result.ok, result.problems


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_condition_that_may_change_is_refused_with_its_reason(tmp_path, name):
    forward, reason = UNSAFE[name]
    original = write_model(tmp_path, name, model_source(forward))
    with pytest.raises(NothingToDo) as refused:
        edit(original)
    assert reason in str(refused.value), str(refused.value)


@pytest.mark.parametrize("name", ["count_greater_than_zero", "if_not_none_with_consumer", "token_count_shape"])
@pytest.mark.parametrize("flag", ["1", "0"])
def test_false_guard_never_runs_the_side_call(tmp_path, name, flag):
    """With the guard false the shared expert is never called, on the side stream or the main one."""
    forward, _ = SAFE[name]
    kwargs = {
        "count_greater_than_zero": "num_shared_experts=0",
        "if_not_none_with_consumer": "num_shared_experts=0",
        "token_count_shape": "",
    }[name]
    source = model_source(forward, kwargs)
    if name == "count_greater_than_zero":  # the module exists, only the count says not to use it
        source = source.replace("if num_shared_experts else None", "")
    original = write_model(tmp_path, name, source)
    edited = edit(original)
    os.environ[FLAG.name] = flag
    try:
        with install() as rt, rt.record_ops() as ops:
            module = load_module(edited, name=f"guards_false_{name}_{flag}")
            block, (x,) = module.make()
            if name == "token_count_shape":
                x = x[:0]  # no tokens: the guard is false
            out = block(x)
    finally:
        del os.environ[FLAG.name]
    shared = block.shared_experts
    assert out.shape == x.shape
    assert shared is None or shared.calls == 0
    assert {op.stream for op in ops} == {"main"}  # nothing was issued on a side stream


@pytest.mark.parametrize(
    "name, guard",
    [
        ("nested_invariant_ifs", "self.shared_experts is not None and self.num_shared_experts > 0"),
        ("elif_chain", "self.top_k <= 4 and self.shared_experts is not None"),
        ("elif_chain_into_else", "self.top_k <= 4 and x.shape[0] != 0"),
    ],
)
def test_nested_and_elif_guards_fork_under_every_condition_on_the_way(tmp_path, name, guard):
    forward, _ = SAFE[name]
    original = write_model(tmp_path, name, model_source(forward))
    text = edit(original).read_text()
    assert f"if shared_expert_stream is not None and ({guard}):" in text, text


def test_guarded_plan_round_trips_through_json(tmp_path):
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.emit.engine import apply_plans
    from msrewrite.plan import OverlapPlan

    forward, _ = SAFE["is_none_else"]
    original = write_model(tmp_path, "else_branch", model_source(forward))
    src = load(original)
    plan = plans_for_case(original, src.module, "moe-shared-expert", "eager", None, FLAG, None)[0]
    assert (plan.guard, plan.guard_line) == ("self.shared_mlp is not None", plan.guard_line)
    again = OverlapPlan.from_json(plan.to_json())
    assert again == plan
    assert apply_plans(src.module, [again]).code == apply_plans(src.module, [plan]).code


def test_guard_that_is_not_the_if_condition_is_refused(tmp_path):
    """A plan's guard becomes code: a forged one (here carrying a call) never reaches the edit."""
    import dataclasses

    from msrewrite.commands.apply import plans_for_case
    from msrewrite.emit.engine import apply_plans
    from msrewrite.errors import BadInput

    forward, _ = SAFE["is_none_else"]
    original = write_model(tmp_path, "else_branch", model_source(forward))
    src = load(original)
    plan = plans_for_case(original, src.module, "moe-shared-expert", "eager", None, FLAG, None)[0]
    forged = dataclasses.replace(plan, guard='self.shared_mlp is not None and __import__("os").getpid()')
    with pytest.raises(BadInput, match="stale plan"):
        apply_plans(src.module, [forged])


REAL = {
    "GraniteMoeSharedDecoderLayer": "transformers.models.granitemoeshared.modeling_granitemoeshared",
    "Cohere2MoeSparseMoeBlock": "transformers.models.cohere2_moe.modeling_cohere2_moe",
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "ge-graph"])
@pytest.mark.parametrize("cls", sorted(REAL))
def test_real_guarded_shared_expert_is_edited_and_verifies(tmp_path, cls, mode):
    """transformers' GraniteMoeShared (`if self.shared_mlp is None: ... else: ... + self.shared_mlp(h)`) and
    Cohere2-MoE (`if self.num_shared_experts > 0:`), refused before guards were split."""
    import importlib

    pytest.importorskip("transformers")
    module_name = REAL[cls]
    original = Path(importlib.import_module(module_name).__file__)
    src = load(original)
    steps = case_steps(original, src.text, src.module, "moe-shared-expert", mode, cls, FLAG, None)
    edited = tmp_path / original.name
    edited.write_text(steps[-1].new)
    assert (
        " and self.shared_mlp is not None:" in edited.read_text()
        or " and self.num_shared_experts > 0:" in edited.read_text()
    )
    result = verify_files(edited, original=original, target=cls, package=module_name.rsplit(".", 1)[0])
    assert result.ok, result.problems
    assert any(stream != "main" for stream in result.runs[2].streams)


def test_plan_whose_guard_is_not_the_ifs_condition_is_refused(tmp_path):
    """The guard is emitted as code: a plan may only carry the `if`'s own condition."""
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.emit.engine import apply_plans
    from msrewrite.errors import BadInput

    forward, _ = SAFE["if_not_none_with_consumer"]
    original = write_model(tmp_path, "stale_guard", model_source(forward))
    src = load(original)
    plan = plans_for_case(original, src.module, "moe-shared-expert", "eager", None, FLAG, None)[0]
    with pytest.raises(BadInput, match="tests 'self.shared_experts is not None'"):
        apply_plans(src.module, [plan.with_changes(guard="__import__('os').system('true')")])
