"""Side work behind helpers, side work the framework or the model already overlaps, the API family
a function speaks, and the phased inliner on serving code.

The helper model (tests/fixtures/deepep_helper_moe.py) has the shape of SGLang 0.5's
`Qwen2MoeSparseMoeBlock._forward_deepep`: the shared expert reached through
`self._forward_shared_experts(h)`, next to the router inside `if hidden_states.shape[0] > 0:`.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import libcst as cst
import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.errors import BadInput, NothingToDo
from msrewrite.load import load
from msrewrite.modes import detect_mode
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FIXTURES = Path(__file__).parent / "fixtures"
FLAG = FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM")


def edit(
    path: Path,
    case: str = "moe-shared-expert",
    mode: str = "eager",
    target: str | None = None,
    assume_pure: tuple[str, ...] = (),
) -> str:
    src = load(path)
    return case_steps(path, src.text, src.module, case, mode, target, FLAG, None, assume_pure=assume_pure)[-1].new


@pytest.fixture(autouse=True)
def sglang_stand_in(monkeypatch):
    """tests/fixtures/deepep_helper_moe.py imports from sglang, as SGLang 0.5.6's qwen2_moe.py does."""
    monkeypatch.syspath_prepend(str(FIXTURES / "frameworks"))


def edit_and_verify(tmp_path: Path, source: Path, case: str, mode: str) -> str:
    original = tmp_path / source.name
    shutil.copy(source, original)
    edited = tmp_path / f"{source.stem}_ms.py"
    text = edit(original, case, mode)
    edited.write_text(text)
    result = verify_files(edited, original=original)
    assert result.ok, result.problems
    assert any(stream != "main" for stream in result.runs[2].streams)
    return text


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["eager", "npugraph-ex", "ge-graph", "cuda"])
def test_deepep_helper_gets_the_shared_expert_edit(tmp_path, mode):
    text = edit_and_verify(tmp_path, FIXTURES / "deepep_helper_moe.py", "moe-shared-expert", mode)
    deepep = text[text.index("def _forward_deepep") : text.index("def _forward_router_experts")]
    # the helper call is the side work, forked under the `if`'s condition before the router
    assert "and hidden_states.shape[0] > 0:" in deepep.split("router_logits, _ = self.gate")[0]
    assert "shared_output = self._forward_shared_experts(hidden_states)" in deepep


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["eager", "ge-graph", "cuda"])
def test_deepep_helper_gets_the_phased_edit(tmp_path, mode):
    text = edit_and_verify(tmp_path, FIXTURES / "deepep_helper_moe.py", "moe-shared-expert-phased", mode)
    deepep = text[text.index("def _forward_deepep") : text.index("def _forward_router_experts")]
    # inlined on the side stream, `self` kept, with its `if`s; the flag-off path calls it as before
    off = "if shared_expert_stream is None:" if mode != "ge-graph" else "if not use_shared_expert_stream:"
    assert deepep.count("self._forward_shared_experts(") == 1
    assert f"{off}\n                shared_output = self._forward_shared_experts(hidden_states)" in deepep
    assert "self.shared_expert.down_proj(" in deepep
    assert "if self.shared_expert is not None:" in deepep and "if self.shared_expert_gate is not None:" in deepep
    assert "phase 1 of the shared expert re-enters the side stream after router_logits" in deepep
    assert "phase 2 of the shared expert re-enters the side stream after topk_output" in deepep


BLOCK = """
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        return F.silu(self.up(x))


class Block(nn.Module):
    def __init__(self, hidden=16, num_experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = MLP(hidden)
        self.shared_experts = MLP(hidden)
{methods}

def make():
    torch.manual_seed(0)
    return Block().eval(), (torch.randn(6, 16),)
"""


def block_file(tmp_path: Path, methods: str, name: str = "block") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(BLOCK.format(methods=textwrap.indent(textwrap.dedent(methods), " " * 4)))
    return path


def refusal(path: Path, mode: str = "eager", case: str = "moe-shared-expert") -> str:
    with pytest.raises(NothingToDo) as refused:
        edit(path, case, mode)
    return str(refused.value)


FORWARD_THROUGH_HELPER = """
def forward(self, x):
    shared = self._shared(x)
    logits = self.gate(x)
    return self.experts(x) * logits.sum() + shared
"""


