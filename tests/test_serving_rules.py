"""Analysis rules added for shapes found in real serving code (issue 10, the serving sweep).

Each rule has a model where it must edit (the edit verifies clean: original = flag off = flag
on under every schedule, sanitizer clean) and one where it must refuse (the refusal names why,
and the edit the rule would make there, forced through a plan, fails verify). The models are
small reductions of shapes read in SGLang 0.5.23 / vLLM 0.33.0 / transformers, not copies.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.emit.engine import apply_plans
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
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

    def forward(self, x):
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
    def __init__(self, hidden=32, inter=16, num_experts=4, top_k=2, has_experts=True):
        super().__init__()
        self.top_k = top_k
        self.has_experts = has_experts
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(hidden, inter, num_experts)
        self.block_sparse_moe = Experts(hidden, inter, num_experts)
        self.shared_expert = MLP(hidden, inter)
        self.shared_mlp = self.shared_expert
        self.shared_experts = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(hidden, hidden, bias=False))

    def route(self, h):
        return torch.topk(self.gate(h).softmax(dim=-1), self.top_k, dim=-1)

    def bump(self, out, h):
        h.mul_(2)
        return out

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


def block_forward(text: str) -> str:
    """Block.forward (and route, bump) of an edited model_source()."""
    return text[text.index("    def route(self, h):") :]


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return path


def edit(path: Path, **options):
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, **options)[-1]


def refusal(path: Path, **options) -> str:
    with pytest.raises(NothingToDo) as refused:
        edit(path, **options)
    return str(refused.value)


def verified(tmp_path: Path, original: Path, text: str, plans, planned: str | None = None) -> object:
    """verify of `text` against `original`; `planned`: the text the plans address (a phased edit's
    inlined step), when it is not the original's."""
    edited = tmp_path / f"{original.stem}_ms.py"
    edited.write_text(text)
    source = ScheduleSource(planned if planned is not None else original.read_text(), plans)
    return verify_files(edited, original=original, schedule_source=source)


def edits_and_verifies(tmp_path: Path, name: str, source: str, **options):
    path = write(tmp_path, name, source)
    step = edit(path, **options)
    result = verified(tmp_path, path, step.new, step.plans)
    assert result.ok, result.problems
    assert any(stream != "main" for stream in result.runs[2].streams)  # flag on really uses the side stream
    return step


def forced_fails_verify(tmp_path: Path, unsafe: Path, plan) -> list[str]:
    """The plan (made by the rule on the safe twin) carried out on `unsafe` anyway: verify must object."""
    src = load(unsafe)
    text = apply_plans(src.module, [plan], src.text).code
    result = verified(tmp_path, unsafe, text, [plan])
    assert not result.ok
    return [str(p) for p in result.problems]


# An early exit before the side work (SGLang laguna.py: `if hidden_states.shape[0] == 0: return
# hidden_states` first): the fork comes after it, so the side work never runs where the original
# returned before it.
EARLY_EXIT = """
if x.shape[0] == 0:
    return x
shared = self.shared_expert(x)
weights, ids = self.route(x)
out = self.experts(x, weights, ids)
return out + shared
"""

# ... but an exit between the side work and the join leaves the side work unjoined there.
EXIT_IN_WINDOW = """
shared = self.shared_expert(x)
weights, ids = self.route(x)
out = self.experts(x, weights, ids)
if x.shape[0] < 2:
    return out
return out + shared
"""


@pytest.mark.slow  # runs the model through verify
def test_an_early_exit_before_the_side_work_moves_the_fork_after_it(tmp_path):
    step = edits_and_verifies(tmp_path, "early_exit", model_source(EARLY_EXIT))
    plan = step.plans[0]
    forward = block_forward(step.new)
    # the side stream is entered only after the `return x` (verify also ran the zero-token batch)
    assert forward.index("return x") < forward.index("with torch.npu.stream(")
    assert plan.fork_line > plan.side[0].first_line - 3


