"""Bad options and plan JSON, and the proof that no user value reaches emitted code unvalidated.

Two halves:

- end to end through the console entry point (like tests/test_bad_input.py): every hostile option
  or plan field gives exactly one `msrewrite: error: ...` line, exit 2 (1 for nothing to do),
  nothing on stdout, no traceback, and leaves the folder byte-identical (in particular, no file
  made by injected code);
- in process: every field of every plan dataclass refuses hostile values (a new field without a
  hostile row fails the test), and scans of the emitter show that strings reach emitted code only
  through `validate.literal` and that the emission context is built only from validated plans.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import EXAMPLES, ROOT, run_main
from msrewrite import validate
from msrewrite.plan import FlagSpec, OverlapPlan, SideStatement, StartGate, load_plans

CASE = ("--case", "moe-shared-expert")
INJECTION = 'X") or __import__("os").system("touch PWNED") or ("'
# Values that must never become a literal or a comment in emitted code ...
HOSTILE_TEXT = [INJECTION, 'a"b', "a'b", "a\nb", "a b", "", "x)\nimport os\n(", "a\\b", "a\rb", "a\x00b"]
# ... nor a name (a keyword, a dunder, a leading digit).
HOSTILE = HOSTILE_TEXT + ["class", "__class__", "1x"]


def _good_plan() -> dict:
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.load import load

    path = EXAMPLES / "deepseek_moe.py"
    return plans_for_case(
        path,
        load(path).module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )[0].to_dict()


PLAN = _good_plan()


def _with(**changes) -> dict:
    plan = copy.deepcopy(PLAN)
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            plan[outer][inner] = value
        else:
            plan[key] = value
    return plan


def _side(**changes) -> list:
    return [{**PLAN["side"][0], **changes}]


def _main_hoist(**changes) -> dict:
    """A main call hoisted out of PLAN's join statement (valid as it stands), with `changes`."""
    line = PLAN["join_line"]
    hoist = {"first_line": line, "last_line": line, "source": "self.experts(h)", "hoist": "experts_output"}
    for key, value in changes.items():
        hoist[key] = value
    return hoist


def _good_microbatch_plan() -> dict:
    from msrewrite.analyze.microbatch import microbatch_plan
    from msrewrite.load import load

    path = EXAMPLES / "microbatch_moe.py"
    return microbatch_plan(
        load(path).module,
        case="prefill-microbatch",
        path=path,
        mode="eager",
        flag=FlagSpec(name="ENABLE_PREFILL_MICROBATCH"),
    ).to_dict()


MB_PLAN = _good_microbatch_plan()


def _mb_with(**changes) -> dict:
    plan = copy.deepcopy(MB_PLAN)
    for key, value in changes.items():
        outer, _, inner = key.partition(".")
        if inner:
            plan[outer][inner] = value
        else:
            plan[key] = value
    return plan


def _mb_statement(**changes) -> list:
    """The plan's stages with the first statement of the first stage changed."""
    stages = copy.deepcopy(MB_PLAN["stages"])
    stages[0]["statements"][0].update(changes)
    return stages