@pytest.mark.slow  # runs the model through verify
def test_free_function_helper_is_a_seed(tmp_path):
    path = block_file(
        tmp_path,
        """
    def forward(self, x):
        shared = run_shared(self, x)
        logits = self.gate(x)
        return self.experts(x) * logits.sum() + shared
    """,
    )
    path.write_text(path.read_text() + "\n\ndef run_shared(block, x):\n    return block.shared_experts(x) * 2\n")
    # the effect summaries do not yet bind `block` to the caller's `self`: unseen, so refused by name
    with pytest.raises(
        NothingToDo,
        match=r"block.shared_experts \(not visible to msrewrite\) may write",
    ):
        edit(path)
    edited = tmp_path / "block_ms.py"
    edited.write_text(edit(path, assume_pure=("block.shared_experts",)))
    assert (
        "with torch.npu.stream(shared_expert_stream):\n                shared = run_shared(self, x)"
        in edited.read_text()
    )
    result = verify_files(edited, original=path)
    assert result.ok, result.problems


@pytest.mark.parametrize(
    "helper,reason",
    [
        (
            "def _shared(self, x):\n    return custom_kernel(self.shared_experts(x))\n",
            "_shared() calls `custom_kernel`, which msrewrite cannot see into",
        ),
        (
            "def _shared(self, x):\n    x.mul_(2)\n    return self.shared_experts(x)\n",
            "_shared() writes its argument `x` in place",
        ),
        (
            "def _shared(self, x):\n    self.last = self.shared_experts(x)\n    return self.last\n",
            "_shared() assigns `self.last`",
        ),
        (
            "def _shared(self, x):\n    return torch.relu_(self.shared_experts(x))\n",
            "_shared() calls `torch.relu_`, which msrewrite cannot see into",
        ),
    ],
)
def test_helper_that_does_more_than_side_work_is_refused_naming_why(tmp_path, helper, reason):
    path = block_file(tmp_path, FORWARD_THROUGH_HELPER + "\n" + helper)
    message = refusal(path)
    assert "reached through self._shared()" in message and reason in message, message


def test_framework_overlap_is_named_instead_of_no_target(tmp_path):
    path = tmp_path / "vllm_style.py"
    path.write_text(
        textwrap.dedent("""
        class SparseMoeBlock(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.shared_expert = MLP(config)
                self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
                self.experts = SharedFusedMoE(shared_experts=self.shared_expert, num_experts=config.num_experts)

            def forward(self, hidden_states):
                router_logits, _ = self.gate(hidden_states)
                return self.experts(hidden_states=hidden_states, router_logits=router_logits)
    """)
    )
    message = refusal(path)
    assert "already overlapped by the framework (SharedFusedMoE, given `shared_experts=` in __init__)" in message


def test_hand_written_overlap_is_not_stacked(tmp_path):
    path = block_file(
        tmp_path,
        """
    def forward(self, x):
        current_stream = torch.cuda.current_stream()
        self.alt_stream.wait_stream(current_stream)
        with torch.cuda.stream(self.alt_stream):
            shared = self.shared_experts(x)
        logits = self.gate(x)
        out = self.experts(x) * logits.sum()
        current_stream.wait_stream(self.alt_stream)
        return out + shared
    """,
    )
    for mode in ("eager", "cuda"):
        message = refusal(path, mode)
        assert "already overlapped: this function runs it on a stream of its own" in message, message


def test_overlap_in_a_sibling_method_is_not_stacked(tmp_path):
    """SGLang hunyuan_v3: forward picks a dual-stream method or a single-stream one."""
    path = block_file(
        tmp_path,
        """
    def forward(self, x):
        if self.alt_stream is not None:
            return self._forward_dual_stream(x)
        return self._forward_single_stream(x)

    def _forward_single_stream(self, x):
        shared = self.shared_experts(x)
        logits = self.gate(x)
        return self.experts(x) * logits.sum() + shared

    def _forward_dual_stream(self, x):
        current_stream = torch.cuda.current_stream()
        self.alt_stream.wait_stream(current_stream)
        shared = self.shared_experts(x)
        with torch.cuda.stream(self.alt_stream):
            logits = self.gate(x)
            out = self.experts(x) * logits.sum()
        current_stream.wait_stream(self.alt_stream)
        return out + shared
    """,
    )
    message = refusal(path, "cuda")
    assert "Block._forward_single_stream: already overlapped: Block._forward_dual_stream runs it" in message, message


def test_npu_code_never_goes_into_a_cuda_function(tmp_path):
    path = block_file(
        tmp_path,
        """
    def forward(self, x):
        shared = self.shared_experts(x)
        logits = self.gate(x)
        torch.cuda.nvtx.range_push("experts")
        return self.experts(x) * logits.sum() + shared
    """,
    )
    assert "uses torch.cuda; msrewrite never mixes torch.npu into it" in refusal(path, "eager")
    assert "torch.cuda.stream(shared_expert_stream)" in edit(path, mode="cuda")