@pytest.mark.slow  # runs the model through verify
def test_an_exit_inside_the_window_is_refused_and_forcing_it_is_caught(tmp_path):
    why = refusal(write(tmp_path, "exit_in_window", model_source(EXIT_IN_WINDOW)))
    assert "can return before the join" in why
    # the plan of the same shape without the exit, carried out anyway: with one token the forward
    # returns while the side stream still runs the shared expert
    safe = edit(
        write(tmp_path, "exit_safe", model_source(EXIT_IN_WINDOW.replace("    return out\n", "    out = out + 0\n")))
    )
    source = model_source(EXIT_IN_WINDOW).replace("(torch.randn(12, 32),)", "(torch.randn(1, 32),)")
    problems = forced_fails_verify(tmp_path, write(tmp_path, "exit_forced", source), safe.plans[0])
    assert any("not joined" in p or "unjoined" in p or "differs" in p for p in problems), problems


# Both branches call the shared expert, only one does main work (transformers GraniteMoeHybrid,
# SGLang/vLLM granitemoehybrid.py): the fork runs under that branch's condition; the other branch
# has nothing to overlap and stays as it is.
ONE_BRANCH_BUSY = """
h = x * 2
if self.has_experts:
    moe = self.block_sparse_moe(h, *self.route(h))
    h = moe + self.shared_mlp(h)
else:
    h = self.shared_mlp(h)
return h + 1
"""

BOTH_BRANCHES_BUSY = """
h = x * 2
if self.has_experts:
    moe = self.block_sparse_moe(h, *self.route(h))
    h = moe + self.shared_mlp(h)
else:
    dense = self.experts(h, *self.route(h))
    h = dense + self.shared_mlp(h)
return h + 1
"""


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("has_experts", [True, False])
def test_side_work_in_both_branches_forks_in_the_one_with_main_work(tmp_path, has_experts):
    source = model_source(ONE_BRANCH_BUSY, f"has_experts={has_experts}")
    path = write(tmp_path, "one_branch_busy", source)
    step = edit(path)
    plan = step.plans[0]
    assert plan.guard == "self.has_experts"
    forward = block_forward(step.new)
    assert "        h = self.shared_mlp(h)\n" in forward.split("else:")[-1]  # the other branch unchanged
    result = verified(tmp_path, path, step.new, step.plans)
    if has_experts:
        assert result.ok, result.problems
        assert any(stream != "main" for stream in result.runs[2].streams)
    else:  # outputs equal, sanitizer clean: the side stream is not used where that branch does not run
        assert result.problems == ["flag on: no op ran on a side stream (is the flag wired?)"], result.problems


def test_side_work_in_two_busy_branches_is_refused(tmp_path):
    why = refusal(write(tmp_path, "both_busy", model_source(BOTH_BRANCHES_BUSY)))
    assert "both branches of `if self.has_experts` call the side branch and both also do main work" in why


@pytest.mark.slow  # runs the model through verify
def test_the_branch_with_main_work_needs_an_invariant_condition(tmp_path):
    """The same split on a condition the router computes: refused; forced, the fork reads the
    router's result before it exists."""
    unsafe = ONE_BRANCH_BUSY.replace("h = x * 2\nif self.has_experts:", "h = x * 2\nw = self.gate(h)\nif w.sum() > 0:")
    safe = ONE_BRANCH_BUSY.replace(
        "h = x * 2\nif self.has_experts:", "h = x * 2\nw = self.gate(h)\nif self.has_experts:"
    )
    why = refusal(write(tmp_path, "busy_data_condition", model_source(unsafe)))
    assert "calls `w.sum`, which msrewrite cannot see into" in why
    plan = edit(write(tmp_path, "busy_invariant", model_source(safe))).plans[0]
    forced = dataclasses.replace(plan, guard="w.sum() > 0")
    problems = forced_fails_verify(tmp_path, write(tmp_path, "busy_forced", model_source(unsafe)), forced)
    assert problems


