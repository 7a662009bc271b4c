"""Every case's declared examples, Fixit-style: each VALID snippet is edited by `apply --case` (and
the edit verifies, where the snippet brings its make()), each INVALID one is refused with the
reason the case declares; docs/cases.md shows one of each, as golden/regen.py writes it."""

from __future__ import annotations

import contextlib
import io

import pytest

from helpers import ROOT, load_regen
from msrewrite.cases import all_cases

VALID = [(case, i) for case in all_cases() for i in range(len(case.valid))]
INVALID = [(case, i) for case in all_cases() for i in range(len(case.invalid))]


def _apply(case, source: str, tmp_path, args: tuple[str, ...] = ()) -> tuple[int, str, str, object]:
    """`msrewrite apply --case CASE --mode M [ARGS] FILE` in this process: (exit code, stdout, stderr, file)."""
    from msrewrite.cli import main

    path = tmp_path / "model.py"
    path.write_text(source)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as done:
        main(["apply", "--case", case.name, "--mode", case.modes[0], *args, "-i", str(path)])
    return int(done.value.code or 0), out.getvalue(), err.getvalue(), path


def test_every_case_declares_examples():
    for case in all_cases():
        assert case.valid and case.invalid, f"{case.name} declares no VALID or no INVALID snippet"
        assert all(item.reason for item in case.invalid), case.name


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("case,index", VALID, ids=[f"{c.name}-{i}" for c, i in VALID])
def test_valid_snippet_is_edited_and_the_edit_verifies(case, index, tmp_path):
    from msrewrite.verify import verify_files

    source = case.valid[index]
    code, _out, err, path = _apply(case, source, tmp_path)
    assert code == 0, err
    edited = path.read_text()
    assert edited != source and f"msrewrite({case.name}" in edited
    compile(edited, str(path), "exec")
    if "\ndef make(" not in source:  # afd-overlap, prefill-microbatch: their gloo suites verify them
        assert case.sync == "async-comm" or case.analysis == "microbatch", f"{case.name}: VALID needs a make()"
        return
    original = tmp_path / "original.py"
    original.write_text(source)
    result = verify_files(path, original=original, inputs=0, train=False)
    assert result.ok and not result.findings, result.problems


@pytest.mark.parametrize("case,index", INVALID, ids=[f"{c.name}-{i}" for c, i in INVALID])
def test_invalid_snippet_is_refused_with_its_reason(case, index, tmp_path):
    invalid = case.invalid[index]
    code, out, err, path = _apply(case, invalid.source, tmp_path, invalid.args)
    assert code == 1 and not out, err
    assert invalid.reason in err, err
    assert path.read_text() == invalid.source


def test_readme_shows_one_valid_and_one_invalid_snippet_per_case():
    regen = load_regen()
    readme = (ROOT / "docs" / "cases.md").read_text(encoding="utf-8")
    assert regen.readme_with_examples(readme) == readme, "docs/cases.md's case examples are stale: run golden/regen.py"
    for case in all_cases():
        assert f"<code>{case.name}</code>: one it edits, one it refuses" in readme
