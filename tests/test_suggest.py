"""`msrewrite suggest`: candidates on real transformers MoE layers, static tier, report, cost model."""

from __future__ import annotations

import json
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
        DEEPSEEK,
        "DeepseekV3DecoderLayer",
        "moe-shared-expert",
        "DeepseekV3MoE.forward",
        ["hidden_states = hidden_states + self.shared_experts(residuals)"],
        "hidden_states = hidden_states + self.shared_experts(residuals)",
    ),
    "qwen3_next": (
        QWEN3_NEXT,
        "Qwen3NextDecoderLayer",
        "moe-shared-expert",
        "Qwen3NextSparseMoeBlock.forward",
        [
            "shared_expert_output = self.shared_expert(hidden_states_reshaped)",
            "shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states_reshaped))",
        ],
        "expert_output = expert_output + shared_expert_output",
    ),
    "longcat": (
        LONGCAT,
        "LongcatFlashDecoderLayer",
        "attn-moe-limit-core",
        "LongcatFlashDecoderLayer.forward",
        ["shortcut_mlp_output = self.mlp(hidden_states)"],
        "hidden_states = residual + hidden_states + shortcut_mlp_output",
    ),
    "hunyuan": (
        HUNYUAN,
        "HunYuanMoEV1DecoderLayer",
        "moe-shared-expert",
        "HunYuanMoEV1Moe.forward",
        ["hidden_states_mlp = self.shared_mlp(hidden_states)"],
        "return final_hidden_states + hidden_states_mlp",
    ),
}


@pytest.fixture(scope="module")
def analyses():
    """Every real layer traced once per module; the tests that use it are marked slow."""
    return {
        name: analyze(path, device=profile("a3"), phase="decode", target=target)
        for name, (path, target, *_rest) in EXPECTED.items()
    }


@pytest.mark.parametrize("name", list(EXPECTED))
@pytest.mark.slow
def test_top_candidate_is_the_known_overlap(analyses, name: str) -> None:
    path, _target, case, function, side_texts, join_text = EXPECTED[name]
    analysis = analyses[name]
    assert analysis.tiers["trace"] == "ok"
    top = analysis.candidates[0]
    assert top.tier == "trace"
    # high confidence only where the cost model expects a worthwhile saving (issue 10, item 9)
    assert top.confidence == ("high" if top.pays_off else "low")
    assert (top.case, top.plan.function) == (case, function)
    side_lines = [line_of(path, text) for text in side_texts]
    assert [s.first_line for s in top.plan.side] == side_lines
    assert top.plan.join_line == line_of(path, join_text)
    assert top.command == f"msrewrite apply --case {case} --target {function} {path}"
    assert OverlapPlan.from_dict(top.plan.to_dict()) == top.plan


@pytest.mark.slow
def test_deepseek_plan_hoists_the_inline_shared_expert_call(analyses) -> None:
    plan = analyses["deepseek"].candidates[0].plan
    (side,) = plan.side
    assert side.hoist == "shared_experts_output" and side.source == "self.shared_experts(residuals)"
    assert plan.fork_line == line_of(DEEPSEEK, "orig_shape = hidden_states.shape")  # right after residuals = ...
    assert plan.side_inputs == ("residuals",) and plan.side_outputs == ("shared_experts_output",)


@pytest.mark.slow
def test_qwen3_next_and_longcat_plan_details(analyses) -> None:
    qwen = analyses["qwen3_next"].candidates[0].plan
    assert qwen.fork_line == line_of(QWEN3_NEXT, "shared_expert_output = self.shared_expert(")
    assert qwen.side_inputs[0] == "hidden_states_reshaped" and qwen.side_outputs == ("shared_expert_output",)
    # the branch finder's plan: exactly what `apply --case moe-shared-expert` carries out
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    src = load(QWEN3_NEXT)
    (case_plan,) = plans_for_case(
        QWEN3_NEXT,
        src.module,
        "moe-shared-expert",
        "eager",
        qwen.function,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
        text=src.text,
    )
    # the same plan; apply's summary also says which --side placement it chose
    assert case_plan.summary.startswith(qwen.summary + "; --side shared")
    assert qwen.with_changes(file=case_plan.file, summary=case_plan.summary) == case_plan
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


@pytest.mark.slow
def test_static_flag_matches_the_trace_plan(analyses) -> None:
    for name in ("deepseek", "longcat", "hunyuan"):
        path = EXPECTED[name][0]
        static = analyze(path, device=profile("a3"), static=True).candidates[0].plan
        traced = analyses[name].candidates[0].plan
        assert (static.function, static.side_lines, static.join_line, static.fork_line) == (
            traced.function,
            traced.side_lines,
            traced.join_line,
            traced.fork_line,
        )


