"""An op whose `forward` is a base's per-platform dispatch (SGLang's BaseFusedOp), read as the
union of the methods it may pick (analyze/fused_dispatch.py; issue 26, item 2).

The fixture package tests/fixtures/fusedop/fusedfw is a small base of the same shape (`forward`
runs `self._forward_method`, resolved per platform on the first call or pinned by the subclass's
`__init__`) and ops on it; the tests register a model of it as msrewrite's SGLang entry is
registered, for the fixture's source. Each block's routed experts call the op on the block's
input while the shared expert reads it on the side stream:
  - block_pinned_writes: `__init__` pins a method that writes the input: refused in every mode,
    and the forced overlap races under verify (on CPU the pinned method runs);
  - block_cuda_writes: only `forward_cuda` writes the input: refused for a CUDA edit, edited for
    an NPU one (the base picks `forward_cuda` on the CUDA key only), and that edit verifies clean;
  - block_pure: every method it may pick is pure: edited in both modes, nothing unseen but the
    model's own note in the trust boundary, and the edit verifies clean.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from msrewrite.analyze import fused_dispatch
from msrewrite.commands.apply import case_steps
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.verify import verify_files
from test_reach import FLAG, forced

FIXTURES = Path(__file__).parent / "fixtures" / "fusedop"
SGLANG = Path("/work/serving/sglang")  # an unpacked SGLang 0.5.23 wheel, where one is


def fixture_model() -> fused_dispatch.Dispatcher:
    """The model of fusedfw's FusedBase, for the fixture's own source."""
    digest = hashlib.sha256((FIXTURES / "fusedfw" / "fused.py").read_bytes()).hexdigest()
    return fused_dispatch.Dispatcher(
        file="fusedfw/fused.py",
        base="FusedBase",
        method="forward",
        sources={"fusedfw/fused.py": digest},
        provenance="msrewrite's test fixture",
        platform_methods={"cuda": ("forward_cuda",), "npu": ("forward_npu",)},
    )


@pytest.fixture
def modelled(monkeypatch):
    monkeypatch.setattr(fused_dispatch, "DISPATCHERS", [*fused_dispatch.DISPATCHERS, fixture_model()])


def edit(path: Path, mode: str = "eager"):
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", mode, None, FLAG, None, protect="none")[-1]


def refusal(path: Path, mode: str = "eager") -> str:
    with pytest.raises(NothingToDo) as refused:
        edit(path, mode)
    return str(refused.value)


def test_without_a_model_the_dispatch_stays_unknown():
    why = refusal(FIXTURES / "block_pure.py")
    assert "self.act_fn (SiluMul)" in why and "not visible to msrewrite" in why, why


@pytest.mark.parametrize("mode", ["eager", "cuda"])
@pytest.mark.usefixtures("modelled")
def test_a_pinned_method_that_writes_is_seen(mode):
    why = refusal(FIXTURES / "block_pinned_writes.py", mode)
    assert "writes 'x' in place while the side stream reads it" in why, why
    assert "not visible to msrewrite" not in why


@pytest.mark.usefixtures("modelled")
def test_the_platforms_method_that_writes_is_seen():
    why = refusal(FIXTURES / "block_cuda_writes.py", "cuda")
    assert "writes 'x' in place while the side stream reads it" in why, why


@pytest.mark.usefixtures("modelled")
def test_another_platforms_method_is_left_out():
    (boundary,) = edit(FIXTURES / "block_cuda_writes.py", "eager").plans[0].trust_boundary
    assert "the union of CudaInplaceSiluMul.forward_native;" in boundary, boundary
    assert "left out, picked on another platform only: forward_cuda" in boundary, boundary


@pytest.mark.parametrize("mode", ["eager", "cuda"])
@pytest.mark.usefixtures("modelled")
def test_pure_methods_are_proved_pure(mode):
    plan = edit(FIXTURES / "block_pure.py", mode).plans[0]
    assert plan.protect_inputs == ()
    (boundary,) = plan.trust_boundary
    mine, other = ("forward_npu", "forward_cuda") if mode == "eager" else ("forward_cuda", "forward_npu")
    # the compile hook's `self.forward_native if ... else None` adds forward_native, already there
    assert f"the union of SiluMul.forward_native, {mine};" in boundary, boundary
    assert f"left out, picked on another platform only: {other}" in boundary, boundary
    assert "assumed: no out-of-tree platform plugin registers a forward for SiluMul" in boundary, boundary


def copy_fixtures(tmp_path: Path) -> Path:
    folder = tmp_path / "fusedop"
    shutil.copytree(FIXTURES, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


@pytest.mark.usefixtures("modelled")
def test_a_base_that_differs_from_the_modelled_source_stays_unknown(tmp_path):
    folder = copy_fixtures(tmp_path)
    base = folder / "fusedfw" / "fused.py"
    base.write_text(base.read_text().replace("        return method(*args, **kwargs)", "        return method(*args)"))
    why = refusal(folder / "block_pure.py")
    assert "msrewrite's model of it was read from msrewrite's test fixture" in why, why
    assert "fusedfw/fused.py differs from that source" in why, why


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        (
            "self._forward_method = self.forward_inplace",
            "self._forward_method = PICKED[0]",
            "PinnedInplaceSiluMul stores PICKED[0] in self._forward_method",
        ),
        (
            "    def forward_inplace(self, x):",
            "    def backend_eligible(self, backend, x):\n        return True\n\n    def forward_inplace(self, x):",
            "PinnedInplaceSiluMul overrides backend_eligible",
        ),
        (
            "class PinnedInplaceSiluMul(FusedBase):",
            "class PinnedInplaceSiluMul(FusedBase):\n"
            "    def _torch_compile_forward(self, num_tokens):\n        return PICKED[0]\n",
            "PinnedInplaceSiluMul._torch_compile_forward returns something other than a method of the op",
        ),
        (  # a base msrewrite cannot read may define any forward_<name>
            "class PinnedInplaceSiluMul(FusedBase):",
            "class PinnedInplaceSiluMul(UnreadMixin, FusedBase):",
            "PinnedInplaceSiluMul derives from UnreadMixin, which msrewrite does not read",
        ),
        (  # a method bound in the class body by an assignment: not a def msrewrite reads
            "    def forward_native(self, x):\n        gate, up = _halves(x)\n        return F.silu(gate) * up\n\n"
            "    def forward_inplace",
            "    forward_cuda = PICKED\n\n    def forward_inplace",
            "PinnedInplaceSiluMul binds forward_cuda other than by a def in its body",
        ),
        (
            "    def forward_inplace(self, x):",
            "    if PIN_INPLACE:\n\n        def forward_npu(self, x):\n            return x\n\n    def forward_inplace(self, x):",
            "PinnedInplaceSiluMul binds forward_npu other than by a def in its body",
        ),
    ],
)
@pytest.mark.usefixtures("modelled")
def test_what_the_model_cannot_name_stays_unknown(tmp_path, old, new, said):
    folder = copy_fixtures(tmp_path)
    acts = folder / "fusedfw" / "acts.py"
    text = acts.read_text().replace("PIN_INPLACE = True", "PIN_INPLACE = True\nPICKED = []")
    assert old in text
    acts.write_text(text.replace(old, new))
    why = refusal(folder / "block_pinned_writes.py")
    assert said in why and "not visible to msrewrite" in why, why


@pytest.mark.slow  # runs the models through verify
@pytest.mark.usefixtures("modelled")
def test_verify_agrees(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    for name in ("block_pure", "block_cuda_writes"):
        original = FIXTURES / f"{name}.py"
        step = edit(original, "eager")
        edited = tmp_path / f"{name}_ms.py"
        edited.write_text(step.new)
        result = verify_files(edited, original=original, schedule_source=ScheduleSource(step.old, step.plans))
        assert result.ok and not result.findings, (name, result.problems)
    writing = FIXTURES / "block_pinned_writes.py"
    text, source = forced(writing)
    raced = tmp_path / "block_pinned_writes_ms.py"
    raced.write_text(text)
    result = verify_files(raced, original=writing, schedule_source=source)
    assert not result.ok, "the forced overlap of the pinned writing op verified clean"


@pytest.mark.slow  # reads SGLang's layers (seconds)
@pytest.mark.skipif(not (SGLANG / "sglang" / "kernels" / "fused_op.py").is_file(), reason="no unpacked SGLang 0.5.23")
@pytest.mark.parametrize("mode", ["eager", "cuda"])
def test_sglang_silu_and_mul_is_read_through_the_model(mode):
    """In SGLang 0.5.23 SiluAndMul's dispatch is seen through: what stays unknown is a method it
    may pick (forward_aiter's aiter kernel), not BaseFusedOp.forward."""
    import libcst as cst

    from msrewrite.analyze.summaries import ModuleSummaries

    path = SGLANG / "sglang" / "srt" / "layers" / "activation.py"
    module = ModuleSummaries(cst.parse_module(path.read_text()), path=path, mode=mode)
    effect = module._instance_call(cst.parse_expression("self.act_fn(x)"), (module, "SiluAndMul"), "a", "S", "")
    (note,) = [u for u in effect.unseen_work if "msrewrite's model of its dispatch (sglang 0.5.23)" in u]
    picked = "forward_aiter, forward_npu" if mode == "eager" else "forward_cuda, forward_aiter"
    assert f"the union of SiluAndMul.forward_native, {picked};" in note, note
    assert "_aiter_silu_and_mul (not visible to msrewrite)" in effect.unknown, effect.unknown
    assert not any("BaseFusedOp.forward uses" in u for u in effect.unknown), effect.unknown


LONG_TESTS = """import torch
from torch import nn

from fw_utils import is_cuda

_is_cuda = is_cuda()


class Routed(nn.Module):
    def forward(self, x):
        y = x * 2
        BRANCHES
        return y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = Routed()

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(x)
        return h + s
"""


def test_a_long_platform_test_note_is_clipped_not_a_crash(tmp_path):
    """Reading more of a framework meets longer platform tests: the trust boundary's note quoting
    them stays one valid line (it made an invalid plan before: a traceback)."""
    branch = "if _is_cuda and (\n            {name}_{i}_is_a_rather_long_flag_name_for_a_fused_kernel_path\n        ):\n            y = y + {i}"
    branches = "\n        ".join(branch.format(name="option" * 6, i=i) for i in range(5))
    path = tmp_path / "long_tests.py"
    path.write_text(LONG_TESTS.replace("BRANCHES", branches))
    boundary = edit(path, "eager").plans[0].trust_boundary
    (note,) = [n for n in boundary if n.startswith("code under")]
    assert len(note) <= 500 and "and 1 more platform tests" in note, note
