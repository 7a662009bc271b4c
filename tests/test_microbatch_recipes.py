"""prefill-microbatch on the layer loop as cann-recipes writes it (tests/fixtures/microbatch_residual.py):
the layers thread the residual beside the hidden states (`residual, hidden_states = layer(hidden_states,
position_ids, past_residual=residual, is_prefill=is_prefill)`), the forward computes the hidden states
itself, and the loop sits inside `with superkernel_scope(...)`.

The loop is forked where it stands: `if <switch>: <two micro-batches, each threading its own state>
else: <the original loop>`. Every value the loop hands the layers beside the hidden states is split
or shared only as the user says (--split-arg / --shared-arg), a constant or scalar parameter
excepted: the source does not tell whether a tensor holds one row per sequence.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from helpers import run_main
from msrewrite.analyze.microbatch import check_microbatch_plan, microbatch_plan
from msrewrite.emit.microbatch import microbatch_edit
from msrewrite.errors import BadInput, NothingToDo
from msrewrite.plan import FlagSpec, MicrobatchPlan
from msrewrite.verify import verify_files

SOURCE = (Path(__file__).parent / "fixtures" / "microbatch_residual.py").read_text()
CASE = "prefill-microbatch"
DECLARED = {"split_args": ("residual", "position_ids")}


def _plan(text: str = SOURCE, mode: str = "eager", **kwargs) -> MicrobatchPlan:
    return microbatch_plan(
        cst.parse_module(text),
        case=CASE,
        path="model.py",
        mode=mode,
        flag=FlagSpec(name="ENABLE_PREFILL_MICROBATCH"),
        **kwargs,
    )


def _edit(text: str = SOURCE, mode: str = "eager", **kwargs) -> str:
    return microbatch_edit(cst.parse_module(text), _plan(text, mode, **kwargs), text).code


def _changed(old: str, new: str, text: str = SOURCE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# Refusals and bad input ------------------------------------------------------------------------
def test_undeclared_state_and_arguments_are_refused_naming_each_once():
    with pytest.raises(NothingToDo) as refused:
        _plan()
    assert str(refused.value) == (
        "Model.forward: the layer loop threads residual through the layers beside hidden_states and passes "
        "`position_ids` to every layer; msrewrite cannot tell from the source whether each holds one row per "
        "sequence (each micro-batch then needs its half: --split-arg NAME) or is the same for every sequence "
        "(both get it whole: --shared-arg NAME; threaded state cannot be)"
    )


def test_a_constant_and_a_scalar_parameter_are_shared_without_asking():
    plan = _plan(**DECLARED)
    assert "shared by both: is_prefill" in plan.summary
    unannotated = _changed("is_prefill: bool = True):\n        with", "is_prefill=True):\n        with")
    with pytest.raises(NothingToDo, match=r"passes `is_prefill` to every layer"):
        _plan(unannotated, **DECLARED)
    assert (
        "shared by both: is_prefill"
        in _plan(unannotated, shared_args=("is_prefill",), split_args=DECLARED["split_args"]).summary
    )


def test_declared_names_the_loop_does_not_pass_are_bad_input():
    with pytest.raises(BadInput, match=r"^--split-arg mask: the layer loop passes no such argument"):
        _plan(split_args=("residual", "position_ids", "mask"))
    with pytest.raises(BadInput, match=r"^--shared-arg residual: residual comes back from every layer"):
        _plan(split_args=("position_ids",), shared_args=("residual",))


def test_a_layer_writing_an_argument_both_micro_batches_share_is_refused():
    writes = _changed(
        "        outputs = (residual, expert_out / dist.get_world_size())\n",
        "        position_ids.add_(0)\n        outputs = (residual, expert_out / dist.get_world_size())\n",
    )
    with pytest.raises(
        NothingToDo, match=r"`position_ids.add_\(0\)` writes position_ids, which both micro-batches share"
    ):
        _plan(writes, split_args=("residual",), shared_args=("position_ids",))


def test_state_the_loop_assigns_but_never_passes_back_is_not_forked():
    dropped = _changed("past_residual=residual,\n", "past_residual=None,\n")
    with pytest.raises(NothingToDo, match=r"assigns residual but does not pass it back to the next layer"):
        _plan(dropped, split_args=("position_ids",))


# The edit ------------------------------------------------------------------------------------------
def test_the_loop_is_forked_where_it_stands_with_the_original_under_else():
    code = _edit(**DECLARED)
    model = code[code.index("class Model") :]
    assert "def forward_microbatch" not in model  # no copy of the model's forward
    fork = model[model.index("# msrewrite(prefill-microbatch): two micro-batches") :]
    # inside the `with`, after the statements that compute the hidden states
    assert (
        model.index("with superkernel_scope(")
        < model.index("residual = None\n")
        < model.index("two micro-batches on two")
    )
    assert (
        "            if _ms_microbatch(self.enable_prefill_microbatch, hidden_states) and "
        "_ms_same_batch(hidden_states, position_ids, residual):\n"
    ) in fork
    assert "residual_mb0, residual_mb1 = (None, None) if residual is None else residual.chunk(2, dim=0)" in fork
    assert (
        "decoder_layer.forward_microbatch(hidden_states_mb0, hidden_states_mb1, position_ids_mb0, "
        "position_ids_mb1, residual_mb0, residual_mb1, is_prefill=is_prefill)"
    ) in fork
    assert "residual_mb0, hidden_states_mb0 = decoder_layer_out_mb0\n" in fork
    assert "residual = None if residual_mb0 is None else torch.cat([residual_mb0, residual_mb1], dim=0)" in fork
    original = SOURCE[
        SOURCE.index("            for decoder_layer in self.layers:") : SOURCE.index(
            "            hidden_states, _ = self.norm"
        )
    ]
    assert "            else:\n" + "".join("    " + line for line in original.splitlines(keepends=True)) in fork
    layer = code[code.index("class DecoderLayer") : code.index("class Model")]
    assert (
        "def forward_microbatch(self, hidden_states_mb0, hidden_states_mb1, position_ids_mb0, position_ids_mb1, "
        "past_residual_mb0, past_residual_mb1, is_prefill: bool = True):"
    ) in layer
    assert "hidden_states_mb1, residual_mb1 = self.input_layernorm(hidden_states_mb1, past_residual_mb1)" in layer


def test_the_context_manager_around_the_loop_is_named_as_not_seen_into():
    plan = _plan(**DECLARED)
    assert plan.trust_boundary == ("superkernel_scope (the `with` around the layer loop)",)
    assert "each micro-batch threads its own residual; split with the batch: position_ids" in plan.summary
    no_grad = _changed(
        '        with superkernel_scope(self.enable_superkernel and not is_prefill, "decode_layer"):\n',
        "        with torch.no_grad():\n",
    )
    assert _plan(no_grad, **DECLARED).trust_boundary == ()  # a context msrewrite knows: nothing to name


def test_a_shared_parameter_the_layer_rebinds_gets_one_copy_per_micro_batch():
    rebinds = _changed(
        "        hidden_states, residual = self.input_layernorm(hidden_states, past_residual)\n",
        "        is_prefill = is_prefill and True\n"
        "        hidden_states, residual = self.input_layernorm(hidden_states, past_residual)\n",
    )
    code = _edit(rebinds, **DECLARED)
    assert "        is_prefill_mb0 = is_prefill_mb1 = is_prefill\n" in code
    assert "        is_prefill_mb1 = is_prefill_mb1 and True\n" in code


def test_the_plan_file_keeps_the_declarations_and_is_rechecked():
    plan = _plan(**DECLARED)
    again = MicrobatchPlan.from_json(plan.to_json())
    assert again == plan and again.split_args == ("residual", "position_ids")
    assert (
        "split_args"
        not in _plan((Path(__file__).parent.parent / "examples" / "microbatch_moe.py").read_text()).to_dict()
    )  # plans without declarations read as before
    assert check_microbatch_plan(cst.parse_module(SOURCE), again, SOURCE, Path("model.py")) == plan
    with pytest.raises(NothingToDo, match=r"threads residual through the layers"):
        check_microbatch_plan(cst.parse_module(SOURCE), again.with_changes(split_args=()), SOURCE, Path("model.py"))


# Through verify ------------------------------------------------------------------------------------
@pytest.mark.slow  # runs the model through verify (a one-process gloo group)
@pytest.mark.parametrize("mode", ["eager", "cuda"])
def test_the_recipe_loop_edit_verifies(tmp_path, mode):
    original = tmp_path / "model.py"
    original.write_text(SOURCE)
    edited = tmp_path / "model_ms.py"
    edited.write_text(_edit(mode=mode, **DECLARED))
    result = verify_files(edited, original=original)
    assert result.ok, result.problems
    assert any(stream != "main" for stream in result.runs[2].streams)  # the comm stream ran


@pytest.mark.slow  # runs the model through verify (a one-process gloo group)
def test_a_false_shared_declaration_is_caught_by_verify(tmp_path):
    """position_ids holds one row per sequence: handed whole to each half, the layer fails."""
    original = tmp_path / "model.py"
    original.write_text(SOURCE)
    edited = tmp_path / "model_ms.py"
    edited.write_text(_edit(split_args=("residual",), shared_args=("position_ids",)))
    result = verify_files(edited, original=original)
    assert not result.ok
    assert any("flag on: raised RuntimeError" in problem for problem in result.problems), result.problems


@pytest.mark.slow  # runs the CLI and verify
def test_apply_takes_the_declarations_and_verifies(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(SOURCE)
    args = ("apply", "--case", CASE, str(path), "--split-arg", "residual", "--split-arg", "position_ids", "--verify")
    done = run_main(*args)
    assert done.returncode == 0, done.stderr
    assert "OK: outputs equal" in done.stderr
    assert "trust boundary (callees not seen into): superkernel_scope (the `with` around the layer loop)" in done.stderr
    refused = run_main("apply", "--case", "moe-shared-expert", str(path), "--split-arg", "residual")
    assert refused.returncode == 2
    assert "--split-arg is for prefill-microbatch; moe-shared-expert has no micro-batches" in refused.stderr


@pytest.mark.slow  # runs the model through verify (a one-process gloo group)
def test_the_first_loop_shape_inside_no_grad_with_computed_hidden_states_verifies(tmp_path):
    """`hidden_states = layer(hidden_states)` under a `with`, the hidden states made in the forward:
    forked in place too (a dispatch at the top of forward could not read them yet)."""
    text = (Path(__file__).parent.parent / "examples" / "microbatch_moe.py").read_text()
    text = _changed(
        "    def forward(self, hidden_states):\n        for layer in self.layers:\n"
        "            hidden_states = layer(hidden_states)\n",
        "    def forward(self, x):\n        hidden_states = x * 1.0\n        with torch.no_grad():\n"
        "            for layer in self.layers:\n                hidden_states = layer(hidden_states)\n",
        text,
    )
    original = tmp_path / "model.py"
    original.write_text(text)
    code = _edit(text)
    assert "            else:\n                for layer in self.layers:\n" in code
    edited = tmp_path / "model_ms.py"
    edited.write_text(code)
    result = verify_files(edited, original=original)
    assert result.ok, result.problems


def test_layers_built_in_a_method_init_calls_are_found():
    """cann-recipes build self.layers in `init_modules`, which `__init__` calls."""
    text = _changed(
        "        self.layers = nn.ModuleList(DecoderLayer(hidden_size) for _ in range(num_layers))\n",
        "        self.init_modules(hidden_size, num_layers)\n",
    )
    text = _changed(
        "    def forward(self, input_ids, position_ids, is_prefill: bool = True):\n",
        "    def init_modules(self, hidden_size, num_layers):\n"
        "        self.layers = nn.ModuleList(DecoderLayer(hidden_size) for _ in range(num_layers))\n\n"
        "    def forward(self, input_ids, position_ids, is_prefill: bool = True):\n",
        text,
    )
    assert _plan(text, **DECLARED).layer == "DecoderLayer.forward"


def test_a_layer_forward_with_an_if_is_refused_naming_the_class_on_one_line():
    branching = _changed(
        "        routed = hidden_states * 1.0\n",
        "        if is_prefill:\n            hidden_states = hidden_states * 1.0\n        routed = hidden_states * 1.0\n",
    )
    with pytest.raises(
        NothingToDo,
        match=r"^DecoderLayer.forward: micro-batching needs a straight-line layer forward \(it holds an `if`\)$",
    ):
        _plan(branching, **DECLARED)


def test_a_refusal_quoting_a_multi_line_statement_stays_one_line():
    unseen = _changed(
        "        weights = self.router(hidden_states).softmax(dim=-1)\n",
        "        weights = _router_kernel(\n            self.router(hidden_states),\n            dim=-1,\n        )\n",
    )
    unseen = _changed(
        "from torch import nn\n", 'from torch import nn\n\n_router_kernel = getattr(torch, "softmax")\n', unseen
    )
    with pytest.raises(NothingToDo) as refused:
        _plan(unseen, **DECLARED)
    assert "\n" not in str(refused.value)
    assert "`weights = _router_kernel(self.router(hidden_states), dim=-1,)` calls _router_kernel" in str(refused.value)
