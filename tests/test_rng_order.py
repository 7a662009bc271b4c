"""apply refuses to move side work whose random draws change order against the main path's
(dropout, torch.rand*, bernoulli, nn.Dropout submodules) unless --allow-rng-reorder is given; each
case is run through verify: a refused shape, forced with the option, fails verify in train mode, and
an accepted one verifies clean (original = flag off = flag on under every schedule, train included).
"""

from __future__ import annotations

import json
from pathlib import Path

import libcst as cst
import pytest

from helpers import run_main
from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")

HEADER = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.dropout import Dropout as ExternalDropout


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)
        self.side_drop = nn.Dropout(0.25)
        self.external = ExternalDropout(0.5)

    def forward(self, x):
"""
FOOTER = """

def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""

# name -> (forward body, the draws the refusal names); every one is refused without the option
REFUSED = {
    "nn-dropout-both": (
        "        s = self.shared_experts(self.side_drop(x))\n"
        "        h = self.experts(self.gate(self.drop(x)))\n"
        "        return h + s\n",
        "(line 19: self.side_drop) and so does the main path between the fork and the join (line 20: self.drop)",
    ),
    "functional-dropout-main": (
        "        s = self.shared_experts(self.side_drop(x))\n"
        "        h = self.experts(F.dropout(self.gate(x), 0.5, self.training))\n"
        "        return h + s\n",
        "(line 20: F.dropout)",
    ),
    "bernoulli-side": (
        "        s = self.shared_experts(x * torch.bernoulli(torch.full_like(x, 0.5)))\n"
        "        h = self.experts(self.gate(x + torch.rand_like(x)))\n"
        "        return h + s\n",
        "(line 19: torch.bernoulli) and so does the main path between the fork and the join (line 20: torch.rand_like)",
    ),
    # the side call is hoisted out of the join statement, across the dropout evaluated before it
    "hoisted-across-join-draw": (
        "        h = self.experts(self.gate(x))\n"
        "        return F.dropout(h, 0.5, self.training) + self.shared_experts(self.side_drop(x))\n",
        "(line 20: self.side_drop) and so does the main path between the fork and the join (line 20: F.dropout)",
    ),
    # a callee msrewrite cannot see into may draw: it is named
    "unseen-main-callee": (
        "        s = self.shared_experts(self.side_drop(x))\n"
        "        h = self.experts(self.external(self.gate(x)))\n"
        "        return h + s\n",
        "the main path between the fork and the join calls self.external (ExternalDropout",
    ),
}
# accepted: no draw on the main path between the fork and the join
ACCEPTED = {
    "side-only": "        s = self.shared_experts(self.side_drop(x))\n        h = self.experts(self.gate(x))\n        return h + s\n",
    "main-draw-before-fork": (
        "        x = self.drop(x)\n"
        "        s = self.shared_experts(self.side_drop(x))\n"
        "        h = self.experts(self.gate(x))\n"
        "        return h + s\n"
    ),
    "main-draw-after-join": (
        "        s = self.shared_experts(self.side_drop(x))\n"
        "        h = self.experts(self.gate(x))\n"
        "        return self.drop(h + s)\n"
    ),
    "main-only": "        s = self.shared_experts(x)\n        h = self.experts(self.gate(self.drop(x)))\n        return h + s\n",
}


