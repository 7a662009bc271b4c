"""Snapshots of side inputs (--protect, issue 27 item 1): what is copied, how, and when not.

The main path may write an input the side stream reads before the join; `--protect auto` (apply's
default) and `clone` snapshot exactly those inputs at the fork, `--protect none` refuses. What a
snapshot copies comes from what the source says the value is (analyze/value_kinds.py), never from
its name: a tensor is cloned, an immutable value (a bool, an int, None) is left alone, anything the
source does not pin down goes through `_ms_snapshot` behind `_ms_can_snapshot`, and an object of a
named class is refused. Keyword names stay as they are; only the values are renamed. Every
snapshot edit here is run through verify under every schedule (the late one included, where the
main path's write lands while the side stream still reads).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst
import pytest

from helpers import run_main
from msrewrite.analyze.value_kinds import IMMUTABLE, TENSOR, UNKNOWN, ValueKinds
from msrewrite.commands.apply import case_steps
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.emit.templates import Rename
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec

HEAD = """\
import torch
from torch import nn
from typing import NamedTuple, Optional


class Shared(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, scale=1.0, is_prefill=False, extra=None):
        out = self.lin(x) * scale
        if extra is not None:
            out = out + extra[0] * extra[1]
        return out if is_prefill else -out


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class Config:
    def __init__(self):
        self.bias = torch.ones(16)


class MoeBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.experts = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)
        self.shared_experts = Shared(d)

