"""Dispatch through an attribute whose class is known only by its base (issue 26, item 2):
`self.method.apply(self, x)` where `self.method` comes from `config.get_method(self)`, a call no
source resolves, but a declaration names the base: the attribute's annotation, the return
annotation of the factory method, or the annotation of the parameter it is stored from. The call
runs the method of the base or of any subclass of it in the package (analyze/dispatch.py).

The framework is a package `fw` in the test's folder; the writing subclass lives in a module of it
that nothing imports (`fw/extra/scaled.py`, registered into a table at import time): only the
search of the package's tree finds it. Each declaration kind has a must-see model (the subclass
writes the side branch's input: the case refuses, and the forced overlap races under verify) and
a must-not-overclaim twin (every subclass is pure: the case edits, its trust boundary saying the
union was over the package's subclasses, and the edit verifies clean).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.analyze import dispatch
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.verify import verify_files
from test_reach import edit, forced

BASE = """import torch

METHODS = {}


class MethodBase:
    def apply(self, layer, x):
        raise NotImplementedError


class PlainMethod(MethodBase):
    def apply(self, layer, x):
        return x @ layer.weight


class Config:
    def __init__(self, name):
        self.name = name

    def get_method(self, layer) -> "MethodBase | None":
        return METHODS[self.name]()
"""

SCALED = """from fw.base import METHODS, PlainMethod


class ScaledMethod(PlainMethod):
    def apply(self, layer, x):
        return BODY @ layer.weight


METHODS["scaled"] = ScaledMethod
"""
WRITES, PURE = "x.mul_(2)", "(x * 2)"

MODEL = """import torch
from torch import nn

from fw.base import Config, MethodBase, PlainMethod


class Layer(nn.Module):
    def __init__(self, config: Config | None = None, method: MethodBase | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)
        STORE

    def forward(self, x):
        return self.method.apply(self, x)


class Block(nn.Module):
    def __init__(self, config=None, method=None):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = Layer(config, method)

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(x)
        return h + s


def make():
    import fw.extra.scaled

    torch.manual_seed(0)
    return Block(Config("scaled"), fw.extra.scaled.ScaledMethod()), (torch.randn(2, 8, 16),)