def model(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(HEADER + body + FOOTER)
    return path


def edit(path: Path, allow: bool = False):
    src = load(path)
    steps = case_steps(
        path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, allow_rng_reorder=allow
    )
    return steps[-1]


def verify(tmp_path: Path, path: Path, text: str):
    edited = tmp_path / f"{path.stem}_ms.py"
    edited.write_text(text)
    return verify_files(edited, original=path, inputs=0)


@pytest.mark.slow  # starts a process or runs verify
@pytest.mark.parametrize("name", list(REFUSED))
def test_reordered_draws_are_refused_and_verify_catches_them_when_forced(tmp_path, name):
    body, named = REFUSED[name]
    path = model(tmp_path, name, body)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert named in str(refused.value) and "--allow-rng-reorder" in str(refused.value), str(refused.value)
    forced = edit(path, allow=True)
    assert forced.plans[0].allow_rng_reorder and forced.plans[0].rng_reorder
    result = verify(tmp_path, path, forced.new)
    assert not result.ok
    if name == "hoisted-across-join-draw":  # hoisting alone changes the order, with the flag off too
        assert any(p.startswith("train: flag off: output 0 differs") for p in result.problems), result.problems
    else:
        assert any("rng-order" in p for p in result.problems), result.problems


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_draws_in_the_same_order_are_edited_and_verify_clean(tmp_path, name):
    path = model(tmp_path, name, ACCEPTED[name])
    step = edit(path)
    assert not step.plans[0].allow_rng_reorder and not step.plans[0].rng_reorder
    result = verify(tmp_path, path, step.new)
    assert result.ok, result.problems
    assert "train" in result.scenarios and result.schedules == ["early", "late", "interleaved"]


@pytest.mark.slow  # the CLI with verify
def test_plan_file_is_rechecked_and_the_option_is_recorded(tmp_path):
    """apply --plan refuses a plan whose move reorders random draws; with --allow-rng-reorder it
    carries it out, says so with the edit, and verify --plan catches the reordering (exit 1)."""
    path = model(tmp_path, "plan", REFUSED["nn-dropout-both"][0])
    plan = edit(path, allow=True).plans[0].with_changes(allow_rng_reorder=False, rng_reorder="")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps([plan.to_dict()]))
    refused = run_main("apply", str(path), "--plan", str(plan_file))
    assert refused.returncode == 1 and not refused.stdout
    assert "refused plan for Block.forward: the side branch draws random numbers" in refused.stderr
    assert refused.stderr.count("\n") == 2, refused.stderr  # the mode note and the one-line refusal

    target = tmp_path / "edited.py"
    target.write_text(path.read_text())
    applied = run_main("apply", str(target), "--plan", str(plan_file), "--allow-rng-reorder", "-i")
    assert applied.returncode == 0, applied.stderr
    assert "--allow-rng-reorder: the side branch draws random numbers" in applied.stderr
    verified = run_main(
        "verify", str(target), "--original", str(path), "--plan", str(plan_file), "--json", "--inputs", "0"
    )
    assert verified.returncode == 1, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    assert any(p.startswith("rng-order: train: flag on") for p in report["problems"]), report["problems"]


def test_option_needs_a_case_that_moves_calls(tmp_path):
    path = model(tmp_path, "options", ACCEPTED["side-only"])
    result = run_main("apply", str(path), "--case", "kvcache-offload", "--allow-rng-reorder")
    assert result.returncode == 2 and not result.stdout
    assert result.stderr.strip().endswith(
        "msrewrite: error: --allow-rng-reorder is for cases that move calls onto a side stream; kvcache-offload moves none"
    ), result.stderr


def test_plan_file_field_types_are_checked(tmp_path):
    path = model(tmp_path, "schema", ACCEPTED["side-only"])
    plan = edit(path).plans[0].to_dict()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({**plan, "allow_rng_reorder": "yes"}))
    result = run_main("apply", str(path), "--plan", str(plan_file))
    assert result.returncode == 2 and "allow_rng_reorder" in result.stderr and not result.stdout


# Every kind of draw the generated table (analyze/torch_names: RNG_OPS, RNG_F_FUNCTIONS,
# RNG_NN_MODULES) names beyond dropout and torch.rand*: kind -> (the draw, as a format of its
# input, the name a refusal gives it). Each is refused when both paths draw (and verify catches
# the forced edit in train mode), and edited when only the side draws.
KIND_HEADER = """
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)
        self.rrelu = nn.RReLU()
        self.alpha_drop = nn.AlphaDropout(0.5)
        self.feature_alpha_drop = nn.FeatureAlphaDropout(0.5)
        self.drop1d = nn.Dropout1d(0.5)

    def forward(self, x):
"""
KINDS = {
    "gumbel-softmax": ("F.gumbel_softmax({}, tau=1.0)", "F.gumbel_softmax"),
    "functional-rrelu": ("F.rrelu({}, training=self.training)", "F.rrelu"),
    "rrelu-module": ("self.rrelu({})", "self.rrelu"),
    "functional-alpha-dropout": ("F.alpha_dropout({}, 0.5, self.training)", "F.alpha_dropout"),
    "alpha-dropout-module": ("self.alpha_drop({})", "self.alpha_drop"),
    "functional-feature-alpha-dropout": ("F.feature_alpha_dropout({}, 0.5, self.training)", "F.feature_alpha_dropout"),
    "feature-alpha-dropout-module": ("self.feature_alpha_drop({})", "self.feature_alpha_drop"),
    "functional-dropout1d": ("F.dropout1d({}, 0.5, self.training)", "F.dropout1d"),
    "dropout1d-module": ("self.drop1d({})", "self.drop1d"),
    **{
        f"method-{method}": (f"{{}} * torch.empty_like({{}}).{method}({args})", f"torch.empty_like(x).{method}")
        for method, args in (
            ("bernoulli_", "0.5"),
            ("uniform_", ""),
            ("normal_", ""),
            ("exponential_", ""),
            ("random_", "0, 2"),
            ("cauchy_", ""),
            ("geometric_", "0.5"),
            ("log_normal_", ""),
        )
    },
}


