"""Shapes of cann-recipes' DSA indexer (DeepSeek-V3.2 / V4, GLM-5), reduced to small models:

- indexer-prolog moves the branches it can and reports the one it cannot (the weights projection
  behind a helper such as `forward_normal`), instead of refusing the whole;
- a refusal names the callee or the variable, never a constant (`kwargs.get(k, None)` was reported
  as "may write its input 'None'") and says each function's reason once, naming the function
  (three twins each "already overlapped" read as one sentence three times);
- an overlap written into `mla_prolog_prefill` does not block its twin `mla_prolog_decode`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import libcst as cst
import pytest

from msrewrite.analyze.defuse import alias_roots
from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FIXTURES = Path(__file__).parent / "fixtures"
CASE = "indexer-prolog"
FLAG = FlagSpec(name="ENABLE_INDEXER_PROLOG_STREAMS")


def _steps(path: Path, mode: str = "eager", target: str | None = None, assume_pure: tuple[str, ...] = ()):
    src = load(path)
    return case_steps(path, src.text, src.module, CASE, mode, target, FLAG, None, assume_pure=assume_pure)


def _write(tmp_path: Path, text: str, name: str = "indexer.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# indexer-prolog: the parts it can ------------------------------------------------------------------
def test_the_q_path_moves_when_the_weights_projection_sits_in_a_helper(tmp_path):
    path = shutil.copy(FIXTURES / "indexer_weights_helper.py", tmp_path / "indexer.py")
    steps = _steps(Path(path))
    assert len(steps) == 1 and steps[0].plans[0].case_branch == "q"
    assert steps[0].plans[0].summary == "the q path: L24; not moved: the weights projection"
    assert steps[0].notes == (
        "indexer-prolog: not moved: weights: Indexer.forward: its side call is in Indexer.forward_normal, "
        "not beside the other branches in Indexer.forward",
    )
    assert "Not moved:\n- weights: Indexer.forward: its side call is in Indexer.forward_normal" in steps[0].body


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["eager", "npugraph-ex", "ge-graph", "cuda"])
def test_the_q_path_alone_verifies(tmp_path, mode):
    original = Path(shutil.copy(FIXTURES / "indexer_weights_helper.py", tmp_path / "indexer.py"))
    edited = _write(tmp_path, _steps(original, mode)[-1].new, "indexer_ms.py")
    result = verify_files(edited, original=original)
    assert result.ok, result.problems
    assert any(stream != "main" for stream in result.runs[2].streams)


def test_with_no_branch_to_move_nothing_is_written_and_each_reason_is_said(tmp_path):
    from msrewrite.cases.indexer_prolog import INVALID

    with pytest.raises(NothingToDo) as refused:
        _steps(_write(tmp_path, INVALID))
    assert str(refused.value) == (
        "no safe indexer-prolog edit: q: Indexer.forward: line 13: the side branch writes its input 'qr' in "
        "place, which line 14 on the main path reads; weights: no side call found"
    )


# Refusal text: the variable, never a constant ------------------------------------------------------
QUANT_INDEXER = """import torch
from torch import nn

_quant_matmul = getattr(torch, "mul")  # a kernel msrewrite cannot see into (a quantized matmul on the device)


class Indexer(nn.Module):
    def __init__(self, hidden=16, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wq_b = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def forward(self, x, qr, c8_input_dict):
        q = _quant_matmul(self.wq_b(qr), c8_input_dict.get("pertoken_scale", None)).view(x.shape[0], self.heads, self.head_dim)
        weights = self.weights_proj(x)
        k = self.wk(x) * c8_input_dict["k_scale"]
        scores = torch.einsum("shd,td->sht", q, k)
        return torch.einsum("sh,sht->st", weights, scores)
"""


def test_a_callee_handed_kwargs_get_with_a_none_default_names_the_dict(tmp_path):
    (step,) = _steps(_write(tmp_path, QUANT_INDEXER))
    assert step.plans[0].case_branch == "weights"  # the weights projection moves alone
    (note,) = step.notes
    # the callee's own words may say more of where it comes from ("a local or parameter ...")
    assert re.match(
        r"indexer-prolog: not moved: q: Indexer.forward: line 16: _quant_matmul \(not visible to msrewrite\) "
        r"and c8_input_dict.get \([^()]*not visible to msrewrite\) may write its input 'c8_input_dict', "
        r"which the main path still reads \(line 18\)",
        note,
    ), note
    assert "'None'" not in note


@pytest.mark.parametrize("constant", ["None", "True", "False"])
def test_a_constant_holds_no_storage(constant):
    """What an unseen callee may write is read through alias_roots: a constant is nothing it could."""
    assert alias_roots(cst.parse_expression(constant), None) == set()  # type: ignore[arg-type]
    assert alias_roots(cst.parse_expression(f"(x, {constant})"), None) == {"x"}  # type: ignore[arg-type]


# Twins: each its own target, each reason once --------------------------------------------------------
TWINS = """import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden=16, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wq_b = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)
        self.prolog_stream = None

    def forward(self, x, qr, is_prefill: bool = True):
        if is_prefill:
            return self.mla_prolog_prefill(x, qr)
        return self.mla_prolog_decode(x, qr)

    def mla_prolog_prefill(self, x, qr):
        cur_stream = torch.{api}.current_stream()
        self.prolog_stream.wait_stream(cur_stream)
        with torch.{api}.stream(self.prolog_stream):
            q = self.wq_b(qr).view(x.shape[0], self.heads, self.head_dim)
        weights = self.weights_proj(x)
        k = self.wk(x)
        cur_stream.wait_stream(self.prolog_stream)
        scores = torch.einsum("shd,td->sht", q, k)
        return torch.einsum("sh,sht->st", weights, scores)

    def mla_prolog_decode(self, x, qr):
        q = self.wq_b(qr).view(x.shape[0], self.heads, self.head_dim)
        weights = self.weights_proj(x)
        k = self.wk(x)
        scores = torch.einsum("shd,td->sht", q, k)
        return torch.einsum("sh,sht->st", weights, scores)


def make():
    torch.manual_seed(0)
    return Attention().eval(), (torch.randn(4, 16), torch.randn(4, 16), False)
"""


def test_the_decode_twin_gets_the_edit_the_prefill_twin_already_has(tmp_path):
    path = _write(tmp_path, TWINS.replace("{api}", "npu"))
    with pytest.raises(NothingToDo) as refused:
        _steps(path, target="Attention.mla_prolog_prefill")
    assert str(refused.value) == (
        "no safe indexer-prolog edit: q, weights: Attention.mla_prolog_prefill: already overlapped: this "
        "function runs it on a stream of its own (`self.prolog_stream.wait_stream`); msrewrite does not stack "
        "a second side stream on it"
    )
    steps = _steps(path, target="Attention.mla_prolog_decode")
    assert [s.plans[0].function for s in steps] == ["Attention.mla_prolog_decode"] * 2


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["eager", "ge-graph", "cuda"])
def test_the_decode_twin_edit_verifies(tmp_path, mode):
    original = _write(tmp_path, TWINS.replace("{api}", "cuda" if mode == "cuda" else "npu"))
    edited = _write(tmp_path, _steps(original, mode, target="Attention.mla_prolog_decode")[-1].new, "ms.py")
    result = verify_files(edited, original=original, target="Attention")
    assert result.ok, result.problems