"""

# declaration kind -> how Layer.__init__ stores self.method
STORES = {
    # the attribute's annotation: `config.get_method` is not followed, the annotation says the base
    "annotation": "if config is None:\n"
    "            self.method: MethodBase | None = PlainMethod()\n"
    "        else:\n"
    "            self.method = config.get_method(self)",
    # the return annotation of Config.get_method (read on the class `config` is annotated with)
    "return-annotation": "self.method = config.get_method(self) if config is not None else PlainMethod()",
    # the annotation of the parameter the attribute is stored from
    "parameter": "self.method = method",
}


def write(tmp_path: Path, kind: str, writing: bool, scaled: str = SCALED, name: str = "fw") -> Path:
    """The model and its framework package `name` (verify imports both: each half of a test that
    verifies gets a package name of its own, never one an earlier import cached)."""
    package = tmp_path / name
    (package / "extra").mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "extra" / "__init__.py").write_text("")
    (package / "base.py").write_text(BASE)
    scaled = scaled.replace("BODY", WRITES if writing else PURE)
    (package / "extra" / "scaled.py").write_text(scaled.replace("from fw.", f"from {name}."))
    path = tmp_path / f"{kind.replace('-', '_')}_{'writes' if writing else 'pure'}.py"
    path.write_text(MODEL.replace("STORE", STORES[kind]).replace("fw.", f"{name}."))
    return path


@pytest.mark.parametrize("kind", list(STORES))
def test_a_writing_subclass_in_the_package_is_seen(tmp_path, kind):
    with pytest.raises(NothingToDo) as refused:
        edit(write(tmp_path, kind, writing=True))
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value
    assert "not visible to msrewrite" not in str(refused.value)


@pytest.mark.parametrize("kind", list(STORES))
def test_pure_subclasses_are_proved_pure(tmp_path, kind):
    step = edit(write(tmp_path, kind, writing=False))
    plan = step.plans[0]
    assert plan.protect_inputs == ()
    (note,) = plan.trust_boundary  # the closed world, said where a reviewer reads it
    assert "self.method.apply (an instance of MethodBase" in note, note
    assert "union over MethodBase and its 2 subclasses in package fw" in note, note
    assert "a subclass defined outside it is not seen" in note


@pytest.mark.slow  # runs the models through verify
@pytest.mark.parametrize("kind", list(STORES))
def test_verify_agrees(tmp_path, monkeypatch, kind):
    monkeypatch.syspath_prepend(str(tmp_path))
    tag = kind.replace("-", "_")
    pure = write(tmp_path, kind, writing=False, name=f"fw_pure_{tag}")
    step = edit(pure)
    edited = tmp_path / "pure_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=pure, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems
    writing = write(tmp_path, kind, writing=True, name=f"fw_writes_{tag}")
    text, source = forced(writing)
    raced = tmp_path / "writes_ms.py"
    raced.write_text(text)
    result = verify_files(raced, original=writing, schedule_source=source)
    assert not result.ok, f"{kind}: the forced overlap of the writing twin verified clean"


# a subclass the search cannot be sure of: the call stays "may write", naming it and why
INCOMPLETE = {
    "nested": (
        "\n\ndef make_method():\n    class Local(PlainMethod):\n        pass\n\n    return Local()\n",
        "defined inside a function or class",
    ),
    "computed-base": (
        "\n\ndef pick(cls):\n    return cls\n\n\nclass Picked(pick(PlainMethod)):\n    pass\n",
        "has a base msrewrite cannot name",
    ),
    "virtual": ("\n\nclass Other:\n    pass\n\n\nMethodBase.register(Other)\n", "registers a virtual subclass"),
}


@pytest.mark.parametrize("kind", list(INCOMPLETE))
def test_a_subclass_the_search_cannot_be_sure_of_keeps_it_unknown(tmp_path, kind):
    extra, why = INCOMPLETE[kind]
    scaled = SCALED.replace("import METHODS, PlainMethod", "import METHODS, MethodBase, PlainMethod") + extra
    path = write(tmp_path, "annotation", writing=False, scaled=scaled)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    message = str(refused.value)
    assert "self.method.apply (an instance of MethodBase, by the annotation of self.method" in message, message
    assert why in message, message


def test_a_protocol_is_not_a_closed_world(tmp_path):
    path = write(tmp_path, "annotation", writing=False)
    base = tmp_path / "fw" / "base.py"
    base.write_text(
        base.read_text()
        .replace("import torch\n", "from typing import Protocol\n\nimport torch\n")
        .replace("class MethodBase:", "class MethodBase(Protocol):")
    )
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "MethodBase is a Protocol" in str(refused.value), refused.value


def test_a_subclass_calling_an_unseen_callee_names_it(tmp_path):
    """The union stops at the first subclass that calls something msrewrite cannot see into:
    the call may write, naming that callee, and says the rest were not read."""
    unseen = SCALED.replace("return BODY @ layer.weight", "return opaque_kernel(x, layer.weight)")
    unseen = unseen.replace("from fw.base", "from native_ops import opaque_kernel\nfrom fw.base")
    path = write(tmp_path, "annotation", writing=False, scaled=unseen)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    message = str(refused.value)
    assert "self.method.apply (ScaledMethod.apply) -> opaque_kernel" in message, message


def test_without_a_declaration_the_call_stays_unknown(tmp_path):
    path = write(tmp_path, "annotation", writing=False)
    path.write_text(path.read_text().replace("self.method: MethodBase | None = ", "self.method = "))
    base = tmp_path / "fw" / "base.py"
    base.write_text(base.read_text().replace(' -> "MethodBase | None"', ""))
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "self.method.apply (config.get_method, not visible to msrewrite)" in str(refused.value)


def test_package_tree_is_the_top_package(tmp_path):
    inner = tmp_path / "top" / "ns" / "sub"
    inner.mkdir(parents=True)
    (tmp_path / "top" / "__init__.py").write_text("")
    (inner / "__init__.py").write_text("")  # `ns/` is a namespace portion in between
    assert dispatch.package_tree(inner / "m.py") == tmp_path / "top"
    loose = tmp_path / "loose"
    loose.mkdir()
    assert dispatch.package_tree(loose / "m.py") == loose


def test_a_parameter_bound_again_says_nothing(tmp_path):
    """`method = make_other()` in the body: the parameter's annotation no longer says what the
    attribute holds."""
    path = write(tmp_path, "parameter", writing=False)
    path.write_text(
        path.read_text().replace(
            "        self.method = method\n", "        method = build(method)\n        self.method = method\n"
        )
    )
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "self.method.apply (set from method, not visible to msrewrite)" in str(refused.value), refused.value


def test_the_text_index_reads_class_statements_as_written(tmp_path):
    source = (
        "from .base import MethodBase as MB\n"
        "class A(MB):\n    pass\n"
        "class B(\n    PlainMethod,  # a comment (with parentheses)\n    metaclass=Meta,\n):\n    pass\n"
        "class C(Generic[MethodBase]):\n    pass\n"
        "if TYPE_CHECKING:\n    class D(mod.MethodBase):\n        pass\n"
    )
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "m.py").write_text(source)
    index = dispatch._tree_index(tmp_path)
    assert index is not None
    heads = {h.name: h for word in index.by_word.values() for h in word}
    assert heads["B"].bases.split("#")[0].strip() == "PlainMethod,"
    assert index.aliases[tmp_path / "m.py"] == {"MB": "MethodBase"}
    found = dispatch._search_tree(tmp_path, "MethodBase")
    assert sorted(name for _, name in found) == ["A", "D"], found  # C is a Generic, not a subclass
