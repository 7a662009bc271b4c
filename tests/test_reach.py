"""Calls through what `__init__` (or any method) builds: factories, class-valued locals and
helpers, bound methods, `functools.partial`, attributes bound outside `__init__` (issue 26, item 2).

Each kind has a must-see model (the callee reached through it writes the side branch's input: the
case refuses naming the line, and the forced overlap races under verify) and a must-not-overclaim
twin (every callee reached through it is pure: the case edits with nothing left unseen, and the
edit verifies clean). The models differ from their twin in one line only.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from msrewrite.analyze import reach
from msrewrite.commands.apply import case_steps
from msrewrite.emit.engine import apply_plans
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec, OverlapPlan, SideStatement
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")

MODEL = """import functools

import torch
from torch import nn


class Pure(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)

    def forward(self, x):
        return self.w(x)


class Scales(nn.Module):
    def forward(self, x):
        return x.mul_(2)


def routed_class(kind):
    if kind == "top1":
        return Pure
    return ROUTED


def build_routed(kind):
    cls = routed_class(kind)
    return cls() if kind else Pure()


def make_routed(width, runner_cls=None):
    cls = runner_cls or Pure
    return cls()


class Block(nn.Module):
    def __init__(self, kind="top2"):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.late = None
        BUILD
        self.bind()  # binds self.late outside __init__

    def bind(self):
        self.late = self.pure_method

    def pure_method(self, x):
        return x * 2

    def writing_method(self, x, factor=2.0):
        return x.mul_(factor)

    def forward(self, x):
        s = self.shared_experts(x)
        h = CALL
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""

# kind -> (the __init__ line, the forward call, pure text, writing text): the twin replaces the first with the second
KINDS = {
    "factory": ("self.experts = build_routed(kind)", "self.experts(x)", "return ROUTED", "return ROUTED"),
    "class-helper-called": ("self.experts = routed_class(kind)()", "self.experts(x)", "", ""),
    "class-valued-local": (
        "moe_cls = routed_class(kind)\n        self.experts = moe_cls()",
        "self.experts(x)",
        "",
        "",
    ),
    "bound-method": ("self.down = self.pure_method", "self.down(x)", "self.pure_method", "self.writing_method"),
    "partial": (
        "self.down = functools.partial(self.pure_method)",
        "self.down(x)",
        "functools.partial(self.pure_method)",
        "functools.partial(self.writing_method, factor=3.0)",
    ),
    "bound-outside-init": ("pass", "self.late(x)", "self.late = self.pure_method", "self.late = self.writing_method"),
    # a factory's parameter bound at the call site (vLLM's `runner_cls or Default`)
    "factory-parameter": (
        "self.experts = make_routed(16, runner_cls=Pure)",
        "self.experts(x)",
        "make_routed(16, runner_cls=Pure)",
        "make_routed(16, runner_cls=Scales)",
    ),
}


def model_text(kind: str, writing: bool) -> str:
    build, call, pure, bad = KINDS[kind]
    text = MODEL.replace("BUILD", build).replace("CALL", call)
    # the factory kinds pick their class from ROUTED: Pure, or Scales (writes its input)
    text = text.replace("return ROUTED", f"return {'Scales' if writing else 'Pure'}")
    if pure and pure != "return ROUTED":
        text = text.replace(pure, bad if writing else pure, 1 if kind != "bound-outside-init" else -1)
    return text


def write(tmp_path: Path, kind: str, writing: bool) -> Path:
    path = tmp_path / f"{kind.replace('-', '_')}_{'writes' if writing else 'pure'}.py"
    path.write_text(model_text(kind, writing))
    return path


def edit(path: Path, protect: str = "none"):
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, protect=protect)[-1]


def forced(path: Path) -> tuple[str, ScheduleSource]:
    """The overlap a reviewer could force with `apply --plan`: the shared expert beside the call."""
    src = load(path)
    lines = src.text.splitlines()
    side = next(i for i, line in enumerate(lines, 1) if "s = self.shared_experts(x)" in line)
    plan = OverlapPlan(
        case="generic",
        file=str(path),
        function="Block.forward",
        side=(SideStatement(side, side, lines[side - 1].strip()),),
        fork_line=side,
        join_line=side + 2,
        side_inputs=("x",),
        side_outputs=("s",),
        stream_tag="side",
        flag=FLAG,
        mode="eager",
    )
    return apply_plans(src.module, [plan], src.text).code, ScheduleSource(src.text, [plan])


@pytest.mark.parametrize("kind", list(KINDS))
def test_writing_callee_is_seen_through_it(tmp_path, kind):
    path = write(tmp_path, kind, writing=True)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value
    assert "not visible to msrewrite" not in str(refused.value)
    protected = edit(path, protect="auto")  # the default remedy: the side stream reads a copy
    assert protected.plans[0].protect_inputs == ("x",)


@pytest.mark.parametrize("kind", list(KINDS))
def test_pure_callee_is_proved_pure_through_it(tmp_path, kind):
    step = edit(write(tmp_path, kind, writing=False))
    assert step.plans[0].trust_boundary == ()
    assert step.plans[0].protect_inputs == ()