# A binding before the `if` that tests the guard's own condition (SGLang sarvam_moe.py:
# `identity = hidden_states.clone() if self.shared_experts is not None else hidden_states`): where
# the side work runs, `identity` is the copy, so a main-path write to `x` does not reach it.
GUARDED_COPY = """
identity = x.clone() if self.shared_expert is not None else x
weights, ids = self.route(x)
out = self.experts(x, weights, ids)
x.mul_(2)
if self.shared_expert is not None:
    out = out + self.shared_expert(identity)
return out
"""


@pytest.mark.slow  # runs the model through verify
def test_a_copy_made_under_the_guards_condition_is_not_an_alias(tmp_path):
    step = edits_and_verifies(tmp_path, "guarded_copy", model_source(GUARDED_COPY))
    assert step.plans[0].guard == "self.shared_expert is not None"
    assert step.plans[0].protect_inputs == ()


@pytest.mark.slow  # runs the model through verify
def test_a_copy_made_under_another_condition_may_alias(tmp_path):
    """`x.clone() if not self.has_experts else x` picks `x` itself when the side work runs."""
    unsafe = GUARDED_COPY.replace("if self.shared_expert is not None else x", "if not self.has_experts else x")
    why = refusal(write(tmp_path, "other_copy", model_source(unsafe)))
    assert (
        "nothing to overlap (the fork waits for line 54, which writes 'x' before the side work reads "
        "'identity', which may hold the storage of 'x' (bound at line 51))"
    ) in why, why
    plan = edit(write(tmp_path, "guarded_copy", model_source(GUARDED_COPY))).plans[0]
    problems = forced_fails_verify(tmp_path, write(tmp_path, "other_copy_forced", model_source(unsafe)), plan)
    assert any("differs" in p or "race" in p for p in problems), problems


# The side work writes its own input in place (a shared expert starting with ReLU(inplace=True)):
# harmless on a copy only the side reads, a race where the main path reads it in the window.
PRIVATE_INPUT = """
identity = x.clone()
weights, ids = self.route(x)
out = self.experts(x, weights, ids)
return out + self.shared_experts(identity)
"""


@pytest.mark.slow  # runs the model through verify
def test_the_side_may_write_an_input_only_it_reads(tmp_path):
    step = edits_and_verifies(tmp_path, "private_input", model_source(PRIVATE_INPUT))
    assert step.plans[0].side_inputs == ("identity",)


@pytest.mark.slow  # runs the model through verify
def test_the_side_may_not_write_an_input_the_main_path_reads(tmp_path):
    unsafe = PRIVATE_INPUT.replace("self.route(x)", "self.route(identity)")
    why = refusal(write(tmp_path, "shared_input", model_source(unsafe)))
    assert "the side branch writes its input 'identity' in place, which line" in why
    assert "on the main path reads" in why
    plan = edit(write(tmp_path, "private_input", model_source(PRIVATE_INPUT))).plans[0]
    problems = forced_fails_verify(tmp_path, write(tmp_path, "shared_input_forced", model_source(unsafe)), plan)
    assert any("differs" in p or "race" in p for p in problems), problems


def test_an_unseen_callee_built_over_several_lines_is_named_on_one_line(tmp_path):
    """transformers' modeling_inkling.py: `self.k_sconv = Conv(\\n ...\\n).to(dtype=...)`; the name of
    what msrewrite cannot see into once broke a plan's one-line trust boundary (suggest crashed)."""
    source = model_source(PRIVATE_INPUT).replace(
        "        self.experts = Experts(hidden, inter, num_experts)\n",
        "        self.experts = Experts(\n            hidden, inter, num_experts\n        ).to(dtype=torch.float32)\n",
    )
    plan = edit(write(tmp_path, "multiline_ctor", source)).plans[0]
    assert any("Experts( hidden, inter, num_experts )" in entry for entry in plan.trust_boundary), plan.trust_boundary
    assert not any("\n" in entry for entry in plan.trust_boundary)


