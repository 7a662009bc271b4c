"""Adversarial models (tests/adversarial/*.py, each with make()): verify is not fooled.

Each model marks its side statements (`# side`), its join (`# join`) and, for unsafe ones, the main
statement that breaks the overlap (`# leak`); a `# fork` comment line, where present, is where the
forced plan issues the side work (above main statements that come first in the original order). The edit is what `apply --case moe-shared-expert`
makes when it accepts the model, else the marked plan forced through `apply_plans` (what
`apply --plan` carries out). Unsafe models must fail verify with the finding their EXPECT names,
safe ones verify clean under every schedule, mode and input.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import libcst as cst
import pytest

from helpers import ROOT, load_file, run_main
from msrewrite.analyze.defuse import node_facts
from msrewrite.emit.engine import apply_plans
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import MsrewriteError
from msrewrite.load import load
from msrewrite.plan import FlagSpec, OverlapPlan, SideStatement
from msrewrite.verify import verify_files

MODELS = ROOT / "tests" / "adversarial"
NAMES = sorted(p.stem for p in MODELS.glob("*.py"))
FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")
GLOBALS = {"self", "torch", "F", "nn"}
# run in the default (fast) test run; the rest are @slow
QUICK = {"storage_free", "rebind_not_write", "del_side_input"}


def marked_lines(text: str, marker: str) -> list[int]:
    return [i for i, line in enumerate(text.splitlines(), start=1) if line.rstrip().endswith(f"# {marker}")]


def forced_plan(path: Path, text: str, mode: str = "eager") -> OverlapPlan:
    """The plan the markers describe: what a hand-written `apply --plan` JSON would say."""
    lines = text.splitlines()
    side_lines, (join,) = marked_lines(text, "side"), marked_lines(text, "join")
    side_nodes = [cst.parse_statement(lines[n - 1].strip()) for n in side_lines]
    stores: set[str] = set()
    loads: set[str] = set()
    for node in side_nodes:
        facts = node_facts(node)
        loads |= facts.loads - stores
        stores |= facts.stores
    inputs = sorted(loads - stores - GLOBALS)
    window = [
        cst.parse_statement(line.strip())
        for line in lines[side_lines[-1] : join - 1]
        if line.strip()
        and not line.strip().startswith(("#", "def ", "if ", "return"))
        and line.startswith(" " * 8)
        and not line.startswith(" " * 12)
    ]
    rebound = sorted({name for node in window for name in node_facts(node).stores} & set(inputs))
    return OverlapPlan(
        case="generic",
        file=str(path),
        function="Block.forward",
        side=tuple(SideStatement(n, n, lines[n - 1].strip()) for n in side_lines),
        fork_line=marked_lines(text, "fork")[0] + 1 if marked_lines(text, "fork") else side_lines[0],
        join_line=join,
        side_inputs=tuple(inputs),
        side_outputs=tuple(sorted(stores)),
        stream_tag="side",
        flag=FLAG,
        mode=mode,
        inputs_rebound_before_join=tuple(rebound),
    )


def edit_of(path: Path, text: str, mode: str = "eager", force: bool = False) -> tuple[str, ScheduleSource, str]:
    """(edited text, its plans, "case" or "forced"): apply --case when it accepts the model
    (unless `force`: the marked plan)."""
    from msrewrite.commands.apply import case_steps
    from msrewrite.load import load

    src = load(path)
    try:
        if force:
            raise MsrewriteError("the marked plan is forced")
        steps = case_steps(path, src.text, src.module, "moe-shared-expert", mode, None, FLAG, None)
        return steps[-1].new, ScheduleSource(steps[-1].old, steps[-1].plans), "case"
    except MsrewriteError:
        plan = forced_plan(path, text, mode)
        return apply_plans(src.module, [plan], src.text).code, ScheduleSource(src.text, [plan]), "forced"


def verify_model(tmp_path: Path, name: str, mode: str = "eager", force: bool | None = None):
    """verify on the model's edit. A model with `FORCE = True` is one apply edits soundly in
    another way (the join before a nested function's call): its race is the marked plan, forced."""
    path = MODELS / f"{name}.py"
    text = path.read_text()
    if force is None:
        force = bool(getattr(load_file(path, f"_adv_{name}"), "FORCE", False))
    edited_text, source, how = edit_of(path, text, mode, force)
    edited = tmp_path / f"{name}_ms.py"
    edited.write_text(edited_text)
    return verify_files(edited, original=path, schedule_source=source), how


PARAMS = [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in NAMES]


def test_the_suite_is_large_and_mixed():
    expects = [load_file(MODELS / f"{n}.py", f"_adv_{n}").EXPECT for n in NAMES]
    assert len(NAMES) >= 40
    assert sum(e == "clean" for e in expects) >= 15 and sum(e != "clean" for e in expects) >= 25


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", PARAMS)
def test_adversarial_model(tmp_path, name):
    expect = load_file(MODELS / f"{name}.py", f"_adv_{name}").EXPECT
    result, how = verify_model(tmp_path, name)
    assert result.schedules == ["early", "late", "interleaved"], result.schedule_note
    if expect == "clean":
        assert result.ok and not result.findings, (how, result.problems)
        return
    assert not result.ok, f"{name} ({how}) verified clean"
    assert any(re.search(expect, p) for p in result.problems), (how, result.problems)
    # the analysis saw it too: apply refused (with --protect none) and the marked plan was forced;
    # an unsafe edit apply made itself is the worst bug, even when verify catches it
    assert how == "forced", f"{name}: apply edited an unsafe model (caught by verify only)"
    # when a schedule shows the race, it names the main statement whose effect leaked
    text = (MODELS / f"{name}.py").read_text()
    named = [p for p in result.problems if "main statement at line" in p]
    leak = marked_lines(text, "leak")
    if named and leak:
        assert any(f"line {leak[0]}:" in p for p in named), named


FORCED = [n for n in NAMES if getattr(load_file(MODELS / f"{n}.py", f"_adv_{n}"), "FORCE", False)]


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", FORCED)
def test_apply_edits_a_forced_model_soundly(tmp_path, name):
    """A model whose marked plan races but that apply edits another way: apply's own edit
    verifies clean under every schedule."""
    result, how = verify_model(tmp_path, name, force=False)
    assert how == "case", f"{name}: apply refused it; drop FORCE"
    assert result.ok and not result.findings, result.problems


@pytest.mark.parametrize("name", ["inplace_method", "storage_free"])
@pytest.mark.parametrize("mode", ["cuda", "npugraph-ex", "ge-graph"])
@pytest.mark.slow
def test_unsafe_models_fail_in_every_mode(tmp_path, name, mode):
    result, _ = verify_model(tmp_path, name, mode)
    assert not result.ok, result.problems


@pytest.mark.slow  # runs the model through verify
def test_late_schedule_names_the_leaking_statement(tmp_path):
    result, how = verify_model(tmp_path, "inplace_method")
    assert how == "forced"  # apply --case refuses it: the plan is forced, as apply --plan would
    text = (MODELS / "inplace_method.py").read_text()
    leak = marked_lines(text, "leak")[0]
    assert any("late schedule" in p and f"main statement at line {leak}: x.mul_(2)" in p for p in result.problems), (
        result.problems
    )


@pytest.mark.slow  # runs the model through verify
def test_outlier_write_is_seen_only_on_random_draws(tmp_path):
    result, _ = verify_model(tmp_path, "outlier_clamp")
    assert any(p.startswith("draw ") or "draw " in p for p in result.problems), result.problems
    assert not any(re.match(r"flag on(,| )", p) for p in result.problems), result.problems  # make()'s inputs: clean


@pytest.mark.slow  # runs the model through verify
def test_train_only_write_is_seen_in_train(tmp_path):
    result, _ = verify_model(tmp_path, "train_only_jitter")
    assert any(p.startswith("train: ") for p in result.problems), result.problems


@pytest.mark.slow  # the CLI with verify
def test_forced_plan_through_the_cli(tmp_path):
    """apply --plan re-derives a hand-written unsafe plan: with --protect none it refuses it, by
    default (--protect auto) it carries it out with the side stream reading a copy of x; the plan
    forced through the emitter without the copy is caught by verify --plan: exit 1 with the race named."""
    model = MODELS / "inplace_method.py"
    plan = forced_plan(model, model.read_text())
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps([plan.to_dict()]))
    applied = run_main("apply", str(model), "--plan", str(plan_file), "--protect", "none")
    assert applied.returncode == 1 and not applied.stdout, applied.stderr
    assert "refused plan" in applied.stderr and "writes 'x' in place" in applied.stderr
    protected = run_main("apply", str(model), "--plan", str(plan_file))
    assert protected.returncode == 0 and "x_side = _ms_snapshot(x)" in protected.stdout, protected.stderr
    src = load(model)
    edited = tmp_path / "inplace_method_ms.py"
    edited.write_text(apply_plans(src.module, [plan], src.text).code)
    verified = run_main("verify", str(edited), "--original", str(model), "--plan", str(plan_file), "--json")
    assert verified.returncode == 1, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    assert report["schedules"] == ["early", "late", "interleaved"]
    assert any("late schedule" in p and "x.mul_(2)" in p for p in report["problems"]), report["problems"]


