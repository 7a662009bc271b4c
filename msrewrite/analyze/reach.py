"""What a value in a class's code can be, read from the source (never run):

- `attribute_stores`: each value a method puts into `self.<attr>`;
- `local_values`: each value a function binds to a local name, or None when some binding is
  not a plain assignment (a parameter, a loop target, `x += ...`): then the name can hold
  anything;
- `class_targets` / `instance_targets`: the classes a class-valued expression or a constructed
  value can be, through factories (`build_fused_moe(...)` returns one of several classes' instances),
  class-valued variables and helpers (`moe_cls = get_moe_impl_class(cfg)`, `moe_cls(...)`), `if`
  expressions and `a or B`; a factory's parameter is what the call being followed passes
  (`make(..., runner_cls=Cls)` with `cls = runner_cls or Default`), read in the caller's scope,
  else its default.

Every target list is complete or None: a branch msrewrite cannot follow makes the whole answer
None, so a caller resolving a call through these unions every possible callee or calls it
unknown, never a subset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from msrewrite.analyze.defuse import dotted_name
from msrewrite.analyze.walk import Visitor

if TYPE_CHECKING:
    from msrewrite.analyze.summaries import ModuleSummaries

Target = tuple["ModuleSummaries", str]  # a class: the module that defines it, its name

# factory -> factory hops followed before a value counts as unknown
MAX_HOPS = 4
# stand-in a store records when the value put into `self.<attr>` cannot be told apart
UNSEEN_STORE = "__unseen_store__"


def _unseen(what: cst.CSTNode) -> cst.BaseExpression:
    """A value that resolves to nothing seen into, carrying the source it came from for messages."""
    return cst.Call(
        func=cst.Name(UNSEEN_STORE), args=[cst.Arg(value=what)] if isinstance(what, cst.BaseExpression) else []
    )


def _self_attr(node: cst.BaseExpression) -> str | None:
    name = dotted_name(node)
    return name[5:] if name and name.startswith("self.") and name.count(".") == 1 else None


class _AttributeStores(Visitor):
    """The stores into `self.<attr>` of one method (see `attribute_stores`)."""

    def __init__(self, method: cst.FunctionDef) -> None:
        super().__init__()
        self.method = method
        self.found: list[tuple[str, cst.BaseExpression]] = []

    def store(self, target: cst.BaseExpression, value: cst.BaseExpression | None) -> None:
        attr = _self_attr(target)
        if attr is not None:
            self.found.append((attr, value if value is not None else _unseen(target)))
        elif isinstance(target, cst.Subscript) and _self_dict(target.value):
            # self.__dict__["k"] = v, vars(self)[k] = v: an attribute by its name in the table
            key = target.slice[0].slice if len(target.slice) == 1 else None
            key_value = key.value if isinstance(key, cst.Index) else None
            literal = isinstance(key_value, cst.SimpleString) and isinstance(key_value.evaluated_value, str)
            name = key_value.evaluated_value if literal else "*"  # type: ignore[union-attr]
            self.found.append((str(name), value if value is not None else _unseen(target)))
        elif isinstance(target, (cst.Tuple, cst.List)):
            pairs = value.elements if isinstance(value, (cst.Tuple, cst.List)) else None
            same = pairs is not None and len(pairs) == len(target.elements)
            for i, element in enumerate(target.elements):
                inner = pairs[i].value if same and pairs is not None else None
                if isinstance(element, cst.StarredElement) or isinstance(inner, cst.StarredElement):
                    inner = None
                self.store(element.value, inner)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node is self.method

    def visit_ClassDef(self, _node: cst.ClassDef) -> bool:
        return False

    def visit_Lambda(self, _node: cst.Lambda) -> bool:
        return False

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:  # `self.a = self.b = X()`: both hold X()
            self.store(t.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self.store(node.target, node.value)

    def visit_For(self, node: cst.For) -> None:
        self.store(node.target, None)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self.store(node.asname.name, None)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self.store(node.target, None)

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value in _TABLE_FILLS and _self_dict(func.value):
            self.found.append(("*", node))  # self.__dict__.update(d): any attribute may hold what d holds
            return
        # setattr(self, "k", v), and object.__setattr__(self, "k", v) with the same arguments
        if (dotted_name(func) != "setattr" and dotted_name(func) not in _SETATTR_UNBOUND) or len(node.args) < 3:
            return
        receiver, name, value = (a.value for a in node.args[:3])
        if not (isinstance(receiver, cst.Name) and receiver.value == "self"):
            return
        if isinstance(name, cst.SimpleString) and isinstance(name.evaluated_value, str):
            self.found.append((name.evaluated_value, value))
        else:
            self.found.append(("*", value))


# the instance's attribute table, filled by name: `self.__dict__[k] = v`, `vars(self).update(d)`
_TABLE_FILLS = frozenset({"update", "setdefault", "__setitem__"})
_SETATTR_UNBOUND = frozenset({"object.__setattr__", "nn.Module.__setattr__", "torch.nn.Module.__setattr__"})


def _self_dict(node: cst.BaseExpression) -> bool:
    """`self.__dict__` or `vars(self)`."""
    if isinstance(node, cst.Attribute):
        return node.attr.value == "__dict__" and isinstance(node.value, cst.Name) and node.value.value == "self"
    if isinstance(node, cst.Call) and dotted_name(node.func) == "vars" and len(node.args) == 1:
        arg = node.args[0].value
        return isinstance(arg, cst.Name) and arg.value == "self"
    return False


def attribute_stores(method: cst.FunctionDef) -> list[tuple[str, cst.BaseExpression]]:
    """(attr, value) for each store into `self.<attr>` in `method` (nested functions and classes
    skipped: their `self` is another object), in source order; "*" for `setattr(self, name, v)`
    whose name is not a string literal."""
    stores = _AttributeStores(method)
    method.visit(stores)
    return stores.found


class _NotLocal:
    """`local_values` of a name the function never binds: a module-level or builtin name."""


NOT_LOCAL = _NotLocal()


class _LocalBinds(Visitor):
    """The bindings of one name in one function (see `local_values`)."""

    def __init__(self, func: cst.FunctionDef, name: str) -> None:
        super().__init__()
        self.func, self.name = func, name
        self.values: list[cst.BaseExpression] = []
        self.other = False  # bound some way that is not `name = value` or `from m import name`
        self.imported: list[tuple[int, str, str]] = []  # `from <dots><module> import <name>`

    def bind(self, target: cst.BaseExpression, value: cst.BaseExpression | None) -> None:
        if isinstance(target, cst.Name) and target.value == self.name:
            if value is None:
                self.other = True
            else:
                self.values.append(value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self.bind(element.value, None)
        elif isinstance(target, cst.StarredElement):
            self.bind(target.value, None)

    def _names(self, names) -> None:
        if any(n.name.value == self.name for n in names):
            self.other = True

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        if node is self.func:
            return True
        self.bind(node.name, None)
        # a nested function binds its own locals, except a name it declares `nonlocal`
        nested = _Nonlocals(self.name)
        node.body.visit(nested)
        self.other = self.other or nested.found
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.bind(node.name, None)
        return False

    def visit_Lambda(self, _node: cst.Lambda) -> bool:
        return False

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self.bind(t.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self.bind(node.target, node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.bind(node.target, None)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self.bind(node.target, node.value)

    def visit_For(self, node: cst.For) -> None:
        self.bind(node.target, None)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self.bind(node.target, None)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self.bind(node.asname.name, None)

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        if node.name is not None:
            self.bind(node.name.name, None)

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            bound = alias.asname.name if alias.asname is not None else alias.name
            if (dotted_name(bound) or "").split(".")[0] == self.name:
                self.other = True

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if isinstance(node.names, cst.ImportStar):
            self.other = True
            return
        for alias in node.names:
            bound = alias.asname.name if alias.asname is not None else alias.name
            if isinstance(bound, cst.Name) and bound.value == self.name:
                source = dotted_name(node.module) if node.module is not None else ""
                self.imported.append((len(node.relative), source or "", dotted_name(alias.name) or ""))

    def visit_Global(self, node: cst.Global) -> None:
        self._names(node.names)

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self._names(node.names)

    def visit_Del(self, node: cst.Del) -> None:
        self.bind(node.target, None)


class _Nonlocals(Visitor):
    """Whether a nested function's body declares `nonlocal <name>` (at any depth)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.found = name, False

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.found = self.found or any(n.name.value == self.name for n in node.names)


