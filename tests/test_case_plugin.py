"""A new case is one file: a toy case written into a temp folder appended to msrewrite.cases.__path__
is listed by `msrewrite cases`, applied by `apply --case`, golden-tested by golden/regen.py's
machinery and mutant-tested by tests/test_mutants.py's, with no other file touched."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys

import pytest

import msrewrite.cases
from helpers import EXAMPLES, load_regen

TOY_CASE = '''"""toy-side: a side projection on a side stream (a test's case, one file)."""

import dataclasses

from msrewrite import validate
from msrewrite.cases._base import CaseOption, SeedCase
from msrewrite.cliargs import Option

# the toy's own option, declared here alone: its side stream's lane (the stream tag toy_LANE)
LANE = CaseOption(
    "--toy-lane", "--toy-lane is for toy-side; {case} has no toy lanes",
    (("toy_lane", str | None, Option(None, "--toy-lane", help="toy-side: the side stream's lane (tag toy_LANE).")),),
    check=validate.identifier,
    settle=lambda options: dataclasses.replace(options, stream_tag=f"toy_{options.extra['toy_lane']}"),
)

CASE = SeedCase(
    name="toy-side",
    summary="toy: the side projection on a side stream next to the main projection",
    modes=("eager", "cuda"),
    is_seed=lambda callee: callee.split(".")[0] == "side_proj",
    stream_tag="toy_side",
    flag_name="ENABLE_TOY_SIDE_STREAM",
    what=("the side projection", "the main projection"),
    golden_examples=("toy_block",),
    mutant_modes=("eager",),
    mutant_examples=("toy_block",),
    options=(LANE,),
)
'''

TOY_MODEL = """import torch
from torch import nn


class ToyBlock(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.main_proj = nn.Linear(hidden, hidden)
        self.side_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        side = self.side_proj(x)
        main = torch.relu(self.main_proj(x))
        return main + side


def make():
    torch.manual_seed(0)
    return ToyBlock().eval(), (torch.randn(3, 16),)
"""


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy case's file in a folder of its own on the cases' path, and a root with its example."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "toy_side.py").write_text(TOY_CASE)
    monkeypatch.setattr(msrewrite.cases, "__path__", [*msrewrite.cases.__path__, str(folder)])
    root = tmp_path / "root"
    (root / "examples").mkdir(parents=True)
    (root / "examples" / "toy_block.py").write_text(TOY_MODEL)
    yield root
    sys.modules.pop("msrewrite.cases.toy_side", None)


def _cli(*argv: str) -> tuple[int, str, str]:
    from msrewrite.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
        except SystemExit as exc:
            return int(exc.code or 0), out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


def _errors(err: str) -> list[str]:
    """The error lines of stderr (the rest are notes such as the mode chosen)."""
    return [line for line in err.splitlines() if "error" in line]


@pytest.mark.slow  # runs the model through verify
def test_a_case_in_one_new_file_is_listed_applied_golden_and_mutant_tested(toy, tmp_path):
    from msrewrite.cases import all_cases

    names = [case.name for case in all_cases()]
    assert names[-1] == "toy-side" and names.index("moe-shared-expert") == 0  # listed last (default order)
    code, out, _err = _cli("cases")
    assert code == 0 and "toy-side" in out and "the side projection on a side stream" in out

    model = toy / "examples" / "toy_block.py"
    code, diff, err = _cli("apply", "--case", "toy-side", "--mode", "eager", str(model))
    assert code == 0, err
    assert "toy_side_stream.wait_stream(current_stream)" in diff and "ENABLE_TOY_SIDE_STREAM" in diff
    code, _out, err = _cli("apply", "--case", "toy-side", "--mode", "eager", "--anchor", "main", str(model))
    assert code == 2 and "--anchor is for phased cases; toy-side runs its side branch in one piece" in err

    # goldens: regen's machinery writes them under the toy root, --check is then clean
    regen = load_regen()
    assert regen.golden_examples()["toy-side"] == ("toy_block",)
    assert regen.main(["--only", "toy-side"], root=toy) == 0
    assert regen.main(["--check", "--only", "toy-side"], root=toy) == 0
    goldens = sorted(p.relative_to(toy).as_posix() for p in (toy / "golden").rglob("*.*"))
    assert goldens == [
        f"golden/toy-side/{mode}/toy_block.{ext}" for mode in ("cuda", "eager") for ext in ("diff", "py")
    ]
    golden_py, _ = regen.golden_paths("toy-side", "eager", "toy_block", root=toy)
    assert golden_py.read_text() == regen.render("toy-side", "eager", "toy_block", root=toy)[0]

    # mutants: test_mutants' operators for the toy's sync, run through verify against the toy model
    import test_mutants

    toy_mutants = test_mutants.mutants([c for c in all_cases() if c.name == "toy-side"])
    assert list(toy_mutants) == [("toy-side", "eager")]
    clean = test_mutants.run_verify(tmp_path, "toy_block", golden_py.read_text(), examples=toy / "examples")
    assert clean.ok and not clean.findings, clean.problems
    for mutant in toy_mutants[("toy-side", "eager")]:
        text = mutant.mutate(golden_py.read_text())
        assert text != golden_py.read_text()
        result = test_mutants.run_verify(tmp_path, "toy_block", text, examples=toy / "examples")
        assert mutant.kind in {f.kind for f in result.findings}, (mutant.name, result.problems)


@pytest.mark.slow  # runs the model through verify
def test_the_toy_case_s_own_option_is_parsed_for_it_alone_listed_and_refused_elsewhere(toy):
    """An option declared in the case's file alone: `apply --case toy-side` parses it, its value
    passes its validator and changes the edit (and the edit verifies); --help lists it; a built-in
    case refuses it in one line, as does a plan file."""
    from msrewrite.cases._base import cli_params

    assert "toy_lane" in [name for name, _kind, _spec in cli_params(["--case", "toy-side"])]
    assert "toy_lane" not in [name for name, _kind, _spec in cli_params(["--case", "moe-shared-expert"])]
    model = toy / "examples" / "toy_block.py"
    code, diff, err = _cli(
        "apply", "--case", "toy-side", "--mode", "eager", "--toy-lane", "fast", "--verify", "-q", str(model)
    )
    assert code == 0, err
    assert "toy_fast_stream.wait_stream(current_stream)" in diff and "toy_side_stream.wait_stream" not in diff
    code, _out, err = _cli("apply", "--case", "toy-side", "--mode", "eager", "--toy-lane", "fa st", str(model))
    assert code == 2 and _errors(err) == ["msrewrite: error: --toy-lane 'fa st' is not a valid identifier"], err
    code, _out, err = _cli(
        "apply",
        "--case",
        "moe-shared-expert",
        "--mode",
        "eager",
        "--toy-lane",
        "fast",
        str(EXAMPLES / "deepseek_moe.py"),
    )
    assert code == 2 and _errors(err) == [
        "msrewrite: error: --toy-lane is for toy-side; moe-shared-expert has no toy lanes"
    ]
    code, plans, err = _cli("suggest", "--static", "--json", str(EXAMPLES / "deepseek_moe.py"))
    assert code == 0 and '"case": "moe-shared-expert"' in plans, err
    plan = toy / "plan.json"
    plan.write_text(plans)
    code, _out, err = _cli("apply", "--plan", str(plan), "--toy-lane", "fast", str(EXAMPLES / "deepseek_moe.py"))
    assert code == 2 and len(_errors(err)) == 1 and "--toy-lane is an option of the case" in err, err
    code, out, _err = _cli("apply", "--help")
    assert code == 0 and "--toy-lane" in out and "--start-after" in out


def _toy_codemod(toy, folder, *options: str) -> subprocess.CompletedProcess:
    """libcst's codemod runner in a fresh process, the toy case's folder on msrewrite.cases' path
    (a sitecustomize on PYTHONPATH: its worker processes get it too)."""
    site = toy / "site"
    site.mkdir(exist_ok=True)
    plugins = [p for p in msrewrite.cases.__path__ if p.endswith("plugins")]
    (site / "sitecustomize.py").write_text(f"import msrewrite.cases\nmsrewrite.cases.__path__.extend({plugins!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "libcst.tool",
            "codemod",
            "--no-format",
            "--hide-progress",
            "-x",
            "msrewrite.codemods.any_case.AnyCase",
            "-j",
            "2",
            *options,
            str(folder),
        ],
        capture_output=True,
        text=True,
        cwd=toy,
        env=env,
        timeout=300,
    )


@pytest.mark.slow  # runs libcst's codemod runner in a subprocess
@pytest.mark.parametrize("lane", [(), ("--toy-lane", "fast")], ids=["default", "own-option"])
def test_the_toy_case_runs_as_a_libcst_codemod_with_its_own_option(toy, lane):
    """`python -m libcst.tool codemod ... AnyCase --case toy-side FOLDER` edits the folder as
    `msrewrite apply` does (its own option included), and skips a file with nothing to do; a
    built-in case refuses the toy's option there too."""
    folder = toy / "models"
    folder.mkdir()
    model = toy / "examples" / "toy_block.py"
    shutil.copy(model, folder)
    shutil.copy(EXAMPLES / "deepseek_moe.py", folder)  # no side projection: skipped
    done = _toy_codemod(toy, folder, "--case", "toy-side", "--mode", "eager", *lane)
    assert done.returncode == 0, done.stderr
    applied = toy / "applied.py"
    shutil.copy(model, applied)
    code, _out, err = _cli("apply", "--case", "toy-side", "--mode", "eager", *lane, "-i", str(applied))
    assert code == 0, err
    assert (folder / "toy_block.py").read_text() == applied.read_text() != model.read_text()
    assert ("toy_fast_stream" in applied.read_text()) == bool(lane)
    assert (folder / "deepseek_moe.py").read_text() == (EXAMPLES / "deepseek_moe.py").read_text()
    assert f"Skipped codemodding {folder / 'deepseek_moe.py'}" in done.stderr
    if lane:
        refused = _toy_codemod(toy, folder, "--case", "moe-shared-expert", *lane)
        assert "--toy-lane is for toy-side; moe-shared-expert has no toy lanes" in refused.stderr
        assert (folder / "deepseek_moe.py").read_text() == (EXAMPLES / "deepseek_moe.py").read_text()


def test_the_real_cases_are_untouched_by_the_toy(toy):
    from msrewrite.cases import get_case

    assert get_case("toy-side") is not None
    shutil.rmtree(toy)
    assert get_case("moe-shared-expert").name == "moe-shared-expert"
    assert get_case("no-such-case") is None


def test_apply_parses_the_per_case_options_the_cases_declare():
    """apply's per-case options come from the declarations (cliargs.Declared in cli.apply), in
    --help's order between --stream-tag and --source-path, and each kind takes only its own."""
    from msrewrite.cases import get_case
    from msrewrite.cases._base import ANCHOR, CASE_OPTIONS, CLI_OPTIONS, CORES, SECOND_COMM_GROUP, cli_params
    from msrewrite.cliargs import COMMANDS, params

    names = [name for name, _kind, _spec in params(COMMANDS["apply"])]
    declared = [name for name, _kind, _spec in cli_params()]
    start = names.index("stream_tag") + 1
    assert names[start : start + len(declared)] == declared and names[start + len(declared)] == "source_path"
    # every option a case may refuse is apply's: a per-case one declared here, or --stream-tag (cli.py's own)
    assert {o.name for o in CASE_OPTIONS} <= {o.name for o in CLI_OPTIONS} | {"--stream-tag"}
    assert ANCHOR in get_case("moe-shared-expert-phased").add_args()
    assert ANCHOR not in get_case("moe-shared-expert").add_args()
    assert CORES in get_case("attn-moe-limit-core").add_args()
    assert SECOND_COMM_GROUP in get_case("prefill-microbatch").add_args()


def test_case_records_are_frozen_keyword_only_and_checked():
    """Cases are records (cheaper to import than dataclasses): the same guarantees still hold."""
    import dataclasses

    from msrewrite.cases._base import CoreLimitCase, SeedCase

    fields = dict(name="t", summary="s", modes=("eager",), is_seed=lambda _callee: False, stream_tag="t", flag_name="F")
    case = CoreLimitCase(**fields)
    assert case.core_limits is True and case.sync == "wait_stream"  # a kind's default, then the base's
    assert "describe" in case.__dict__  # a function default lives on the instance: not bound as a method
    with pytest.raises(dataclasses.FrozenInstanceError):
        case.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected field.*nosuch"):
        SeedCase(**fields, nosuch=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing field.*flag_name"):
        SeedCase(**{k: v for k, v in fields.items() if k != "flag_name"})  # type: ignore[call-arg]
    changed = case.replace(phased=True)
    assert type(changed) is CoreLimitCase and changed.phased and not case.phased and changed.name == "t"
    assert case != CoreLimitCase(**fields)  # identity, not field equality
