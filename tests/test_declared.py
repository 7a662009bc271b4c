"""Declared effects (analyze/declared.py): custom ops write what their registration declares.

The adversarial models tests/adversarial/declared_*.py run each kind through verify (must-see and
must-not-overclaim). Here: the apply refusals and edits name what was read, on those models and on
files inside tests/fixtures/declared, two tiny packages shaped like vLLM's
`direct_register_custom_op` and SGLang's `register_custom_op` (run in place, as a user runs
msrewrite inside an unpacked framework tree), and the schema reader.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import ROOT
from msrewrite.analyze import declared
from msrewrite.commands.apply import case_steps
from msrewrite.errors import MsrewriteError
from msrewrite.load import load
from msrewrite.plan import FlagSpec

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")
ADVERSARIAL = ROOT / "tests" / "adversarial"
PACKAGES = ROOT / "tests" / "fixtures" / "declared"


def _apply(path: Path):
    """(the plans apply --case moe-shared-expert makes, "") or ([], its refusal), --protect none."""
    src = load(path)
    try:
        steps = case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None)
    except MsrewriteError as error:
        return [], str(error)
    return steps[-1].plans, ""


def _edited(path: Path) -> list:
    plans, refusal = _apply(path)
    assert plans and not refusal, refusal
    assert all(not p.protect_inputs for p in plans)  # no copy of the side input was needed
    return plans


# --- the adversarial models (verify runs them in tests/test_adversarial.py) --------------------


@pytest.mark.parametrize(
    ("name", "callee"),
    [
        ("declared_custom_op_writes", "scale_into(...)"),
        ("declared_custom_op_call_writes", "scale_into(...)"),
        ("declared_inplace_flag_writes", "fused(...)"),
        ("declared_torch_ops_writes", "torch.ops.msr_adv_ops_w.scale_into(...)"),
        ("declared_schema_writes", "torch.ops.msr_adv_schema_w.scale_into.default(...)"),
    ],
)
def test_a_declared_write_of_the_side_input_refuses_naming_the_op(name, callee):
    plans, refusal = _apply(ADVERSARIAL / f"{name}.py")
    assert not plans
    assert "writes 'x' in place while the side stream reads it" in refusal and f"inside {callee}" in refusal, refusal


@pytest.mark.parametrize(
    "name",
    [
        "declared_custom_op_pure",
        "declared_custom_op_call_pure",
        "declared_torch_ops_pure",
        "declared_schema_pure",
        "declared_inplace_flag_pure",
    ],
)
def test_a_declared_pure_op_lets_the_edit_happen(name):
    _edited(ADVERSARIAL / f"{name}.py")


def test_a_schema_ops_implementation_is_in_the_trust_boundary():
    """The schema says what it writes, not whether its implementation runs a collective."""
    (plan,) = _edited(ADVERSARIAL / "declared_schema_pure.py")
    assert any("torch.ops.msr_adv_schema_p.mix" in u and "not read" in u for u in plan.trust_boundary), plan


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # the flag is rebound before its test: it may not hold the call's value there
        ("    if inplace:\n", "    inplace = inplace or x.is_leaf\n    if inplace:\n"),
        # the call spreads arguments msrewrite cannot write out: the flag may be among them
        ("fused(x, h, inplace=False)", "fused(x, h, *self.flags)"),
        ("fused(x, h, inplace=False)", "fused(x, h, **self.options)"),
        # a flag that is not a literal at the call
        ("fused(x, h, inplace=False)", "fused(x, h, inplace=self.training)"),
        # the test is not decided by the flag alone
        ("    if inplace:\n", "    if inplace or x.is_leaf:\n"),
    ],
)
def test_a_flag_the_call_does_not_fix_keeps_both_branches(tmp_path, old, new):
    text = (ADVERSARIAL / "declared_inplace_flag_pure.py").read_text()
    assert old in text
    init = "        self.gate = nn.Linear(16, 16)\n"
    text = text.replace(init, init + '        self.flags = (True,)\n        self.options = {"inplace": True}\n')
    path = tmp_path / "model.py"
    path.write_text(text.replace(old, new))
    plans, refusal = _apply(path)
    assert not plans and "fused(...)" in refusal, refusal


def test_the_flags_default_decides_when_the_call_leaves_it_out(tmp_path):
    text = (ADVERSARIAL / "declared_inplace_flag_pure.py").read_text()
    path = tmp_path / "model.py"
    path.write_text(text.replace("fused(x, h, inplace=False)", "fused(x, h)"))
    _edited(path)
    path.write_text(text.replace("fused(x, h, inplace=False)", "fused(x, h, True)"))
    assert "inside fused(...)" in _apply(path)[1]


@pytest.mark.parametrize(
    ("mutates", "why"),
    [
        ('"unknown"', 'mutates_args="unknown"'),
        ("MUTATED", "mutates_args is not a literal list of names"),
        ('["y"]', "mutates_args names 'y', which is no parameter of scale_into"),
    ],
)
def test_an_unreadable_declaration_keeps_the_op_unknown_and_says_why(tmp_path, mutates, why):
    text = (ADVERSARIAL / "declared_custom_op_pure.py").read_text()
    text = text.replace("mutates_args=()", f"mutates_args={mutates}").replace("def mix(", "def scale_into(")
    text = text.replace("import torch\n", 'import torch\n\nMUTATED = ["x"]\n', 1)
    path = tmp_path / "model.py"
    path.write_text(text.replace("h = mix(x, self.w)", "h = scale_into(x, self.w)"))
    plans, refusal = _apply(path)
    assert not plans and "scale_into (@torch.library.custom_op" in refusal and why in refusal, refusal
    assert "may write 'x'" in refusal


def test_two_registrations_that_disagree_keep_the_op_unknown(tmp_path):
    path = tmp_path / "model.py"
    text = (
        (ADVERSARIAL / "declared_torch_ops_pure.py")
        .read_text()
        .replace(
            "class Block(nn.Module):",
            '@torch.library.custom_op("msr_adv_ops_p::mix", mutates_args=("x",))\n'
            "def mix_again(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:\n    return x * w\n\n\n"
            "class Block(nn.Module):",
        )
    )
    path.write_text(text)
    plans, refusal = _apply(path)
    assert not plans and "msr_adv_ops_p::mix is registered with different declarations" in refusal, refusal


# --- framework helpers, in a package tree ---------------------------------------------------


def test_vllm_helper_declared_write_refuses():
    plans, refusal = _apply(PACKAGES / "vllm" / "models" / "moe_writes.py")
    assert not plans and "inside torch.ops.vllm.scale_into(...)" in refusal, refusal


def test_vllm_helper_declared_pure_op_edits():
    (plan,) = _edited(PACKAGES / "vllm" / "models" / "moe_pure.py")
    # its body's kernel is not seen: it stays in the trust boundary (collectives, RNG, streams)
    assert any(
        u.startswith("torch.ops.vllm.mix (direct_register_custom_op(mix), declared)") for u in plan.trust_boundary
    )


def test_vllm_helper_with_a_variable_mutates_args_stays_unknown():
    plans, refusal = _apply(PACKAGES / "vllm" / "models" / "moe_unreadable.py")
    assert not plans and "torch.ops.vllm.mystery (not visible to msrewrite: " in refusal, refusal
    assert (
        "mutates_args is not a literal list of names" in refusal and "--assume-pure torch.ops.vllm.mystery" in refusal
    )


def test_an_op_registered_nowhere_searched_stays_unknown():
    plans, refusal = _apply(PACKAGES / "vllm" / "models" / "moe_unregistered.py")
    assert not plans and "no registration of vllm::not_registered found in" in refusal, refusal
    assert "--assume-pure torch.ops.vllm.not_registered" in refusal


def test_sglang_decorator_declared_pure_op_edits():
    _edited(PACKAGES / "sglang" / "srt" / "models" / "moe_outplace.py")


def test_sglang_inplace_keyword_writes_through_the_declared_op():
    """`fused_experts(x, w, inplace=True)`: the body hands x to the op declared to write it."""
    plans, refusal = _apply(PACKAGES / "sglang" / "srt" / "models" / "moe_inplace.py")
    assert not plans and "writes 'x' in place" in refusal and "inside fused_experts(...)" in refusal, refusal


@pytest.mark.parametrize("name", ["moe_not_inplace", "moe_default_inplace"])
def test_sglang_out_of_place_call_of_the_same_function_edits(name):
    _edited(PACKAGES / "sglang" / "srt" / "models" / f"{name}.py")


def test_sglang_decorated_op_through_torch_ops():
    plans, refusal = _apply(PACKAGES / "sglang" / "srt" / "models" / "moe_torch_ops.py")
    assert not plans and "inside torch.ops.sglang.inplace_experts(...)" in refusal, refusal


def test_a_lookalike_helper_is_not_trusted():
    plans, refusal = _apply(PACKAGES / "sglang" / "srt" / "models" / "moe_lookalike.py")
    assert not plans and "lookalike_experts (a decorator, @lookalike.register_custom_op" in refusal, refusal


# --- the schema reader ------------------------------------------------------------------------


def test_schema_marks_written_arguments_and_result_aliases():
    name, decl = declared.from_schema("s", "foo.out(Tensor(a!) x, Tensor y, *, Tensor(b!) out, int n=2) -> Tensor(b!)")
    assert name == "foo.out" and not decl.why
    assert decl.params == ["x", "y"] and decl.kwonly == ["out", "n"]
    assert decl.writes == {"x", "out"} and decl.returns == {"out"}


def test_schema_view_result_aliases_without_a_write():
    _, decl = declared.from_schema("s", "view_of(Tensor(a) self, int[] size) -> Tensor(a)")
    assert not decl.why and decl.writes == set() and decl.returns == {"self"}


def test_schema_pure_op_returns_a_new_tensor():
    _, decl = declared.from_schema("s", "mix(Tensor x, Tensor[] ws, Tensor? bias=None) -> (Tensor, Tensor)")
    assert not decl.why and decl.writes == set() and decl.returns == set() and decl.params == ["x", "ws", "bias"]


@pytest.mark.parametrize("schema", ["mix(Tensor x", "mix Tensor x -> Tensor", "(Tensor x) -> Tensor(c)"])
def test_a_schema_that_does_not_parse_is_not_read(schema):
    _, decl = declared.from_schema("s", schema)
    assert decl.why