# The same side call in every branch of the join's `if` (transformers HY-V3's fp32 combine): it
# runs once on every path, so it is hoisted once, before the `if`.
EVERY_BRANCH = """
weights, ids = self.route(x)
out = self.experts(x, weights, ids)
if self.has_experts:
    h = (out.float() + self.shared_expert(x).float()).to(x.dtype)
else:
    h = out + self.shared_expert(x)
return h
"""


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("has_experts", [True, False])
def test_the_same_side_call_in_every_branch_is_hoisted_once(tmp_path, has_experts):
    step = edits_and_verifies(tmp_path, "every_branch", model_source(EVERY_BRANCH, f"has_experts={has_experts}"))
    forward = block_forward(step.new)
    assert forward.count("self.shared_expert(x)") == 2  # on the side stream, and once on the flag-off path
    assert "h = (out.float() + shared_expert_output.float()).to(x.dtype)" in forward
    assert "h = out + shared_expert_output" in forward


@pytest.mark.slow  # runs the model through verify
def test_a_branch_that_changes_the_side_input_first_is_refused(tmp_path):
    """`x.mul_(2) + self.shared_expert(x)` reads x after the write: hoisting the call changes it."""
    unsafe = EVERY_BRANCH.replace("h = out + self.shared_expert(x)", "h = x.mul_(2) + self.shared_expert(x)")
    source = model_source(unsafe, "has_experts=False")
    why = refusal(write(tmp_path, "branch_writes_input", source))
    assert "writes 'x' before the side call in the same statement reads it" in why
    plan = edit(write(tmp_path, "every_branch", model_source(EVERY_BRANCH))).plans[0]
    problems = forced_fails_verify(tmp_path, write(tmp_path, "branch_writes_forced", source), plan)
    assert any("differs" in p for p in problems), problems


@pytest.mark.slow  # runs the model through verify
def test_every_side_call_of_a_join_statement_is_replaced(tmp_path):
    """Two side calls hoisted out of one statement: both read their results on the main path (the
    second one once stayed in place, and ran again on the main stream)."""
    two = """
weights, ids = self.route(x)
out = self.experts(x, weights, ids)
return out + self.shared_expert(x) * self.shared_mlp(x).sigmoid()
"""
    step = edits_and_verifies(tmp_path, "two_hoists", model_source(two))
    forward = block_forward(step.new)
    assert "return out + shared_expert_output * shared_mlp_output.sigmoid()" in forward
    assert forward.count("self.shared_mlp(x)") == 2  # on the side stream, and on the flag-off path


# In the join statement, a call evaluated after the side call (Python's left-to-right order) may
# write the side input: the hoisted side call has read it by then, as it had before.
AFTER_IN_JOIN = """
weights, ids = self.route(x)
out = self.experts(x, weights, ids)
return self.shared_expert(x) + self.bump(out, x)
"""


@pytest.mark.slow  # runs the model through verify
def test_a_write_after_the_side_call_in_its_statement_is_not_in_the_way(tmp_path):
    step = edits_and_verifies(tmp_path, "after_in_join", model_source(AFTER_IN_JOIN))
    assert "return shared_expert_output + self.bump(out, x)" in block_forward(step.new)


@pytest.mark.slow  # runs the model through verify
def test_a_write_before_the_side_call_in_its_statement_is_refused(tmp_path):
    unsafe = AFTER_IN_JOIN.replace(
        "self.shared_expert(x) + self.bump(out, x)", "self.bump(out, x) + self.shared_expert(x)"
    )
    why = refusal(write(tmp_path, "before_in_join", model_source(unsafe)))
    assert "writes 'x' before the side call in the same statement reads it" in why
    plan = edit(write(tmp_path, "after_in_join", model_source(AFTER_IN_JOIN))).plans[0]
    problems = forced_fails_verify(tmp_path, write(tmp_path, "before_forced", model_source(unsafe)), plan)
    assert any("differs" in p for p in problems), problems