# name -> file content (str: text, dict/list: JSON)
PLAN_FILES = {
    "mb-ok.json": {"candidates": [{"plan": MB_PLAN}]},
    "mb-group-code.json": _mb_with(second_group="g)\nimport os"),
    "mb-group-module-method.json": _mb_with(second_group="cuda"),
    "mb-group-unset.json": _mb_with(second_group="other_group"),
    "mb-tag-injection.json": _mb_with(stream_tag=INJECTION),
    "mb-flag-injection.json": _mb_with(**{"flag.name": INJECTION}),
    "mb-flag-attr-forward.json": _mb_with(**{"flag.kind": "attr", "flag.name": "forward"}),
    "mb-gate-capture.json": _mb_with(**{"flag.gate": "capture"}),
    "mb-max-tokens.json": _mb_with(**{"flag.max_tokens": 64}),
    "mb-kind-other.json": _mb_with(kind="overlap"),
    "mb-function-code.json": _mb_with(function="MoEModel.forward;os"),
    "mb-function-not-forward.json": _mb_with(function="MoEModel.__init__"),
    "mb-layer-code.json": _mb_with(layer="MoEDecoderLayer.forward)\nimport os"),
    "mb-stages-empty.json": _mb_with(stages=[]),
    "mb-stages-no-comm.json": _mb_with(stages=[MB_PLAN["stages"][0]]),
    "mb-stages-not-alternating.json": _mb_with(stages=[MB_PLAN["stages"][1], MB_PLAN["stages"][1]]),
    "mb-stage-comm-string.json": _mb_with(stages=[{**MB_PLAN["stages"][0], "comm": "no"}, *MB_PLAN["stages"][1:]]),
    "mb-statement-line-zero.json": _mb_with(stages=_mb_statement(first_line=0)),
    "mb-statement-source-code.json": _mb_with(stages=_mb_statement(source="import os; os.system('x')")),
    "mb-statement-beyond-file.json": _mb_with(
        stages=[
            *MB_PLAN["stages"][:-1],
            {"comm": False, "statements": [{**MB_PLAN["stages"][-1]["statements"][0], "last_line": 100000}]},
        ]
    ),
    "mb-loop-source.json": _mb_with(**{"loop.source": "for layer in self.other:\n    x = layer(x)"}),
    "mb-unknown-field.json": _mb_with(exec="os.system('x')"),
    "mb-mode-ge-graph.json": _mb_with(mode="ge-graph"),
    "mb-case-other.json": _mb_with(case="moe-shared-expert"),
    "inject-flag.json": {"candidates": [{"plan": _with(**{"flag.name": INJECTION})}]},
    "flag-kind-yaml.json": {"candidates": [{"plan": _with(**{"flag.kind": "yaml"})}]},
    "attr-forward.json": _with(**{"flag.kind": "attr", "flag.name": "forward"}),
    "tag-quote.json": _with(stream_tag='a"b'),
    "tag-newline.json": _with(stream_tag="a\nb"),
    "input-inject.json": _with(side_inputs=["residuals); import os; (x"]),
    "output-keyword.json": _with(side_outputs=["class"]),
    "hoist-inject.json": _with(side=_side(hoist="x = __import__('os')")),
    "gate-anchor.json": _with(mode="ge-graph", start_gates=[{"tensor": "residuals", "anchor": "a+b"}]),
    "phase-anchor.json": _with(phase_anchors=["x\nimport os"]),
    "case-newline.json": _with(case="moe\nimport os"),
    "case-unknown.json": _with(case="no-such-case"),
    "branch-paren.json": _with(case_branch="q): import os #"),
    "function-inject.json": _with(function="DeepseekMoE.forward;os"),
    "candidates-null.json": {"candidates": [None]},
    "candidates-string.json": {"candidates": "abc"},
    "top-number.json": 42,
    "fork-line-string.json": _with(fork_line="64"),
    "fork-line-bool.json": _with(fork_line=True),
    "join-line-beyond-file.json": _with(join_line=100000),
    "side-line-zero.json": _with(side=_side(first_line=0)),
    "side-empty.json": _with(side=[]),
    "side-null.json": _with(side=[None]),
    "unknown-field.json": _with(exec="os.system('x')"),
    "mode-enum.json": _with(mode="tpu"),
    "sync-enum.json": _with(sync="threads"),
    "source-enum.json": _with(stream_source="global"),
    "non-blocking-string.json": _with(non_blocking="yes"),
    "allow-rng-string.json": _with(allow_rng_reorder="yes"),
    "core-limits-short.json": _with(core_limits=[1, 2]),
    "flag-not-object.json": _with(flag="env:X"),
    "max-tokens-zero.json": _with(**{"flag.max_tokens": 0}),
    "flag-default-string.json": _with(**{"flag.default": "off"}),
    "deep.json": "[" * 100000 + "]" * 100000,
}


@dataclass(frozen=True)
class Row:
    id: str
    args: tuple[str, ...]  # {name} is replaced by the path of that file in the row's folder
    code: int
    message: str


