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
