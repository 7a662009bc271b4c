"""Read-only traversal of a libcst tree that does not rebuild it.

libcst's `node.visit(visitor)` rebuilds every node it passes, even for a `CSTVisitor` that
cannot change anything: each node's children are visited into a new node, constructed (and
validated) and thrown away. For the analysis, which only reads trees, that copy was most of the
cost of a visit. `walk(node, visitor)` makes the same calls on the visitor, in the same order,
on the same (original) nodes, without the copies; a `Visitor` does that under `node.visit`.

The order of a node's children is libcst's own: recorded, once per node class, by libcst's
public `node.visit` with a visitor that enters the node and none of its children (its
on_visit_attribute hook names each attribute visited), so it follows the installed libcst. Visitors whose hooks could observe more than visit_/leave_ calls (attribute
hooks such as `visit_Call_func`, an overridden `on_visit_attribute`) are walked by libcst
itself, unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from operator import attrgetter
from types import FunctionType

from libcst import CSTNode, CSTVisitor, MaybeSentinel

from msrewrite.analyze.budget import charge

# libcst's own classes under a CSTVisitor: the no-op visit_/leave_ stubs live there
_LIBCST_BASES = frozenset(CSTVisitor.__mro__)
_HOOKS = ("on_visit", "on_leave", "on_visit_attribute", "on_leave_attribute")


class _Recorder(CSTVisitor):
    """Records the attributes libcst visits on one node, in order: `node.visit(recorder)` enters
    the node itself (libcst then visits its attributes, calling on_visit_attribute for each) and
    none of its children."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.entered = False

    def on_visit(self, _node: CSTNode) -> bool:
        entered, self.entered = self.entered, True
        return not entered  # the root's attributes, no child's

    def on_leave(self, original_node: CSTNode) -> None:
        pass

    def on_visit_attribute(self, _node: CSTNode, attribute: str) -> None:
        self.names.append(attribute)

    def on_leave_attribute(self, original_node: CSTNode, attribute: str) -> None:
        pass


def _recorded(node: CSTNode) -> tuple[str, ...]:
    recorder = _Recorder()
    node.visit(recorder)
    return tuple(recorder.names)


def _is_node(value: object) -> bool:
    """isinstance(value, CSTNode), without the ABC machinery: a failed isinstance check against
    an abstract class walks every subclass of it (hundreds, for CSTNode) the first time."""
    return CSTNode in type(value).__mro__


def _may_hold_nodes(value: object) -> bool:
    return value is None or isinstance(value, (MaybeSentinel, tuple, list)) or _is_node(value)


def _holds_nodes(value: object) -> bool:
    if _is_node(value):
        return True
    return isinstance(value, (tuple, list)) and any(_is_node(v) for v in value)


# node class -> (attributes libcst visits, in order; attributes it did not visit on the node it
# was recorded from that might hold nodes on another node of the class: checked on every one;
# a function returning the visited attributes' values of a node, as a tuple)
_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...], Callable]] = {}


def _values_getter(order: tuple[str, ...]) -> Callable:
    if len(order) > 1:
        return attrgetter(*order)
    if order:
        get = attrgetter(order[0])
        return lambda node: (get(node),)
    return lambda _node: ()


def _record_class(node: CSTNode) -> tuple[tuple[str, ...], tuple[str, ...], Callable]:
    order = _recorded(node)
    unsure = tuple(
        f.name for f in dataclasses.fields(node) if f.name not in order and _may_hold_nodes(getattr(node, f.name))
    )
    entry = _FIELDS[type(node)] = (order, unsure, _values_getter(order))
    return entry


def _values_of(node: CSTNode, entry: tuple) -> tuple:
    """The values of the attributes of `node` libcst visits, in its order (`entry`: its class's)."""
    order, unsure, values = entry
    if unsure and any(_holds_nodes(getattr(node, name)) for name in unsure):
        return tuple(getattr(node, name) for name in _recorded(node))  # visited on some nodes of the class only
    return values(node)


