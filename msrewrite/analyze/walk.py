"""Read-only traversal of a libcst tree that does not rebuild it.

libcst's `node.visit(visitor)` rebuilds every node it passes, even for a `CSTVisitor` that
cannot change anything: each node's `_visit_and_replace_children` constructs (and validates) a
copy that is thrown away. For the analysis, which only reads trees, that copy was most of the
cost of a visit. `walk(node, visitor)` makes the same calls on the visitor, in the same order,
on the same (original) nodes, without the copies; a `Visitor` does that under `node.visit`.

The order of a node's children is libcst's own: recorded, once per node class, from the class's
`_visit_and_replace_children` run with a visitor that descends nowhere, so it follows the
installed libcst. Visitors whose hooks could observe more than visit_/leave_ calls (attribute
hooks such as `visit_Call_func`, an overridden `on_visit_attribute`) are walked by libcst
itself, unchanged.
"""

from __future__ import annotations

import dataclasses

from libcst import CSTNode, CSTVisitor, MaybeSentinel

# libcst's own classes under a CSTVisitor: the no-op visit_/leave_ stubs live there
_LIBCST_BASES = frozenset(CSTVisitor.__mro__)
_HOOKS = ("on_visit", "on_leave", "on_visit_attribute", "on_leave_attribute")


class _Recorder(CSTVisitor):
    """Records the attributes a node's `_visit_and_replace_children` visits, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def on_visit(self, node: CSTNode) -> bool:
        return False

    def on_leave(self, original_node: CSTNode) -> None:
        pass

    def on_visit_attribute(self, node: CSTNode, attribute: str) -> None:
        self.names.append(attribute)

    def on_leave_attribute(self, original_node: CSTNode, attribute: str) -> None:
        pass


def _recorded(node: CSTNode) -> tuple[str, ...]:
    recorder = _Recorder()
    node._visit_and_replace_children(recorder)
    return tuple(recorder.names)


def _may_hold_nodes(value: object) -> bool:
    return value is None or isinstance(value, (MaybeSentinel, tuple, list, CSTNode))


def _holds_nodes(value: object) -> bool:
    if isinstance(value, CSTNode):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, CSTNode) for v in value)


# node class -> (attributes libcst visits, in order; attributes it did not visit on the node it
# was recorded from that might hold nodes on another node of the class: checked on every one)
_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _record_class(node: CSTNode) -> tuple[tuple[str, ...], tuple[str, ...]]:
    order = _recorded(node)
    unsure = tuple(
        f.name for f in dataclasses.fields(node) if f.name not in order and _may_hold_nodes(getattr(node, f.name))
    )
    entry = _FIELDS[type(node)] = (order, unsure)
    return entry


def _fields_of(node: CSTNode) -> tuple[str, ...]:
    """The attributes of `node` libcst visits, in its order."""
    order, unsure = _FIELDS.get(type(node)) or _record_class(node)
    if unsure and any(_holds_nodes(getattr(node, name)) for name in unsure):
        return _recorded(node)  # a child libcst visits only on some nodes of the class
    return order


def _own_names(cls: type) -> set[str]:
    """visit_/leave_ names defined below libcst's base classes (the visitor's, not libcst's stubs)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass not in _LIBCST_BASES and klass is not Visitor:
            names |= {n for n in vars(klass) if n.startswith(("visit_", "leave_"))}
    return names


def _plan(cls: type):
    """How to walk for visitor class `cls`: "libcst" (only libcst can), "hooks" (call its
    on_visit / on_leave), or {node class name: (visit method name or None, leave method name or
    None)}, filled as node classes are met. Kept on the class (visitor classes defined inside
    functions come and go with their calls)."""
    plan = cls.__dict__.get("_walk_plan")
    if plan is None:
        own = _own_names(cls)
        base = Visitor if issubclass(cls, Visitor) else CSTVisitor
        overridden = {hook for hook in _HOOKS if getattr(cls, hook) is not getattr(base, hook)}
        if overridden & {"on_visit_attribute", "on_leave_attribute"} or any(n.count("_") > 1 for n in own):
            plan = "libcst"  # attribute hooks (visit_Call_func), or names that might be ones
        elif overridden:
            plan = "hooks"
        else:
            plan = {}
        cls._walk_plan = plan  # type: ignore[attr-defined]
    return plan


def _walker(visitor: CSTVisitor, plan):
    """A function that walks a subtree for `visitor` (whose class's plan is `plan`) as libcst
    would, or None when only libcst can (see _plan; or visit_/leave_ methods set on the
    instance). Called with leave_it=False, it leaves its root's on_leave to the caller."""
    cls = type(visitor)
    if plan == "libcst" or any(key.startswith(("visit_", "leave_", "on_")) for key in vars(visitor)):
        return None
    if plan == "hooks":
        on_visit, on_leave = visitor.on_visit, visitor.on_leave

        def methods(node_cls: type) -> tuple:
            return on_visit, on_leave
    else:
        own: set[str] | None = None

        def methods(node_cls: type) -> tuple:
            nonlocal own
            name = node_cls.__name__
            names = plan.get(name)  # type: ignore[union-attr]
            if names is None:
                if own is None:
                    own = _own_names(cls)
                names = plan[name] = tuple(  # type: ignore[index]
                    method if method in own and getattr(cls, method, None) is not None else None
                    for method in (f"visit_{name}", f"leave_{name}")
                )
            visit, leave = names
            found = table[node_cls] = (getattr(visitor, visit) if visit else None, getattr(visitor, leave) if leave else None)
            return found

    table: dict[type, tuple] = {}
    default = MaybeSentinel.DEFAULT

    def walk_node(node: CSTNode, leave_it: bool = True) -> None:
        node_cls = type(node)
        visit, leave = table.get(node_cls) or methods(node_cls)
        if visit is None or visit(node) is not False:
            order, unsure = _FIELDS.get(node_cls) or _record_class(node)
            if unsure:
                order = _fields_of(node)
            for name in order:
                value = getattr(node, name)
                kind = type(value)
                if kind is tuple or kind is list:
                    for child in value:
                        walk_node(child)
                elif value is not None and value is not default:
                    if kind in _FIELDS or isinstance(value, CSTNode):
                        walk_node(value)
                    else:  # another kind of sequence
                        for child in value:
                            walk_node(child)
        if leave is not None and leave_it:
            leave(node)

    if plan == "hooks":  # on_visit says whether to descend
        def walk_hooks(node: CSTNode, leave_it: bool = True) -> None:
            if on_visit(node):
                for name in _fields_of(node):
                    value = getattr(node, name)
                    kind = type(value)
                    if kind is tuple or kind is list:
                        for child in value:
                            walk_hooks(child)
                    elif value is not None and value is not default:
                        if kind in _FIELDS or isinstance(value, CSTNode):
                            walk_hooks(value)
                        else:  # another kind of sequence
                            for child in value:
                                walk_hooks(child)
            if leave_it:
                on_leave(node)

        return walk_hooks
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
        plan = _plan(type(self))
        walker = _walker(self, plan) if isinstance(plan, dict) else None
        if walker is None:
            return CSTVisitor.on_visit(self, node)
        walker(node, False)  # its visit_ and the children's whole walks; libcst calls on_leave next
        return False  # nothing left for libcst to visit, or to copy


__all__ = ["Visitor", "walk"]
