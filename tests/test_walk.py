"""analyze/walk.py: a read-only walk makes exactly the visitor calls libcst's `visit` makes, on
the same nodes in the same order, and builds no node while it does."""

from __future__ import annotations

import sys

import libcst as cst
import pytest

from helpers import EXAMPLES, ROOT
from msrewrite.analyze import walk as walk_module
from msrewrite.analyze.walk import Visitor, walk

SYNTAX = """\
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
"""


def _node_classes() -> list[type]:
    found, todo = set(), [cst.CSTNode]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted((c for c in found if not c.__name__.startswith("_")), key=lambda c: c.__name__)


SKIP = ("Lambda", "Decorator", "FormattedStringExpression")  # visit_ says False: no children


def _recording(base: type, trivia: bool = True) -> type:
    """A visitor with visit_/leave_ for every node class (without `trivia`: every node class but
    whitespace, comments, operators and brackets), recording (event, node) pairs."""
    namespace = {}
    for node_cls in _node_classes():
        if not trivia and node_cls.__name__ in {c.__name__ for c in walk_module.TRIVIA}:
            continue
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
    return type(f"Recording{base.__name__}{'' if trivia else 'NoTrivia'}", (base,), namespace)


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
NoTriviaCSTVisitor = _recording(cst.CSTVisitor, trivia=False)
NoTriviaVisitor = _recording(Visitor, trivia=False)


def _sources():
    yield "syntax", SYNTAX
    for path in sorted(EXAMPLES.glob("*.py")):
        yield path.name, path.read_text()
    for rel in ("msrewrite/analyze/walk.py", "msrewrite/cases/_finder.py"):
        yield rel, (ROOT / rel).read_text()


@pytest.mark.parametrize("name,text", list(_sources()), ids=lambda v: v if isinstance(v, str) and len(v) < 60 else "")
def test_walk_makes_libcsts_calls_in_libcsts_order(name, text):
    module = cst.parse_module(text)
    for make in (RecordingCSTVisitor, NoTriviaCSTVisitor, Hooks, Attributes):
        theirs, ours = make(), make()
        module.visit(theirs)
        walk(module, ours)
        assert ours.events == theirs.events, (name, make.__name__)
        assert theirs.events, make.__name__
    assert walk_module._plan(NoTriviaVisitor).skip and not walk_module._plan(RecordingVisitor).skip
    for theirs, ours in ((RecordingCSTVisitor(), RecordingVisitor()), (NoTriviaCSTVisitor(), NoTriviaVisitor())):
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

        def visit_Arg(self, _node):
            return False

        def visit_Name(self, node):
            self.names.append(node.value)

    stop = Stop()
    module.visit(stop)
    assert stop.names == ["f"]


def test_ast_nodes_is_ast_walk_in_order():
    import ast

    from msrewrite.analyze.positions import ast_calls, ast_nodes

    for name, text in _sources():
        try:
            tree = ast.parse(text)
        except SyntaxError:  # the syntax sample on a Python older than its except*
            assert name == "syntax" and sys.version_info < (3, 11)
            continue
        assert [id(n) for n in ast_nodes(tree)] == [id(n) for n in ast.walk(tree)]
        calls = {id(n) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert calls and sorted(id(n) for n in ast_calls(tree)) == sorted(calls)
        func = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
        assert [id(n) for n in ast_nodes(func)] == [id(n) for n in ast.walk(func)]


def _concrete(cls: type) -> set[type]:
    found, todo = set(), [cls]
    while todo:
        current = todo.pop()
        found.add(current)
        todo.extend(current.__subclasses__())
    return found


def test_trivia_hold_only_trivia():
    """A walk leaves out the subtrees of TRIVIA nodes for visitors with no method for any
    TRIVIA class: sound only if such nodes hold nothing else, by libcst's field types..."""
    import dataclasses
    import typing

    def classes(annotation) -> set[type]:
        if isinstance(annotation, type):
            return {annotation}
        return (
            set().union(*(classes(arg) for arg in typing.get_args(annotation)))
            if typing.get_args(annotation)
            else set()
        )

    assert {cst.SimpleWhitespace, cst.Comment, cst.Comma, cst.LeftParen, cst.Add} <= walk_module.TRIVIA
    assert not {cst.Name, cst.Call, cst.Attribute, cst.ImportAlias} & walk_module.TRIVIA
    for trivia in walk_module.TRIVIA:
        for f in dataclasses.fields(trivia):
            for held in classes(f.type):
                if issubclass(held, cst.CSTNode):  # (by name: libcst's add_slots leaves a pre-slots twin of each class)
                    names = {c.__name__ for c in walk_module.TRIVIA}
                    assert {c.__name__ for c in _concrete(held)} <= names, (trivia.__name__, f.name, held.__name__)
                else:
                    assert held in (str, bool, type(None)), (trivia.__name__, f.name, held)


def test_trivia_hold_only_trivia_in_real_trees():
    """... and in the trees the tool parses."""

    class Trivia(cst.CSTVisitor):
        def __init__(self) -> None:
            super().__init__()
            self.depth = 0
            self.seen = 0

        def on_visit(self, node):
            inside = self.depth > 0
            if isinstance(node, tuple(walk_module.TRIVIA)):
                self.depth += 1
                self.seen += 1
            else:
                assert not inside, type(node).__name__
            return True

        def on_leave(self, node):
            if isinstance(node, tuple(walk_module.TRIVIA)):
                self.depth -= 1

    for _name, text in _sources():
        seen = Trivia()
        cst.parse_module(text).visit(seen)
        assert seen.seen and seen.depth == 0


def test_a_visitor_of_trivia_is_walked_through_them():
    module = cst.parse_module("x = f(a,  # one\n      b)  # two\n")

    class Comments(Visitor):
        def __init__(self) -> None:
            super().__init__()
            self.comments: list[str] = []

        def visit_Comment(self, node):
            self.comments.append(node.value)

    seen = Comments()
    module.visit(seen)
    assert seen.comments == ["# one", "# two"]


def test_function_positions_are_the_wrapper_positions():
    """positions._positions renders the module once, as PositionProvider does, without the
    wrapper's walk for batched providers: the same positions for every node."""
    from libcst.metadata import MetadataWrapper, PositionProvider

    from msrewrite.analyze.positions import _positions

    for _name, text in _sources():
        for stmt in cst.parse_module(text).body:
            module = cst.Module(body=[stmt])
            theirs = dict(MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider))
            assert _positions(module) == theirs