def test_auto_mode_follows_a_file_that_drives_cuda_streams():
    mode, why = detect_mode("import torch\nalt = torch.cuda.Stream()\n")
    assert mode == "cuda" and "torch.cuda.Stream" in why
    assert detect_mode("import torch_npu\nalt = torch.cuda.Stream()\n")[0] == "eager"
    assert detect_mode("ok = torch.cuda.is_available()\n")[0] == "eager"


def test_auto_mode_reads_the_frameworks_platform_helpers():
    """SGLang files with no stream code yet: is_cuda() or the cuda graph runner say CUDA."""
    mode, why = detect_mode("from sglang.srt.utils import is_cuda\n_is_cuda = is_cuda()\n")
    assert mode == "cuda" and "is_cuda(" in why
    assert detect_mode("from sglang.srt.model_executor.cuda_graph_runner import get_is_capture_mode\n")[0] == "cuda"
    assert detect_mode("if current_platform.is_cuda_alike():\n    pass\n")[0] == "cuda"
    # both platforms checked and no stream code: the file does not say; the error lists the modes
    with pytest.raises(ValueError, match="give --mode cuda, or --mode eager, npugraph-ex or ge-graph"):
        detect_mode("_is_cuda = is_cuda()\n_is_npu = is_npu()\n")
    assert detect_mode("from vllm_ascend.ascend_config import get_ascend_config\n")[0] == "eager"
    assert detect_mode("_is_npu = is_npu()\n")[0] == "eager"


def test_auto_mode_follows_the_stream_code_the_file_mostly_speaks():
    """SGLang's deepseek_v2.py: torch.cuda streams throughout, torch.npu once in an NPU branch."""
    text = (
        "alt = torch.cuda.Stream()\nwith torch.cuda.stream(alt):\n    pass\n"
        "torch.cuda.current_stream().wait_stream(alt)\nif _is_npu:\n    s = torch.npu.current_stream()\n"
    )
    mode, why = detect_mode(text)
    assert mode == "cuda" and "3 uses against 1" in why
    assert detect_mode("import torch_npu\n" + text)[0] == "eager"  # imported at module level: it runs on the NPU


@pytest.mark.slow  # runs the model through verify
def test_phased_inliner_keeps_a_multi_line_conditional_expression(tmp_path):
    """SGLang ernie4: `shared = (\\n self.shared_experts(h)\\n if ... \\n else None\\n)` used to lose
    its parentheses and be reported as the user's syntax error."""
    path = block_file(
        tmp_path,
        """
    def forward(self, x):
        shared = (
            self.shared_experts(x)
            if self.gate is not None
            else None
        )
        logits = self.gate(x)
        out = self.experts(x) * logits.sum()
        return out + shared
    """,
    )
    edited = tmp_path / "block_ms.py"
    edited.write_text(edit(path, "moe-shared-expert-phased"))
    result = verify_files(edited, original=path)
    assert result.ok, result.problems


def test_inliner_failure_is_an_internal_error_not_the_users_syntax_error(tmp_path, monkeypatch):
    import msrewrite.emit.inline as inline_module

    path = block_file(tmp_path, FORWARD_THROUGH_HELPER.replace("self._shared(x)", "self.shared_experts(x)"))

    def broken(_module, _cls, func, _is_seed):  # what the old inliner made of a multi-line expression
        bad = cst.parse_statement("y = (1\n    if x\n    else 2)\n")
        value = bad.body[0].value.with_changes(lpar=[], rpar=[])
        stmt = bad.with_changes(body=[bad.body[0].with_changes(value=value)])
        return func.with_changes(body=func.body.with_changes(body=[stmt, *func.body.body]))

    monkeypatch.setattr(inline_module, "inline_and_flatten", broken)  # apply imports it lazily, at the call
    with pytest.raises(BadInput) as failed:
        edit(path, "moe-shared-expert-phased")
    message = str(failed.value)
    assert message.startswith("internal error:") and "syntax error" not in message
    assert str(path) not in message