ROWS = [
    # plan JSON: code in a value, wrong kinds, wrong types, wrong shapes
    Row(
        "plan-injected-flag-name",
        ("apply", "--plan", "{inject-flag.json}", "{good.py}"),
        2,
        "not a valid environment variable name",
    ),
    Row(
        "plan-flag-kind-yaml",
        ("apply", "--plan", "{flag-kind-yaml.json}", "{good.py}"),
        2,
        "flag kind must be env, attr",
    ),
    Row("plan-attr-flag-forward", ("apply", "--plan", "{attr-forward.json}", "{good.py}"), 2, "nn.Module.forward"),
    Row("plan-tag-quote", ("apply", "--plan", "{tag-quote.json}", "{good.py}"), 2, "not a valid stream tag"),
    Row("plan-tag-newline", ("apply", "--plan", "{tag-newline.json}", "{good.py}"), 2, "not a valid stream tag"),
    Row("plan-side-input-code", ("apply", "--plan", "{input-inject.json}", "{good.py}"), 2, "not a valid identifier"),
    Row("plan-side-output-keyword", ("apply", "--plan", "{output-keyword.json}", "{good.py}"), 2, "keyword"),
    Row("plan-hoist-code", ("apply", "--plan", "{hoist-inject.json}", "{good.py}"), 2, "side hoist"),
    Row("plan-gate-anchor-code", ("apply", "--plan", "{gate-anchor.json}", "{good.py}"), 2, "start gate anchor"),
    Row("plan-phase-anchor-newline", ("apply", "--plan", "{phase-anchor.json}", "{good.py}"), 2, "phase_anchors"),
    Row("plan-case-newline", ("apply", "--plan", "{case-newline.json}", "{good.py}"), 2, "not a valid case name"),
    Row("plan-case-unknown", ("apply", "--plan", "{case-unknown.json}", "{good.py}"), 2, "unknown case 'no-such-case'"),
    Row("plan-case-branch-code", ("apply", "--plan", "{branch-paren.json}", "{good.py}"), 2, "case_branch"),
    Row("plan-function-code", ("apply", "--plan", "{function-inject.json}", "{good.py}"), 2, "Class.method"),
    Row(
        "plan-candidates-null",
        ("apply", "--plan", "{candidates-null.json}", "{good.py}"),
        2,
        "candidate 1 must be an object",
    ),
    Row(
        "plan-candidates-string",
        ("apply", "--plan", "{candidates-string.json}", "{good.py}"),
        2,
        "candidates must be a list",
    ),
    Row("plan-top-level-number", ("apply", "--plan", "{top-number.json}", "{good.py}"), 2, "a plan file holds"),
    Row("plan-line-as-string", ("apply", "--plan", "{fork-line-string.json}", "{good.py}"), 2, "fork_line must be int"),
    Row("plan-line-as-bool", ("apply", "--plan", "{fork-line-bool.json}", "{good.py}"), 2, "fork_line must be int"),
    Row(
        "plan-line-beyond-file",
        ("apply", "--plan", "{join-line-beyond-file.json}", "{good.py}"),
        2,
        "join_line 100000 is out of range",
    ),
    Row("plan-line-zero", ("apply", "--plan", "{side-line-zero.json}", "{good.py}"), 2, "out of range"),
    Row("plan-side-empty", ("apply", "--plan", "{side-empty.json}", "{good.py}"), 2, "at least one side statement"),
    Row("plan-side-null", ("apply", "--plan", "{side-null.json}", "{good.py}"), 2, "side[0] must be an object"),
    Row("plan-unknown-field", ("apply", "--plan", "{unknown-field.json}", "{good.py}"), 2, "unknown field 'exec'"),
    Row("plan-mode-enum", ("apply", "--plan", "{mode-enum.json}", "{good.py}"), 2, "mode must be one of"),
    Row("plan-sync-enum", ("apply", "--plan", "{sync-enum.json}", "{good.py}"), 2, "sync must be one of"),
    Row("plan-stream-source-enum", ("apply", "--plan", "{source-enum.json}", "{good.py}"), 2, "stream_source"),
    Row(
        "plan-non-blocking-string",
        ("apply", "--plan", "{non-blocking-string.json}", "{good.py}"),
        2,
        "non_blocking must be bool",
    ),
    Row(
        "plan-allow-rng-string",
        ("apply", "--plan", "{allow-rng-string.json}", "{good.py}"),
        2,
        "allow_rng_reorder must be bool",
    ),
    Row("plan-core-limits-short", ("apply", "--plan", "{core-limits-short.json}", "{good.py}"), 2, "core_limits"),
    Row("plan-flag-not-object", ("apply", "--plan", "{flag-not-object.json}", "{good.py}"), 2, "flag must be dict"),
    Row("plan-max-tokens-zero", ("apply", "--plan", "{max-tokens-zero.json}", "{good.py}"), 2, "positive token count"),
    Row(
        "plan-flag-default-string",
        ("apply", "--plan", "{flag-default-string.json}", "{good.py}"),
        2,
        "default must be bool",
    ),
    Row("plan-nested-100000-deep", ("apply", "--plan", "{deep.json}", "{good.py}"), 2, "nested too deeply"),
    Row(
        "plan-override-tag-quote",
        ("apply", "--plan", "{ok.json}", "--stream-tag", 'a"b', "{good.py}"),
        2,
        "--stream-tag",
    ),
    # micro-batch plans (kind "microbatch"): the same checks, field by field
    Row("plan-mb-group-code", ("apply", "--plan", "{mb-group-code.json}", "{mb.py}"), 2, "second_group"),
    Row(
        "plan-mb-group-module-method",
        ("apply", "--plan", "{mb-group-module-method.json}", "{mb.py}"),
        2,
        "nn.Module.cuda",
    ),
    Row(
        "plan-mb-group-unset", ("apply", "--plan", "{mb-group-unset.json}", "{mb.py}"), 2, "never sets self.other_group"
    ),
    Row(
        "plan-mb-tag-injection", ("apply", "--plan", "{mb-tag-injection.json}", "{mb.py}"), 2, "not a valid stream tag"
    ),
    Row(
        "plan-mb-flag-injection",
        ("apply", "--plan", "{mb-flag-injection.json}", "{mb.py}"),
        2,
        "not a valid environment variable name",
    ),
    Row(
        "plan-mb-flag-attr-forward",
        ("apply", "--plan", "{mb-flag-attr-forward.json}", "{mb.py}"),
        2,
        "nn.Module.forward",
    ),
    Row(
        "plan-mb-gate-capture",
        ("apply", "--plan", "{mb-gate-capture.json}", "{mb.py}"),
        2,
        "prefill-microbatch takes no --gate capture",
    ),
    Row(
        "plan-mb-max-tokens",
        ("apply", "--plan", "{mb-max-tokens.json}", "{mb.py}"),
        2,
        "prefill-microbatch takes no --gate tokens<=N",
    ),
    Row(
        "plan-mb-kind-other",
        ("apply", "--plan", "{mb-kind-other.json}", "{mb.py}"),
        2,
        "kind must be 'microbatch' or absent",
    ),
    Row("plan-mb-function-code", ("apply", "--plan", "{mb-function-code.json}", "{mb.py}"), 2, "Class.method"),
    Row(
        "plan-mb-function-not-forward",
        ("apply", "--plan", "{mb-function-not-forward.json}", "{mb.py}"),
        2,
        "function must be Class.forward",
    ),
    Row("plan-mb-layer-code", ("apply", "--plan", "{mb-layer-code.json}", "{mb.py}"), 2, "layer must be"),
    Row("plan-mb-stages-empty", ("apply", "--plan", "{mb-stages-empty.json}", "{mb.py}"), 2, "at least one stage"),
    Row("plan-mb-stages-no-comm", ("apply", "--plan", "{mb-stages-no-comm.json}", "{mb.py}"), 2, "needs a comm stage"),
    Row(
        "plan-mb-stages-not-alternating",
        ("apply", "--plan", "{mb-stages-not-alternating.json}", "{mb.py}"),
        2,
        "alternate",
    ),
    Row(
        "plan-mb-stage-comm-string",
        ("apply", "--plan", "{mb-stage-comm-string.json}", "{mb.py}"),
        2,
        "comm must be bool",
    ),
    Row(
        "plan-mb-statement-line-zero",
        ("apply", "--plan", "{mb-statement-line-zero.json}", "{mb.py}"),
        2,
        "out of range",
    ),
    Row(
        "plan-mb-statement-source-code",
        ("apply", "--plan", "{mb-statement-source-code.json}", "{mb.py}"),
        2,
        "stale plan for MoEDecoderLayer.forward: line 31 no longer reads",
    ),
    Row(
        "plan-mb-statement-beyond-file",
        ("apply", "--plan", "{mb-statement-beyond-file.json}", "{mb.py}"),
        2,
        "stale plan: MoEDecoderLayer.forward: stage statement last_line 100000 is out of range",
    ),
    Row("plan-mb-loop-source", ("apply", "--plan", "{mb-loop-source.json}", "{mb.py}"), 2, "is not its layer loop"),
    Row("plan-mb-unknown-field", ("apply", "--plan", "{mb-unknown-field.json}", "{mb.py}"), 2, "unknown field 'exec'"),
    Row(
        "plan-mb-mode-ge-graph",
        ("apply", "--plan", "{mb-mode-ge-graph.json}", "{mb.py}"),
        2,
        "does not support mode ge-graph",
    ),
    Row(
        "plan-mb-case-other",
        ("apply", "--plan", "{mb-case-other.json}", "{mb.py}"),
        2,
        "a micro-batch plan for case moe-shared-expert, which has no micro-batches",
    ),
    Row(
        "plan-mb-override-tag-quote",
        ("apply", "--plan", "{mb-ok.json}", "--stream-tag", 'a"b', "{mb.py}"),
        2,
        "--stream-tag",
    ),
    Row(
        "plan-mb-with-another-plan",
        ("apply", "--plan", "{mixed.json}", "{mb.py}"),
        2,
        "a prefill-microbatch plan forks the whole model: carry it out alone",
    ),
    # options that reach emitted code
    Row("option-tag-quote", ("apply", *CASE, "--stream-tag", 'a"b', "{good.py}"), 2, "--stream-tag"),
    Row("option-tag-newline", ("apply", *CASE, "--stream-tag", "a\nb", "{good.py}"), 2, "--stream-tag"),
    Row("option-tag-injection", ("apply", *CASE, "--stream-tag", INJECTION, "{good.py}"), 2, "--stream-tag"),
    Row(
        "option-flag-env-injection",
        ("apply", *CASE, "--flag", "env:" + INJECTION, "{good.py}"),
        2,
        "not a valid environment variable name",
    ),
    Row(
        "option-flag-env-space",
        ("apply", *CASE, "--flag", "env:A B", "{good.py}"),
        2,
        "not a valid environment variable name",
    ),
    Row("option-flag-attr-keyword", ("apply", *CASE, "--flag", "attr:class", "{good.py}"), 2, "keyword"),
    Row(
        "option-flag-attr-module-method",
        ("apply", *CASE, "--flag", "attr:forward", "{good.py}"),
        2,
        "nn.Module.forward",
    ),
    Row("option-flag-attr-training", ("apply", *CASE, "--flag", "attr:training", "{good.py}"), 2, "nn.Module.training"),
    Row("option-flag-attr-dunder", ("apply", *CASE, "--flag", "attr:__class__", "{good.py}"), 2, "dunder"),
    Row("option-flag-attr-dotted", ("apply", *CASE, "--flag", "attr:a.b", "{good.py}"), 2, "not a valid identifier"),
    Row(
        "option-start-after-code",
        ("apply", *CASE, "--mode", "ge-graph", "--start-after", "x)+(y", "{good.py}"),
        2,
        "--start-after",
    ),
    Row(
        "option-anchor-newline",
        ("apply", "--case", "moe-shared-expert-phased", "--anchor", "a\nb", "{good.py}"),
        2,
        "--anchor",
    ),
    Row(
        "option-second-group-missing",
        ("apply", "--case", "prefill-microbatch", "--second-comm-group", "nosuch", "{mb.py}"),
        2,
        "never sets self.nosuch",
    ),
    Row(
        "option-allow-rng-reorder-copies",
        ("apply", "--case", "kvcache-offload", "--allow-rng-reorder", "{good.py}"),
        2,
        "--allow-rng-reorder is for cases that move calls onto a side stream",
    ),
    Row(
        "option-second-group-code",
        ("apply", "--case", "prefill-microbatch", "--second-comm-group", "g)\nimport os", "{mb.py}"),
        2,
        "--second-comm-group",
    ),
    Row(
        "option-second-group-module-method",
        ("apply", "--case", "prefill-microbatch", "--second-comm-group", "cuda", "{mb.py}"),
        2,
        "nn.Module.cuda",
    ),
    Row("option-target-code", ("apply", *CASE, "--target", "A.forward;import os", "{good.py}"), 2, "--target"),
    # per-case options a case does not take (Case.add_args): refused, never ignored (#15)
    Row(
        "option-start-after-branches",
        ("apply", "--case", "indexer-prolog", "--mode", "ge-graph", "--start-after", "x", "{good.py}"),
        2,
        "--start-after is for cases with one side branch; indexer-prolog runs several side streams one after another",
    ),
    Row(
        "option-stream-tag-branches",
        ("apply", "--case", "indexer-prolog", "--stream-tag", "x", "{good.py}"),
        2,
        "--stream-tag: indexer-prolog names each of its side streams itself",
    ),
    Row(
        "option-protect-copies",
        ("apply", "--case", "kvcache-offload", "--protect", "clone", "{good.py}"),
        2,
        "--protect is for cases that move calls onto a side stream; kvcache-offload moves buffer copies",
    ),
    Row(
        "option-anchor-with-plan",
        ("apply", "--plan", "{ok.json}", "--anchor", "x", "{good.py}"),
        2,
        "--anchor: a plan file carries its own phase anchors; give --anchor with --case",
    ),
    Row(
        "option-cores-with-plan",
        ("apply", "--plan", "{ok.json}", "--cores", "a2", "{good.py}"),
        2,
        "--cores and --core-limit: a plan file carries its own core budgets",
    ),
    Row(
        "option-core-limit-with-plan",
        ("apply", "--plan", "{ok.json}", "--core-limit", "8/16,16/32", "{good.py}"),
        2,
        "--cores and --core-limit: a plan file carries its own core budgets",
    ),
    Row(
        "option-start-after-with-plan",
        ("apply", "--plan", "{ok.json}", "--mode", "ge-graph", "--start-after", "x", "{good.py}"),
        2,
        "--start-after: a plan file carries its own start gates",
    ),
]


