"""Summaries from installed packages' source (issue 10, item 3), read without importing.

tests/fixtures/pkg_moe.py takes its routed experts from tests/fixtures/srcpkg/fakeserve, a small
package reached through `__init__.py` re-exports and relative imports. With `--source-path` its
classes are summarized: a pure one lets the edit through (and verify proves it), one that writes
its input or dispatches through a method picked at run time is refused, naming what it does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from msrewrite.analyze import packages
from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FIXTURES = Path(__file__).parent / "fixtures"
SOURCES = FIXTURES / "srcpkg"
MODEL = (FIXTURES / "pkg_moe.py").read_text()


@pytest.fixture
def source_path():
    packages.set_source_path([SOURCES])
    yield
    packages.set_source_path([])


def edit(tmp_path: Path, source: str):
    original = tmp_path / "pkg_moe.py"
    original.write_text(source.replace('Path(__file__).resolve().parent / "srcpkg"', repr(str(SOURCES))))
    src = load(original)
    steps = case_steps(
        original,
        src.text,
        src.module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )
    edited = tmp_path / "pkg_moe_ms.py"
    edited.write_text(steps[-1].new)
    return steps[-1].plans[0], edited, original


def refusal(tmp_path: Path, source: str) -> str:
    with pytest.raises(NothingToDo) as err:
        edit(tmp_path, source)
    return str(err.value)


@pytest.mark.slow  # runs the model through verify
@pytest.mark.usefixtures("source_path")
def test_a_package_class_is_read_through_reexports_and_the_edit_verifies(tmp_path):
    plan, edited, original = edit(tmp_path, MODEL)
    assert plan.trust_boundary == ()
    assert "fakeserve" not in sys.modules  # read, never imported
    result = verify_files(edited, original=original)
    assert result.ok, result.problems


def test_without_the_source_path_the_package_stays_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != SOURCES.resolve()])
    why = refusal(tmp_path, MODEL)
    assert "self.experts (RoutedExperts, not visible to msrewrite)" in why


@pytest.mark.usefixtures("source_path")
def test_a_package_function_that_writes_its_input_is_seen(tmp_path):
    """InplaceExperts.forward calls combine_into(x, out), which copies into x (kernels.py)."""
    why = refusal(
        tmp_path,
        MODEL.replace("import RoutedExperts", "import InplaceExperts").replace(
            "RoutedExperts(d, n)", "InplaceExperts(d, n)"
        ),
    )
    assert "writes 'x' in place" in why


@pytest.mark.usefixtures("source_path")
def test_dynamic_dispatch_in_a_package_is_unknown_and_named(tmp_path):
    why = refusal(
        tmp_path,
        MODEL.replace("import RoutedExperts", "import DispatchExperts").replace(
            "RoutedExperts(d, n)", "DispatchExperts(d, n)"
        ),
    )
    assert "self.experts (DispatchExperts) -> self.method" in why and "may write 'x'" in why


@pytest.mark.usefixtures("source_path")
def test_a_subclass_of_a_package_class_uses_its_forward(tmp_path):
    """`class LocalExperts(RoutedExperts)` without a forward of its own runs the package's."""
    subclass = "\n\nclass LocalExperts(RoutedExperts):\n    pass\n"
    source = MODEL.replace("\n\nclass SharedMLP", subclass + "\n\nclass SharedMLP").replace(
        "RoutedExperts(d, n)", "LocalExperts(d, n)"
    )
    plan, _, _ = edit(tmp_path, source)
    assert plan.trust_boundary == ()
    # a subclass that replaces a submodule the package's forward calls: that forward is not proof
    override = subclass.replace(
        "pass", "def __init__(self, d, n):\n        super().__init__(d, n)\n        self.experts = make_experts()"
    )
    source = MODEL.replace("\n\nclass SharedMLP", override + "\n\nclass SharedMLP").replace(
        "RoutedExperts(d, n)", "LocalExperts(d, n)"
    )
    assert "uses self.experts, which LocalExperts overrides" in refusal(tmp_path, source)


def test_reading_is_bounded(tmp_path, monkeypatch):
    """A chain of re-exports longer than the depth bound stays unknown (no crash, no import)."""
    from msrewrite.analyze import summaries

    root = tmp_path / "src"
    pkg = root / "chain"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    depth = summaries.MAX_IMPORT_DEPTH + 2
    for i in range(depth):
        (pkg / f"m{i}.py").write_text(f"from chain.m{i + 1} import Experts\n")
    (pkg / f"m{depth}.py").write_text(
        "from torch import nn\n\nclass Experts(nn.Module):\n    def forward(self, x, w):\n        return x * w.sum()\n"
    )
    model = tmp_path / "model"
    model.mkdir()
    packages.set_source_path([SOURCES, root])  # fakeserve too: MODEL's gate (RowLinear) comes from it
    try:
        why = refusal(
            model,
            MODEL.replace("from fakeserve.layers import RoutedExperts", "from chain.m0 import Experts").replace(
                "RoutedExperts(d, n)", "Experts()"
            ),
        )
        assert "self.experts (Experts, not visible to msrewrite)" in why
        monkeypatch.setattr(summaries, "MAX_IMPORT_DEPTH", depth + 2)
        plan, _, _ = edit(
            model,
            MODEL.replace("from fakeserve.layers import RoutedExperts", "from chain.m0 import Experts").replace(
                "RoutedExperts(d, n)", "Experts()"
            ),
        )
        assert plan.trust_boundary == ()
    finally:
        packages.set_source_path([])