@pytest.mark.slow  # runs the model through verify
def test_inference_only_model_skips_train_and_says_so(tmp_path):
    """A model that refuses train mode is not bad input: the train runs are skipped, by name."""
    model = tmp_path / "inference_only.py"
    model.write_text(
        (MODELS / "plain_shared_expert.py")
        .read_text()
        .replace(
            "        s = self.shared_experts(x)  # side\n",
            '        if self.training:\n            raise RuntimeError("inference only")\n'
            "        s = self.shared_experts(x)  # side\n",
        )
    )
    edited_text, source, _ = edit_of(model, model.read_text())
    edited = tmp_path / "inference_only_ms.py"
    edited.write_text(edited_text)
    result = verify_files(edited, original=model, schedule_source=source)
    assert result.ok, result.problems
    assert "train" not in result.scenarios
    assert any(s.startswith("train (the original raises RuntimeError: inference only") for s in result.skipped)


@pytest.mark.slow  # the CLI with verify
def test_rng_model_refused_without_the_option_and_caught_when_forced(tmp_path):
    """Dropout on both branches: apply (--case and --plan) refuses the move naming both draws;
    with --allow-rng-reorder apply --plan carries it out, and verify --plan catches the reordered
    draws in train mode (exit 1)."""
    model = MODELS / "dropout_both_branches.py"
    case = run_main("apply", str(model), "--case", "moe-shared-expert")
    assert case.returncode == 1 and not case.stdout
    assert "draws random numbers (line 24: self.drop)" in case.stderr and "(line 25: self.drop)" in case.stderr
    plan = forced_plan(model, model.read_text())
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps([plan.to_dict()]))
    refused = run_main("apply", str(model), "--plan", str(plan_file))
    assert refused.returncode == 1 and "refused plan" in refused.stderr and "--allow-rng-reorder" in refused.stderr
    edited = tmp_path / "dropout_both_branches_ms.py"
    edited.write_text(model.read_text())
    applied = run_main("apply", str(edited), "--plan", str(plan_file), "--allow-rng-reorder", "-i")
    assert applied.returncode == 0, applied.stderr
    verified = run_main("verify", str(edited), "--original", str(model), "--plan", str(plan_file), "--json")
    assert verified.returncode == 1, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    assert any(p.startswith("rng-order: train: flag on") and "aten.bernoulli" in p for p in report["problems"]), report[
        "problems"
    ]