def test_json_output_is_only_candidates(capsys) -> None:
    code = run_suggest(files=[DEEPSEEK], static=True, json_out=True)
    out = capsys.readouterr().out
    data = json.loads(out)
    assert code == 0 and list(data) == ["candidates", "refused"]
    assert all({"function", "side", "reason"} <= set(r) for r in data["refused"])
    first = data["candidates"][0]
    assert {"case", "file", "function", "side_lines", "join_line", "estimated_saving", "plan"} <= set(first)
    assert load_plans(out)[0].function == "DeepseekV3MoE.forward"


def test_no_candidates_exits_1(tmp_path: Path, capsys) -> None:
    plain = tmp_path / "plain.py"
    plain.write_text("class A:\n    def forward(self, x):\n        y = self.f(x)\n        return self.g(y)\n")
    assert run_suggest(files=[plain], static=True, json_out=True) == 1
    assert json.loads(capsys.readouterr().out) == {"candidates": [], "refused": []}


# Report ---------------------------------------------------------------------------------------------
SECTIONS = [
    "## 1. 分析范围",
    "## 2. 目标优化点",
    "## 3. 整网模块清单",
    "## 4. 整网模块依赖清单",
    "## 5. 整网模块 DAG",
    "## 6. 模块级并行性结论",
    "### 6.1 主串行链",
    "### 6.2 可并行模块组",
    "### 6.3 待验证模块组",
    "### 6.4 建议流分组",
    "## 7. 模块拆解结论",
    "## 8. 每个模块的算子级拆解",
    "#### 算子清单",
    "#### 算子依赖清单",
    "#### 算子 DAG",
    "##### 模块内主串行链",
    "##### 模块内可并行算子组",
    "##### 模块内待验证算子组",
    "##### 模块内建议流分组",
    "#### 模块内结论",
    "## 9. 实施记录",
    "### 9.1 方案选择",
    "### 9.2 关键改动",
    "### 9.3 当前实现结论",
    "## 10. 调试记录",
    "### 10.5 当前调试结论",
    "## 11. 验收结果",
    "### 11.4 Profile",
    "## 12. 最终结论",
]


@pytest.mark.parametrize("name", ["deepseek", "longcat"])
@pytest.mark.slow
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


def test_static_report_is_complete() -> None:
    text = render(analyze(DEEPSEEK, device=profile("a3"), static=True))
    for heading in SECTIONS[:12] + SECTIONS[20:]:
        assert heading in text
    assert all(mermaid.check(b) == [] for b in mermaid.blocks(text))


def test_mermaid_checker_rejects_bad_graphs() -> None:
    good = (
        'flowchart LR\n    subgraph Main[Main Path]\n        a["x"]\n        b["y"]\n    end\n    a --> b\n    a -.-> b'
    )
    assert mermaid.check(good) == []
    assert mermaid.check(good.replace("flowchart LR", "graph TD"))
    assert mermaid.check(good.replace("    end\n", ""))
    assert mermaid.check(good + "\n    a --> c")
    assert mermaid.check(good + '\n    c["a "quoted" label"]')
    assert mermaid.check(good + "\n    a ==> b")


# Cost model -----------------------------------------------------------------------------------------
@pytest.mark.slow
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


@pytest.mark.slow
def test_tiny_generic_candidates_are_flagged_too_small(analyses) -> None:
    generic = [c for c in analyses["deepseek"].candidates if c.case == "generic"]
    assert generic and all(c.cost and c.cost.too_small for c in generic if c.cost_shapes == "tiny trace")


# Full-size hand calculations (decode, T=1, A3 die, bf16): at T=1 every matmul is weight-bandwidth bound,
# so a branch takes about (bytes of the weights it reads) / HBM bandwidth; the saving is the shorter
# branch minus the two synchronizations (one fork, one join).
BF16, FP32 = 2, 4


def _check_full_size(top, side_bytes: float, main_bytes: float | None = None) -> None:
    device = profile("a3")
    assert top.cost_shapes == "full-size decode T=1"
    assert top.min_syncs == 2
    side = side_bytes / device.hbm_bandwidth
    assert top.cost.side_time == pytest.approx(side, rel=0.10)
    if main_bytes is not None:
        assert top.cost.main_time == pytest.approx(main_bytes / device.hbm_bandwidth, rel=0.10)
    expected = min(side, top.cost.main_time) - 2 * device.sync_overhead
    assert top.estimated_saving == pytest.approx(expected, rel=0.10)


