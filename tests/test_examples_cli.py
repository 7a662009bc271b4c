"""Every bundled example traces with `msrewrite suggest` and proves its case with `apply --verify`,
from the command line as a new user runs them (afd and microbatch start their own gloo group).
Both commands run user code, so helpers.run_main forks them from the fork server: the same
`python -m msrewrite` run without a Python start-up and an `import torch` per call
(tests/test_forkserver.py compares the two)."""

from __future__ import annotations

import pytest

from helpers import EXAMPLES, load_regen, run_main

pytestmark = pytest.mark.slow

CASE_OF = {}
for _case, _examples in load_regen().golden_examples().items():
    for _example in _examples:
        CASE_OF.setdefault(_example, _case)


def test_every_example_has_a_case():
    assert sorted(CASE_OF) == sorted(p.stem for p in EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("example", sorted(CASE_OF))
def test_example_traces_and_verifies(example, tmp_path):
    path = EXAMPLES / f"{example}.py"
    traced = run_main("suggest", str(path), cwd=tmp_path)
    assert traced.returncode in (0, 1), traced.stderr
    assert "error" not in traced.stderr and "static" not in traced.stderr, traced.stderr
    proved = run_main("apply", "--case", CASE_OF[example], "--verify", str(path), cwd=tmp_path)
    assert proved.returncode == 0, proved.stderr
    # exactly; micro-batches within float rounding of each tensor's scale (smaller GEMMs round differently)
    how = "within atol=1e-06, rtol=1e-05 (atol relative" if CASE_OF[example] == "prefill-microbatch" else "exactly"
    assert f"OK: outputs equal {how}" in proved.stderr, proved.stderr
    assert proved.stdout.startswith("--- a/")
    assert list(tmp_path.iterdir()) == []