# Refusals say what blocks, and where.
def test_a_write_through_an_alias_names_where_the_alias_came_from(tmp_path):
    forward = """
shared = self.shared_expert(x)
weights, ids = self.route(x)
out = fused_experts(x, weights, ids)
out.mul_(2)
return out + shared
"""
    source = model_source(forward).replace(
        "from torch import nn\n", "from torch import nn\nfrom kernels_not_here import fused_experts\n"
    )
    why = refusal(write(tmp_path, "alias_origin", source))
    assert (
        "line 55 writes 'out' in place while the side stream reads it ('out' may hold the storage of 'x' "
        "(bound at line 54 from fused_experts (not visible to msrewrite), which may return its argument))"
    ) in why, why


def test_a_helper_that_only_runs_the_side_work_says_so(tmp_path):
    """SGLang qwen2_moe.py's `_forward_shared_experts` calls a kernel msrewrite cannot see into, so
    it is no helper whose call can move; as a function of its own it has nothing to overlap."""
    helper = "    def _forward_shared_experts(self, x):\n        return fused_gate(self.shared_expert(x))\n\n"
    source = model_source("return self._forward_shared_experts(x) + self.experts(x, *self.route(x))")
    block_forward_def = "    def forward(self, x):\n        return self._forward_shared_experts"
    source = source.replace(block_forward_def, helper + block_forward_def, 1)
    source = source.replace("from torch import nn\n", "from torch import nn\nfrom kernels_not_here import fused_gate\n")
    src = load(write(tmp_path, "helper_only", source))
    from msrewrite.cases import get_case
    from msrewrite.cases._base import Options
    from msrewrite.cases._finder import find_targets

    targets = {
        t.function: t
        for t in find_targets(get_case("moe-shared-expert"), src.path, src.module, Options(), text=src.text)
    }
    assert "calls `fused_gate`, which msrewrite cannot see into" in targets["Block.forward"].reason
    assert targets["Block._forward_shared_experts"].reason == (
        "_forward_shared_experts() calls no submodule besides the side work (self.shared_expert): nothing "
        "to overlap it with here; the overlap belongs where it is called"
    )


def test_main_work_inside_the_join_statement_is_named(tmp_path):
    """Main work evaluated after the statement reads the side output stays in the statement (the
    shape whose main work comes first is hoisted: tests/test_join_split.py)."""
    why = refusal(
        write(
            tmp_path,
            "main_in_join",
            model_source("h = x * 2\nshared = self.shared_expert(h)\nreturn shared + self.experts(h, *self.route(h))"),
        )
    )
    assert (
        "nothing to overlap (the main work, self.experts, is in the join statement at line 53 itself; "
        "msrewrite does not hoist it out of that statement: self.experts(h, *self.route(h)) runs after the "
        "statement reads the side output 'shared'; hoisting it would run it before that read)"
    ) in why, why


def test_a_side_call_in_an_if_that_returns_is_named(tmp_path):
    """KimiK3MoE._forward_shared_experts' shape: one path returns the side call, the other gathers
    first. The `if` that returns stays as it is (tests/test_early_exit_if.py); what is left has
    nothing to overlap, and the refusal says why."""
    why = refusal(
        write(
            tmp_path,
            "if_returns",
            model_source(
                "if self.has_experts:\n    return self.shared_expert(x)\nout = self.shared_expert(x * 2)\n"
                "return self.experts(out, *self.route(out))"
            ),
        )
    )
    assert "nothing to overlap (the main work, self.experts, is in the join statement" in why, why
    assert "reads the side output 'out', so it can only run after the join" in why, why
    assert "returns from the function" not in why, why