@pytest.mark.slow
def test_full_size_qwen3_next_hand_calculation(analyses) -> None:
    """Qwen3-Next defaults: H=2048, shared expert I=512 plus a 2048x1 sigmoid gate; 512 experts, top-10, I=512."""
    top = analyses["qwen3_next"].candidates[0]
    hidden, shared_inter, moe_inter, top_k, experts = 2048, 512, 512, 10, 512
    side_bytes = 3 * hidden * shared_inter * BF16 + hidden * BF16  # shared expert + shared_expert_gate weights
    touched = experts * (1 - (1 - 1 / experts) ** top_k)  # ~9.9 experts receive the token
    main_bytes = hidden * experts * BF16 + touched * 3 * hidden * moe_inter * BF16  # router + touched experts
    _check_full_size(top, side_bytes, main_bytes)
    # ~4 µs of shared expert does not pay for 10 µs of syncs on A3: reported, ranked first, flagged too small.
    assert top.estimated_saving < 0 and top.cost.too_small
    assert top.case == "moe-shared-expert"


@pytest.mark.slow
def test_full_size_hunyuan_hand_calculation(analyses) -> None:
    """HunYuanMoEV1 defaults (head_dim=None fixed to 4096/32): H=4096, I=11008, 1 expert, top-1, shared MLP I=11008."""
    top = analyses["hunyuan"].candidates[0]
    assert "ok" in analyses["hunyuan"].tiers["full-size"]
    hidden, inter = 4096, 11008
    side_bytes = 3 * hidden * inter * BF16  # 270 MB: ~169 µs at 1.6 TB/s
    main_bytes = hidden * 1 * BF16 + 3 * hidden * inter * BF16  # gate (1 expert) + the one routed expert
    _check_full_size(top, side_bytes, main_bytes)
    assert top.estimated_saving > 150e-6


@pytest.mark.slow
def test_full_size_longcat_hand_calculation(analyses) -> None:
    """LongCat-Flash defaults: H=6144; shortcut MoE = router (768 choices: 512 experts + 256 identity) + top-12
    experts of I=2048 whose loop cannot run on fake tensors (estimated analytically); main = two dense MLPs
    (ffn 12288) and one MLA (q_lora 1536, kv_lora 512, 64 heads, nope 128 / rope 64 / v 128)."""
    analysis = analyses["longcat"]
    assert "estimated analytically" in analysis.tiers["full-size"]
    top = analysis.candidates[0]
    hidden, inter, experts, zero, top_k, ffn = 6144, 2048, 512, 256, 12, 12288
    router = hidden * (experts + zero) * (BF16 + FP32 + FP32)  # weight read, cast to fp32, read again
    rows = top_k * experts / (experts + zero)  # 8 of the 12 choices compute on average
    touched = experts * (1 - (1 - 1 / experts) ** rows)
    side_bytes = router + touched * 3 * hidden * inter * BF16
    heads, q_lora, kv_lora, nope, rope, v = 64, 1536, 512, 128, 64, 128
    mla = (
        hidden * q_lora
        + q_lora * heads * (nope + rope)
        + hidden * (kv_lora + rope)
        + kv_lora * heads * (nope + v)
        + heads * v * hidden
    ) * BF16
    main_bytes = 2 * 3 * hidden * ffn * BF16 + mla
    _check_full_size(top, side_bytes, main_bytes)
    assert top.cost.main_time > top.cost.side_time


# fx tier, module DAG and syncs ---------------------------------------------------------------------
@pytest.mark.slow
def test_fx_tier_records_which_tracer_worked(analyses) -> None:
    fx = {name: analyses[name].fx for name in analyses}
    # The plain leaf tracer works where the forward never iterates a shape ...
    assert fx["qwen3_next"]["Qwen3NextSparseMoeBlock.forward"].tracer == "leaf"
    assert fx["hunyuan"]["HunYuanMoEV1Moe.forward"].tracer == "leaf"
    assert fx["longcat"]["LongcatFlashDecoderLayer.forward"].tracer == "leaf"
    # ... and fails on `.view(*orig_shape)`; the meta-leaf tracer with the shape oracle takes over.
    deepseek = fx["deepseek"]["DeepseekV3MoE.forward"]
    assert deepseek.tracer == "meta-leaf" and deepseek.reason.startswith("TraceError: Proxy object cannot be iterated")
    tiers = analyses["deepseek"].tiers["fx"]
    assert (
        "DeepseekV3MoE: ok (meta-leaf tracer with shape oracle" in tiers
        and "plain leaf tracer failed: TraceError" in tiers
    )
    assert "HunYuanMoEV1Moe: ok (leaf tracer" in analyses["hunyuan"].tiers["fx"]
    # Only the functions of named cases (and of the best candidate) are traced.
    assert set(fx["deepseek"]) == {"DeepseekV3MoE.forward"}