def local_values(
    func: cst.FunctionDef, name: str, cache: dict | None = None
) -> list[cst.BaseExpression] | None | _NotLocal:
    """Every value `func` binds to the local `name` by a plain `name = value`; None when it is
    also bound otherwise (a parameter, a loop or `with` target, `name += ...`, unpacking, an
    import, `global`): it can then hold anything; NOT_LOCAL when `func` never binds it. `cache`:
    the caller's, kept while `func`'s tree is alive (keyed by its id)."""
    key = (id(func), name)
    if cache is not None and key in cache:
        return cache[key]
    found = _local_values(func, name)
    if cache is not None:
        cache[key] = found
    return found


def _local_values(func: cst.FunctionDef, name: str) -> list[cst.BaseExpression] | None | _NotLocal:
    params = func.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    every += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
    if any(p.name.value == name for p in every):
        return None
    binds = _LocalBinds(func, name)
    func.visit(binds)
    if binds.other or binds.imported:
        return None
    return binds.values if binds.values else NOT_LOCAL


def local_import(func: cst.FunctionDef, name: str) -> tuple[int, str, str] | None:
    """(dots, module, name) when `func` binds `name` only by one `from <module> import <name>`
    inside its body (an import kept out of the module's import time); else None."""
    binds = _LocalBinds(func, name)
    func.visit(binds)
    if binds.other or binds.values or len(binds.imported) != 1:
        return None
    return binds.imported[0]


