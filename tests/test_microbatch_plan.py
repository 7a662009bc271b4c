"""prefill-microbatch as a plan like every other case: every flag kind and the prefill gate
honoured (and verified), the plan's JSON round trip, `apply --plan` re-checking it (stale or
re-split plans refused), `verify --plan`, and the refusals of the analysis rules it adds.

The models are examples/microbatch_moe.py, changed as each test needs; `make()` starts a
one-process gloo group, so every collective runs for real under `verify`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import libcst as cst
import pytest

from helpers import EXAMPLES, run_cli, run_main
from msrewrite.analyze.microbatch import check_microbatch_plan, microbatch_plan
from msrewrite.emit.microbatch import microbatch_edit
from msrewrite.errors import BadInput, NothingToDo
from msrewrite.plan import FlagSpec, MicrobatchPlan, load_plans, plan_from_dict

FRAMEWORKS = Path(__file__).parent / "fixtures" / "frameworks"
SOURCE = (EXAMPLES / "microbatch_moe.py").read_text()
CASE = "prefill-microbatch"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FRAMEWORKS), env.get("PYTHONPATH")) if p)
    return env


def _write(tmp_path: Path, text: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _changed(*pairs: tuple[str, str], text: str = SOURCE) -> str:
    for old, new in pairs:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def _added(diff: str) -> list[str]:
    return [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]


def _plan(text: str = SOURCE, flag: FlagSpec | None = None, **kwargs) -> MicrobatchPlan:
    return microbatch_plan(
        cst.parse_module(text),
        case=CASE,
        path="model.py",
        mode="eager",
        flag=flag or FlagSpec(name="ENABLE_PREFILL_MICROBATCH"),
        **kwargs,
    )


# Flags: each kind as the other cases emit it ----------------------------------------------------
def test_attr_flag_is_an_attribute_not_an_env_read(tmp_path):
    path = _write(tmp_path, SOURCE)
    done = run_main("apply", "--case", CASE, str(path), "--flag", "attr:use_microbatch")
    assert done.returncode == 0, done.stderr
    added = _added(done.stdout)
    assert "self.use_microbatch = True" in added  # __init__ takes no config: the default
    assert "if _ms_microbatch(self.use_microbatch, hidden_states):" in added
    assert "_ms_env_flag" not in done.stdout and "os.environ" not in done.stdout and "import os" not in added
    assert "flag attr:use_microbatch (default on)" in done.stderr
    # the assumption no source analysis can check is said with the edit
    assert "assumed, not checked: every layer treats the sequences of dim 0 independently" in done.stderr


def test_attr_flag_set_by_the_class_is_reused_and_one_from_config_is_read():
    reused = _changed(
        (
            "        self.norm = nn.LayerNorm(hidden_size)\n",
            "        self.norm = nn.LayerNorm(hidden_size)\n        self.use_microbatch = False\n",
        )
    )
    code = microbatch_edit(cst.parse_module(reused), _plan(reused, FlagSpec(kind="attr", name="use_microbatch"))).code
    assert code.count("self.use_microbatch =") == 1  # the class's own line, nothing added
    assert "if _ms_microbatch(self.use_microbatch, hidden_states):" in code
    config = _changed(
        (
            "    def __init__(self, hidden_size=64, num_layers=2):",
            "    def __init__(self, config=None, hidden_size=64, num_layers=2):",
        )
    )
    plan = _plan(config, FlagSpec(kind="attr", name="use_microbatch", default=False))
    code = microbatch_edit(cst.parse_module(config), plan).code
    assert '        self.use_microbatch = getattr(config, "use_microbatch", False)\n' in code
    assert "# msrewrite(prefill-microbatch): config.use_microbatch = True runs the layers as two micro-batches." in code


@pytest.mark.slow
def test_attr_flag_edit_verifies(tmp_path):
    """verify switches the attribute (flag off: every op on main; flag on: collectives on the comm stream)."""
    path = _write(tmp_path, SOURCE)
    done = run_main("apply", "--case", CASE, str(path), "--flag", "attr:use_microbatch", "--verify", "-i")
    assert done.returncode == 0, done.stderr
    assert "OK: outputs equal" in done.stderr and "flag attr:use_microbatch]" in done.stderr
    assert "flag off: 1 output tensor(s); 139 ops on main\n" in done.stderr
    assert "ops on side:1" in done.stderr
    # standalone verify finds the attribute switch in the edit itself (not the helper's `tag` parameter)
    alone = run_main(
        "verify", str(path), "--original", str(EXAMPLES / "microbatch_moe.py"), "--no-train", "--inputs", "0"
    )
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "flag attr:use_microbatch]" in alone.stdout


SGLANG = _changed(
    ("from torch import nn\n", "from torch import nn\n\nfrom sglang.srt.utils import add_prefix  # noqa: F401\n")
)
VLLM_ASCEND = _changed(
    (
        "from torch import nn\n",
        "from torch import nn\n\nfrom vllm_ascend.ascend_config import get_ascend_config  # noqa: F401\n",
    )
)


@pytest.mark.slow  # starts a process
def test_sglang_and_vllm_ascend_flags_read_like_the_framework(tmp_path):
    done = run_cli(
        "apply",
        "--case",
        CASE,
        str(_write(tmp_path, SGLANG)),
        "--flag",
        "sglang:SGLANG_ENABLE_TBO",
        "--flag-default",
        "off",
        env=_env(),
    )
    assert done.returncode == 0, done.stderr
    added = _added(done.stdout)
    assert "from sglang.srt.utils import get_bool_env_var" in added
    assert 'self.enable_sglang_enable_tbo = get_bool_env_var("SGLANG_ENABLE_TBO", "false")' in added
    assert "# msrewrite(prefill-microbatch): SGLANG_ENABLE_TBO=1 runs the layers as two micro-batches." in added
    assert "_ms_env_flag" not in done.stdout and "import os" not in added
    done = run_cli(
        "apply",
        "--case",
        CASE,
        str(_write(tmp_path, VLLM_ASCEND, "v.py")),
        "--flag",
        "vllm-ascend:enable_prefill_microbatch",
        env=_env(),
    )
    assert done.returncode == 0, done.stderr
    added = _added(done.stdout)
    assert 'self.enable_prefill_microbatch = getattr(get_ascend_config(), "enable_prefill_microbatch", True)' in added
    assert "if _ms_microbatch(self.enable_prefill_microbatch, hidden_states):" in added


@pytest.mark.slow
@pytest.mark.parametrize(
    "text, flag", [(SGLANG, "sglang:SGLANG_ENABLE_TBO"), (VLLM_ASCEND, "vllm-ascend:enable_prefill_microbatch")]
)
def test_framework_flag_edits_verify(tmp_path, text, flag):
    done = run_cli("apply", "--case", CASE, str(_write(tmp_path, text)), "--flag", flag, "--verify", env=_env())
    assert done.returncode == 0, done.stderr
    assert "OK: outputs equal" in done.stderr and f"flag {flag}]" in done.stderr
    assert "flag off: 1 output tensor(s); 139 ops on main\n" in done.stderr


PREFILL = _changed(
    (
        "    def forward(self, hidden_states):\n        for layer",
        "    def forward(self, hidden_states, is_prefill=True):\n        for layer",
    ),
)


def test_prefill_gate_reads_the_model_forward_parameter(tmp_path):
    done = run_main("apply", "--case", CASE, str(_write(tmp_path, PREFILL)), "--gate", "prefill")
    assert done.returncode == 0, done.stderr
    added = _added(done.stdout)
    assert "if _ms_microbatch(self.enable_prefill_microbatch, hidden_states) and is_prefill:" in added
    assert "return self.forward_microbatch(hidden_states, is_prefill)" in added
    assert "def forward_microbatch(self, hidden_states, is_prefill=True):" in added
    assert "only when prefill" in done.stderr


@pytest.mark.slow
def test_prefill_gate_edit_verifies_and_decode_runs_the_original_loop(tmp_path):
    """make() passes is_prefill=True (the gate open); a forward with is_prefill=False never leaves
    the main stream, on the same edited module."""
    path = _write(tmp_path, PREFILL)
    done = run_main("apply", "--case", CASE, str(path), "--gate", "prefill", "--verify", "-i")
    assert done.returncode == 0, done.stderr
    assert "OK: outputs equal" in done.stderr and "ops on side:1" in done.stderr
    import torch

    from helpers import load_file
    from msrewrite.runtime import install

    original = load_file(EXAMPLES / "microbatch_moe.py", "mb_gate_original")
    model, (x,) = original.make()
    with torch.no_grad():
        expected = model(x)
        with install() as rt:
            edited, (x,) = load_file(path, "mb_gate_edited").make()
            with rt.record_ops() as ops:
                closed = edited(x, is_prefill=False)
    assert torch.equal(closed, expected)
    assert {op.stream for op in ops} == {"main"}


# The plan: JSON round trip, apply --plan, staleness -----------------------------------------------
def test_plan_json_round_trips_in_every_file_shape():
    plan = _plan(
        flag=FlagSpec(kind="attr", name="use_microbatch", default=False, gate=None),
        second_group="ep_group_mb1",
        stream_tag="mb_comm",
    )
    data = plan.to_dict()
    assert data["kind"] == "microbatch" and data["version"] == 1
    assert MicrobatchPlan.from_json(plan.to_json()) == plan
    assert plan_from_dict(json.loads(json.dumps(data))) == plan
    for shape in (data, [data], {"candidates": [{"plan": data}]}):
        assert load_plans(json.dumps(shape)) == [plan]
    assert [s.comm for s in plan.stages] == [False, True, False, True, False]
    assert plan.loop.source.startswith("for layer in self.layers:")


def test_apply_plan_makes_exactly_the_case_edit(tmp_path):
    path = _write(tmp_path, SOURCE)
    options = ("--flag", "attr:use_microbatch", "--second-comm-group", "ep_group_mb1", "--stream-tag", "mb_comm")
    by_case = run_main("apply", "--case", CASE, str(path), *options)
    assert by_case.returncode == 0, by_case.stderr
    assert '_ms_side_stream("mb_comm")' in by_case.stdout  # --stream-tag is honoured, not dropped
    plan = _plan(flag=FlagSpec(kind="attr", name="use_microbatch"), second_group="ep_group_mb1", stream_tag="mb_comm")
    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps({"candidates": [{"plan": plan.to_dict()}]}))
    by_plan = run_main("apply", "--plan", str(plans), str(path))
    assert by_plan.returncode == 0, by_plan.stderr
    assert by_plan.stdout == by_case.stdout
    # options on top of a plan file: the flag kind changes only because it was asked
    env = run_main("apply", "--plan", str(plans), str(path), "--flag", "env:MB")
    assert env.returncode == 0 and '_ms_env_flag("MB", True)' in env.stdout, env.stderr
    # --second-comm-group on a plan without one is carried, not dropped
    bare = tmp_path / "bare.json"
    bare.write_text(plan.with_changes(second_group="").to_json())
    grouped = run_main("apply", "--plan", str(bare), str(path), "--second-comm-group", "ep_group_mb1")
    assert grouped.returncode == 0, grouped.stderr
    assert grouped.stdout == by_case.stdout
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.load import load

    moe = EXAMPLES / "deepseek_moe.py"
    overlap = tmp_path / "overlap.json"
    overlap.write_text(
        plans_for_case(moe, load(moe).module, "moe-shared-expert", "eager", None, FlagSpec(name="X"), None)[0].to_json()
    )
    refused = run_main("apply", "--plan", str(overlap), str(moe), "--second-comm-group", "ep_group_mb1")
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert (
        "--second-comm-group is for prefill-microbatch; the plan file's plans have no micro-batches" in refused.stderr
    )


def test_apply_plan_on_a_stale_plan_is_refused(tmp_path):
    plans = tmp_path / "plans.json"
    plans.write_text(_plan().to_json())
    cases = [
        (
            ("        dist.all_reduce(expert_out)  # combine\n", "        dist.all_reduce(expert_out)  # combine!\n"),
            "stale plan for MoEDecoderLayer.forward: line 38 no longer reads 'dist.all_reduce(expert_out)  # combine'",
        ),
        (
            ("import socket\n", "import socket\nimport sys\n"),
            "stale plan for MoEModel.forward: line 49 is not its layer loop 'for layer in self.layers:'",
        ),
        (
            ("softmax(dim=-1)\n", "softmax(dim=-2)\n"),
            "stale plan for MoEDecoderLayer.forward: line 35 no longer reads 'weights = self.router(routed).softmax(dim=-1)'",
        ),
    ]
    for change, message in cases:
        path = _write(tmp_path, _changed(change))
        before = path.read_text()
        done = run_main("apply", "--plan", str(plans), str(path), "-i")
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert done.stderr.splitlines()[-1] == f"msrewrite: error: {message}", done.stderr
        assert path.read_text() == before


def test_a_plan_that_splits_the_layer_otherwise_is_refused():
    """A hand-edited stage split (a compute statement moved into the comm stage) is not carried
    out: what runs is always the split the analysis derives."""
    plan = _plan()
    stages = list(plan.stages)
    moved = stages[0].statements[-1]
    stages[0] = stages[0].__class__(False, stages[0].statements[:-1])
    stages[1] = stages[1].__class__(True, (moved, *stages[1].statements))
    edited = plan.with_changes(stages=tuple(stages))
    with pytest.raises(
        NothingToDo,
        match=r"refused plan for MoEModel.forward: the analysis splits "
        r"MoEDecoderLayer.forward into L31-35 compute, L36 comm",
    ):
        check_microbatch_plan(cst.parse_module(SOURCE), edited, SOURCE)
    assert check_microbatch_plan(cst.parse_module(SOURCE), plan, SOURCE) == plan


def test_apply_plan_refuses_options_a_model_level_fork_cannot_take(tmp_path):
    path = _write(tmp_path, SOURCE)
    plans = tmp_path / "plans.json"
    plans.write_text(_plan().to_json())
    for options, message in [
        (("--markers",), "--markers: prefill-microbatch has no single side and main window to mark"),
        (("--protect", "clone"), "--protect is for cases that move calls onto a side stream"),
        (("--allow-rng-reorder",), "--allow-rng-reorder is for cases that move calls onto a side stream"),
        (("--gate", "capture"), "prefill-microbatch takes no --gate capture"),
        (("--mode", "ge-graph"), "case prefill-microbatch does not support mode ge-graph"),
    ]:
        for source in (("--plan", str(plans)), ("--case", CASE)):
            done = run_main("apply", *source, str(path), *options)
            assert done.returncode == 2 and done.stdout == "", (source, options, done.stderr)
            assert message in done.stderr, (source, options, done.stderr)


@pytest.mark.slow
def test_verify_plan_checks_the_plan_reproduces_the_edit(tmp_path):
    original = _write(tmp_path, SOURCE, "original.py")
    edited = _write(tmp_path, SOURCE, "edited.py")
    plan = _plan(flag=FlagSpec(kind="attr", name="use_microbatch"))
    plans = tmp_path / "plans.json"
    plans.write_text(plan.to_json())
    done = run_main("apply", "--plan", str(plans), str(edited), "-i")
    assert done.returncode == 0, done.stderr
    ok = run_main(
        "verify", str(edited), "--original", str(original), "--plan", str(plans), "--no-train", "--inputs", "0"
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "early schedule only: prefill-microbatch is a model-level fork" in ok.stdout
    other = tmp_path / "other.json"
    other.write_text(plan.with_changes(stream_tag="elsewhere").to_json())
    off = run_main(
        "verify", str(edited), "--original", str(original), "--plan", str(other), "--no-train", "--inputs", "0"
    )
    assert off.returncode == 0, off.stdout + off.stderr
    assert "early schedule only: the plans do not reproduce this edit" in off.stdout


# Analysis rules: each refuses where it must, and the edit it allows verifies (the goldens) -------
COUNTER = _changed(
    (
        "        self.ep_group_mb1 = dist.new_group() if dist.is_initialized() else None\n",
        "        self.ep_group_mb1 = dist.new_group() if dist.is_initialized() else None\n"
        '        self.register_buffer("seen", torch.zeros(()))\n',
    ),
    (
        "        dist.all_reduce(routed)  # dispatch\n",
        "        self.seen.add_(routed.mean())\n        dist.all_reduce(routed)  # dispatch\n",
    ),
    (
        "        return hidden_states + expert_out / dist.get_world_size()\n",
        "        return hidden_states + expert_out / dist.get_world_size() + self.seen\n",
    ),
)


@pytest.mark.slow  # starts a process or runs verify
def test_a_layer_writing_shared_state_is_refused_and_verify_catches_the_forced_edit(tmp_path):
    with pytest.raises(
        NothingToDo,
        match=r"MoEDecoderLayer.forward: `self.seen.add_\(routed.mean\(\)\)` writes "
        r"self.seen, which both micro-batches share",
    ):
        _plan(COUNTER)
    for line, name in [("        self.last = attn\n", "self.last"), ("        CACHE.add_(attn.mean())\n", "CACHE")]:
        text = _changed(
            (
                "        hidden_states = hidden_states + self.o_proj(attn)\n",
                line + "        hidden_states = hidden_states + self.o_proj(attn)\n",
            )
        )
        with pytest.raises(NothingToDo, match=f"writes {name}, which both micro-batches share"):
            _plan(text)
    # forced past the analysis (the split the analysis would make without the rule): verify sees it
    import msrewrite.analyze.microbatch as analysis

    keep, analysis.shared_write = analysis.shared_write, lambda _func, _label, _deep=None, **_shared: None
    try:
        forced = microbatch_edit(cst.parse_module(COUNTER), _plan(COUNTER)).code
    finally:
        analysis.shared_write = keep
    original = _write(tmp_path, COUNTER, "original.py")
    edited = _write(tmp_path, forced, "edited.py")
    bad = run_main("verify", str(edited), "--original", str(original), "--no-train", "--inputs", "0")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "flag on: buffer layers.0.seen differs from original after the forward" in bad.stdout


LOCAL_WRITE = _changed(
    (
        "        expert_out = torch.einsum",
        "        picked = torch.zeros_like(routed)\n        picked[:, 0] = routed[:, 0]\n"
        "        routed = routed + picked\n        expert_out = torch.einsum",
    )
)


@pytest.mark.slow
def test_a_layer_writing_only_its_own_locals_is_edited_and_verified(tmp_path):
    """The shared-state rule looks at what is written: a subscript store into a local is per micro-batch."""
    path = _write(tmp_path, LOCAL_WRITE)
    done = run_main("apply", "--case", CASE, str(path), "--verify")
    assert done.returncode == 0, done.stderr
    assert "picked_mb1[:, 0] = routed_mb1[:, 0]" in done.stdout and "OK: outputs equal" in done.stderr


def test_layers_of_several_classes_are_refused():
    text = _changed(
        ("class MoEModel(nn.Module):", "class DenseLayer(MoEDecoderLayer):\n    pass\n\n\nclass MoEModel(nn.Module):"),
        (
            "        self.layers = nn.ModuleList(MoEDecoderLayer(hidden_size) for _ in range(num_layers))\n",
            "        self.layers = nn.ModuleList(DenseLayer(hidden_size) if i == 0 else MoEDecoderLayer(hidden_size)\n"
            "                                    for i in range(num_layers))\n",
        ),
    )
    with pytest.raises(
        NothingToDo, match=r"self.layers holds layers of several classes \(DenseLayer, MoEDecoderLayer\)"
    ):
        _plan(text)


def test_inside_a_fullgraph_region_the_fork_is_refused_with_the_reason(tmp_path):
    text = _changed(
        ("class MoEModel(nn.Module):", "@support_torch_compile\nclass MoEModel(nn.Module):"),
        (
            "from torch import nn\n",
            "from torch import nn\nfrom vllm.compilation.decorators import support_torch_compile\n",
        ),
    )
    done = run_main("apply", "--case", CASE, str(_write(tmp_path, text)))
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert (
        "MoEModel.forward runs inside a torch.compile fullgraph region (vLLM's @support_torch_compile on "
        "MoEModel): stream code there would be traced into the graph"
    ) in done.stderr


def test_bad_plan_values_never_reach_the_emitter():
    """A plan with a gate it cannot honour cannot even be made (the JSON path is
    tests/test_bad_input_options.py)."""
    plan = _plan()
    for flag in (FlagSpec(gate="capture"), FlagSpec(gate="decode"), FlagSpec(max_tokens=8)):
        with pytest.raises(ValueError, match="prefill-microbatch takes no"):
            plan.with_changes(flag=flag)
    with pytest.raises(BadInput, match="prefill-microbatch takes no --gate capture"):
        _plan(flag=FlagSpec(gate="capture"))


# suggest proposes the fork with its plan; apply --plan carries it out ------------------------------
def test_suggest_json_proposes_the_fork_and_apply_plan_carries_it_out(tmp_path):
    path = _write(tmp_path, SOURCE, "microbatch_moe.py")
    suggested = run_main("suggest", "--static", "--json", str(path))
    assert suggested.returncode == 0, suggested.stderr
    data = json.loads(suggested.stdout)
    [candidate] = [c for c in data["candidates"] if c["case"] == CASE]
    assert candidate["plan"]["kind"] == "microbatch" and candidate["estimated_saving"] is None
    assert candidate["stages"] == "L31-35 compute, L36 comm, L37 compute, L38 comm, L39 compute"
    assert candidate["command"] == f"msrewrite apply --case {CASE} --target MoEModel {path}"
    plans = tmp_path / "plans.json"
    plans.write_text(suggested.stdout)
    by_plan = run_main("apply", "--plan", str(plans), str(path))
    by_case = run_main("apply", "--case", CASE, str(path))
    assert by_plan.returncode == 0 and by_plan.stdout == by_case.stdout, by_plan.stderr
    table = run_main("suggest", "--static", str(path))
    assert table.returncode == 0 and "no candidates found" not in table.stdout
    assert f"best: msrewrite apply --case {CASE} --target MoEModel {path}" in table.stdout.splitlines()
    assert "prefill-microbatch  N/A     low" in table.stdout  # a row of the table, with no estimate


def test_suggest_reports_a_refused_fork_with_the_analysis_reason(tmp_path):
    path = _write(tmp_path, COUNTER)
    suggested = run_main("suggest", "--static", "--json", str(path))
    assert suggested.returncode == 1, suggested.stderr  # nothing to propose
    data = json.loads(suggested.stdout)
    assert not [c for c in data["candidates"] if c["case"] == CASE]
    [refused] = [r for r in data["refused"] if r["function"] == "MoEModel.forward"]
    assert "writes self.seen, which both micro-batches share" in refused["reason"]
    # a file without a layer loop is not parsed for it at all (and proposes nothing)
    from msrewrite.suggest.microbatch import microbatch_candidates

    found: list = []
    assert microbatch_candidates(path, (EXAMPLES / "deepseek_moe.py").read_text(), "x.py", found) == [] and not found