def _trivia() -> frozenset[type]:
    """Whitespace, comments, operators and brackets: nodes that hold nothing but each other
    (tests/test_walk.py checks that on libcst's field types and on real trees). Named through
    libcst's public classes: the operator and whitespace bases, and the punctuation nodes that
    have no base of their own. A class libcst adds later is simply walked (slower, never wrong)."""
    import libcst

    bases = tuple(
        getattr(libcst, name)
        for name in (
            "BaseBinaryOp",
            "BaseUnaryOp",
            "BaseBooleanOp",
            "BaseCompOp",
            "BaseAugOp",
            "BaseParenthesizableWhitespace",
        )
    )
    names = {
        "AssignEqual",
        "Colon",
        "Comma",
        "Dot",
        "ImportStar",
        "Semicolon",  # punctuation
        "Comment",
        "EmptyLine",
        "Newline",
        "TrailingWhitespace",  # lines and comments
        "LeftParen",
        "RightParen",
        "LeftSquareBracket",
        "RightSquareBracket",
        "LeftCurlyBrace",
        "RightCurlyBrace",
    }
    return frozenset(  # __mro__, not issubclass: an ABC's subclass check walks all its subclasses
        c
        for name, c in vars(libcst).items()
        if isinstance(c, type) and CSTNode in c.__mro__ and (name in names or any(b in c.__mro__ for b in bases))
    )


TRIVIA = _trivia()
_TRIVIA_METHODS = frozenset(f"{kind}_{c.__name__}" for c in TRIVIA for kind in ("visit", "leave"))


class _Plan:
    """How to walk for one visitor class: "libcst" (only libcst can: attribute hooks such as
    visit_Call_func, an overridden on_visit_attribute), "hooks" (its own on_visit / on_leave),
    or "methods": its visit_/leave_ methods per node class. `skip`: the node classes whose
    subtrees the walk may leave out because the visitor has no method for any node in them
    (TRIVIA, unless it visits some of those). `table`, for "methods" visitors whose methods
    are all plain functions: node class -> (visit_ function or None, leave_ function or None,
    the class's _FIELDS entry), filled as node classes are met and shared by every walk."""

    __slots__ = ("kind", "cls", "own", "skip", "table", "plain")

    def __init__(self, kind: str, cls: type, own: dict[str, object]) -> None:
        self.kind, self.cls, self.own = kind, cls, own
        self.skip = TRIVIA if kind == "methods" and not own.keys() & _TRIVIA_METHODS else frozenset()
        self.table: dict[type, tuple] = {}
        # a plain function is called with the visitor as `self`, as its bound method would be;
        # anything else (a staticmethod, a callable object) is bound for each walk
        self.plain = all(isinstance(attr, FunctionType) for attr in own.values())

    def names(self, node_cls: type) -> tuple:
        """(visit method name or None, leave method name or None) for a node class."""
        cls_name = node_cls.__name__
        return tuple(method if method in self.own else None for method in (f"visit_{cls_name}", f"leave_{cls_name}"))

    def entry(self, node: CSTNode) -> tuple:
        """The table entry for the class of `node` (a plain visitor's)."""
        node_cls = type(node)
        visit, leave = self.names(node_cls)
        found = self.table[node_cls] = (
            self.own[visit] if visit else None,
            self.own[leave] if leave else None,
            _FIELDS.get(node_cls) or _record_class(node),
        )
        return found


def _own_methods(cls: type) -> dict[str, object]:
    """visit_/leave_ name -> the attribute as the class defines it, for the names defined below
    libcst's base classes (the visitor's, not libcst's stubs) and not set to None."""
    own: dict[str, object] = {}
    for klass in cls.__mro__:
        if klass not in _LIBCST_BASES and klass is not Visitor:
            for name, attr in vars(klass).items():
                if name.startswith(("visit_", "leave_")):
                    own.setdefault(name, attr)
    return {name: attr for name, attr in own.items() if getattr(cls, name, None) is not None}


def _plan(cls: type) -> _Plan:
    """The class's walk plan, kept on the class (visitor classes defined inside functions come
    and go with their calls)."""
    plan = cls.__dict__.get("_walk_plan")
    if plan is None:
        own = _own_methods(cls)
        base = Visitor if Visitor in cls.__mro__ else CSTVisitor
        overridden = {hook for hook in _HOOKS if getattr(cls, hook) is not getattr(base, hook)}
        if overridden & {"on_visit_attribute", "on_leave_attribute"} or any(n.count("_") > 1 for n in own):
            kind = "libcst"  # attribute hooks (visit_Call_func), or names that might be ones
        else:
            kind = "hooks" if overridden else "methods"
        plan = _Plan(kind, cls, own)
        cls._walk_plan = plan  # type: ignore[attr-defined]
    return plan