def returned_values(func: cst.FunctionDef) -> list[cst.BaseExpression] | None:
    """The values `func`'s `return` statements give (a bare `return` or falling off the end
    gives None, which holds no class); None for a generator, whose call returns no value of these."""
    values: list[cst.BaseExpression] = []
    generator = False

    class _Returns(Visitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is func

        def visit_ClassDef(self, _node: cst.ClassDef) -> bool:
            return False

        def visit_Lambda(self, _node: cst.Lambda) -> bool:
            return False

        def visit_Return(self, node: cst.Return) -> None:
            if node.value is not None:
                values.append(node.value)

        def visit_Yield(self, _node: cst.Yield) -> None:
            nonlocal generator
            generator = True

    func.visit(_Returns())
    return None if generator else values


def _union(parts: list[list[Target] | None]) -> list[Target] | None:
    out: list[Target] = []
    for part in parts:
        if part is None:
            return None
        out += [t for t in part if not any(t[0] is o[0] and t[1] == o[1] for o in out)]
    return out


def _is_none(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


# a factory's parameter -> what the call binds it to: the argument expression, the file and the
# function it is written in (its default: the factory's own file, at module level), and the
# bindings of that function when it is a factory being followed itself
Bindings = dict[str, tuple["ModuleSummaries", cst.BaseExpression, cst.FunctionDef | None, "Bindings | None"]]


def _bound(name: str, home: cst.FunctionDef | None, bound: Bindings | None):
    """What the call binds the parameter `name` of `home` (the factory being followed) to, when
    the body never binds it again; None otherwise."""
    if bound is None or home is None or name not in bound:
        return None
    binds = _LocalBinds(home, name)
    home.visit(binds)
    return None if binds.values or binds.other or binds.imported else bound[name]


def class_targets(
    owner: ModuleSummaries,
    expr: cst.BaseExpression,
    home: cst.FunctionDef | None,
    hops: int = 0,
    bound: Bindings | None = None,
) -> list[Target] | None:
    """The classes `expr` (evaluated in `home`, a function of `owner`'s file; None: at module
    level) may be: a class name, a local bound only to class names, `A if c else B`, `a or B`, a
    call of a function that returns only classes (`get_moe_impl_class(cfg)`), a parameter of a
    factory that the call being followed binds to one (`bound`; `None` is no class). None when
    any possibility is not a class msrewrite reads (a registry filled at import time is one:
    anything may be put in)."""
    if hops > MAX_HOPS:
        return None
    if _is_none(expr):
        return []  # `runner_cls or Default` with runner_cls None: Default
    if isinstance(expr, cst.IfExp):
        return _union([class_targets(owner, e, home, hops, bound) for e in (expr.body, expr.orelse)])
    if isinstance(expr, cst.BooleanOperation) and isinstance(expr.operator, cst.Or):
        return _union([class_targets(owner, e, home, hops, bound) for e in (expr.left, expr.right)])
    if isinstance(expr, cst.Name) and home is not None:
        binding = _bound(expr.value, home, bound)
        if binding is not None:  # a factory's parameter: what the call passes, in the caller's scope
            where, given, caller, outer = binding
            return class_targets(where, given, caller, hops + 1, outer)
        bound_locally = local_values(home, expr.value, owner.reach_cache)
        if bound_locally is None:
            return None
        if not isinstance(bound_locally, _NotLocal):
            return _union([class_targets(owner, v, home, hops, bound) for v in bound_locally])
    if isinstance(expr, (cst.Name, cst.Attribute)):
        named = dotted_name(expr)
        found = owner.find_class(named) if named else None
        return [found] if found is not None else None
    if isinstance(expr, cst.Call):
        return _through_function(owner, expr, home, hops, class_targets, bound)
    return None


def instance_targets(
    owner: ModuleSummaries,
    expr: cst.BaseExpression,
    home: cst.FunctionDef | None,
    hops: int = 0,
    bound: Bindings | None = None,
) -> list[Target] | None:
    """The classes whose instance `expr` (evaluated in `home`) may be: a constructor call
    (`Cls(...)`, `moe_cls(...)`, `get_moe_impl_class(cfg)(...)`), a factory call whose every
    return is such an instance (`build_fused_moe(...)`), a local bound only to them, an `if`
    expression of them. None when any possibility is not one msrewrite reads."""
    if hops > MAX_HOPS:
        return None
    if _is_none(expr):
        return []
    if isinstance(expr, cst.IfExp):
        return _union([instance_targets(owner, e, home, hops, bound) for e in (expr.body, expr.orelse)])
    if isinstance(expr, cst.Name) and home is not None:
        bound_locally = local_values(home, expr.value, owner.reach_cache)
        if bound_locally is None or isinstance(bound_locally, _NotLocal):
            return None
        return _union([instance_targets(owner, v, home, hops, bound) for v in bound_locally])
    if not isinstance(expr, cst.Call):
        return None
    classes = class_targets(owner, expr.func, home, hops, bound)
    if classes is not None:
        return classes
    return _through_function(owner, expr, home, hops, instance_targets, bound)


def _bindings(
    owner: ModuleSummaries,
    call: cst.Call,
    caller: cst.FunctionDef | None,
    outer: Bindings | None,
    where: ModuleSummaries,
    func: cst.FunctionDef,
) -> Bindings | None:
    """What `call` binds each parameter of `func` to: the argument written (in `owner`, inside
    `caller`), else the parameter's default (in `where`, at module level). None when the call
    spreads `*args` / `**kwargs` (any parameter may be set there)."""
    if any(a.star for a in call.args):
        return None
    params = func.params
    positional = [*params.posonly_params, *params.params]
    out: Bindings = {}
    for p in (*positional, *params.kwonly_params):
        if p.default is not None:
            out[p.name.value] = (where, p.default, None, None)
    given = [a for a in call.args if a.keyword is None]
    for p, arg in zip(positional, given, strict=False):
        out[p.name.value] = (owner, arg.value, caller, outer)
    for arg in call.args:
        if arg.keyword is not None:
            out[arg.keyword.value] = (owner, arg.value, caller, outer)
    return out


def _through_function(
    owner: ModuleSummaries,
    call: cst.Call,
    caller: cst.FunctionDef | None,
    hops: int,
    follow,
    outer: Bindings | None = None,
) -> list[Target] | None:
    """What a call of a free function msrewrite reads can give: `follow` over each returned value,
    in the function's own file and scope, its parameters bound to what the call passes."""
    named = dotted_name(call.func)
    found = owner.find_function(named) if named else None
    if found is None:
        return None
    where, name = found
    func = where.functions[name]
    if not isinstance(func, cst.FunctionDef) or func.decorators:
        return None  # a decorator may return something else
    values = returned_values(func)
    if values is None:
        return None
    bound = _bindings(owner, call, caller, outer, where, func)
    return _union([follow(where, v, func, hops + 1, bound) for v in values if not _is_none(v)])