"""


def block(signature: str, body: str, make: str) -> str:
    forward = f"    def forward(self, {signature}):\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), " " * 8)
    return f"{HEAD}{forward}\n\n\ndef make():\n    torch.manual_seed(0)\n    return {make}\n"


# the side reads x by keyword-free position, scale by keyword, is_prefill (a bool) by keyword;
# the main path writes x and scale in place and rebinds is_prefill
KEYWORDS = block(
    "x, scale: torch.Tensor, is_prefill: bool = False, steps: int = 2, extra: Optional[torch.Tensor] = None",
    """
    shared = self.shared_experts(x, scale=scale, is_prefill=is_prefill)
    x.mul_(2.0)
    scale.add_(1.0)
    is_prefill = not is_prefill
    h = self.gate(x) * steps
    return self.experts(h) + shared
    """,
    "MoeBlock(), (torch.randn(4, 16), torch.ones(1), True, 3, None)",
)
# a tuple of tensors and a NamedTuple the side reads while the main path writes one of their tensors
TUPLES = block(
    "x, y",
    """
    pair = (x, y)
    named = Pair(x, y)
    shared = self.shared_experts(x.clone(), extra=pair) + self.shared_experts(y.clone(), extra=named)
    x.add_(1.0)
    return self.experts(x) + shared
    """,
    "MoeBlock(), (torch.randn(4, 16), torch.randn(4, 16))",
)
# an unannotated input that is not a tensor when it runs: _ms_can_snapshot keeps the single stream
# (the main path doubles cfg.bias and halves it back, so every call sees the same bias)
OPAQUE = block(
    "x, cfg",
    """
    shared = self.shared_experts(x, extra=(cfg.bias, cfg.bias))
    cfg.bias.mul_(2.0)
    h = self.gate(x) + cfg.bias
    cfg.bias.div_(2.0)
    return self.experts(h) + shared
    """,
    "MoeBlock(), (torch.randn(4, 16), Config())",
)
# the input is annotated with a class: a snapshot cannot copy its state
NAMED_CLASS = block(
    "x, cfg: Config",
    """
    shared = self.shared_experts(x, extra=(cfg.bias, cfg.bias))
    cfg.bias.mul_(2.0)
    return self.experts(x) + shared
    """,
    "MoeBlock(), (torch.randn(4, 16), Config())",
)
# the side branch writes what the main path reads: a snapshot of the side's input cannot help
SIDE_WRITES = block(
    "x",
    """
    shared = self.shared_experts(x.mul_(2.0))
    h = self.gate(x)
    return self.experts(h) + shared
    """,
    "MoeBlock(), (torch.randn(4, 16),)",
)


# annotated a bool, but written in place by the source itself: the annotation is wrong, the copy is made
MISANNOTATED = block(
    "x, mask: bool",
    """
    shared = self.shared_experts(x, scale=mask)
    mask.mul_(2.0)
    return self.experts(x * mask) + shared
    """,
    "MoeBlock(), (torch.randn(4, 16), torch.full((1,), 3.0))",
)
# an unseen callee on the main path is handed the shared expert's weights: module state a snapshot
# of the side's inputs does not copy
UNSEEN_STATE = block(
    "x",
    """
    shared = self.shared_experts(x)
    h = fused_moe(self.shared_experts.lin.weight, x)
    return self.experts(h) + shared
    """,
    "MoeBlock(), (torch.randn(4, 16),)",
).replace("import torch\n", "import torch\nfrom some_kernels import fused_moe\n", 1)
# both branches draw random numbers: their order changes on two streams
RNG = block(
    "x",
    """
    shared = self.shared_experts(torch.dropout(x, 0.5, True))
    x.mul_(2.0)
    h = torch.dropout(self.gate(x), 0.5, True)
    return self.experts(h) + shared
    """,
    "MoeBlock(), (torch.randn(4, 16),)",
)


def edit(tmp_path: Path, source: str, protect: str = "auto", mode: str = "eager"):
    original = tmp_path / "block.py"
    original.write_text(source)
    src = load(original)
    steps = case_steps(
        original,
        src.text,
        src.module,
        "moe-shared-expert",
        mode,
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
        protect=protect,
    )
    edited = tmp_path / "block_ms.py"
    edited.write_text(steps[-1].new)
    return steps[-1], edited, original


def refusal(tmp_path: Path, source: str, protect: str = "auto") -> str:
    with pytest.raises(NothingToDo) as err:
        edit(tmp_path, source, protect)
    return str(err.value)


def verified(tmp_path: Path, source: str, protect: str = "auto", mode: str = "eager"):
    from msrewrite.verify import verify_files

    step, edited, original = edit(tmp_path, source, protect, mode)
    result = verify_files(edited, original=original, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.schedules == ["early", "late", "interleaved"], result.schedule_note
    assert result.ok and not result.findings, result.problems
    return step.plans[0], edited.read_text(), result


# --- what a value is, from the source -------------------------------------------------------------
KINDS_SOURCE = """
def forward(self, x, scale: torch.Tensor, flag: bool = False, n: Optional[int] = None, fb: ForwardBatch = None,
            o: Optional[torch.Tensor] = None, t: "torch.Tensor" = None, pair: tuple[torch.Tensor, torch.Tensor] = None,
            scale_factor=2.0):
    h = self.lin(x)
    g = torch.softmax(h, dim=-1)
    s = g.shape
    m = g > 0
    k = not flag
    y = self.custom(x)
    if flag:
        z = 1
    w = h.view(-1)
    w += 1
    q, r = h.chunk(2)
    c = x.size(0) > 3
    return h