def _fill(arg: str, folder: Path) -> str:
    if arg.startswith("{") and arg.endswith("}"):
        return str(folder / arg[1:-1])
    return arg


def make_files(folder: Path) -> None:
    shutil.copy(EXAMPLES / "deepseek_moe.py", folder / "good.py")
    shutil.copy(EXAMPLES / "microbatch_moe.py", folder / "mb.py")
    (folder / "ok.json").write_text(json.dumps({"candidates": [{"plan": PLAN}]}))
    (folder / "mixed.json").write_text(json.dumps([MB_PLAN, MB_PLAN]))
    for name, content in PLAN_FILES.items():
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))


def snapshot(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every row through the CLI's main() in this process (a row that runs user code is forked
    from the fork server): the exit code and both streams a subprocess would give, without a
    Python and torch start-up per row."""

    def run(row: Row):
        folder = tmp_path_factory.mktemp(row.id)
        make_files(folder)
        before = snapshot(folder)
        result = run_main(*[_fill(a, folder) for a in row.args], cwd=folder)
        return result, before, snapshot(folder)

    return {row.id: run(row) for row in ROWS}


@pytest.mark.slow  # a row may run user code (verify) in a forked child
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_option_or_plan(outcomes, row):
    result, before, after = outcomes[row.id]
    where = f"msrewrite {' '.join(row.args)!r}\nexit {result.returncode}\nstderr: {result.stderr[-1500:]}"
    assert "Traceback" not in result.stderr, where
    assert result.returncode == row.code, where
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("msrewrite: error: ")]
    assert len(errors) == 1, where
    assert row.message in errors[0], where
    assert all(line.startswith("msrewrite: ") for line in lines), where
    assert result.stdout == "", where
    assert after == before, "files changed, added or removed:\n" + where


def test_rows_cover_options_and_plan_json():
    options = {r.id for r in ROWS if r.id.startswith("option-")}
    plans = {r.id for r in ROWS if r.id.startswith("plan-")}
    assert len(options) >= 15 and len(plans) >= 30, (len(options), len(plans))
    for option in ("--stream-tag", "--flag", "--start-after", "--anchor", "--second-comm-group", "--target"):
        assert any(option in r.args for r in ROWS if r.id.startswith("option-")), option


# In process: every plan field refuses hostile values -------------------------------------------
# field -> values that must be refused when put in that field of a valid plan's JSON.
PLAN_FIELD_HOSTILE = {
    "case": HOSTILE_TEXT + ["1x", "Moe"],
    "file": [3, None, ["a"]],
    "function": HOSTILE_TEXT + ["class", "A.class", "1x", "A..b"],
    "side": [[], [None], "abc", [{"first_line": 1}]],
    "fork_line": [0, -1, "1", True, 1.5, None],
    "join_line": [0, -1, "1", False, 2.5, None],
    "side_inputs": [[v] for v in HOSTILE] + ["abc", [3]],
    "side_outputs": [[v] for v in HOSTILE] + [[None]],
    "stream_tag": HOSTILE_TEXT + [3, "é"],
    "flag": ["env:X", [], {"kind": "yaml"}, {"name": INJECTION}, {"kind": "attr", "name": "forward"}],
    "mode": ["tpu", "", 3, None],
    "start_gates": [[{"tensor": v, "anchor": "a"}] for v in HOSTILE if v]
    + [[{"tensor": "x", "anchor": v}] for v in HOSTILE]
    + [[None]],
    "summary": [3, "a\x00b", "a\x1b[31m"],
    "inputs_rebound_before_join": [[v] for v in HOSTILE],
    "outputs_maybe_unbound": [[v] for v in HOSTILE],
    "stream_source": ["global", 3],
    "sync": ["threads", None],
    "phase_anchors": [[v] for v in HOSTILE],
    "case_branch": [v for v in HOSTILE_TEXT if v] + [3, "1x"],
    "non_blocking": ["yes", 1],
    "markers": ["yes", 1, None],
    "placement": ["middle", "routed\nx", 1, None, True],
    "core_limits": [[1, 2], [1, 2, 3, "4"], [-1, 0, 0, 0], "8/16"],
    # a guard is emitted as code: the emitter also requires it to be its `if`'s own condition
    # (tests/test_guards.py::test_guard_that_is_not_the_if_condition_is_refused)
    "guard": [3, None, "a\nb", "self.x is not None"],  # the last: no guard_line
    "guard_line": [-1, "3", True, 5],  # the last: no guard
    "protect_inputs": [[v] for v in HOSTILE] + ["abc", [3]],
    "trust_boundary": [["a\nb"], [3], "abc"],
    "assume_pure": [["a\nb"], [None], "abc"],
    "allow_rng_reorder": ["yes", 1, None],
    "rng_reorder": [3, "a\nb", "a\x00b", ["x"]],
    # main calls hoisted out of the join statement: each needs its lines, its call and a temporary
    # that is a plain identifier, distinct from every other hoist's
    "main_hoists": [
        "abc",
        [None],
        3,
        [{"first_line": 1}],
        [_main_hoist(hoist=None)],
        [_main_hoist(phase=1)],
        [_main_hoist(first_line=0)],
        [_main_hoist(last_line=1)],
        [_main_hoist(source=3)],
        [_main_hoist(source=" ")],
        [_main_hoist(), _main_hoist()],
    ]
    + [[_main_hoist(hoist=v)] for v in HOSTILE]
    + [[_main_hoist(hoist=3)]],
    # emitted as `_ms_runs_as_inlined(self.<attr>, <Class>)`: two identifiers, nothing else
    "inline_guards": ["shared_expert:MLP", [3], ["shared_expert"], ["a:b:c"], ["x.y:MLP"], ["shared_expert:MLP()"]]
    + [[f"{v}:MLP"] for v in HOSTILE]
    + [[f"shared_expert:{v}"] for v in HOSTILE],
}
SIDE_FIELD_HOSTILE = {
    "first_line": [0, "3", True],
    "last_line": [0, "3", None],
    "source": [3, None],
    "hoist": [v for v in HOSTILE if v] + [3],
    "phase": [-1, "0", True],
    "inner_phases": [[-1, 0], ["0"], [True], "01", 3, None],
}
FLAG_FIELD_HOSTILE = {
    "kind": ["yaml", "", 3],
    "name": HOSTILE_TEXT + ["é"],
    "default": ["off", 0, None],
    "max_tokens": [0, -5, "64", True],
    "gate": ["always", "", "tokens<=4", 1, "capture; os.system(1)"],
}


MICROBATCH_FIELD_HOSTILE = {
    "kind": ["overlap", "", 3, None],
    "case": HOSTILE_TEXT + ["1x", "Moe"],
    "file": [3, None, ["a"]],
    "function": HOSTILE_TEXT + ["class", "MoEModel", "MoEModel.__init__", "A.B.forward"],
    "layer": HOSTILE_TEXT + ["MoEDecoderLayer", "MoEDecoderLayer.run"],
    "loop": [
        None,
        "for x in y",
        {"first_line": 1},
        {"first_line": 0, "last_line": 1, "source": "x"},
        {"first_line": 2, "last_line": 1, "source": "x"},
        {"first_line": 1, "last_line": 1, "source": 3},
    ],
    "stages": [
        [],
        None,
        "abc",
        [None],
        [MB_PLAN["stages"][0]],
        [MB_PLAN["stages"][1], MB_PLAN["stages"][1]],
        list(reversed(MB_PLAN["stages"])),
    ],
    "stream_tag": HOSTILE_TEXT + [3, "é"],
    "flag": [
        "env:X",
        [],
        {"kind": "yaml"},
        {"name": INJECTION},
        {"kind": "attr", "name": "forward"},
        {"gate": "capture"},
        {"gate": "decode"},
        {"max_tokens": 8},
    ],
    "mode": ["tpu", "", 3, None],
    "second_group": [v for v in HOSTILE if v] + ["cuda", "training", 3, None],
    "summary": [3, "a\x00b", "a\x1b[31m"],
    "trust_boundary": [["a\nb"], [3], "abc"],
    "assume_pure": [["a\nb"], [None], "abc"],
    "split_args": [[v] for v in HOSTILE] + [[3], [None], "abc"],
    "shared_args": [[v] for v in HOSTILE] + [[3], [None], "abc"],
}
SPAN_FIELD_HOSTILE = {
    "first_line": [0, -1, "3", True, None],
    "last_line": [0, "3", None, False],
    "source": [3, None, ["x"]],
}
STAGE_FIELD_HOSTILE = {
    "comm": ["no", 0, None],
    "statements": [[], None, "abc", [None]],
}


def test_every_microbatch_plan_field_has_hostile_values():
    from msrewrite.plan import MicrobatchPlan, MicrobatchStage, SourceSpan

    assert set(MICROBATCH_FIELD_HOSTILE) == {f.name for f in dataclasses.fields(MicrobatchPlan)}
    assert set(SPAN_FIELD_HOSTILE) == {f.name for f in dataclasses.fields(SourceSpan)}
    assert set(STAGE_FIELD_HOSTILE) == {f.name for f in dataclasses.fields(MicrobatchStage)}


@pytest.mark.parametrize("field", sorted(MICROBATCH_FIELD_HOSTILE))
def test_microbatch_plan_field_refuses_hostile_values(field):
    assert load_plans(json.dumps(MB_PLAN))  # the base plan is fine
    for value in MICROBATCH_FIELD_HOSTILE[field]:
        with pytest.raises(ValueError) as info:
            load_plans(json.dumps(_mb_with(**{field: value})))
        assert "\n" not in str(info.value), (field, value)


def test_nested_microbatch_plan_fields_refuse_hostile_values():
    for key, values in SPAN_FIELD_HOSTILE.items():
        for value in values:
            for changed in (_mb_with(stages=_mb_statement(**{key: value})), _mb_with(**{f"loop.{key}": value})):
                with pytest.raises(ValueError):
                    load_plans(json.dumps(changed))
    for key, values in STAGE_FIELD_HOSTILE.items():
        for value in values:
            stages = copy.deepcopy(MB_PLAN["stages"])
            stages[0][key] = value
            with pytest.raises(ValueError):
                load_plans(json.dumps(_mb_with(stages=stages)))


def test_every_plan_field_has_hostile_values():
    """A new field in the plan contract must come with the values it refuses."""
    assert set(PLAN_FIELD_HOSTILE) == {f.name for f in dataclasses.fields(OverlapPlan)}
    assert set(SIDE_FIELD_HOSTILE) == {f.name for f in dataclasses.fields(SideStatement)}
    assert set(FLAG_FIELD_HOSTILE) == {f.name for f in dataclasses.fields(FlagSpec)}
    assert {f.name for f in dataclasses.fields(StartGate)} == {"tensor", "anchor"}


@pytest.mark.parametrize("field", sorted(PLAN_FIELD_HOSTILE))
def test_plan_field_refuses_hostile_values(field):
    assert load_plans(json.dumps(PLAN))  # the base plan is fine
    for value in PLAN_FIELD_HOSTILE[field]:
        with pytest.raises(ValueError) as info:
            load_plans(json.dumps(_with(**{field: value})))
        assert "\n" not in str(info.value), (field, value)


@pytest.mark.parametrize("part, table", [("side", SIDE_FIELD_HOSTILE), ("flag", FLAG_FIELD_HOSTILE)])
def test_nested_plan_fields_refuse_hostile_values(part, table):
    for key, values in table.items():
        for value in values:
            changed = _with(side=_side(**{key: value})) if part == "side" else _with(**{f"flag.{key}": value})
            with pytest.raises(ValueError):
                load_plans(json.dumps(changed))


def test_a_plan_file_without_a_stream_tag_reads_as_before_and_code_must_name_one():
    """Plan files may omit stream_tag (optional since the first schema) and get shared_expert;
    a plan made in code has no default tag to inherit from a case it is not."""
    without = {k: v for k, v in PLAN.items() if k != "stream_tag"}
    plan = load_plans(json.dumps(without))[0]
    assert plan.stream_tag == "shared_expert"
    assert load_plans(json.dumps(_with(stream_tag="side")))[0].stream_tag == "side"
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(OverlapPlan) if f.name != "stream_tag"}
    with pytest.raises(TypeError, match="stream_tag"):
        OverlapPlan(**fields)


def test_plans_built_in_code_are_checked_too():
    """Not only JSON: a plan made by a case (or by a bug) with a hostile value cannot exist."""
    plan = load_plans(json.dumps(PLAN))[0]
    for value in HOSTILE_TEXT:
        with pytest.raises(ValueError):
            plan.with_changes(stream_tag=value)
        with pytest.raises(ValueError):
            plan.with_changes(side_outputs=(value,))
        with pytest.raises(ValueError):
            FlagSpec(kind="env", name=value)
    for value in HOSTILE:
        with pytest.raises(ValueError):
            FlagSpec(kind="attr", name=value)
        with pytest.raises(ValueError):
            StartGate("x", value)


def test_validators_accept_the_names_real_code_uses():
    assert validate.identifier("hidden_states", "x") == "hidden_states"
    assert validate.identifier("隐藏", "x") == "隐藏"  # source names may be any Python identifier
    assert validate.stream_tag("11") == "11"  # torchair's own tags are digits
    assert validate.env_name("ENABLE_MOE_SHARED_EXPERT_STREAM", "x")
    assert validate.attribute("enable_multi_stream", "x")
    assert validate.qualified_name("Outer.Inner.__call__", "x")
    assert validate.case_name("moe-shared-expert") and validate.case_name("q_quant")
    for value in ("a", 'a"b', "a'b", "a\\b", "tag\u2028x", "é"):
        assert ast.literal_eval(validate.literal(value)) == value
    assert validate.literal("shared_expert") == '"shared_expert"'


def test_nn_module_attribute_list_matches_torch():
    torch = pytest.importorskip("torch")
    members = set(dir(torch.nn.Module)) | set(vars(torch.nn.Module()))
    missing = {m for m in members if not (m.startswith("__") and m.endswith("__"))} - validate.NN_MODULE_ATTRIBUTES
    assert not missing, f"add to validate.NN_MODULE_ATTRIBUTES: {sorted(missing)}"


def test_microbatch_edit_checks_its_own_values():
    from msrewrite.analyze.microbatch import microbatch_plan
    from msrewrite.emit.microbatch import microbatch_edit
    from msrewrite.errors import BadInput
    from msrewrite.load import load

    module = load(EXAMPLES / "microbatch_moe.py").module
    flag = FlagSpec(name="ENABLE_PREFILL_MICROBATCH")

    def plan(**kwargs):
        return microbatch_plan(module, case="prefill-microbatch", path=None, mode="eager", flag=flag, **kwargs)

    with pytest.raises(BadInput, match="--stream-tag"):
        plan(stream_tag='x")\nimport os\n("')
    for group in ("nosuch", "forward", "a b"):
        with pytest.raises(BadInput):
            plan(second_group=group)
    good = plan(second_group="ep_group_mb1")
    assert "group=self.ep_group_mb1" in microbatch_edit(module, good).code
    # the emitter takes no value on trust either: a plan is validated on construction
    for value in HOSTILE_TEXT:
        with pytest.raises(ValueError):
            good.with_changes(stream_tag=value)
        with pytest.raises(ValueError):
            good.with_changes(second_group=value or "forward")  # "" is no second group
    # and a group the layer does not set is refused by the emitter, not emitted
    with pytest.raises(BadInput, match="never sets self.other_group"):
        microbatch_edit(module, good.with_changes(second_group="other_group"))


# Scans of the emitter ---------------------------------------------------------------------------
EMITTER = sorted(
    [
        *(ROOT / "msrewrite" / "emit").glob("*.py"),
        *(ROOT / "msrewrite" / "cases").glob("*.py"),
        *(ROOT / "msrewrite" / "codemods").glob("*.py"),
    ]
)


def _hand_quoted(tree: ast.AST) -> list[int]:
    """Lines of f-strings that paste a value between quotes (`f'"{x}"'`) instead of literal(x)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.JoinedStr):
            continue
        parts = node.values
        for before, value, after in zip(parts, parts[1:], parts[2:], strict=False):  # overlapping triples
            if (
                isinstance(value, ast.FormattedValue)
                and isinstance(before, ast.Constant)
                and isinstance(after, ast.Constant)
                and str(before.value)[-1:] in "\"'"
                and str(after.value)[:1] in "\"'"
            ):
                lines.append(node.lineno)
    return lines


