"""The edit is right without an NPU: real transformers MoE blocks, every mode, on CPU.

For each block and mode: original, rewritten flag off and rewritten flag on give equal outputs
(exactly), the shared branch's ops run on the side stream and the router/experts on main, and the
stream sanitizer reports nothing.
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path

import pytest

from msrewrite.commands.apply import plans_for_case
from msrewrite.emit.engine import apply_plans
from msrewrite.harness import build_harness, load_module
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.runtime import install
from msrewrite.verify import verify_files

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

TARGETS = {
    "DeepseekV3MoE": ("transformers.models.deepseek_v3.modeling_deepseek_v3", ("shared_experts",)),
    "Qwen3NextSparseMoeBlock": (
        "transformers.models.qwen3_next.modeling_qwen3_next",
        ("shared_expert", "shared_expert_gate"),
    ),
    "HunYuanMoEV1Moe": ("transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe", ("shared_mlp",)),
}
CASE_OF = {"HunYuanMoEV1Moe": "moe-shared-mlp-init"}
MODES = ["eager", "npugraph-ex", "ge-graph", "cuda"]
PAIRS = [
    (cls, mode)
    for cls in sorted(TARGETS)
    for mode in MODES
    if cls not in CASE_OF or mode in ("eager", "cuda")  # moe-shared-mlp-init: native modes only
]
FLAG = FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM")


def rewrite(module_name: str, cls: str, mode: str, folder: Path) -> tuple[Path, Path, str]:
    original = Path(importlib.import_module(module_name).__file__)
    edited = folder / original.name
    edited.write_text(_edited_text(module_name, cls, mode))
    return original, edited, module_name.rsplit(".", 1)[0]


@functools.cache
def _edited_text(module_name: str, cls: str, mode: str) -> str:
    """The edit of a real block (the same text for every test of this worker that asks: the
    analysis of a transformers modeling file takes seconds, and two tests edit the same pairs)."""
    original = Path(importlib.import_module(module_name).__file__)
    src = load(original)
    case = CASE_OF.get(cls, "moe-shared-expert")
    plans = plans_for_case(original, src.module, case, mode, cls, FLAG, None, text=src.text)
    return apply_plans(src.module, plans, src.text).code


@pytest.mark.parametrize("cls,mode", PAIRS)
def test_real_block_is_equivalent_and_clean(tmp_path, cls, mode):
    module_name, _ = TARGETS[cls]
    original, edited, package = rewrite(module_name, cls, mode, tmp_path)
    result = verify_files(edited, original=original, target=cls, package=package)
    assert result.ok, result.problems
    names = [run.name for run in result.runs]
    assert names[:3] == ["original", "flag off", "flag on"]
    on = result.runs[2]
    assert any(stream != "main" for stream in on.streams), on.streams
    assert set(result.runs[1].streams) == {"main"}


@pytest.mark.parametrize("cls,mode", [p for p in PAIRS if p[1] in ("eager", "ge-graph")])
def test_shared_branch_runs_on_the_side_stream_and_nothing_else_does(tmp_path, cls, mode):
    module_name, shared_attrs = TARGETS[cls]
    original, edited, package = rewrite(module_name, cls, mode, tmp_path)
    os.environ[FLAG.name] = "1"
    try:
        reference = build_harness(original, target=cls, package=package)
        with install() as rt:
            built = reference.rebuild_from(load_module(edited, package=package, name=f"{package}._placement_{mode}"))
            with rt.graph_mode() if mode == "ge-graph" else _nothing(), rt.record_ops() as ops:
                built.run()
    finally:
        del os.environ[FLAG.name]
    shared_ops = [op for op in ops if (op.module_path or "").split(".")[0] in shared_attrs]
    routed_ops = [op for op in ops if (op.module_path or "").split(".")[0] in ("gate", "experts")]
    assert shared_ops and routed_ops
    assert {op.stream for op in shared_ops} == {"tag:shared_expert" if mode == "ge-graph" else "side:1"}
    assert {op.stream for op in routed_ops} == {"main"}
    # nothing else leaks onto the side stream: only the shared modules and the block's own
    # ops of the side statements (Qwen3-Next's sigmoid gate multiply)
    leaked = {op.module_path for op in ops if op.stream != "main"} - {""}
    assert {path.split(".")[0] for path in leaked} <= set(shared_attrs), leaked


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_model_hands_one_stream_to_every_layer(tmp_path):
    """moe-shared-mlp-init: the model creates the stream once; every MoE layer gets that object."""
    from msrewrite.harness import tiny_config

    module_name, _ = TARGETS["HunYuanMoEV1Moe"]
    _original, edited, package = rewrite(module_name, "HunYuanMoEV1Moe", "eager", tmp_path)
    for value, expect_stream in (("1", True), ("0", False)):
        os.environ[FLAG.name] = value
        try:
            with install():
                mod = load_module(edited, package=package, name=f"{package}._plumbing_{value}")
                model = mod.HunYuanMoEV1ForCausalLM(tiny_config(mod.HunYuanMoEV1Config))
                streams = [layer.mlp.shared_mlp_stream for layer in model.model.layers]
        finally:
            del os.environ[FLAG.name]
        assert len(streams) == 2
        if expect_stream:
            assert streams[0] is not None and all(s is streams[0] for s in streams)
        else:
            assert streams == [None, None]


@pytest.mark.parametrize("mode", ["eager", "ge-graph", "cuda"])
def test_qwen3_next_phased_is_equivalent_and_clean(tmp_path, mode):
    """moe-shared-expert-phased on the real Qwen3-Next block: inlined, two phases, still exact."""
    from msrewrite.commands.apply import case_steps

    module_name, _ = TARGETS["Qwen3NextSparseMoeBlock"]
    original = Path(importlib.import_module(module_name).__file__)
    src = load(original)
    steps = case_steps(
        original, src.text, src.module, "moe-shared-expert-phased", mode, "Qwen3NextSparseMoeBlock", FLAG, None
    )
    assert len(steps) == 2 and steps[0].plans == []  # the inlining refactor, then the phases
    assert steps[1].plans[0].phase_anchors == ("selected_experts",)
    edited = tmp_path / original.name
    edited.write_text(steps[-1].new)
    package = module_name.rsplit(".", 1)[0]
    result = verify_files(edited, original=original, target="Qwen3NextSparseMoeBlock", package=package)
    assert result.ok, result.problems
    # the inlining step alone changes nothing either
    refactor = tmp_path / "refactor" / original.name
    refactor.parent.mkdir()
    refactor.write_text(steps[0].new)
    reference = build_harness(original, target="Qwen3NextSparseMoeBlock", package=package)
    inlined = reference.rebuild_from(load_module(refactor, package=package, name=f"{package}._inlined_{mode}"))
    import torch

    assert torch.equal(reference.run(), inlined.run())


HARNESSES = Path(__file__).resolve().parent / "harnesses"


INDEXERS = {
    "deepseek_v32": ("transformers.models.deepseek_v32.modeling_deepseek_v32", "deepseek_v32_indexer.py"),
    "glm_moe_dsa": ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "glm_moe_dsa_indexer.py"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", sorted(INDEXERS))
def test_indexer_prolog_is_equivalent_and_clean(tmp_path, model, mode):
    """indexer-prolog on transformers DeepseekV32Indexer and GlmMoeDsaIndexer: q path and weights
    projection on two side streams, k path on main."""
    from msrewrite.commands.apply import case_steps

    module_name, harness = INDEXERS[model]
    original = Path(importlib.import_module(module_name).__file__)
    src = load(original)
    steps = case_steps(
        original,
        src.text,
        src.module,
        "indexer-prolog",
        mode,
        None,
        FlagSpec(name="ENABLE_INDEXER_PROLOG_STREAMS"),
        None,
    )
    assert [step.plans[0].case_branch for step in steps] == ["q", "weights"]  # no int8 q quant here
    edited = tmp_path / original.name
    edited.write_text(steps[-1].new)
    result = verify_files(
        edited, original=original, harness=f"{HARNESSES / harness}:make", package=module_name.rsplit(".", 1)[0]
    )
    assert result.ok, result.problems
    side_streams = {s for s in result.runs[2].streams if s != "main"}
    assert len(side_streams) == 2, result.runs[2].streams


@pytest.mark.parametrize("mode", ["eager", "npugraph-ex", "ge-graph"])
def test_longcat_shortcut_moe_with_core_limits(tmp_path, mode):
    """attn-moe-limit-core on transformers LongcatFlashDecoderLayer: exact, clean, and the side
    stream really runs under its core budget (the stand-in records the stream limits)."""
    from msrewrite.commands.apply import case_steps
    from msrewrite.cores import PRESETS

    module_name = "transformers.models.longcat_flash.modeling_longcat_flash"
    original = Path(importlib.import_module(module_name).__file__)
    src = load(original)
    steps = case_steps(
        original,
        src.text,
        src.module,
        "attn-moe-limit-core",
        mode,
        "LongcatFlashDecoderLayer",
        FlagSpec(name="ENABLE_MOE_SHORTCUT_STREAM"),
        None,
        core_limits=PRESETS["a3"],
    )
    text = steps[-1].new
    if mode == "eager":
        assert '_ms_limited_side_stream("moe_shortcut", self.enable_moe_shortcut_stream, 8, 16)' in text
        assert "with _ms_core_limit(moe_shortcut_stream is not None, 16, 32):" in text
        assert "reset_stream_limit" not in text  # it would drop a limit the main stream already had
    else:
        assert "_ms_core_limit(True, 8, 16)" in text and ", 16, 32):" in text
    edited = tmp_path / original.name
    edited.write_text(text)
    result = verify_files(
        edited, original=original, target="LongcatFlashDecoderLayer", package=module_name.rsplit(".", 1)[0]
    )
    assert result.ok, result.problems
