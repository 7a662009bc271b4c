"""Framework-aware switches and gates: --flag sglang:NAME / vllm-ascend:NAME and --gate.

The models import from sglang / vllm_ascend; tests/fixtures/frameworks stands in for the few names
the edit uses (put on PYTHONPATH for the CLI's child processes).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from helpers import run_cli, run_main
from msrewrite.plan import FlagSpec, load_plans

FIXTURES = Path(__file__).parent / "fixtures"
SGLANG_MOE = FIXTURES / "sglang_style_moe.py"
VLLM_ASCEND_MOE = FIXTURES / "vllm_ascend_style_moe.py"
PLAIN_MOE = Path(__file__).parent.parent / "examples" / "deepseek_moe.py"
CASE = ("--case", "moe-shared-expert")


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FIXTURES / "frameworks"), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _apply(path: Path, *options: str, env: dict | None = None):
    return run_cli("apply", *CASE, str(path), *options, env=env or _env())


@pytest.mark.slow  # starts a process
def test_sglang_flag_and_capture_gate_read_like_sglang_code():
    done = _apply(
        SGLANG_MOE,
        "--mode",
        "eager",
        "--flag",
        "sglang:SGLANG_NPU_USE_MULTI_STREAM",
        "--flag-default",
        "off",
        "--gate",
        "capture",
    )
    assert done.returncode == 0, done.stderr
    added = [line[1:].strip() for line in done.stdout.splitlines() if line.startswith("+")]
    assert "from sglang.srt.utils import get_bool_env_var" in added
    assert "from sglang.srt.model_executor.runner import get_is_capture_mode" in added
    assert 'self.enable_sglang_npu_use_multi_stream = get_bool_env_var("SGLANG_NPU_USE_MULTI_STREAM", "false")' in added
    assert (
        'shared_expert_stream = _ms_side_stream("shared_expert", '
        "self.enable_sglang_npu_use_multi_stream and get_is_capture_mode())"
    ) in added
    assert "_ms_env_flag" not in done.stdout and "os.environ" not in done.stdout


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize(
    "gate, predicate",
    [
        ("prefill", "forward_batch is not None and forward_batch.forward_mode.is_extend()"),
        ("decode", "forward_batch is not None and forward_batch.forward_mode.is_decode()"),
    ],
)
def test_phase_gate_reads_the_forward_batch(gate, predicate):
    done = _apply(SGLANG_MOE, "--mode", "eager", "--flag", "sglang:SGLANG_NPU_USE_MULTI_STREAM", "--gate", gate)
    assert done.returncode == 0, done.stderr
    assert f"self.enable_sglang_npu_use_multi_stream and {predicate})" in done.stdout


@pytest.mark.slow  # starts a process
def test_vllm_ascend_flag_reads_the_ascend_config_and_with_prefill():
    done = _apply(
        VLLM_ASCEND_MOE,
        "--mode",
        "npugraph-ex",
        "--flag",
        "vllm-ascend:multistream_overlap_shared_expert",
        "--flag-default",
        "off",
        "--gate",
        "decode",
    )
    assert done.returncode == 0, done.stderr
    added = [line[1:].strip() for line in done.stdout.splitlines() if line.startswith("+")]
    # joins the file's own `from vllm_ascend.ascend_config import ...` line when it has one
    assert (
        "self.multistream_overlap_shared_expert = "
        'getattr(get_ascend_config(), "multistream_overlap_shared_expert", False)'
    ) in added
    assert "shared_expert_stream = _ms_capture_safe(self.shared_expert_stream) if not with_prefill else None" in added


@pytest.mark.slow
def test_sglang_edit_verifies_and_the_gate_false_path_is_the_original(tmp_path):
    """verify opens the capture gate for flag on (ops on the side stream) and runs it closed too:
    exactly the original code, every op on the main stream."""
    edited = tmp_path / "sglang_style_moe.py"
    edited.write_text(SGLANG_MOE.read_text())
    done = _apply(edited, "-i", "--mode", "eager", "--flag", "sglang:SGLANG_NPU_USE_MULTI_STREAM", "--gate", "capture")
    assert done.returncode == 0, done.stderr
    ok = run_cli("verify", str(edited), "--original", str(SGLANG_MOE), "--no-train", "--inputs", "0", env=_env())
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = {line.split(":")[0].strip(): line for line in ok.stdout.splitlines()}
    assert "ops on side" in lines["flag on"]
    assert "ops on main" in lines["flag on, gate false"] and "side" not in lines["flag on, gate false"]
    # a gate that does not close (`flag or gate and gate`) is caught by the gate-false run
    broken = tmp_path / "broken.py"
    broken.write_text(
        edited.read_text().replace(
            " and get_is_capture_mode())", " or get_is_capture_mode() and get_is_capture_mode())"
        )
    )
    bad = run_cli(
        "verify",
        str(broken),
        "--original",
        str(SGLANG_MOE),
        "--no-train",
        "--inputs",
        "0",
        "--flag",
        "sglang:SGLANG_NPU_USE_MULTI_STREAM",
        env=_env(),
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "problem: flag on, gate false: " in bad.stdout and "ops ran off the main stream" in bad.stdout


@pytest.mark.slow
def test_vllm_ascend_edit_verifies_with_its_config_switched():
    done = _apply(
        VLLM_ASCEND_MOE,
        "--mode",
        "npugraph-ex",
        "--flag",
        "vllm-ascend:multistream_overlap_shared_expert",
        "--flag-default",
        "off",
        "--gate",
        "decode",
        "--verify",
    )
    assert done.returncode == 0, done.stderr
    assert "ops on side" in done.stderr and "OK:" in done.stderr


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize(
    "path, options, message",
    [
        (
            PLAIN_MOE,
            ("--flag", "sglang:SGLANG_NPU_USE_MULTI_STREAM"),
            "--flag sglang:SGLANG_NPU_USE_MULTI_STREAM needs a sglang model file",
        ),
        (
            PLAIN_MOE,
            ("--flag", "vllm-ascend:multistream_overlap_shared_expert"),
            "needs a vllm-ascend model file, and this file imports nothing from vllm_ascend",
        ),
        (PLAIN_MOE, ("--gate", "capture"), "looked for SGLang's get_is_capture_mode()"),
        (
            PLAIN_MOE,
            ("--gate", "prefill"),
            "has no phase predicate: looked for a forward parameter with_prefill, is_prefill, forward_batch",
        ),
        (VLLM_ASCEND_MOE, ("--gate", "capture"), "has no capture predicate"),
        (PLAIN_MOE, ("--gate", "tokens<=0"), "--gate must be capture, prefill, decode, always or tokens<=N"),
        (PLAIN_MOE, ("--gate", "warmup"), "flag gate must be one of capture, prefill, decode"),
        (PLAIN_MOE, ("--gate", "tokens<=64", "--max-tokens", "32"), "disagree"),
        (PLAIN_MOE, ("--flag", "sglang:NOT-A-NAME"), "not a valid environment variable name"),
        (PLAIN_MOE, ("--flag", "vllm-ascend:forward"), "would shadow nn.Module.forward"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(path, options, message):
    done = _apply(path, *options)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("msrewrite: error: ")]
    assert len(errors) == 1 and message in errors[0], done.stderr


@pytest.mark.slow  # starts a process
def test_gate_reading_a_rebound_parameter_is_refused(tmp_path):
    model = tmp_path / "rebound.py"
    text = SGLANG_MOE.read_text().replace(
        "        residuals = hidden_states\n", "        forward_batch = None\n        residuals = hidden_states\n", 1
    )
    model.write_text(text)
    done = _apply(model, "--gate", "prefill")
    assert done.returncode == 2
    assert "assigns its parameter 'forward_batch'" in done.stderr


@pytest.mark.slow  # starts a process
def test_tokens_gate_is_max_tokens():
    via_gate = _apply(PLAIN_MOE, "--gate", "tokens<=64")
    via_option = _apply(PLAIN_MOE, "--max-tokens", "64")
    assert via_gate.returncode == 0 and via_gate.stdout == via_option.stdout
    assert "_ms_num_tokens(residuals) <= 64" in via_gate.stdout


@pytest.mark.slow  # starts a process
def test_plan_files_carry_flag_kind_and_gate():
    done = run_cli("suggest", "--static", "--json", str(SGLANG_MOE), env=_env())
    assert done.returncode == 0, done.stderr
    plans = load_plans(done.stdout)
    plan = dataclasses.replace(
        plans[0], flag=FlagSpec(kind="sglang", name="SGLANG_NPU_USE_MULTI_STREAM", default=False, gate="capture")
    )
    again = load_plans(
        json.dumps(
            {
                **json.loads(done.stdout),
                "candidates": [{**json.loads(done.stdout)["candidates"][0], "plan": plan.to_dict()}],
            }
        )
    )
    assert again[0].flag == plan.flag
    bad = plan.to_dict()
    bad["flag"]["gate"] = "always"
    with pytest.raises(ValueError, match="flag gate must be one of capture, prefill, decode"):
        load_plans(
            json.dumps(
                {**json.loads(done.stdout), "candidates": [{**json.loads(done.stdout)["candidates"][0], "plan": bad}]}
            )
        )


FULLGRAPH_MOE = FIXTURES / "fullgraph_moe.py"


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize(
    "compiled, reason",
    [
        ("@support_torch_compile\nclass Model", "vLLM's @support_torch_compile on Model, which builds MoE"),
        ("@torch.compile(fullgraph=True)\nclass Model", "@torch.compile(fullgraph=True) on Model, which builds MoE"),
        ("class Model", None),  # torch.compile(Model(), fullgraph=True) appended below
    ],
)
def test_inside_a_fullgraph_region_is_refused_with_the_reason(tmp_path, compiled, reason):
    text = FULLGRAPH_MOE.read_text().replace("@support_torch_compile\nclass Model", compiled)
    if reason is None:
        text += "\n\ncompiled = torch.compile(Model(), fullgraph=True)\n"
        reason = "torch.compile(..., fullgraph=True) of Model, which builds MoE"
    model = tmp_path / "fullgraph_moe.py"
    model.write_text(text)
    done = run_cli("apply", *CASE, str(model), "--mode", "eager")
    # a refusal of the function (found before any analysis of it), not an error of the input
    assert done.returncode == 1 and done.stdout == ""
    assert f"MoE.forward runs inside a torch.compile fullgraph region ({reason})" in done.stderr
    assert "vLLM keeps its own stream code inside a custom op" in done.stderr


@pytest.mark.slow
def test_outside_a_fullgraph_region_the_same_model_is_edited_and_verified(tmp_path):
    """Eager, or compiled by a backend that lowers streams itself (npugraph_ex): edited, proven."""
    for name, extra in (
        ("eager", ""),
        (
            "npugraph_ex",
            '\n\ndef compiled():\n    return torch.compile(Model(), backend="npugraph_ex", fullgraph=True)\n',
        ),
    ):
        model = tmp_path / f"{name}_moe.py"
        model.write_text(FULLGRAPH_MOE.read_text().replace("@support_torch_compile\n", "") + extra)
        done = run_main("apply", *CASE, str(model), "--verify")  # the fork server: no PYTHONPATH needed
        assert done.returncode == 0, done.stderr
        assert "OK:" in done.stderr and "ops on side" in done.stderr


@pytest.mark.slow  # starts a process
def test_a_stream_made_by_the_model_reads_the_framework_flag_too(tmp_path):
    """moe-shared-mlp-init: the outermost model makes the stream; it reads the same SGLang switch."""
    model = tmp_path / "hunyuan_moe.py"
    model.write_text(
        (Path(__file__).parent.parent / "examples" / "hunyuan_moe.py")
        .read_text()
        .replace(
            "from torch import nn\n",
            "from torch import nn\n\nfrom sglang.srt.utils import add_prefix  # noqa: F401\n",
            1,
        )
    )
    done = run_cli(
        "apply",
        "--case",
        "moe-shared-mlp-init",
        str(model),
        "--mode",
        "eager",
        "--flag",
        "sglang:SGLANG_NPU_USE_MULTI_STREAM",
        env=_env(),
    )
    assert done.returncode == 0, done.stderr
    assert '_ms_side_stream("shared_mlp", get_bool_env_var("SGLANG_NPU_USE_MULTI_STREAM", "true"))' in done.stdout
    assert "getattr(config" not in done.stdout


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize(
    "options, message",
    [
        (("--flag", "sglang:SGLANG_NPU_USE_MULTI_STREAM"), "needs a sglang model file, and this file imports nothing"),
        (("--flag", "vllm-ascend:multistream_overlap_shared_expert"), "needs a vllm-ascend model file"),
        (("--gate", "capture"), "prefill-microbatch takes no --gate capture: it runs eager"),
        (
            ("--gate", "decode"),
            "prefill-microbatch takes no --gate decode: it splits prefill batches; use --gate prefill",
        ),
        (("--gate", "tokens<=64"), "prefill-microbatch takes no --gate tokens<=N / --max-tokens"),
        (("--max-tokens", "64"), "prefill-microbatch takes no --gate tokens<=N / --max-tokens"),
        (("--gate", "prefill"), "has no phase predicate: looked for a forward parameter with_prefill"),
    ],
)
def test_prefill_microbatch_refuses_a_flag_or_gate_it_cannot_honour(options, message):
    """Every flag kind is honoured where the file can read it (tests/test_microbatch_plan.py); a
    framework flag on a plain file, or a gate that means nothing for a model-level fork, is one line."""
    done = run_cli(
        "apply",
        "--case",
        "prefill-microbatch",
        str(Path(__file__).parent.parent / "examples" / "microbatch_moe.py"),
        *options,
        env=_env(),
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("msrewrite: error: ")]
    assert len(errors) == 1 and message in errors[0], done.stderr


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize(
    "binding, message",
    [
        ("def get_is_capture_mode():\n    return True\n", "the file defines its own get_is_capture_mode()"),
        ("from mylib import get_is_capture_mode\n", "the file binds get_is_capture_mode by another import"),
        ("get_is_capture_mode = lambda: True\n", "the file assigns its own get_is_capture_mode"),
    ],
)
def test_a_framework_name_the_file_binds_itself_is_refused(tmp_path, binding, message):
    model = tmp_path / "own.py"
    model.write_text(SGLANG_MOE.read_text().replace("from torch import nn\n", "from torch import nn\n\n" + binding, 1))
    done = _apply(model, "--gate", "capture")
    assert done.returncode == 2 and done.stdout == ""
    assert message in done.stderr, done.stderr


def test_fullgraph_text_precheck_neither_misses_a_region_nor_walks_for_a_class_attribute():
    """fullgraph_region skips its module walk when the source names no root: `fullgraph =` with
    spaces is still a region; transformers' `_can_compile_fullgraph = True` is not."""
    import libcst as cst

    from msrewrite.emit.frameworks import fullgraph_region

    base = FULLGRAPH_MOE.read_text(encoding="utf-8")
    spaced = base + "\n\ncompiled = torch.compile(Model(), fullgraph = True)\n"
    assert fullgraph_region(cst.parse_module(spaced), "MoE.forward", spaced) is not None
    flagged = base.replace("class Model", "class Model:\n    _can_compile_fullgraph = True\n\n\nclass _Model", 1)
    assert fullgraph_region(cst.parse_module(flagged), "MoE.forward", flagged) is None