# A package that re-exports with `from .common import *` (SGLang's sglang/srt/utils/__init__.py):
# its functions are read through the star import, never imported.
@pytest.fixture
def star_package(tmp_path):
    from msrewrite.analyze import packages

    root = tmp_path / "src"
    pkg = root / "starpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from starpkg.common import *\n")
    (pkg / "common.py").write_text(
        "def scaled(x, w):\n    return x * w.sum()\n\n\ndef scale_(x, w):\n    x.mul_(w.sum())\n    return x\n"
    )
    packages.set_source_path([root])
    yield root
    packages.set_source_path([])


STAR = """
weights, ids = self.route(x)
out = self.experts(x, weights, ids)
out = scaled(x, weights) + out
return out + self.shared_expert(x)
"""


@pytest.mark.slow  # runs the model through verify
def test_a_function_reexported_with_a_star_import_is_read(tmp_path, star_package):
    source = model_source(STAR).replace(
        "from torch import nn\n",
        f"from torch import nn\nimport sys\nsys.path.insert(0, {str(star_package)!r})\nfrom starpkg import scaled, scale_\n",
    )
    step = edits_and_verifies(tmp_path, "star_pure", source)
    assert step.plans[0].trust_boundary == ()


@pytest.mark.slow  # runs the model through verify
def test_a_star_exported_function_that_writes_its_input_is_refused(tmp_path, star_package):
    source = model_source(STAR.replace("scaled(x, weights) + out", "scale_(x, weights) + out")).replace(
        "from torch import nn\n",
        f"from torch import nn\nimport sys\nsys.path.insert(0, {str(star_package)!r})\nfrom starpkg import scaled, scale_\n",
    )
    why = refusal(write(tmp_path, "star_writes", source))
    assert "nothing to overlap (the fork waits for line 56, which writes 'x' before the side work reads it)" in why, why
    plan = edit(
        write(
            tmp_path,
            "star_pure",
            model_source(STAR).replace(
                "from torch import nn\n",
                f"from torch import nn\nimport sys\nsys.path.insert(0, {str(star_package)!r})\nfrom starpkg import scaled, scale_\n",
            ),
        )
    ).plans[0]
    problems = forced_fails_verify(tmp_path, write(tmp_path, "star_forced", source), plan)
    assert any("differs" in p or "race" in p for p in problems), problems


# --- moe-shared-expert-phased: a helper with `if`s, inlined and split over the phases ------------
def phased(path: Path, **options):
    src = load(path)
    steps = case_steps(path, src.text, src.module, "moe-shared-expert-phased", "eager", None, FLAG, None, **options)
    return steps


PHASED_HELPER = """
    def _shared(self, h, on):
        out = None
        if on:
            out = self.shared_expert(h)
        return out

    def forward(self, x):
        on = self.has_experts
        shared = self._shared(x, on)
        off = not on
        w, ids = self.route(x)
        out = self.experts(x, w, ids)
        return out + shared
"""


def phased_source(body: str) -> str:
    source = model_source("return x")
    start = source.index("    def forward(self, x):\n        return x\n")
    return (
        source[:start]
        + textwrap.dedent(body).strip("\n").replace("\n", "\n    ").join(["    ", "\n"])
        + source[start + len("    def forward(self, x):\n        return x\n") :]
    )


@pytest.mark.slow  # runs the model through verify
def test_a_helper_with_an_if_is_inlined_and_split_over_the_phases(tmp_path):
    path = write(tmp_path, "phased_helper", phased_source(PHASED_HELPER))
    steps = phased(path)
    inlined, edited = steps[0].new, steps[-1].new
    assert "self._shared(" not in block_forward(inlined).split("def forward")[1]
    forward = block_forward(edited).split("def forward")[1]
    # phase 0 at the fork: the up projection; phase 1 after `w`: the rest, under the same `if on:`
    assert "                if on:\n                    up_out = self.shared_expert.up(x)\n        else:" in forward
    assert (
        "phase 1 of the shared expert re-enters the side stream after w." in forward
        and "                if on:\n                    silu_out = F.silu(up_out)\n"
        "                    shared = self.shared_expert.down(silu_out)\n        out = self.experts"
        in forward
    )
    plan = steps[-1].plans[0]
    assert any(len(set(side.inner_phases)) == 2 for side in plan.side)
    result = verified(tmp_path, path, edited, steps[-1].plans, planned=steps[-1].old)
    assert result.ok, result.problems


