"""msrewrite's cases as real libcst codemods: `python -m libcst.tool codemod` over a folder makes,
file by file, the edit `msrewrite apply --case` makes, and skips the files with nothing to do."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import EXAMPLES, ROOT, run_cli
from msrewrite.cases import all_cases

CASES = [case for case in all_cases() if case.golden_examples]


def _codemod(command: str, folder: Path, *options: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "libcst.tool",
            "codemod",
            "--no-format",
            "--hide-progress",
            command,
            "-j",
            "2",
            *options,
            str(folder),
        ],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def _apply(case: str, mode: str, path: Path) -> str | None:
    """What `msrewrite apply --case CASE --mode MODE` writes for `path` (its case_steps), or None
    when it has nothing to do."""
    from msrewrite.cases import require_case
    from msrewrite.commands.apply import case_steps
    from msrewrite.errors import NothingToDo
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    src = load(path)
    try:
        steps = case_steps(  # apply's default --protect auto, as the codemod has
            path,
            src.text,
            src.module,
            case,
            mode,
            None,
            FlagSpec(name=require_case(case).flag_name),
            None,
            protect="auto",
        )
    except NothingToDo:
        return None
    return steps[-1].new


def _examples_folder(tmp_path: Path) -> Path:
    """Every case's golden examples in one folder (each case applies to some and skips the rest)."""
    folder = tmp_path / "models"
    folder.mkdir()
    for case in CASES:
        for example in case.golden_examples:
            shutil.copy(EXAMPLES / f"{example}.py", folder / f"{example}.py")
    return folder


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_codemod_over_a_folder_equals_apply_file_by_file(tmp_path, case):
    folder = _examples_folder(tmp_path)
    module = case.name.replace("-", "_")
    command = f"msrewrite.codemods.{module}.{''.join(p.capitalize() for p in case.name.split('-'))}"
    mode = case.modes[0]
    done = _codemod(command, folder, "-x", "--mode", mode, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    edited = 0
    for path in sorted(folder.glob("*.py")):
        original = (EXAMPLES / path.name).read_text()
        expected = _apply(case.name, mode, EXAMPLES / path.name)
        if expected is None:  # nothing to do for apply: the codemod skipped it, untouched
            assert path.read_text() == original, path.name
            assert f"Skipped codemodding {path}" in done.stderr
        else:
            assert path.read_text() == expected, path.name
            edited += 1
    assert edited >= len(case.golden_examples)


@pytest.mark.slow  # starts a process or runs verify
def test_the_repo_config_resolves_the_short_command_and_any_case_takes_case_options(tmp_path):
    """In this checkout (.libcst.codemod.yaml lists msrewrite.codemods) `module.Class` is enough;
    AnyCase runs the case --case names, with that case's options, and a case refuses an option it
    does not take as apply does (a warning and the file skipped, never the option ignored)."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(EXAMPLES / "longcat_layer.py", folder)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "libcst.tool",
            "codemod",
            "--no-format",
            "--hide-progress",
            "any_case.AnyCase",
            "-j",
            "1",
            "--case",
            "attn-moe-limit-core",
            "--mode",
            "eager",
            "--cores",
            "a2",
            str(folder),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    applied = run_cli(
        "apply",
        "--case",
        "attn-moe-limit-core",
        "--mode",
        "eager",
        "--cores",
        "a2",
        "-i",
        str(shutil.copy(EXAMPLES / "longcat_layer.py", tmp_path / "longcat_layer.py")),
    )
    assert applied.returncode == 0, applied.stderr
    assert (folder / "longcat_layer.py").read_text() == (tmp_path / "longcat_layer.py").read_text()

    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(EXAMPLES / "deepseek_moe.py", again)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "libcst.tool",
            "codemod",
            "--no-format",
            "--hide-progress",
            "any_case.AnyCase",
            "-j",
            "1",
            "--case",
            "moe-shared-expert",
            "--anchor",
            "x",
            str(again),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert "--anchor is for phased cases; moe-shared-expert runs its side branch in one piece" in refused.stderr
    assert (again / "deepseek_moe.py").read_text() == (EXAMPLES / "deepseek_moe.py").read_text()
