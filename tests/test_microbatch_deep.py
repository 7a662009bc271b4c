"""prefill-microbatch with the collectives one module deeper (`self.moe(x)`), seen through the
file's summaries: the call becomes the comm stage, or the edit is refused with a reason."""

from __future__ import annotations

import libcst as cst
import pytest

from helpers import EXAMPLES
from msrewrite.analyze.microbatch import microbatch_plan
from msrewrite.emit.microbatch import microbatch_edit
from msrewrite.errors import NothingToDo
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

SOURCE = (EXAMPLES / "microbatch_moe_submodule.py").read_text()
FLAG = FlagSpec(name="ENABLE_PREFILL_MICROBATCH")


def edit(source: str, **kwargs) -> str:
    module = cst.parse_module(source)
    plan = microbatch_plan(module, case="prefill-microbatch", path=None, mode="eager", flag=FLAG, **kwargs)
    return microbatch_edit(module, plan).code


def test_the_submodule_call_is_the_comm_stage():
    code = edit(SOURCE)
    assert "# stage 1 (communication), micro-batch 0\n        with torch.npu.stream(comm_stream):" in code
    assert "            moe_out_mb0 = self.moe(self.post_norm(hidden_states_mb0))\n" in code
    assert code.count("# stage 2 (compute)") == 2  # the residual add after it is compute again


def test_a_collective_under_control_flow_in_the_submodule_is_refused():
    source = SOURCE.replace(
        "        dist.all_reduce(expert_out)  # combine\n",
        "        if expert_out.shape[0] > 1:\n            dist.all_reduce(expert_out)  # combine\n",
    )
    assert source != SOURCE
    with pytest.raises(NothingToDo, match=r"the collective in MoE.forward sits inside an `if`"):
        edit(source)


def test_a_compute_statement_calling_something_unseen_is_refused_naming_it():
    """A hidden collective there (a tensor-parallel linear's all_reduce) would run on the compute
    stream, out of order with the comm stream."""
    source = SOURCE.replace("from torch import nn\n", "from torch import nn\nfrom kernels import RowParallelLinear\n")
    source = source.replace(
        "self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)",
        "self.o_proj = RowParallelLinear(hidden_size, hidden_size)",
    )
    with pytest.raises(NothingToDo, match=r"calls self\.o_proj \(RowParallelLinear.*out of order with the comm stream"):
        edit(source)


def test_a_second_comm_group_cannot_reach_into_the_submodule():
    source = SOURCE.replace(
        "        self.moe = MoE(hidden_size, num_experts)\n",
        "        self.moe = MoE(hidden_size, num_experts)\n        self.ep_group_mb1 = None\n",
    )
    with pytest.raises(NothingToDo, match=r"those inside self\.moe\(\) take their group from the submodule"):
        edit(source, second_group="ep_group_mb1")


def test_a_submodule_writing_its_own_state_is_refused_naming_it():
    """An expert counter in the MoE block: each micro-batch would add to it, one beside the other's
    comm stage (summaries follow self.moe to MoE.forward)."""
    source = SOURCE.replace(
        "        tokens = hidden_states.clone()\n",
        "        tokens = hidden_states.clone()\n        self.seen.add_(tokens.mean())\n",
    ).replace(
        "        self.router = nn.Linear(hidden_size, num_experts, bias=False)\n",
        "        self.router = nn.Linear(hidden_size, num_experts, bias=False)\n"
        '        self.register_buffer("seen", torch.zeros(()))\n',
    )
    assert source.count("seen") == 2
    with pytest.raises(
        NothingToDo,
        match=r"`moe_out = self.moe\(self.post_norm\(hidden_states\)\)` writes "
        r"self.seen in MoE.forward, which both micro-batches share",
    ):
        edit(source)


# A collective inside a function of a package msrewrite reads (here a sibling package) beside a
# kernel it cannot see into: the package function's summary keeps the collective it saw, so the
# statement calling it is a comm stage; a collective under an `if` there is refused as one in a
# submodule is.
TP_KERNELS = """import torch
import torch.distributed as dist

_fused_scale = getattr(torch, "mul")  # a kernel msrewrite cannot see into


def tp_reduce(x):
    y = _fused_scale(x, 1.0)
{reduce}    return y
"""
STRAIGHT = "    dist.all_reduce(y)\n"
GUARDED = "    if y.shape[0] > 2:\n        dist.all_reduce(y)\n"


def _with_package(tmp_path, reduce: str):
    (tmp_path / "tpkern").mkdir()
    (tmp_path / "tpkern" / "__init__.py").write_text(TP_KERNELS.replace("{reduce}", reduce))
    source = SOURCE.replace("from torch import nn\n", "from torch import nn\nfrom tpkern import tp_reduce\n").replace(
        "        hidden_states = hidden_states + self.o_proj(attn)\n",
        "        hidden_states = hidden_states + tp_reduce(self.o_proj(attn))\n",
    )
    path = tmp_path / "model.py"
    path.write_text(source)
    module = cst.parse_module(source)
    return path, module


def test_a_package_function_with_a_collective_beside_an_unseen_kernel_is_a_comm_stage(tmp_path):
    path, module = _with_package(tmp_path, STRAIGHT)
    plan = microbatch_plan(module, case="prefill-microbatch", path=path, mode="eager", flag=FLAG)
    code = microbatch_edit(module, plan).code
    assert "hidden_states_mb0 = hidden_states_mb0 + tp_reduce(self.o_proj(attn_mb0))" in code
    assert plan.trust_boundary == ("_fused_scale (not visible to msrewrite)",), plan.trust_boundary


def test_a_collective_under_an_if_in_a_package_function_is_refused(tmp_path):
    path, module = _with_package(tmp_path, GUARDED)
    with pytest.raises(NothingToDo, match=r"the collective in tp_reduce\(\) sits inside an `if`"):
        microbatch_plan(module, case="prefill-microbatch", path=path, mode="eager", flag=FLAG)


def test_an_unseen_kernel_alone_in_a_package_function_is_refused(tmp_path):
    path, module = _with_package(tmp_path, "")
    with pytest.raises(
        NothingToDo,
        match=r"tp_reduce\(self.o_proj\(attn\)\)` calls _fused_scale \(not visible to msrewrite\): a collective in it",
    ):
        microbatch_plan(module, case="prefill-microbatch", path=path, mode="eager", flag=FLAG)


@pytest.mark.slow  # runs the model through verify (a one-process gloo group)
def test_the_package_comm_stage_edit_verifies(tmp_path):
    path, module = _with_package(tmp_path, STRAIGHT)
    plan = microbatch_plan(module, case="prefill-microbatch", path=path, mode="eager", flag=FLAG)
    edited = tmp_path / "model_ms.py"
    edited.write_text(microbatch_edit(module, plan).code)
    result = verify_files(edited, original=path, inputs=0)
    assert result.ok, result.problems
