"""analyze/walk.py: a read-only walk makes exactly the visitor calls libcst's `visit` makes, on
the same nodes in the same order, and builds no node while it does."""

from __future__ import annotations

import sys

import libcst as cst
import pytest

from conftest import EXAMPLES, ROOT
from msrewrite.analyze import walk as walk_module
from msrewrite.analyze.walk import Visitor, walk

SYNTAX = '''\
x = f"{a}"
y = f"{a:>{w}} {b!r:10} {c=} {d:{e}.{f}}"
z = f"{a:>10}{b}" f"{q}"
def g(*, a=1, **k): return lambda q, /, r=2: (yield from q)
@dec(1)
class C(B, metaclass=M):
    x: int = 1
    async def h(self):
        async with a as b, c:
            await d
from . import (a as b, c)
from x import *
w = [i async for i in j if k]; v = {**a, 'b': 1}; u = {k: v for k, v in t}; s = {*a}
match p:
    case {"a": [1, *rest]} | Point(x=0) if y:
        pass
    case _:
        del q[1:2, ::3]
with (a as b, c):
    ...
try:
    pass
except* E as e:
    raise X from e
else:
    global gg
finally:
    nonlocal_ = (yield)
while not a and b or c is not d: assert e, "m"; break
for i, *j in k: continue
t = a if b else c; u = a @ b; u @= 2; u = -a ** ~b; u = (a := 1); print(*a, **b)
'''


def _node_classes() -> list[type]:
    found, todo = set(), [cst.CSTNode]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted((c for c in found if not c.__name__.startswith("_")), key=lambda c: c.__name__)


SKIP = ("Lambda", "Decorator", "FormattedStringExpression")  # visit_ says False: no children


def _recording(base: type) -> type:
    """A visitor with visit_/leave_ for every node class, recording (event, node) pairs."""
    namespace = {}
    for node_cls in _node_classes():
        name = node_cls.__name__

        def visit(self, node, _name=name):
            self.events.append(("visit", id(node)))
            return False if _name in SKIP else None

        def leave(self, node):
            self.events.append(("leave", id(node)))

        namespace[f"visit_{name}"], namespace[f"leave_{name}"] = visit, leave

    def __init__(self):
        base.__init__(self)
        self.events = []

    namespace["__init__"] = __init__
    return type(f"Recording{base.__name__}", (base,), namespace)


class Hooks(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.events: list = []

    def on_visit(self, node):
        self.events.append(("visit", id(node)))
        return not isinstance(node, cst.Lambda)

    def on_leave(self, node):
        self.events.append(("leave", id(node)))


class Attributes(cst.CSTVisitor):
    """Attribute hooks: only libcst makes those calls, so walk hands the visitor to it."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list = []

    def visit_Call_func(self, node):
        self.events.append(("func", id(node)))

    def visit_Name(self, node):
        self.events.append(("name", id(node)))


RecordingCSTVisitor = _recording(cst.CSTVisitor)
RecordingVisitor = _recording(Visitor)


def _sources():
    yield "syntax", SYNTAX
    for path in sorted(EXAMPLES.glob("*.py")):
        yield path.name, path.read_text()
    for rel in ("msrewrite/analyze/walk.py", "msrewrite/cases.py"):
        yield rel, (ROOT / rel).read_text()


@pytest.mark.parametrize("name,text", list(_sources()), ids=lambda v: v if isinstance(v, str) and len(v) < 60 else "")
def test_walk_makes_libcsts_calls_in_libcsts_order(name, text):
    module = cst.parse_module(text)
    for make in (RecordingCSTVisitor, Hooks, Attributes):
        theirs, ours = make(), make()
        module.visit(theirs)
        walk(module, ours)
        assert ours.events == theirs.events, (name, make.__name__)
        assert theirs.events, make.__name__
    theirs, ours = RecordingCSTVisitor(), RecordingVisitor()
    module.visit(theirs)
    module.visit(ours)  # a Visitor under libcst's own visit
    assert ours.events == theirs.events
    for stmt in module.body[:5]:  # from a node below the module, too
        theirs, ours = RecordingCSTVisitor(), RecordingVisitor()
        stmt.visit(theirs)
        stmt.visit(ours)
        assert ours.events == theirs.events


def test_syntax_sample_parses_on_this_python():
    """The sample must reach the f-string, match and except* nodes it is there for."""
    if sys.version_info < (3, 11):
        pytest.skip("except* needs Python 3.11")
    kinds = {type(cst.parse_module(SYNTAX).body[k]).__name__ for k in range(len(cst.parse_module(SYNTAX).body))}
    assert {"Match", "TryStar", "With", "While", "For"} <= kinds


def test_walk_builds_no_node(monkeypatch):
    module = cst.parse_module((EXAMPLES / "deepseek_moe.py").read_text())
    walk(module, RecordingCSTVisitor())  # first sight of each node class records its children's order
    built = []
    original = cst.CSTNode.__post_init__
    monkeypatch.setattr(cst.CSTNode, "__post_init__", lambda self: (built.append(type(self)), original(self)))
    visitor = RecordingVisitor()
    module.visit(visitor)
    walk(module, RecordingCSTVisitor())
    assert visitor.events and built == []
    module.visit(RecordingCSTVisitor())  # libcst's visit builds a copy of every node it passes
    assert len(built) > 500


def test_child_visited_on_some_nodes_of_a_class_only():
    """FormattedStringExpression visits format_spec only when there is one: a class first met
    without one must still walk it on the next node."""
    walk_module._FIELDS.pop(cst.FormattedStringExpression, None)
    module = cst.parse_module('a = f"{x}"\nb = f"{y:{width}}"\n')

    class Names(Visitor):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def visit_Name(self, node):
            self.names.append(node.value)

    seen = Names()
    module.visit(seen)
    assert seen.names == ["a", "x", "b", "y", "width"]


def test_instance_methods_and_fallbacks_are_honoured():
    module = cst.parse_module("f(a, b)\n")

    class Plain(cst.CSTVisitor):
        pass

    plain = Plain()
    seen: list[str] = []
    plain.visit_Name = lambda node: seen.append(node.value)  # set on the instance: libcst finds it
    walk(module, plain)
    assert seen == ["f", "a", "b"]

    class Stop(Visitor):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def visit_Arg(self, node):
            return False

        def visit_Name(self, node):
            self.names.append(node.value)

    stop = Stop()
    module.visit(stop)
    assert stop.names == ["f"]


def test_ast_nodes_is_ast_walk_in_order():
    import ast

    from msrewrite.analyze.positions import ast_nodes

    for name, text in _sources():
        try:
            tree = ast.parse(text)
        except SyntaxError:  # the syntax sample on a Python older than its except*
            assert name == "syntax" and sys.version_info < (3, 11)
            continue
        assert [id(n) for n in ast_nodes(tree)] == [id(n) for n in ast.walk(tree)]
        func = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
        assert [id(n) for n in ast_nodes(func)] == [id(n) for n in ast.walk(func)]