@pytest.mark.slow  # runs the models through verify
@pytest.mark.parametrize("kind", list(KINDS))
def test_verify_agrees(tmp_path, kind):
    pure = write(tmp_path, kind, writing=False)
    step = edit(pure)
    edited = tmp_path / "pure_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=pure, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems
    writing = write(tmp_path, kind, writing=True)
    text, source = forced(writing)
    raced = tmp_path / "writes_ms.py"
    raced.write_text(text)
    result = verify_files(raced, original=writing, schedule_source=source)
    assert not result.ok, f"{kind}: the forced overlap of the writing twin verified clean"


def test_a_partial_binding_a_local_is_not_followed(tmp_path):
    text = model_text("partial", writing=False).replace(
        "self.down = functools.partial(self.pure_method)",
        "scale = 2.0\n        self.down = functools.partial(self.writing_method, factor=scale)",
    )
    path = tmp_path / "partial_local.py"
    path.write_text(text)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "binds values msrewrite cannot name here" in str(refused.value)


def test_a_class_table_is_not_followed(tmp_path):
    """A dict of classes may be filled at import time from anywhere: a call through it stays unseen."""
    text = model_text("factory", writing=False).replace(
        "self.experts = build_routed(kind)", 'self.experts = {"a": Pure}["a"]()'
    )
    path = tmp_path / "table.py"
    path.write_text(text)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "not visible to msrewrite" in str(refused.value)


def _func(code: str) -> cst.FunctionDef:
    node = cst.parse_statement(code)
    assert isinstance(node, cst.FunctionDef)
    return node


def test_local_values_knows_only_plain_assignments():
    func = _func(
        "def f(p):\n"
        "    a = A\n"
        "    if c:\n"
        "        a = B\n"
        "    for b in xs:\n"
        "        pass\n"
        "    c = C\n"
        "    c += 1\n"
        "    d, e = pair\n"
        "    return a\n"
    )
    assert [cst.Module([]).code_for_node(v) for v in reach.local_values(func, "a")] == ["A", "B"]  # type: ignore[union-attr]
    for name in ("p", "b", "c", "d"):
        assert reach.local_values(func, name) is None, name
    assert reach.local_values(func, "Unbound") is reach.NOT_LOCAL


def test_attribute_stores_sees_every_form():
    func = _func(
        "def setup(self):\n"
        "    self.a = A()\n"
        "    self.b, self.c = B(), C()\n"
        "    self.d, self.e = pair()\n"
        "    for self.f in xs:\n"
        "        pass\n"
        '    setattr(self, "g", G())\n'
        "    setattr(self, name, H())\n"
        "    def inner(self):\n"
        "        self.z = Z()\n"
    )
    stores = {name: cst.Module([]).code_for_node(v) for name, v in reach.attribute_stores(func)}
    assert stores["a"] == "A()" and stores["b"] == "B()" and stores["c"] == "C()" and stores["g"] == "G()"
    assert stores["*"] == "H()"
    for unseen in ("d", "e", "f"):
        assert stores[unseen].startswith(reach.UNSEEN_STORE), stores[unseen]
    assert "z" not in stores  # a nested function's `self` is another object


def test_a_generator_factory_gives_no_class():
    assert reach.returned_values(_func("def f():\n    yield A()\n")) is None


NEW_MODEL = """import torch
from torch import nn

REPLACEMENTS = {}


class Op(nn.Module):
    def __new__(cls, *args, **kwargs):
        NEW


class Pure(Op):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)

    def forward(self, x):
        return self.w(x)


class Scales(Pure):
    def forward(self, x):
        return x.mul_(2)


REPLACEMENTS["Pure"] = Scales  # what an out-of-tree platform plugin registers


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = Pure()

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(x)
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""
SWAPPING_NEW = "return super().__new__(REPLACEMENTS.get(cls.__name__, cls))"
PLAIN_NEW = "return super().__new__(cls)"


def test_a_new_that_may_build_another_class_is_not_trusted(tmp_path):
    """vLLM's CustomOp.__new__ builds the class an out-of-tree platform registered (vllm-ascend's
    NPU layers): the source of the class named at the call is not what runs."""
    path = tmp_path / "swapping_new.py"
    path.write_text(NEW_MODEL.replace("NEW", SWAPPING_NEW))
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "Op.__new__ may build an instance of another class" in str(refused.value), refused.value


def test_a_new_that_builds_its_own_class_is_followed(tmp_path):
    path = tmp_path / "plain_new.py"
    path.write_text(NEW_MODEL.replace("NEW", PLAIN_NEW))
    assert edit(path).plans[0].trust_boundary == ()


@pytest.mark.slow  # runs the models through verify
def test_verify_agrees_on_new(tmp_path):
    plain = tmp_path / "plain_new.py"
    plain.write_text(NEW_MODEL.replace("NEW", PLAIN_NEW))
    step = edit(plain)
    edited = tmp_path / "plain_new_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=plain, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems
    swapping = tmp_path / "swapping_new.py"
    swapping.write_text(NEW_MODEL.replace("NEW", SWAPPING_NEW))
    text, source = forced(swapping)
    raced = tmp_path / "swapping_new_ms.py"
    raced.write_text(text)
    assert not verify_files(raced, original=swapping, schedule_source=source).ok


CONTAINER_MODEL = """import torch
from torch import nn