def _sglang_tree(tmp_path: Path, defines: str | None) -> Path:
    """An SGLang source tree (never imported) whose `defines` module holds get_is_capture_mode,
    with the model file inside it, as a user runs msrewrite in their checkout."""
    executor = tmp_path / "sglang" / "srt" / "model_executor"
    executor.mkdir(parents=True)
    for folder in (tmp_path / "sglang", tmp_path / "sglang" / "srt", executor):
        (folder / "__init__.py").write_text("")
    (tmp_path / "sglang" / "srt" / "utils.py").write_text("def add_prefix(name, prefix):\n    return name\n")
    (executor / "cuda_graph_runner.py").write_text("class CudaGraphRunner:\n    pass\n")
    if defines is not None:
        (executor / f"{defines}.py").write_text("def get_is_capture_mode():\n    return False\n")
    models = tmp_path / "sglang" / "srt" / "models"
    models.mkdir()
    model = models / "sglang_style_moe.py"
    model.write_text(SGLANG_MOE.read_text())
    return model


@pytest.mark.parametrize("defines", ["runner", "cuda_graph_runner"])
def test_the_capture_gate_imports_from_where_this_sglang_defines_it(tmp_path, defines):
    """Older SGLang releases define get_is_capture_mode in cuda_graph_runner: an edit importing it
    from runner would fail at import there. The tree the file lives in decides."""
    from msrewrite.commands.apply import case_steps
    from msrewrite.load import load

    model = _sglang_tree(tmp_path, defines)
    src = load(model)
    flag = FlagSpec(kind="sglang", name="SGLANG_NPU_USE_MULTI_STREAM", default=False, gate="capture")
    step = case_steps(model, src.text, src.module, "moe-shared-expert", "eager", None, flag, None)[-1]
    assert f"from sglang.srt.model_executor.{defines} import get_is_capture_mode" in step.new
    other = "cuda_graph_runner" if defines == "runner" else "runner"
    assert f"model_executor.{other} import" not in step.new


def test_the_capture_gate_is_refused_where_this_sglang_defines_it_nowhere(tmp_path):
    from msrewrite.commands.apply import case_steps
    from msrewrite.errors import BadInput
    from msrewrite.load import load

    model = _sglang_tree(tmp_path, None)
    src = load(model)
    flag = FlagSpec(kind="sglang", name="SGLANG_NPU_USE_MULTI_STREAM", default=False, gate="capture")
    with pytest.raises(BadInput) as refused:
        case_steps(model, src.text, src.module, "moe-shared-expert", "eager", None, flag, None)
    assert "defines get_is_capture_mode() in none of its modules" in str(refused.value)
    assert "cuda_graph_runner.py" in str(refused.value)
