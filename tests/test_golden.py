"""Byte-for-byte golden tests: every case x mode x example model (see golden/regen.py)."""

from __future__ import annotations

import pytest

from helpers import load_regen

regen = load_regen()

PARAMS = [
    (case, mode, example)
    for case, examples in regen.golden_examples().items()
    for mode in regen.golden_modes(case)
    for example in examples
]


@pytest.mark.parametrize("case,mode,example", PARAMS, ids=["-".join(p) for p in PARAMS])
def test_golden_output_and_diff(case, mode, example):
    new, diff = regen.render(case, mode, example)
    expected_py, expected_diff = regen.golden_paths(case, mode, example)
    assert expected_py.exists(), f"missing {expected_py}; run python golden/regen.py"
    assert new == expected_py.read_text(encoding="utf-8"), "rewritten source differs from golden"
    assert diff == expected_diff.read_text(encoding="utf-8"), "diff differs from golden"
    compile(new, str(expected_py), "exec")


@pytest.mark.parametrize("case,mode,example", PARAMS, ids=["-".join(p) for p in PARAMS])
def test_golden_is_idempotent(case, mode, example):
    """Applying the case to its own output finds nothing to do, and says it was already applied."""
    from msrewrite.cases import get_case
    from msrewrite.commands.apply import case_steps
    from msrewrite.errors import NothingToDo
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    expected_py, _ = regen.golden_paths(case, mode, example)
    src = load(expected_py)
    with pytest.raises(NothingToDo, match="already applied"):
        case_steps(expected_py, src.text, src.module, case, mode, None, FlagSpec(name=get_case(case).flag_name), None)


@pytest.mark.slow  # starts a process or runs verify
@pytest.mark.parametrize("case,mode,example", PARAMS, ids=["-".join(p) for p in PARAMS])
def test_golden_diff_applies_to_a_pristine_copy(tmp_path, case, mode, example):
    """The expected diff is what users get from `apply`; it must apply with git apply and patch."""
    import shutil
    import subprocess

    from helpers import EXAMPLES

    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLES / f"{example}.py", tmp_path / "examples" / f"{example}.py")
    _, diff = regen.golden_paths(case, mode, example)
    subprocess.run(["git", "apply", "--check", str(diff)], cwd=tmp_path, check=True, capture_output=True)
    subprocess.run(["patch", "-p1", "-s", "-i", str(diff)], cwd=tmp_path, check=True, capture_output=True)
    expected, _ = regen.golden_paths(case, mode, example)
    assert (tmp_path / "examples" / f"{example}.py").read_text() == expected.read_text()


# Goldens of a case's own option (golden/regen.py OPTION_GOLDENS): `--side routed` -----------------
OPTION_PARAMS = regen.option_goldens()
OPTION_IDS = ["-".join(p) for p in OPTION_PARAMS]


@pytest.mark.parametrize("case,mode,example,variant", OPTION_PARAMS, ids=OPTION_IDS)
def test_option_golden_output_and_diff(case, mode, example, variant):
    new, diff = regen.render(case, mode, example, variant=variant)
    expected_py, expected_diff = regen.golden_paths(case, mode, example, variant=variant)
    assert expected_py.exists(), f"missing {expected_py}; run python golden/regen.py"
    assert new == expected_py.read_text(encoding="utf-8"), "rewritten source differs from golden"
    assert diff == expected_diff.read_text(encoding="utf-8"), "diff differs from golden"
    compile(new, str(expected_py), "exec")
    # each variant's form differs from the default one (the option is not ignored)
    assert new != regen.golden_paths(case, mode, example)[0].read_text(encoding="utf-8")


@pytest.mark.parametrize("case,mode,example,variant", OPTION_PARAMS, ids=OPTION_IDS)
def test_option_golden_is_idempotent(case, mode, example, variant):
    from msrewrite.cases import get_case
    from msrewrite.commands.apply import case_steps
    from msrewrite.errors import NothingToDo
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    expected_py, _ = regen.golden_paths(case, mode, example, variant=variant)
    src = load(expected_py)
    extra = regen.option_extra(case, variant)
    with pytest.raises(NothingToDo, match="already applied"):
        flag = FlagSpec(name=get_case(case).flag_name)
        case_steps(expected_py, src.text, src.module, case, mode, None, flag, None, extra=extra)


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("case,mode,example,variant", OPTION_PARAMS, ids=OPTION_IDS)
def test_option_golden_diff_applies_to_a_pristine_copy(tmp_path, case, mode, example, variant):
    import shutil
    import subprocess

    from helpers import EXAMPLES

    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLES / f"{example}.py", tmp_path / "examples" / f"{example}.py")
    expected, diff = regen.golden_paths(case, mode, example, variant=variant)
    subprocess.run(["git", "apply", "--check", str(diff)], cwd=tmp_path, check=True, capture_output=True)
    subprocess.run(["patch", "-p1", "-s", "-i", str(diff)], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "examples" / f"{example}.py").read_text() == expected.read_text()