"""


@pytest.mark.parametrize(
    "name, kind",
    [
        ("x", UNKNOWN),  # unannotated: the source does not say
        ("scale", TENSOR),
        ("flag", IMMUTABLE),
        ("n", IMMUTABLE),
        ("fb", "object:ForwardBatch"),
        ("o", UNKNOWN),  # a tensor or None
        ("t", TENSOR),
        ("pair", UNKNOWN),  # a tuple: copied element by element
        ("scale_factor", UNKNOWN),  # a default is no promise: the caller may pass a tensor
        ("h", TENSOR),  # an nn.Linear built in __init__
        ("g", TENSOR),
        ("s", IMMUTABLE),
        ("m", TENSOR),  # a comparison of a tensor
        ("k", IMMUTABLE),
        ("y", UNKNOWN),  # a custom module may return anything
        ("z", UNKNOWN),  # bound on one path only
        ("w", TENSOR),
        ("q", UNKNOWN),
        ("c", UNKNOWN),  # x is not known to be a tensor
    ],
)
def test_value_kinds_come_from_the_source_not_the_name(name, kind):
    func = cst.parse_module(KINDS_SOURCE).body[0]
    assert isinstance(func, cst.FunctionDef) and isinstance(func.body, cst.IndentedBlock)
    kinds = ValueKinds(func, list(func.body.body), {"lin": "nn.Linear", "custom": "Mine"})
    assert kinds.of(name, len(func.body.body) - 1) == kind


def test_rename_keeps_keyword_names_and_attributes():
    call = cst.parse_expression("f(x, scale=scale, other=scale.scale)")
    renamed = cst.Module([]).code_for_node(call.visit(Rename("scale", "scale_side")))
    assert renamed == "f(x, scale=scale_side, other=scale_side.scale)"


# --- what the edit copies (fast: no verify) --------------------------------------------------------
def test_keyword_names_stay_and_only_tensors_are_cloned(tmp_path):
    step, edited, _ = edit(tmp_path, KEYWORDS)
    text = edited.read_text()
    (plan,) = step.plans
    assert plan.protect_inputs == ("x", "scale")  # is_prefill: a bool, nothing can write it in place
    assert "self.shared_experts(x_side, scale=scale_side, is_prefill=is_prefill)" in text
    assert "scale_side = scale.clone()" in text  # annotated torch.Tensor
    assert "x_side = _ms_snapshot(x)" in text and "_ms_can_snapshot(x)" in text  # unannotated
    assert "is_prefill.clone()" not in text and "is_prefill_side" not in text
    compile(text, str(edited), "exec")


def test_a_known_tensor_needs_no_helper(tmp_path):
    source = KEYWORDS.replace("def forward(self, x,", "def forward(self, x: torch.Tensor,")
    _step, edited, _ = edit(tmp_path, source)
    text = edited.read_text()
    assert "x_side = x.clone()" in text and "scale_side = scale.clone()" in text
    assert "_ms_snapshot" not in text and "_ms_can_snapshot" not in text


@pytest.mark.slow  # runs the model through verify
def test_an_annotation_the_source_contradicts_is_not_trusted(tmp_path):
    plan, text, _result = verified(tmp_path, MISANNOTATED)
    assert plan.protect_inputs == ("mask",) and "mask_side = _ms_snapshot(mask)" in text


def test_protect_none_refuses_what_auto_snapshots(tmp_path):
    why = refusal(tmp_path, KEYWORDS, protect="none")
    assert "writes 'x' in place while the side stream reads it; pass --protect clone" in why, why
    step, _, _ = edit(tmp_path, KEYWORDS, protect="clone")  # clone keeps its meaning
    assert step.plans[0].protect_inputs == ("x", "scale")


def test_an_object_of_a_named_class_is_refused(tmp_path):
    why = refusal(tmp_path, NAMED_CLASS)
    assert "the main path may write 'cfg' while the side stream reads it, and 'cfg' is a Config" in why, why


def test_the_side_writing_what_main_reads_is_refused_with_a_snapshot_on(tmp_path):
    why = refusal(tmp_path, SIDE_WRITES)
    assert "x" in why and "protect" not in why.split(";")[0], why


def test_an_unseen_callee_handed_the_side_modules_state_is_refused_with_a_snapshot_on(tmp_path):
    why = refusal(tmp_path, UNSEEN_STATE)
    assert (
        "fused_moe (not visible to msrewrite) may write module state 'self.shared_experts', which the side stream "
        "uses; a snapshot cannot help here; pass --assume-pure fused_moe if it does not"
    ) in why, why


def test_reordered_random_draws_are_refused_with_a_snapshot_on(tmp_path):
    why = refusal(tmp_path, RNG)
    assert "draws random numbers" in why and "--allow-rng-reorder" in why, why


def test_the_cli_says_what_the_snapshot_costs_and_none_refuses(tmp_path):
    path = tmp_path / "block.py"
    path.write_text(KEYWORDS)
    default = run_main("apply", "--case", "moe-shared-expert", str(path))
    assert default.returncode == 0, default.stderr
    assert (
        "snapshot (--protect): the main path may write x, scale before the join, so the side stream reads copies "
        "made at the fork; it costs one copy of x and one copy of scale per call"
    ) in default.stderr
    assert "paid only while the flag is on; --protect none refuses the edit instead" in default.stderr
    refused = run_main("apply", "--case", "moe-shared-expert", str(path), "--protect", "none")
    assert refused.returncode == 1 and not refused.stdout
    assert "writes 'x' in place while the side stream reads it" in refused.stderr


# --- every snapshot edit verifies ------------------------------------------------------------------
@pytest.mark.slow  # runs the model through verify
def test_keyword_and_scalar_arguments_verify(tmp_path):
    plan, text, result = verified(tmp_path, KEYWORDS)
    assert plan.protect_inputs == ("x", "scale")
    assert any(s != "main" for s in result.runs[-1].streams), result.runs[-1].streams


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["cuda", "npugraph-ex", "ge-graph"])
def test_snapshot_edits_verify_in_every_mode(tmp_path, mode):
    plan, text, _result = verified(tmp_path, KEYWORDS, mode=mode)
    assert plan.protect_inputs == ("x", "scale") and "scale_side = scale.clone()" in text


@pytest.mark.slow  # runs the model through verify
def test_tuples_of_tensors_are_copied_and_verify(tmp_path):
    plan, text, result = verified(tmp_path, TUPLES)
    assert plan.protect_inputs == ("x", "pair"), plan.protect_inputs
    # the NamedTuple is built on the side stream, from the copy
    assert "pair_side = _ms_snapshot(pair)" in text and "named = Pair(x_side, y)" in text
    assert any(s != "main" for s in result.runs[-1].streams), result.runs[-1].streams


@pytest.mark.slow  # runs the model through verify
def test_a_value_the_helper_cannot_copy_keeps_the_single_stream(tmp_path):
    """cfg is a Config when it runs: the edit runs the original code on the current stream, which
    verify reports as the only difference (no side-stream op), with every output equal."""
    from msrewrite.verify import verify_files

    step, edited, original = edit(tmp_path, OPAQUE)
    assert step.plans[0].protect_inputs == ("cfg",) and "_ms_can_snapshot(cfg)" in edited.read_text()
    result = verify_files(edited, original=original, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.problems and all("no op ran on a side stream" in p for p in result.problems), result.problems


@pytest.mark.slow  # runs the model through verify
def test_the_snapshot_is_needed_forced_without_it_verify_fails(tmp_path):
    """The twin of the snapshot edit: the same plan without its copies races in the late schedule."""
    from msrewrite.emit.engine import apply_plans
    from msrewrite.verify import verify_files

    step, _, original = edit(tmp_path, KEYWORDS)
    bare = [p.with_changes(protect_inputs=()) for p in step.plans]
    src = load(original)
    edited = tmp_path / "bare_ms.py"
    edited.write_text(apply_plans(src.module, bare, src.text).code)
    result = verify_files(edited, original=original, schedule_source=ScheduleSource(src.text, bare))
    assert not result.ok
    assert any("late schedule" in p for p in result.problems), result.problems


@pytest.mark.slow  # the CLI with verify
def test_the_readme_invalid_example_is_edited_by_default_and_verifies(tmp_path):
    from msrewrite.cases import require_case

    case = require_case("moe-shared-expert")
    path = tmp_path / "model.py"
    path.write_text(case.invalid[0].source + "\n\ndef make():\n    return MoeBlock(), (torch.randn(4, 16),)\n")
    result = run_main("apply", "--case", "moe-shared-expert", str(path), "--verify")
    assert result.returncode == 0, result.stderr
    assert "x_side = _ms_snapshot(x)" in result.stdout


def test_start_after_with_auto_refuses_as_none_does(tmp_path):
    """--start-after rebinds the side's input inside the GE graph, which a snapshot cannot: with
    it, auto refuses the write as none does (a refusal, not an error about the options)."""
    from msrewrite.plan import StartGate

    source = KEYWORDS.replace("        is_prefill = not is_prefill\n", "")
    original = tmp_path / "block.py"
    original.write_text(source)
    src = load(original)
    flag = FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM")
    gates = (StartGate("", "h"),)
    with pytest.raises(NothingToDo, match="writes 'x' in place while the side stream reads it"):
        case_steps(
            original, src.text, src.module, "moe-shared-expert", "ge-graph", None, flag, None, gates, protect="auto"
        )