@pytest.mark.slow
def test_fx_module_dag_and_cross_check(analyses) -> None:
    dag = analyses["deepseek"].fx["DeepseekV3MoE.forward"].dag
    modules = {d["target"]: n for n, d in dag.nodes(data=True) if d["kind"] == "module"}
    assert set(modules) == {"gate", "experts", "shared_experts"}
    assert dag.edges[modules["gate"], modules["experts"]]["kind"] == "item"  # top-k indices and weights
    assert dag.nodes[modules["shared_experts"]]["line"] == line_of(
        DEEPSEEK, "hidden_states = hidden_states + self.shared_experts("
    )
    for name in EXPECTED:
        top = analyses[name].candidates[0]
        assert top.fx_check == "independent", name
        assert "fx module graph: side and main submodules are independent" in top.notes


@pytest.mark.slow  # traces the model (runs it)
def test_fx_failure_keeps_the_top_candidate(monkeypatch) -> None:
    from msrewrite.suggest import fxgraph

    def broken(qualname, path, _module, _cap):
        return fxgraph.FxResult(qualname, path, None, "TraceError: forced")

    monkeypatch.setattr(fxgraph, "trace_module", broken)
    analysis = analyze(HUNYUAN, device=profile("a3"), target="HunYuanMoEV1Moe", full_size=False)
    top = analysis.candidates[0]
    assert "HunYuanMoEV1Moe: failed (TraceError: forced)" in analysis.tiers["fx"]
    assert top.case == "moe-shared-expert" and top.confidence == ("high" if top.pays_off else "low")
    assert top.fx_check.startswith("unavailable")


@pytest.mark.slow
def test_minimum_syncs_in_json_and_report(analyses) -> None:
    for name in EXPECTED:
        top = analyses[name].candidates[0]
        assert (top.syncs["fork"], top.syncs["join"]) == (1, 1), name
        assert top.to_dict()["min_syncs"] == 2
    text = render(analyses["deepseek"])
    assert "最少同步点 (one side stream): 2 (1 fork + 1 join;" in text
    assert "### 5.1 torch.fx 模块级 DAG" in text and "| fx_gate | fx_experts | item |" in text
    assert all(mermaid.check(b) == [] for b in mermaid.blocks(text))
    static = analyze(DEEPSEEK, device=profile("a3"), static=True).candidates[0]
    assert static.min_syncs == 2


def test_sync_points_merge_dominated_waits() -> None:
    import networkx as nx

    from msrewrite.suggest.graph import ENTRY, sync_points

    # main 0 -> side 1, main 2 -> side 3 (needs a second fork), side 1 -> main 4, side 3 -> main 4 (one join)
    dag = nx.DiGraph([(ENTRY, 0), (0, 1), (0, 2), (2, 3), (1, 3), (1, 4), (3, 4), (2, 4)])
    position = {ENTRY: -1, 0: 0, 1: 1, 2: 2, 3: 3, 4: 4}
    reduced = nx.transitive_reduction(dag)
    assert sync_points(reduced, position, {1, 3}) == {"fork": 2, "join": 1, "fork_edges": 2, "join_edges": 1}


@pytest.mark.slow
def test_pruned_parse_matches_the_full_parse(analyses) -> None:
    """The traced tier parses only the classes the trace ran; what it keeps is analyzed identically."""
    from msrewrite.analyze.stmtgraph import analyze_file

    full = analyze_file(DEEPSEEK)
    pruned = analyses["deepseek"].module
    assert "DeepseekV3ForCausalLM.forward" in full.functions and "DeepseekV3ForCausalLM.forward" not in pruned.functions
    assert pruned.module_names == full.module_names
    methods = [q for q in pruned.functions if "." in q]  # stubbed top-level functions have no methods
    for qualname in methods:
        assert pruned.functions[qualname] == full.functions[qualname], qualname
    assert "DeepseekV3MoE.forward" in pruned.functions and "DeepseekV3DecoderLayer.forward" in pruned.functions