TUNED = {"small": 2.0}


class Writer:
    def get(self, key, x):
        return x.mul_(2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)
        self.cache = {}

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(x) * TUNED.get("small", x)
        h = h + self.cache.get("bias", 0.0)
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""


def test_reads_of_a_literal_container_write_nothing(tmp_path):
    path = tmp_path / "containers.py"
    path.write_text(CONTAINER_MODEL)
    assert edit(path).plans[0].trust_boundary == ()


@pytest.mark.parametrize(
    "rebinding",
    [
        "\n\ndef reset():\n    global TUNED\n    TUNED = Writer()\n",  # another value, through `global`
        "\n\nTUNED = Writer()\n",  # rebound at module level
    ],
)
def test_a_container_name_bound_to_anything_else_is_not_trusted(tmp_path, rebinding):
    path = tmp_path / "containers_rebound.py"
    path.write_text(CONTAINER_MODEL.replace('        h = h + self.cache.get("bias", 0.0)\n', "") + rebinding)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "TUNED.get" in str(refused.value) or "writes 'x'" in str(refused.value), refused.value


def test_an_attribute_bound_to_a_container_and_to_an_object_is_both(tmp_path):
    path = tmp_path / "containers_attr.py"
    path.write_text(
        CONTAINER_MODEL.replace(
            '        h = h + self.cache.get("bias", 0.0)\n', '        h = h + self.cache.get("bias", x)\n'
        )
        + "\n\ndef swap(block):\n    block.cache = {}\n"
    )
    assert edit(path).plans[0].trust_boundary == ()
    path.write_text(
        path.read_text().replace(
            "        self.cache = {}\n", "        self.cache = {}\n        self.cache = Writer()\n"
        )
    )
    with pytest.raises(NothingToDo):
        edit(path, protect="none")


LOCAL_IMPORT_MODEL = """import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        from routed_layers import ROUTED as Routed  # kept out of import time

        self.shared_experts = nn.Linear(16, 16)
        self.experts = Routed()

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(x)
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""
ROUTED_LAYERS = """from torch import nn


class Pure(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)

    def forward(self, x):
        return self.w(x)


class Scales(nn.Module):
    def forward(self, x):
        return x.mul_(2)
"""


@pytest.mark.parametrize("imported, writes", [("Pure", False), ("Scales", True)])
def test_a_class_imported_inside_init_is_followed(tmp_path, imported, writes):
    (tmp_path / "routed_layers.py").write_text(ROUTED_LAYERS)
    path = tmp_path / "local_import.py"
    path.write_text(LOCAL_IMPORT_MODEL.replace("ROUTED", imported))
    if not writes:
        assert edit(path).plans[0].trust_boundary == ()
        return
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value


@pytest.mark.slow  # runs the models through verify
def test_container_and_local_import_edits_verify(tmp_path, monkeypatch):
    (tmp_path / "routed_layers.py").write_text(ROUTED_LAYERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, text in (("containers", CONTAINER_MODEL), ("local_import", LOCAL_IMPORT_MODEL.replace("ROUTED", "Pure"))):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        step = edit(path)
        edited = tmp_path / f"{name}_ms.py"
        edited.write_text(step.new)
        result = verify_files(edited, original=path, schedule_source=ScheduleSource(step.old, step.plans))
        assert result.ok and not result.findings, (name, result.problems)


def test_a_nested_function_rebinding_a_local_nonlocal_leaves_it_unknown():
    func = _func("def f():\n    cls = A\n    def swap():\n        nonlocal cls\n        cls = B\n    return cls\n")
    assert reach.local_values(func, "cls") is None
    plain = _func("def f():\n    cls = A\n    def other():\n        cls = B\n    return cls\n")
    assert [cst.Module([]).code_for_node(v) for v in reach.local_values(plain, "cls")] == ["A"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "call",
    [
        "make_routed(16, runner_cls=cls_from_caller)",  # a local the caller binds some other way
        "make_routed(16, *extra)",  # any parameter may be set through the spread
    ],
)
def test_a_factory_parameter_bound_to_anything_else_is_not_followed(tmp_path, call):
    text = model_text("factory-parameter", writing=False).replace(
        "self.experts = make_routed(16, runner_cls=Pure)",
        f"cls_from_caller, extra = pick(), ()\n        self.experts = {call}",
    )
    path = tmp_path / "factory_parameter_unknown.py"
    path.write_text(text)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "self.experts (make_routed, not visible to msrewrite)" in str(refused.value), refused.value


def test_a_factory_parameter_left_to_its_default_is_the_default(tmp_path):
    text = model_text("factory-parameter", writing=False).replace("make_routed(16, runner_cls=Pure)", "make_routed(16)")
    path = tmp_path / "factory_parameter_default.py"
    path.write_text(text)
    assert edit(path).plans[0].trust_boundary == ()
    path.write_text(text.replace("cls = runner_cls or Pure", "cls = runner_cls or Scales"))
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value