def kind_model(tmp_path: Path, name: str, main_draws: bool) -> Path:
    draw = KINDS[name][0]
    main_input = draw.format(*["h"] * draw.count("{}")) if main_draws else "h"
    body = (
        f"        s = self.shared_experts({draw.format(*['x'] * draw.count('{}'))})\n"
        "        h = self.gate(x)\n"
        f"        h = self.experts({main_input})\n"
        "        return h + s\n"
    )
    path = tmp_path / f"{name.replace('-', '_')}_{'both' if main_draws else 'side'}.py"
    path.write_text(KIND_HEADER + body + FOOTER)
    return path


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize("name", list(KINDS))
def test_each_kind_of_draw_on_both_paths_is_refused_and_verify_catches_it_when_forced(tmp_path, name):
    path = kind_model(tmp_path, name, main_draws=True)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    message = str(refused.value)
    assert f"the side branch draws random numbers (line 19: {KINDS[name][1]})" in message, message
    assert "the main path between the fork and the join (line 21:" in message and "--allow-rng-reorder" in message
    forced = edit(path, allow=True)
    result = verify(tmp_path, path, forced.new)
    assert any(p.startswith("rng-order: train: flag on") for p in result.problems), result.problems


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize("name", list(KINDS))
def test_each_kind_of_draw_on_the_side_only_is_edited_and_verifies_clean(tmp_path, name):
    path = kind_model(tmp_path, name, main_draws=False)
    step = edit(path)
    assert not step.plans[0].rng_reorder
    result = verify(tmp_path, path, step.new)
    assert result.ok, result.problems
    assert "train" in result.scenarios


def test_the_draw_table_names_each_kind():
    """The analysis counts each kind as a draw (the unit layer of the two tests above)."""
    from msrewrite.analyze.torch_effects import draws, nn_module_effect

    for leaf in ("gumbel_softmax", "rrelu", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout"):
        assert draws(leaf, functional=True), leaf
    for method in ("bernoulli_", "uniform_", "normal_", "exponential_", "random_", "cauchy_", "geometric_"):
        assert draws(method, functional=False), method
    assert draws("log_normal_", functional=False) and draws("rrelu", functional=False)
    for module in ("RReLU", "AlphaDropout", "FeatureAlphaDropout", "Dropout1d", "Dropout", "MultiheadAttention"):
        effect = nn_module_effect(cst.parse_expression(f"nn.{module}()"))
        assert effect is not None and effect.rng, module
    for pure in ("relu", "gelu", "softmax", "layer_norm", "leaky_relu"):
        assert not draws(pure, functional=True), pure
    for module in ("ReLU", "Linear", "LayerNorm", "Embedding"):
        effect = nn_module_effect(cst.parse_expression(f"nn.{module}()"))
        assert effect is not None and not effect.rng, module


def test_attention_draws_only_with_a_dropout_probability():
    from msrewrite.analyze.torch_effects import torch_call_effect

    def rng(code: str) -> bool:
        effect = torch_call_effect(cst.parse_expression(code))
        assert effect is not None, code
        return effect.rng

    assert not rng("F.scaled_dot_product_attention(q, k, v)")
    assert not rng("F.scaled_dot_product_attention(q, k, v, None, 0.0)")
    assert not rng("F.scaled_dot_product_attention(q, k, v, dropout_p=0)")
    assert rng("F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)")
    assert rng("F.scaled_dot_product_attention(q, k, v, None, 0.1)")
    assert rng("F.scaled_dot_product_attention(q, k, v, **kwargs)")