_PREFIXES = ("visit_", "leave_", "on_")


def _walker(visitor: CSTVisitor, plan: _Plan):
    """A function that walks a subtree for `visitor` (whose class's plan is `plan`) as libcst
    would, or None when only libcst can (see _Plan; or visit_/leave_ methods set on the
    instance). Called with leave_it=False, it leaves its root's on_leave to the caller."""
    if plan.kind == "libcst":
        return None
    for key in vars(visitor):
        if key.startswith(_PREFIXES):
            return None
    if plan.kind == "hooks":
        return _hooks_walker(visitor)
    return _methods_walker(visitor, plan)


def _hooks_walker(visitor: CSTVisitor):
    """The walk for a visitor with its own on_visit / on_leave: every node goes through them."""
    default = MaybeSentinel.DEFAULT
    fields = _FIELDS
    on_visit, on_leave = visitor.on_visit, visitor.on_leave

    def walk_hooks(node: CSTNode, leave_it: bool = True) -> None:
        if on_visit(node):
            for value in _values_of(node, fields.get(type(node)) or _record_class(node)):
                kind = type(value)
                if kind is tuple or kind is list:
                    for child in value:
                        walk_hooks(child)
                elif value is not None and value is not default:
                    if kind in fields or _is_node(value):
                        walk_hooks(value)
                    else:  # another kind of sequence
                        for child in value:
                            walk_hooks(child)
        if leave_it:
            on_leave(node)

    return walk_hooks


def _methods_walker(visitor: CSTVisitor, plan: _Plan):
    """The walk for a visitor with visit_/leave_ methods: each node class's pair looked up once."""
    default = MaybeSentinel.DEFAULT
    fields = _FIELDS
    skip = plan.skip
    if plan.plain:
        table, entry_for = plan.table, plan.entry
        this = visitor
    else:  # bound methods, for this walk only
        table = {}
        this = None

        def entry_for(node: CSTNode) -> tuple:
            node_cls = type(node)
            visit, leave = plan.names(node_cls)
            found = table[node_cls] = (
                getattr(visitor, visit) if visit else None,
                getattr(visitor, leave) if leave else None,
                fields.get(node_cls) or _record_class(node),
            )
            return found

    def walk_node(node: CSTNode, leave_it: bool = True) -> None:
        visit, leave, entry = table.get(type(node)) or entry_for(node)
        if visit is None or (visit(this, node) if this is not None else visit(node)) is not False:
            for value in entry[2](node) if not entry[1] else _values_of(node, entry):
                kind = type(value)
                if kind is tuple or kind is list:
                    for child in value:
                        if type(child) not in skip:
                            walk_node(child)
                elif kind in skip or value is None or value is default:
                    continue
                elif kind in fields or _is_node(value):
                    walk_node(value)
                else:  # another kind of sequence
                    for child in value:
                        if type(child) not in skip:
                            walk_node(child)
        if leave is not None and leave_it:
            leave(this, node) if this is not None else leave(node)

    return walk_node


def walk(node: CSTNode, visitor: CSTVisitor) -> None:
    """`node.visit(visitor)` for a read-only visitor: the same visit_/leave_ calls in the same
    order, on the same nodes, without libcst's copy of the tree."""
    walker = _walker(visitor, _plan(type(visitor)))
    if walker is None:
        node.visit(visitor)
    else:
        walker(node)


class Visitor(CSTVisitor):
    """A CSTVisitor that `node.visit(visitor)` walks without rebuilding the tree: define
    visit_<Node> / leave_<Node> methods as for any CSTVisitor (a visit_ returning False skips
    the children). Attribute hooks (visit_<Node>_<attribute>) or an overridden on_leave hand the
    walk back to libcst."""

    def on_visit(self, node: CSTNode) -> bool:
        charge()  # a walk is a step of the function's analysis budget
        plan = _plan(type(self))
        walker = _walker(self, plan) if plan.kind == "methods" else None
        if walker is None:
            return CSTVisitor.on_visit(self, node)
        walker(node, False)  # its visit_ and the children's whole walks; libcst calls on_leave next
        return False  # nothing left for libcst to visit, or to copy


__all__ = ["Visitor", "walk"]
