"""`msrewrite suggest`: candidates on real transformers MoE layers, static tier, report, cost model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import transformers.models as hf_models  # noqa: E402

from msrewrite.commands.suggest import run_suggest  # noqa: E402
from msrewrite.plan import OverlapPlan, load_plans  # noqa: E402
from msrewrite.suggest import mermaid  # noqa: E402
from msrewrite.suggest.pipeline import analyze  # noqa: E402
from msrewrite.suggest.profiles import profile  # noqa: E402
from msrewrite.suggest.report import render, write_report  # noqa: E402

MODELS = Path(hf_models.__file__).parent
DEEPSEEK = MODELS / "deepseek_v3" / "modeling_deepseek_v3.py"
QWEN3_NEXT = MODELS / "qwen3_next" / "modeling_qwen3_next.py"
LONGCAT = MODELS / "longcat_flash" / "modeling_longcat_flash.py"
HUNYUAN = MODELS / "hunyuan_v1_moe" / "modeling_hunyuan_v1_moe.py"


def line_of(path: Path, text: str) -> int:
    """1-based line of the only line whose stripped text starts with `text`."""
    hits = [i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(text)]
    assert len(hits) == 1, (text, hits)
    return hits[0]


# What each model's top candidate must be: (file, target, case, function, side statements, join).
EXPECTED = {
    "deepseek": (
        DEEPSEEK, "DeepseekV3DecoderLayer", "moe-shared-expert", "DeepseekV3MoE.forward",
        ["hidden_states = hidden_states + self.shared_experts(residuals)"],
        "hidden_states = hidden_states + self.shared_experts(residuals)",
    ),
    "qwen3_next": (
        QWEN3_NEXT, "Qwen3NextDecoderLayer", "moe-shared-expert", "Qwen3NextSparseMoeBlock.forward",
        ["shared_expert_output = self.shared_expert(hidden_states_reshaped)",
         "shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states_reshaped))"],
        "expert_output = expert_output + shared_expert_output",
    ),
    "longcat": (
        LONGCAT, "LongcatFlashDecoderLayer", "attn-moe-limit-core", "LongcatFlashDecoderLayer.forward",
        ["shortcut_mlp_output = self.mlp(hidden_states)"],
        "hidden_states = residual + hidden_states + shortcut_mlp_output",
    ),
    "hunyuan": (
        HUNYUAN, "HunYuanMoEV1DecoderLayer", "moe-shared-expert", "HunYuanMoEV1Moe.forward",
        ["hidden_states_mlp = self.shared_mlp(hidden_states)"],
        "return final_hidden_states + hidden_states_mlp",
    ),
}


@pytest.fixture(scope="module")
def analyses():
    return {
        name: analyze(path, device=profile("a3"), phase="decode", target=target)
        for name, (path, target, *_rest) in EXPECTED.items()
    }


@pytest.mark.parametrize("name", list(EXPECTED))
def test_top_candidate_is_the_known_overlap(analyses, name: str) -> None:
    path, _target, case, function, side_texts, join_text = EXPECTED[name]
    analysis = analyses[name]
    assert analysis.tiers["trace"] == "ok"
    top = analysis.candidates[0]
    assert top.tier == "trace" and top.confidence == "high"
    assert (top.case, top.plan.function) == (case, function)
    side_lines = [line_of(path, text) for text in side_texts]
    assert [s.first_line for s in top.plan.side] == side_lines
    assert top.plan.join_line == line_of(path, join_text)
    assert top.command == f"msrewrite apply --case {case} --target {function} {path}"
    assert OverlapPlan.from_dict(top.plan.to_dict()) == top.plan


def test_deepseek_plan_hoists_the_inline_shared_expert_call(analyses) -> None:
    plan = analyses["deepseek"].candidates[0].plan
    (side,) = plan.side
    assert side.hoist == "shared_experts_output" and side.source == "self.shared_experts(residuals)"
    assert plan.fork_line == line_of(DEEPSEEK, "orig_shape = hidden_states.shape")  # right after residuals = ...
    assert plan.side_inputs == ("residuals",) and plan.side_outputs == ("shared_experts_output",)


def test_qwen3_next_and_longcat_plan_details(analyses) -> None:
    qwen = analyses["qwen3_next"].candidates[0].plan
    assert qwen.fork_line == line_of(QWEN3_NEXT, "shared_expert_output = self.shared_expert(")
    assert qwen.side_inputs == ("hidden_states_reshaped",) and qwen.side_outputs == ("shared_expert_output",)
    longcat = analyses["longcat"].candidates[0].plan
    assert longcat.side_outputs == ("shortcut_mlp_output",)
    assert longcat.inputs_rebound_before_join == ("hidden_states",)
    hunyuan = analyses["hunyuan"].candidates[0].plan
    assert hunyuan.inputs_rebound_before_join == ("hidden_states",)


def test_broken_imports_fall_back_to_the_static_tier(tmp_path: Path) -> None:
    broken = tmp_path / "modeling_deepseek_v3.py"
    text = DEEPSEEK.read_text().replace("from ... import initialization as init", "import no_such_module_xyz as init")
    broken.write_text(text)
    analysis = analyze(broken, device=profile("a3"))
    assert analysis.tiers["trace"].startswith("failed")
    top = analysis.candidates[0]
    assert top.tier == "static" and top.case == "moe-shared-expert"
    assert top.plan.function == "DeepseekV3MoE.forward"
    assert top.plan.side_lines == [[line_of(DEEPSEEK, "hidden_states = hidden_states + self.shared_experts(")] * 2]
    assert top.plan.side[0].hoist == "shared_experts_output"


def test_static_flag_matches_the_trace_plan(analyses) -> None:
    for name in ("deepseek", "longcat", "hunyuan"):
        path = EXPECTED[name][0]
        static = analyze(path, device=profile("a3"), static=True).candidates[0].plan
        traced = analyses[name].candidates[0].plan
        assert (static.function, static.side_lines, static.join_line, static.fork_line) == (
            traced.function, traced.side_lines, traced.join_line, traced.fork_line
        )


def test_json_output_is_only_candidates(tmp_path: Path, capsys) -> None:
    code = run_suggest(files=[DEEPSEEK], static=True, json_out=True)
    out = capsys.readouterr().out
    data = json.loads(out)
    assert code == 0 and list(data) == ["candidates"]
    first = data["candidates"][0]
    assert {"case", "file", "function", "side_lines", "join_line", "estimated_saving", "plan"} <= set(first)
    assert load_plans(out)[0].function == "DeepseekV3MoE.forward"


def test_no_candidates_exits_1(tmp_path: Path, capsys) -> None:
    plain = tmp_path / "plain.py"
    plain.write_text("class A:\n    def forward(self, x):\n        y = self.f(x)\n        return self.g(y)\n")
    assert run_suggest(files=[plain], static=True, json_out=True) == 1
    assert json.loads(capsys.readouterr().out) == {"candidates": []}


# Report ---------------------------------------------------------------------------------------------
SECTIONS = ["## 1. 分析范围", "## 2. 目标优化点", "## 3. 整网模块清单", "## 4. 整网模块依赖清单", "## 5. 整网模块 DAG",
            "## 6. 模块级并行性结论", "### 6.1 主串行链", "### 6.2 可并行模块组", "### 6.3 待验证模块组", "### 6.4 建议流分组",
            "## 7. 模块拆解结论", "## 8. 每个模块的算子级拆解", "#### 算子清单", "#### 算子依赖清单", "#### 算子 DAG",
            "##### 模块内主串行链", "##### 模块内可并行算子组", "##### 模块内待验证算子组", "##### 模块内建议流分组", "#### 模块内结论",
            "## 9. 实施记录", "### 9.1 方案选择", "### 9.2 关键改动", "### 9.3 当前实现结论", "## 10. 调试记录",
            "### 10.5 当前调试结论", "## 11. 验收结果", "### 11.4 Profile", "## 12. 最终结论"]


@pytest.mark.parametrize("name", ["deepseek", "longcat"])
def test_report_has_every_section_and_valid_mermaid(analyses, tmp_path: Path, name: str) -> None:
    path = write_report(analyses[name], tmp_path)
    assert path.name == {"deepseek": "deepseek-v3-decode.md", "longcat": "longcat-flash-decode.md"}[name]
    text = path.read_text()
    for heading in SECTIONS:
        assert heading in text, heading
    for kind in ("| data |", "| event |", "| collective_order |"):
        assert kind in text
    blocks = mermaid.blocks(text)
    assert len(blocks) >= 2
    for block in blocks:
        assert mermaid.check(block) == [], block
    assert "subgraph Side[Side Path]" in blocks[0] and "-.->" in blocks[0]


def test_static_report_is_complete(tmp_path: Path) -> None:
    text = render(analyze(DEEPSEEK, device=profile("a3"), static=True))
    for heading in SECTIONS[:12] + SECTIONS[20:]:
        assert heading in text
    assert all(mermaid.check(b) == [] for b in mermaid.blocks(text))


def test_mermaid_checker_rejects_bad_graphs() -> None:
    good = 'flowchart LR\n    subgraph Main[Main Path]\n        a["x"]\n        b["y"]\n    end\n    a --> b\n    a -.-> b'
    assert mermaid.check(good) == []
    assert mermaid.check(good.replace("flowchart LR", "graph TD"))
    assert mermaid.check(good.replace("    end\n", ""))
    assert mermaid.check(good + "\n    a --> c")
    assert mermaid.check(good + '\n    c["a "quoted" label"]')
    assert mermaid.check(good + "\n    a ==> b")


# Cost model -----------------------------------------------------------------------------------------
def test_full_size_saving_matches_a_hand_calculation(analyses) -> None:
    """DeepSeek-V3 decode, T=1, A3 die: the shared expert is three bf16 7168x2048 matmuls, bandwidth-bound."""
    top = analyses["deepseek"].candidates[0]
    assert top.cost_shapes == "full-size decode T=1"
    hidden, inter, bf16 = 7168, 2048, 2
    device = profile("a3")
    weight_bytes = 3 * hidden * inter * bf16
    activation_bytes = 2 * (hidden + inter) * bf16 + (inter + hidden) * bf16  # inputs and outputs of the 3 matmuls
    side = (weight_bytes + activation_bytes) / device.hbm_bandwidth  # FLOPs: 2*3*7168*2048 -> 0.2 µs, far below
    expected = side - 2 * device.sync_overhead  # routed experts (~8 experts' weights) take far longer
    assert top.estimated_saving == pytest.approx(expected, rel=0.10)
    assert top.cost.main_time > top.cost.side_time
    assert 1.05 < top.cost.bound < 1.2  # feasibility study: x1.12 for DeepSeek-V3
    assert not top.cost.too_small


def test_tiny_generic_candidates_are_flagged_too_small(analyses) -> None:
    generic = [c for c in analyses["deepseek"].candidates if c.case == "generic"]
    assert generic and all(c.cost and c.cost.too_small for c in generic if c.cost_shapes == "tiny trace")