# Unsafe models whose only hazard is a main-path write of the side input after the fork: apply's
# default --protect auto edits them with the side stream reading a copy of x, and that edit verifies
# clean where the forced plan without the copy does not (test_adversarial_model).
SNAPSHOT_FIXES = [
    "annotated_alias",
    "attribute_table_store",
    "annotated_object_parameter",
    "closure_default_write",
    "closure_mutation",
    "copy_into_input",
    "data_assignment",
    "declared_custom_op_call_writes",
    "declared_custom_op_writes",
    "declared_inplace_flag_writes",
    "declared_schema_writes",
    "declared_torch_ops_writes",
    "flatten_alias",
    "identity_module_alias",
    "index_put_input",
    "inplace_functional",
    "inplace_method",
    "inplace_relu_submodule",
    "inplace_torch_fn",
    "list_element_alias",
    "map_unbound_inplace",
    "local_attribute_method",
    "local_object_method",
    "out_argument",
    "outlier_clamp",
    "router_clamps_input",
    "self_attribute_alias",
    "starred_alias",
    "storage_free",
    "storage_set",
    "train_only_jitter",
    "type_unbound_method",
    "view_inplace",
    "view_setitem",
    "walrus_alias",
]


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", SNAPSHOT_FIXES)
def test_the_snapshot_edit_of_an_unsafe_model_verifies(tmp_path, name):
    from msrewrite.commands.apply import case_steps

    path = MODELS / f"{name}.py"
    assert load_file(path, f"_adv_{name}").EXPECT != "clean"
    src = load(path)
    steps = case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, protect="auto")
    assert steps[-1].plans[0].protect_inputs == ("x",)
    edited = tmp_path / f"{name}_ms.py"
    edited.write_text(steps[-1].new)
    result = verify_files(edited, original=path, schedule_source=ScheduleSource(steps[-1].old, steps[-1].plans))
    assert result.schedules == ["early", "late", "interleaved"], result.schedule_note
    assert result.ok and not result.findings, result.problems