@pytest.mark.slow  # starts a process or runs verify
def test_deepep_helper_with_sglangs_flag_and_capture_gate_reuses_the_models_stream(tmp_path):
    """Issue 13's done-when on SGLang 0.5.6's shape: `--flag sglang:SGLANG_NPU_USE_MULTI_STREAM --gate
    capture` reads like the file's own dual-stream code: self.alt_stream, SGLang's flag reader and
    capture predicate, torch.cuda as the file speaks it; verify opens and closes the gate."""
    original = tmp_path / "deepep_helper_moe.py"
    shutil.copy(FIXTURES / "deepep_helper_moe.py", original)
    src = load(original)
    flag = FlagSpec(kind="sglang", name="SGLANG_NPU_USE_MULTI_STREAM", default=False, gate="capture")
    step = case_steps(
        original,
        src.text,
        src.module,
        "moe-shared-expert",
        "cuda",
        "Qwen2MoeSparseMoeBlock._forward_deepep",
        flag,
        None,
        protect="clone",
    )[-1]
    deepep = step.new[step.new.index("def _forward_deepep") : step.new.index("def _forward_router_experts")]
    assert (
        "shared_expert_stream = self.alt_stream if self.enable_sglang_npu_use_multi_stream and "
        "get_is_capture_mode() else None"
    ) in deepep
    assert "current_stream = torch.cuda.current_stream()" in deepep
    assert "shared_expert_stream.wait_stream(current_stream)" in deepep
    assert "with torch.cuda.stream(shared_expert_stream):" in deepep
    assert "current_stream.wait_stream(shared_expert_stream)" in deepep
    assert '= get_bool_env_var("SGLANG_NPU_USE_MULTI_STREAM", "false")' in step.new
    assert "_ms_side_stream" not in step.new and "torch.npu" not in step.new
    edited = tmp_path / "deepep_helper_moe_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=original)
    assert result.ok, result.problems
    runs = {run.name for run in result.runs}
    assert "flag on, gate false" in runs


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["ge-graph", "cuda"])
def test_deepep_helper_without_a_shared_expert_runs_the_phased_edit(tmp_path, mode):
    """shared_expert_intermediate_size=0: the side `if`s are false in every phase; nothing reads a
    name only they bind (in ge-graph mode no start gate waits on one)."""
    original = tmp_path / "deepep_helper_moe.py"
    original.write_text(
        (FIXTURES / "deepep_helper_moe.py")
        .read_text()
        .replace("return Qwen2MoeModel().eval()", "return Qwen2MoeModel(shared_expert_intermediate_size=0).eval()")
    )
    text = edit(original, "moe-shared-expert-phased", mode, target="Qwen2MoeSparseMoeBlock._forward_deepep")
    edited = tmp_path / "deepep_helper_moe_ms.py"
    edited.write_text(text)
    result = verify_files(edited, original=original)
    # outputs equal, sanitizer clean; only `shared_output = None` is left for the side stream
    assert result.problems == ["flag on: no op ran on a side stream (is the flag wired?)"], result.problems


def twin_methods(api: str) -> str:
    """A decode/prefill pair (cann-recipes' `mla_prolog_decode` / `mla_prolog_prefill` shape): the
    decode twin already runs the shared expert on a stream of its own."""
    return f"""
    def forward(self, x):
        if x.shape[0] > 4:
            return self.forward_prefill(x)
        return self.forward_decode(x)

    def forward_decode(self, x):
        current_stream = torch.{api}.current_stream()
        self.alt_stream.wait_stream(current_stream)
        with torch.{api}.stream(self.alt_stream):
            shared = self.shared_experts(x)
        logits = self.gate(x)
        out = self.experts(x) * logits.sum()
        current_stream.wait_stream(self.alt_stream)
        return out + shared

    def forward_prefill(self, x):
        shared = self.shared_experts(x)
        logits = self.gate(x)
        return self.experts(x) * logits.sum() + shared
    """


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("mode", ["eager", "npugraph-ex", "ge-graph", "cuda"])
def test_an_overlap_in_the_decode_twin_leaves_the_prefill_twin_a_target(tmp_path, mode):
    """An existing overlap blocks only the function it is in: the prefill twin gets its own edit,
    the decode twin (its own stream code) is still refused."""
    path = block_file(tmp_path, twin_methods("cuda" if mode == "cuda" else "npu"))
    with pytest.raises(NothingToDo, match=r"Block.forward_decode: already overlapped: this function runs it"):
        src = load(path)
        case_steps(path, src.text, src.module, "moe-shared-expert", mode, "Block.forward_decode", FLAG, None)
    text = edit(path, mode=mode)
    prefill = text[text.index("def forward_prefill") :]
    assert "# msrewrite(moe-shared-expert): the shared expert runs on side stream" in prefill
    assert text.count("self.alt_stream.wait_stream(current_stream)") == 1  # the decode twin as written
    edited = tmp_path / "block_ms.py"
    edited.write_text(text)
    result = verify_files(edited, original=path)
    assert result.ok, result.problems


def test_phase_twins_are_told_apart_from_other_variants():
    from msrewrite.cases._finder import phase_twins

    assert phase_twins("mla_prolog_decode", "mla_prolog_prefill")
    assert phase_twins("mlaprolog_prefill", "mlaprolog_decode")
    assert not phase_twins("_forward_dual_stream", "_forward_single_stream")
    assert not phase_twins("forward_decode", "forward_decode_graph_decode")  # no single phase: not twins
    assert not phase_twins("forward", "forward_decode")