def test_emitter_never_quotes_a_value_by_hand():
    offenders = {}
    for path in EMITTER:
        lines = _hand_quoted(ast.parse(path.read_text()))
        if lines:
            offenders[path.relative_to(ROOT).as_posix()] = lines
    assert not offenders, f"use validate.literal(...) for string literals in emitted code: {offenders}"
    # the scan itself finds the pattern it forbids
    assert _hand_quoted(ast.parse("f'_ms_side_stream(\"{tag}\")'"))


def test_emission_context_is_built_only_from_the_validated_plan():
    """function_edit._context builds the strategies' Context: every user value in it comes from `plan`
    (an OverlapPlan, validated on construction); the other inputs are names read from the source
    or made by the emitter."""
    tree = ast.parse((ROOT / "msrewrite" / "emit" / "function_edit.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Context"]
    assert len(calls) == 1
    # snapshots: plan.protect_inputs (validated) mapped to names the emitter made unique
    # phase_gate, framework_imports: emit/frameworks.py, from plan.flag (kind and gate are enums) with
    # fixed templates and the function's own parameter names
    internal = {
        "init",
        "config_param",
        "init_sets_flag",
        "gates",
        "names",
        "what",
        "list",
        "bool",
        "snapshots",
        "n",
        "phase_gate",
        "framework_imports",
        "model_stream",
    }
    # model_stream: the name of a `self.<attr>` stream the class's __init__ assigns (read from the source)
    for keyword in calls[0].keywords:
        roots = {n.id for n in ast.walk(keyword.value) if isinstance(n, ast.Name)}
        assert roots <= internal | {"plan"}, (keyword.arg, roots - internal)
    # the start gates are the plan's own (validated) names, or names the emitter made unique
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_start_gates")
    source = ast.get_source_segment((ROOT / "msrewrite" / "emit" / "function_edit.py").read_text(), function)
    assert "gates.append((side_name, gate.tensor, gate.anchor))" in source
    assert "for gate in plan.start_gates:" in source