def test_read_modules_are_indexed_once_per_version(tmp_path):
    """Indexed per process by path, size and mtime; a definition is parsed only when asked for."""
    file = tmp_path / "m.py"
    file.write_text("class A:\n    pass\n")
    first = packages.index_file(file)
    assert packages.index_file(file) is first and first.classes == {"A"}
    file.write_text("def b(x):\n    return x\n")
    again = packages.index_file(file)
    assert again is not first and again.functions == {"b"} and not again.classes


def test_a_missing_source_path_is_a_one_line_error(tmp_path):
    from helpers import run_main

    result = run_main(
        "apply", "--case", "moe-shared-expert", str(FIXTURES / "pkg_moe.py"), "--source-path", str(tmp_path / "missing")
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"msrewrite: error: --source-path {tmp_path / 'missing'}: not a folder"
    ]


SIDE_WORK = (FIXTURES / "pkg_side_work.py").read_text()


@pytest.mark.slow  # runs the model through verify
@pytest.mark.usefixtures("source_path")
def test_an_inherited_package_method_and_a_package_function_are_read(tmp_path):
    """vLLM's minicpmv (`self._repeat(...)` from BaseResampler) and idefics2 (`async_tensor_h2d`):
    both are pure in their source, so the edit goes through and verifies."""
    original = tmp_path / "pkg_side_work.py"
    original.write_text(SIDE_WORK.replace('Path(__file__).resolve().parent / "srcpkg"', repr(str(SOURCES))))
    src = load(original)
    steps = case_steps(
        original,
        src.text,
        src.module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )
    assert steps[-1].plans[0].trust_boundary == ()
    edited = tmp_path / "pkg_side_work_ms.py"
    edited.write_text(steps[-1].new)
    result = verify_files(edited, original=original)
    assert result.ok, result.problems


def test_without_the_source_path_the_inherited_method_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != SOURCES.resolve()])
    original = tmp_path / "pkg_side_work.py"
    original.write_text(SIDE_WORK)
    src = load(original)
    with pytest.raises(NothingToDo, match=r"self\._repeat \(BaseResampler, not visible to msrewrite\) may write 'x'"):
        case_steps(
            original,
            src.text,
            src.module,
            "moe-shared-expert",
            "eager",
            None,
            FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
            None,
        )


# The framework the file lives in, found without --source-path -------------------------------------
def _inside_the_package(tmp_path: Path, source: str) -> Path:
    """The model file at `<tree>/fakeserve/models/pkg_moe.py`, beside a copy of the package, with no
    `__init__.py` in `models/` (as wheels leave namespace portions such as SGLang's `srt/`); no
    --source-path, and the tree is not on sys.path."""
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(SOURCES / "fakeserve", tree / "fakeserve")
    models = tree / "fakeserve" / "models"
    models.mkdir()
    original = models / "pkg_moe.py"
    original.write_text(source.replace('Path(__file__).resolve().parent / "srcpkg"', repr(str(tree))))
    return original


def _edit_in_place(original: Path):
    src = load(original)
    return case_steps(
        original,
        src.text,
        src.module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )


def test_the_package_the_file_is_in_is_read_without_a_source_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != SOURCES.resolve()])
    monkeypatch.setattr(packages, "_read_from", {})
    original = _inside_the_package(tmp_path, MODEL)
    plan = _edit_in_place(original)[-1].plans[0]
    assert plan.trust_boundary == ()  # RoutedExperts and RowLinear proved pure from their source
    imported = getattr(sys.modules.get("fakeserve"), "__file__", None) or ""
    assert not imported.startswith(str(tmp_path))  # read, never imported
    assert packages.roots_read() == [f"fakeserve from {tmp_path / 'tree'} (the package the file is in)"]


def test_an_effect_in_the_package_the_file_is_in_is_seen(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != SOURCES.resolve()])
    source = MODEL.replace("import RoutedExperts", "import InplaceExperts").replace(
        "RoutedExperts(d, n)", "InplaceExperts(d, n)"
    )
    with pytest.raises(NothingToDo) as err:
        _edit_in_place(_inside_the_package(tmp_path, source))
    assert "writes 'x' in place" in str(err.value)


def test_a_folder_of_another_name_is_not_taken_for_the_package(tmp_path, monkeypatch):
    """Only a folder named as the import's top-level package marks the tree: a model file in
    `elsewhere/` beside the package still reads nothing."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != SOURCES.resolve()])
    original = _inside_the_package(tmp_path, MODEL)
    other = tmp_path / "elsewhere" / "pkg_moe.py"
    other.parent.mkdir()
    other.write_text(original.read_text())
    with pytest.raises(NothingToDo) as err:
        _edit_in_place(other)
    assert "self.experts (RoutedExperts, not visible to msrewrite)" in str(err.value)


@pytest.mark.slow  # runs the model through verify
def test_an_edit_through_the_package_the_file_is_in_verifies(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != SOURCES.resolve()])
    original = _inside_the_package(tmp_path, MODEL)
    edited = original.with_name("pkg_moe_ms.py")
    edited.write_text(_edit_in_place(original)[-1].new)
    result = verify_files(edited, original=original)
    assert result.ok, result.problems


@pytest.mark.slow  # the CLI in a subprocess, as a user runs it inside the tree
def test_the_cli_says_which_package_sources_it_read(tmp_path):
    from helpers import run_cli

    original = _inside_the_package(tmp_path, MODEL)
    result = run_cli("apply", "--case", "moe-shared-expert", str(original), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        f"msrewrite: package sources read (never imported): fakeserve from {tmp_path / 'tree'} "
        "(the package the file is in)"
    ) in result.stderr.splitlines()
