"""Byte-for-byte golden tests: every case x mode x example model (see golden/regen.py)."""

from __future__ import annotations

import pytest

from conftest import load_regen

regen = load_regen()

PARAMS = [
    (case, mode, example)
    for case, examples in regen.GOLDEN_EXAMPLES.items()
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
    """Applying the case to its own output finds nothing to do."""
    from msrewrite.cases import Options, find_targets
    from msrewrite.codemods import get_case
    from msrewrite.load import load

    expected_py, _ = regen.golden_paths(case, mode, example)
    src = load(expected_py)
    targets = find_targets(get_case(case), expected_py, src.module, Options(mode=mode))
    assert targets and all(t.applied and t.plan is None for t in targets)