# Static tier speed-ups: an ast pre-scan, forwards parsed alone, lines of one function --------------
def _same_static_analysis(path: Path) -> None:
    """analyze_static keeps exactly what analyze_file finds for every forward that can hold a candidate."""
    from msrewrite.analyze import stmtgraph
    from msrewrite.analyze.stmtgraph import analyze_file, analyze_static

    full, fast = analyze_file(path), analyze_static(path)
    assert fast.module_names == full.module_names and fast.classes == full.classes
    for qualname, info in full.functions.items():
        if qualname in fast.functions:
            got = fast.functions[qualname]
            assert got == info, qualname
            assert [s.source for s in got.statements] == [s.source for s in info.statements], qualname
        elif qualname.endswith(".forward"):  # left out: fewer than two self-calls, or all in one chain
            assert sum(len(s.calls) for s in info.statements) < 2 or not stmtgraph.may_hold_a_branch(info), qualname
    assert set(fast.functions) <= set(full.functions)


@pytest.mark.parametrize("path", [DEEPSEEK, QWEN3_NEXT, LONGCAT, HUNYUAN], ids=lambda p: p.parent.name)
def test_static_tier_analyzes_forwards_like_the_full_parse(path: Path) -> None:
    _same_static_analysis(path)


def test_static_tier_analyzes_odd_layouts_like_the_full_parse(tmp_path: Path) -> None:
    """Indents other than the file's first, CRLF line ends, two-space files: same analysis, same candidates."""
    from msrewrite.analyze import stmtgraph

    base = (Path(__file__).resolve().parent.parent / "examples" / "deepseek_moe.py").read_text()
    variants = {
        "first_indent_two.py": "if True:\n  FLAG = 1\n" + base,
        "crlf.py": base.replace("\n", "\r\n"),
        "two_spaces.py": base.replace("    ", "  "),
    }
    for name, text in variants.items():
        path = tmp_path / name
        path.write_bytes(text.encode())
        tree = __import__("ast").parse(text)
        assert stmtgraph._ast_outline(tree)[2], name
        _same_static_analysis(path)
        fast = [c.to_dict() for c in analyze(path, device=profile("a3"), static=True).candidates]
        assert fast, name


def test_static_tier_skips_libcst_without_a_forward_to_analyze(tmp_path: Path, monkeypatch) -> None:
    import libcst

    from msrewrite.analyze.stmtgraph import analyze_static

    calls = []
    real = libcst.parse_module
    monkeypatch.setattr(libcst, "parse_module", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = tmp_path / "plain.py"
    plain.write_text(
        "import torch as t\nX, (Y, *Z) = 1, (2, 3)\nclass A:\n    def forward(self, x):\n"
        "        return torch.relu(self.f(x)).view(-1)\n    def helper(self, x):\n        return self.a(x) + self.b(x)\n"
    )
    info = analyze_static(plain)
    assert calls == [] and info.functions == {}
    assert info.module_names == {"t", "X", "Y", "Z", "A"} and info.classes == {"A": ["forward", "helper"]}
    assert run_suggest(files=[plain], static=True, json_out=True) == 1
    two = tmp_path / "two.py"
    two.write_text(
        "class A:\n    def forward(self, x):\n        y = self.f(x)\n        z = self.g(x)\n        return y + z\n"
    )
    assert list(analyze_static(two).functions) == ["A.forward"] and calls
    chain = tmp_path / "chain.py"  # two self-calls, one after the other: parsed, then left out
    chain.write_text("class A:\n    def forward(self, x):\n        y = self.f(x)\n        return self.f(y)\n")
    assert analyze_static(chain).functions == {}


@pytest.mark.slow  # starts a process
def test_indexer_prolog_is_classified_and_make_is_used_as_the_harness():
    """A file with make() is traced through it; the indexer's q/weights overlap is named."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "msrewrite", "suggest", "--json", str(root / "examples" / "indexer_prolog.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    candidates = json.loads(out.stdout)["candidates"]
    assert candidates[0]["case"] == "indexer-prolog"
    assert candidates[0]["function"] == "Indexer.forward"
    assert candidates[0]["command"].startswith("msrewrite apply --case indexer-prolog")


def test_branches_bound_by_the_same_resource_are_flagged():
    """Decode DeepSeek-V3: the shared expert and the routed experts both stream weights from HBM."""
    from msrewrite.suggest.cost import BranchCost

    def cost(side_bound, main_bound):
        return BranchCost(1e-5, 1e-4, 2e-4, 1.0, 1.0, 1.0, 1.0, 1e-6, 1, side_bound, main_bound)

    assert cost("memory", "memory").same_resource == "HBM bandwidth"
    assert cost("compute", "compute").same_resource == "cube compute"
    assert cost("compute", "memory").same_resource is None