@pytest.mark.slow  # runs the model through verify
def test_an_if_whose_test_changes_before_a_later_phase_is_not_split(tmp_path):
    """`on` rebound before the phase-1 re-entry: each phase would test it again and skip the rest,
    so the `if` runs whole, in one phase; the split, forced anyway, is caught by verify."""
    unsafe = PHASED_HELPER.replace("off = not on", "on = not on")
    path = write(tmp_path, "phased_flip", phased_source(unsafe))
    steps = phased(path)
    assert not any(side.inner_phases for side in steps[-1].plans[0].side)
    result = verified(tmp_path, path, steps[-1].new, steps[-1].plans, planned=steps[-1].old)
    assert result.ok, result.problems
    safe = phased(write(tmp_path, "phased_helper", phased_source(PHASED_HELPER)))
    forced = write(tmp_path, "phased_flip_inlined", safe[0].new.replace("off = not on", "on = not on"))
    problems = forced_fails_verify(tmp_path, forced, safe[-1].plans[0])
    assert any("differs" in p or "raised" in p for p in problems), problems


# A later side statement that rebinds what an earlier one reads never moves to an earlier phase.
REBIND_IN_SIDE = """
    def forward(self, x):
        x2 = x * 2
        a = self.shared_expert.up(x)
        b = F.silu(a)
        a = self.shared_expert.up(x2)
        c = self.shared_expert.down(b) + self.shared_expert.down(F.silu(a))
        w, ids = self.route(x)
        out = self.experts(x, w, ids)
        d = self.gate(out)
        return out + c + d.sum()
"""


@pytest.mark.slow  # runs the model through verify
def test_a_rebinding_side_statement_keeps_its_order_across_phases(tmp_path):
    path = write(tmp_path, "rebind_in_side", phased_source(REBIND_IN_SIDE))
    steps = phased(path, phase_anchors=("w", "out"))
    plan = steps[-1].plans[0]
    phases = {side.source: side.phase for side in plan.side}
    b = phases["b = F.silu(a)"]
    rebound = phases["a = self.shared_expert.up(x2)"]
    assert rebound >= b == 1  # never before `b = F.silu(a)` reads the first `a`
    result = verified(tmp_path, path, steps[-1].new, steps[-1].plans, planned=steps[-1].old)
    assert result.ok, result.problems
    # by depth alone the rebinding would go to phase 0, at the fork, before `b` reads the first `a`
    early = dataclasses.replace(
        plan,
        side=tuple(
            dataclasses.replace(side, phase=0) if side.source == "a = self.shared_expert.up(x2)" else side
            for side in plan.side
        ),
    )
    inlined = write(tmp_path, "rebind_in_side_inlined", steps[-1].old)
    problems = forced_fails_verify(tmp_path, inlined, early)
    assert any("differs" in p for p in problems), problems


def test_suggest_proposes_nothing_inside_a_fullgraph_region(tmp_path):
    """vLLM 0.33.0's MTP and eagle layers: apply --plan refuses a plan inside @support_torch_compile,
    so suggest never prints one there; without the decorator the same branch is proposed."""
    from msrewrite.suggest.pipeline import analyze
    from msrewrite.suggest.profiles import profile

    fixture = Path(__file__).parent / "fixtures" / "fullgraph_moe.py"
    analysis = analyze(fixture, device=profile("a3"), static=True)
    assert analysis.candidates == []
    assert any("MoE.forward runs inside a torch.compile fullgraph region" in r["reason"] for r in analysis.refused)
    plain = write(tmp_path, "plain_moe", fixture.read_text().replace("@support_torch_compile\n", ""))
    assert [c.plan.function for c in analyze(plain, device=profile("a3"), static=True).candidates] == ["MoE.forward"]
