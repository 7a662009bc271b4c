"""Static def-use facts for the top-level statements of one function (no import, no execution).

Each statement (a compound statement counts as one unit) gets the names it reads, the names it
binds, the names whose objects it writes in place (through views too: `x.view(-1).mul_(2)`
writes x), the storage links its bindings make (`h = x.view(..)`, `lst[0] = x`, `self.last = x`),
what callees it cannot see into may write, and the `self.<attr>` submodules it calls. That is
enough to decide whether a group of statements can move: dataflow by name, plus in-place writes
and aliasing, which are what make moving tensor code unsafe. What a call does comes from the torch
effects table (torch_effects.py) and, for same-file code, from summaries (summaries.py).

These facts are the one statement IR of msrewrite: `apply`'s branch finder reads them, and
`suggest` builds its statement DAG from them (stmtgraph.py, which apply never imports).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence, Set
from dataclasses import field
from typing import Any

import libcst as cst
from libcst.metadata import CodeRange

from msrewrite.analyze.spreads import spread_expansions
from msrewrite.analyze.torch_effects import (
    METADATA_ATTRS,
    CallEffect,
    dotted,
    is_inplace_name,
    is_ordering_call,
    is_stream_object,
    torch_call_effect,
)
from msrewrite.analyze.torch_names import TENSOR_METHODS
from msrewrite.analyze.walk import Visitor
from msrewrite.records import record


@record
class StatementFacts:
    """What one top-level statement of a function reads, binds and writes, and the calls it makes."""

    index: int
    node: cst.BaseStatement
    first_line: int
    last_line: int
    loads: set[str] = field(default_factory=set)
    stores: set[str] = field(default_factory=set)
    mutates: set[str] = field(default_factory=set)
    self_calls: list[str] = field(default_factory=list)  # dotted callee after "self.", e.g. "shared_expert.down_proj"
    calls: list[cst.Call] = field(default_factory=list)  # the calls behind self_calls, in source order
    has_call: bool = False
    exits: bool = False  # contains return / yield / raise: leaving the function early
    raises: bool = False
    # effects beyond names: storage shared through bindings, writes by callees msrewrite cannot
    # see into (name -> the callee), and what kind of work the statement holds
    links: set[tuple[str, str]] = field(default_factory=set)
    # the links that store into an object the target already names (`lst[0] = x`, `obj.a = x`,
    # `put(lst, x)`), not rebindings of it: a summary reads "argument i now holds argument j" here
    stored: set[tuple[str, str]] = field(default_factory=set)
    # links of an augmented assignment from its right side (`lst += [x]`: (x, lst)) or of a store
    # into a field (`obj.a = x`, `lst[0] = x`): the target holds those objects only after its own
    # in-place write
    late_links: set[tuple[str, str]] = field(default_factory=set)
    self_stores: set[str] = field(default_factory=set)  # `self.x = v`: "self.x" (its old value is replaced)
    # attributes rebound (`obj.a = v`, `self.calls += 1`, `del obj.a`, or inside a callee: its
    # summary's, on the call's receiver), as dotted paths ("self.shared_experts.last_norm"): an
    # effect on the object's state even where no tensor is written in place
    rebinds: set[str] = field(default_factory=set)
    may_write: dict[str, str] = field(default_factory=dict)
    unknown_callees: set[str] = field(default_factory=set)
    unseen_work: set[str] = field(default_factory=set)  # CallEffect.unseen_work of its calls
    collective: bool = False
    rng: bool = False
    stream: bool = False
    # stream ordering (an event or stream wait, a synchronize): later work must not start before it
    barrier: bool = False
    # asynchronous collectives this statement starts (see `extend_pending`), and the buffers an
    # earlier one is still writing (or reading) while this statement runs: name -> why
    async_ops: list[AsyncOp] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)


@record
class AsyncOp:
    """One asynchronous collective a statement starts: the names of the buffers it keeps writing
    and reading until its result is waited, and whether a first use of the result waits (an
    AsyncCollectiveTensor) or only `.wait()` / `wait_tensor` does (a work handle)."""

    label: str
    writes: set[str]
    reads: set[str]
    waits_on_use: bool


# 'self.shared_expert.down_proj' for an attribute chain of names, else None (one implementation,
# in the effects table, which this module builds on)
dotted_name = dotted


def self_callee(func: cst.BaseExpression) -> str | None:
    """'experts' for self.experts[i](...), 'shared_expert.down_proj' for self.shared_expert.down_proj(...)."""
    parts: list[str] = []
    node = func
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        if isinstance(node, cst.Attribute):
            parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name) and node.value == "self" and parts:
        return ".".join(reversed(parts))
    return None


def _stream_value(node: cst.BaseExpression) -> bool:
    """A stream or event object (or None): `torch.npu.Event()`, msrewrite's own
    `_ms_side_stream(...)`, `torch.npu.Stream() if on else None`."""
    if isinstance(node, cst.IfExp):
        branches = (node.body, node.orelse)
        return any(_stream_value(b) for b in branches) and all(
            _stream_value(b) or (isinstance(b, cst.Name) and b.value == "None") for b in branches
        )
    if isinstance(node, cst.Call) and (dotted(node.func) or "").startswith("_ms_"):
        return True
    return is_stream_object(node)


def _is_self(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "self"


def _root_name(node: cst.BaseExpression) -> str | None:
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None


# Resolves a call the torch table does not know (a submodule, a helper, a same-file function):
# its CallEffect, or an unknown one. None: no resolver, unknown calls are taken as before (no writes).
CallResolver = Callable[[cst.Call, "Scope"], CallEffect]


@record
class Scope:
    """What the statements of one function share: local closures and the submodules behind
    loop variables (`for expert in self.experts`)."""

    resolver: CallResolver | None = None
    closures: dict[str, StatementFacts] = field(default_factory=dict)  # nested def -> its effects
    # nested def -> (its parameters in order, those it may write in place): bound at each call
    closure_params: dict[str, tuple[tuple[str, ...], frozenset[str]]] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)  # local name -> "self.experts[]"
    # locals that may hold an object other than a tensor, with the value they were bound to:
    # `acc = self.acc`, `acc = get_acc()`, `ops = Ops()`. A method called on one is that object's
    # method (`acc.add(x, h)` may be `Acc.add`, which may write x), never a tensor method by name.
    # Flow-insensitive: once bound so, a later tensor binding of the name does not clear it.
    receivers: dict[str, cst.BaseExpression] = field(default_factory=dict)
    # `self.<attr>` names the class's `__init__` assigns (submodules, tensors, config); None when
    # there is no class: `self.<other>(...)` is then a method, whose reads of module state are unseen
    state_attrs: frozenset[str] | None = None
    # names the module binds to modules, classes and functions (`np`, `MoE`, `helper`): not tensors
    module_names: frozenset[str] = frozenset()
    # locals bound to a stream or event object (`ev = torch.npu.Event()`) in the statements seen so
    # far, and those of them msrewrite's own edit made (`s = _ms_side_stream(...)`)
    stream_locals: set[str] = field(default_factory=set)
    own_streams: set[str] = field(default_factory=set)
    # `self.<attr>`s `__init__` sets from msrewrite's own helpers (`_ms_stream_events(...)`):
    # `fork_event, join_event = self.<attr>` binds its own events
    own_stream_attrs: frozenset[str] = frozenset()
    # `self.<name>` attributes the class defines as a @property: reading one runs its getter
    properties: frozenset[str] = frozenset()
    # the class's own method `name` -> the `self.<chain>`s its body (and the same-file methods it
    # calls, and their same-file overrides) reads; None when `self` escapes or a definition is not
    # in this file: then the call may read any of the object's state
    method_reads: Callable[[str], frozenset[str] | None] | None = None
    # locals bound to an asynchronous collective's work or result (`work = dist.all_reduce(x,
    # async_op=True)`): `work.wait()` ends its buffer's write (extend_pending) and orders streams
    work_locals: set[str] = field(default_factory=set)
    # every name the function binds (parameters, assignments, loops, `with`/`except` targets,
    # nested defs, at any depth): a call of such a name is of that local, never of the module's
    # function or import of the same name (summaries.function_locals)
    local_names: frozenset[str] = frozenset()
    # id(call) -> its arguments with the `*seq` / `**mapping` the function builds written out
    # (analyze/spreads.py); None until a function body is seen
    spreads: dict[int, tuple[cst.Arg, ...]] | None = None
    # nested functions handed on or stored so far -> their free variables (read at any later point)
    escaped: dict[str, frozenset[str]] = field(default_factory=dict)

    def note_body(self, body: Sequence[cst.BaseStatement]) -> None:
        """Reads what the function body builds for its spreads (once: a guarded `if`'s flattened
        body is not the function's own)."""
        if self.spreads is None:
            self.spreads = spread_expansions(body)

    def effect_of(self, call: cst.Call) -> CallEffect:
        expanded = self.spreads.get(id(call)) if self.spreads else None
        if expanded is not None:
            call = call.with_changes(args=expanded)
        if isinstance(call.func, cst.Name) and call.func.value in self.closures:
            return CallEffect()  # its writes are added at the call site (free variables)
        frame = self._frame_access(call)
        if frame is not None:
            return frame
        receiver = self._object_receiver(call) if self.resolver is not None else None
        if receiver is not None:
            return self._object_method_effect(call, receiver)
        known = torch_call_effect(call, self.local_names, self.module_names)
        if known is not None:
            return known
        if is_ordering_call(call):
            receiver = call.func.value  # type: ignore[attr-defined]
            if _root_name(receiver) in self.work_locals:
                return CallEffect(stream=True, barrier=True)  # work.wait(): the collective's buffers are done
            if isinstance(receiver, cst.Name) and receiver.value in self.stream_locals:
                # ev = torch.npu.Event(); ev.wait(). msrewrite's own fork and join of another side
                # stream (`side.wait_stream(current)`, `current.wait_stream(side)`) order only that
                # branch's outputs, which are names: data dependences already keep their readers after it
                names = {receiver.value, *(a.value.value for a in call.args if isinstance(a.value, cst.Name))}
                return CallEffect(stream=True, barrier=not names & self.own_streams)
            if self.resolver is None:  # nothing to resolve it with: it may order streams
                return CallEffect(stream=True, barrier=True)
        if self.resolver is None:
            return CallEffect()
        return self.resolver(call, self)

    def _frame_access(self, call: cst.Call) -> CallEffect | None:
        """`exec(...)` / `eval(...)` run code msrewrite cannot read: they may write any name of the
        function (and module state through `self`). `locals()` / `vars()` return the function's
        names in a dict: `locals()["x"].mul_(2)` writes x."""
        func = call.func
        if not isinstance(func, cst.Name) or func.value in self.local_names or func.value in self.module_names:
            return None
        names = [cst.Name(n) for n in sorted(self.local_names)]
        if func.value in ("exec", "eval"):
            resolved = self.resolver(call, self) if self.resolver is not None else None
            if resolved is not None and not resolved.unknown:
                return resolved  # --assume-pure exec
            why = f"{func.value} (not visible to msrewrite: the code it runs may write any name of the function)"
            return CallEffect(returns=list(names), may_writes=[(n, why) for n in names], unknown=[why])
        if func.value in ("locals", "vars") and not call.args:
            return CallEffect(returns=list(names))
        return None

    def _object_receiver(self, call: cst.Call) -> cst.BaseExpression | None:
        """What `name` was bound to, for `name.method(...)` on a local that may hold an object."""
        func = call.func
        if not (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)):
            return None
        name = func.value.value
        if name in self.stream_locals or name in self.work_locals or name in self.modules:
            return None
        return self.receivers.get(name)

    def _object_method_effect(self, call: cst.Call, receiver: cst.BaseExpression) -> CallEffect:
        """`acc.add(x, h)` with `acc = self.acc` is the call `self.acc.add(x, h)`, which the resolver
        reads (a tensor attribute's method or the attribute's class's method). With `acc = get_acc()`
        (or a parameter annotated `acc: Acc`) it is a method of whatever the call returned: the resolver's answer for a local's method
        (unknown, named `acc.add`, which --assume-pure takes). An in-place tensor method
        (`out.mul_(2)`) writes `out` all the same; what else it may write is its arguments."""
        func = cst.ensure_type(call.func, cst.Attribute)
        if isinstance(receiver, cst.Attribute) and (dotted_name(receiver) or "").startswith("self."):
            return self.effect_of(call.with_changes(func=func.with_changes(value=receiver)))
        assert self.resolver is not None
        resolved = self.resolver(call, self)
        method = func.attr.value
        if not (resolved.unknown and is_inplace_name(method) and method in TENSOR_METHODS):
            return resolved
        effect = torch_call_effect(call, self.local_names, self.module_names) or CallEffect()
        values = {id(arg.value) for arg in call.args}
        extra = [(e, why) for e, why in resolved.may_writes if id(e) in values]
        effect.may_writes.extend(extra)
        if extra:
            effect.unknown.extend(resolved.unknown)
        return effect


def _attribute_table_key(target: cst.Subscript) -> str | None:
    """ "k" for `self.__dict__["k"]` / `vars(self)["k"]` (an identifier key), else None."""
    table = target.value
    is_table = (isinstance(table, cst.Attribute) and table.attr.value == "__dict__" and _is_self(table.value)) or (
        isinstance(table, cst.Call)
        and dotted(table.func) == "vars"
        and len(table.args) == 1
        and _is_self(table.args[0].value)
    )
    if not is_table or len(target.slice) != 1 or not isinstance(target.slice[0].slice, cst.Index):
        return None
    key = target.slice[0].slice.value
    named = key.evaluated_value if isinstance(key, cst.SimpleString) else None
    return named if isinstance(named, str) and named.isidentifier() else None


# nn.Module's own tables of its state: `self._buffers["bias"]` is module state, any of it
MODULE_STATE_TABLES = frozenset({"_buffers", "_parameters", "_modules", "__dict__"})


CONSTANT_NAMES = frozenset({"None", "True", "False"})


def alias_roots(node: cst.BaseExpression, scope: Scope) -> set[str]:
    """Names whose storage the value of `node` may share: `x` for `x.view(-1)[:4]`, `torch.flatten(x)`,
    `(x, y)`, `a if c else x`; `self.last` for an attribute of self; `self` (all module state) for
    `self._buffers` or `self.parameters()`; what its getter returns for a @property of self;
    nothing for fresh results."""
    if isinstance(node, cst.Name):
        # None, True and False are constants, not storage: nothing can write them
        return set() if node.value in CONSTANT_NAMES else {node.value}
    if isinstance(node, cst.Attribute):
        name = dotted_name(node)
        if name is not None and name.startswith("self."):
            return _self_attribute_roots(name.split(".")[1], scope)
        if node.attr.value in METADATA_ATTRS:
            return set()
        return alias_roots(node.value, scope)
    if isinstance(node, cst.Subscript):
        return alias_roots(node.value, scope)
    if isinstance(node, cst.Call):
        return {r for e in scope.effect_of(node).returns for r in alias_roots(e, scope)}
    if isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        return {r for el in node.elements for r in alias_roots(el.value, scope)}
    if isinstance(node, cst.Dict):
        return {r for el in node.elements if isinstance(el, cst.DictElement) for r in alias_roots(el.value, scope)}
    if isinstance(node, cst.StarredElement):
        return alias_roots(node.value, scope)
    if isinstance(node, cst.IfExp):
        return alias_roots(node.body, scope) | alias_roots(node.orelse, scope)
    if isinstance(node, cst.BooleanOperation):
        return alias_roots(node.left, scope) | alias_roots(node.right, scope)
    if isinstance(node, cst.NamedExpr):
        return alias_roots(node.value, scope)
    if isinstance(node, (cst.ListComp, cst.SetComp, cst.GeneratorExp)):
        found = alias_roots(node.elt, scope)
        comp: cst.CompFor | None = node.for_in
        while comp is not None:
            found |= alias_roots(comp.iter, scope)
            comp = comp.inner_for_in
        return found
    return set()


def _self_attribute_roots(attr: str, scope: Scope) -> set[str]:
    """What `self.<attr>` may share: itself; all module state for nn.Module's own tables
    (`self._buffers`); for a @property, also the state its getter returns."""
    if attr in MODULE_STATE_TABLES:
        return {"self"}
    if attr in scope.properties:  # self.scale_view: the state its getter returns
        getter = cst.Attribute(value=cst.Name("self"), attr=cst.Name(attr))
        returned = scope.effect_of(cst.Call(func=getter)).returns
        return {f"self.{attr}", *(r for e in returned for r in alias_roots(e, scope))}
    return {f"self.{attr}"}


# `t op= v` whose result may hold v's objects: concatenation (`lst += [x]`, a tuple's `+=`),
# set and dict union and intersection (`d |= table`), and an int repeating a sequence
# (`n *= [x]`). `-=`, `/=`, `**=`, `%=`, `@=`, shifts and the rest give numbers, tensors, a
# set of t's own elements or a string: like `t - v`, never something holding v.
_HOLDING_AUG_OPERATORS = (
    cst.AddAssign,
    cst.MultiplyAssign,
    cst.BitOrAssign,
    cst.BitAndAssign,
    cst.BitXorAssign,
)


class _Collector(Visitor):
    def __init__(
        self,
        facts: StatementFacts,
        scope: Scope | None = None,
        after_calls: Set[int] = frozenset(),
        skip: Set[int] = frozenset(),
    ) -> None:
        self.facts = facts
        self.scope = scope or Scope()
        self.after_calls = after_calls  # calls whose own effect is left out (they run after the hoisted call)
        self.skip = skip  # blocks that never run where the edit runs (another platform's branch)
        self._label = "a call"  # the call whose effect is being recorded
        self._called: set[int] = set()  # Name nodes that are the callee of a nested function's call

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> bool:
        return id(node) not in self.skip

    def visit_SimpleStatementSuite(self, node: cst.SimpleStatementSuite) -> bool:
        return id(node) not in self.skip

    def _roots(self, node: cst.BaseExpression) -> set[str]:
        return alias_roots(node, self.scope)

    def _link(self, targets: set[str], node: cst.BaseExpression | None, into: bool = False) -> None:
        if node is None:
            return
        for source in self._roots(node):
            for target in targets:  # x = x.view(-1) links x to itself: the same storage
                # a source `self` is all of the module's state (`for p in self.parameters()`)
                self.facts.links.add((source, target))
                if into:
                    self.facts.stored.add((source, target))

    def _hold(self, container: cst.BaseExpression, value: cst.BaseExpression) -> None:
        """A call made `container` hold `value` (`put(lst, x)` doing `lst[0] = x`): as after
        `container[0] = value`, the container's object shares value's storage. The container's own write is the callee's (its summary's writes, or an unseen callee's
        may-writes): holding is a link only."""
        self._link(self._roots(container) - {"self"}, value, into=True)

    def _write(self, node: cst.BaseExpression) -> None:
        if isinstance(node, cst.Name) and node.value == "self":
            # a method writing its object's state (`self.helper()`, `setattr(self, ...)`): all of `self`
            self.facts.mutates.add("self")
            return
        self.facts.mutates |= self._roots(node) - {"self"}

    # names --------------------------------------------------------------------------
    def visit_Name(self, node: cst.Name) -> None:
        self.facts.loads.add(node.value)
        closure = self.scope.closures.get(node.value)
        if closure is not None and id(node) not in self._called:
            # a nested function handed on or stored (`fn = add_shared`, `apply(add_shared, h)`):
            # it may run at any later point, so its free variables count as read from here on
            self.facts.loads |= closure.loads
            self.scope.escaped[node.value] = frozenset(closure.loads)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        if isinstance(node.value, cst.Name) and node.value.value == "self" and node.attr.value in self.scope.properties:
            self._property_read(node)
        node.value.visit(self)  # `attr` is a field name, not a variable
        return False

    def _property_read(self, node: cst.Attribute) -> None:
        """`self.scale` where the class defines `scale` as a @property: its getter runs here, with
        the effect of calling it; one that writes module state or reaches a callee msrewrite
        cannot see into may write any of the module's state (`self`)."""
        effect = self.scope.effect_of(cst.Call(func=node))
        self._apply_effect(effect)
        state = any(r == "self" or r.startswith("self.") for w in effect.writes for r in self._roots(w))
        if state or effect.unknown or effect.may_writes:
            unseen = f" -> {effect.unknown[0]}" if effect.unknown else ""
            self.facts.mutates.add("self")
            self.facts.may_write.setdefault("self", f"self.{node.attr.value} (a @property{unseen})")

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)  # skip the keyword's name
        return False

    def _store_target(self, target: cst.BaseExpression, value: cst.BaseExpression | None = None) -> None:
        if isinstance(target, cst.Name):
            self.facts.stores.add(target.value)
            self._link({target.value}, value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self._store_target(element.value, value)  # unpacking: each name may hold any part
        elif isinstance(target, cst.StarredElement):
            self._store_target(target.value, value)
        elif isinstance(target, cst.Subscript) and (named := _attribute_table_key(target)) is not None:
            # self.__dict__["k"] = v, vars(self)["k"] = v: the store `self.k = v`
            self._store_target(cst.Attribute(value=cst.Name("self"), attr=cst.Name(named)), value)
        elif isinstance(target, (cst.Attribute, cst.Subscript)):
            # x[i] = v, x.view(-1)[:4] = v, x.data = v write into the object x names; self.last = x
            # and lst[0] = x make the attribute or container hold x.
            name = dotted_name(target) if isinstance(target, cst.Attribute) else None
            self._rebind(target)
            if name is not None and name.startswith("self.") and name.count(".") == 1:
                self.facts.self_stores.add(name)
                self._link({name}, value, into=True)
            else:
                roots = self._roots(target.value)
                self.facts.mutates |= roots - {"self"}
                before = set(self.facts.links)
                self._link(roots - {"self"}, value, into=True)
                # the store writes the object's old storage, then the object holds the value:
                # `moe.backend = Backend.AUTO` writes moe, not the Backend it is given
                self.facts.late_links |= self.facts.links - before
            target.visit(self)

    def visit_Assign(self, node: cst.Assign) -> bool:
        own_attr = (dotted_name(node.value) or "").removeprefix("self.") in self.scope.own_stream_attrs
        for target in node.targets:
            bound = target.target
            if own_attr and isinstance(bound, (cst.Name, cst.Tuple)):
                items = [bound] if isinstance(bound, cst.Name) else [e.value for e in bound.elements]
                for item in items:
                    if isinstance(item, cst.Name):
                        self.scope.stream_locals.add(item.value)
                        self.scope.own_streams.add(item.value)
            elif isinstance(target.target, cst.Name):
                name = target.target.value
                self.scope.stream_locals.discard(name)
                self.scope.own_streams.discard(name)
                if _stream_value(node.value):
                    self.scope.stream_locals.add(name)
                if isinstance(node.value, cst.Call) and (dotted(node.value.func) or "").startswith("_ms_"):
                    self.scope.own_streams.add(name)
            self._store_target(target.target, node.value)
            self._bind_receiver(target.target, node.value)
            if isinstance(node.value, cst.Call) and isinstance(target.target, (cst.Name, cst.Tuple)):
                effect = self.scope.effect_of(node.value)
                if effect.pending_writes or effect.pending_reads:
                    bound = target.target
                    items = [bound] if isinstance(bound, cst.Name) else [e.value for e in bound.elements]
                    self.scope.work_locals |= {item.value for item in items if isinstance(item, cst.Name)}
            if isinstance(node.value, cst.Subscript):  # expert = self.experts[i]
                self._bind_module(target.target, node.value.value)
            if isinstance(node.value, cst.Lambda) and isinstance(target.target, cst.Name):
                # `add = lambda t: t + shared`: a nested function, like a def
                self._closure(target.target.value, node.value.params, node.value.body, node.value)
        node.value.visit(self)
        return False

    def visit_AnnAssign(self, node: cst.AnnAssign) -> bool:
        self._store_target(node.target, node.value)
        if node.value is not None:
            node.value.visit(self)
        return False

    def _bind_receiver(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        """Note a local that may hold an object other than a tensor (Scope.receivers): one bound to
        `self.<attr>` (the resolver knows the attribute), or to a call that is not a known torch
        function or tensor method and not a call of a submodule (`Acc()`, `get_acc()`)."""
        if isinstance(target, (cst.Tuple, cst.List)):  # `cache, meta = make_cache()`: each part
            if isinstance(value, cst.Call) and self._object_call(value):
                for element in target.elements:
                    part = element.value
                    if isinstance(part, cst.Name) and part.value not in self.scope.receivers:
                        self.scope.receivers[part.value] = value
            return
        if not isinstance(target, cst.Name) or target.value in self.scope.receivers:
            return
        if isinstance(value, cst.Attribute):
            name = dotted_name(value)
            if name is not None and name.startswith("self.") and value.attr.value not in METADATA_ATTRS:
                self.scope.receivers[target.value] = value
        elif isinstance(value, cst.Call) and self._object_call(value):
            self.scope.receivers[target.value] = value

    def _object_call(self, call: cst.Call) -> bool:
        """A call whose result may be an object: a function or class (`get_acc()`, `Acc()`,
        `fused_experts(x)` msrewrite cannot see), or a method not named like a tensor method
        (`pool.get_buffer()`), that no torch table knows."""
        func = call.func
        name = dotted(func)
        if name is not None and (name.startswith("_ms_") or (name.startswith("self.") and name.count(".") == 1)):
            return False  # msrewrite's own helpers; a submodule or method of self
        if isinstance(func, cst.Name) and func.value in self.scope.modules:
            return False  # expert(x), with expert = self.experts[i]
        if isinstance(func, cst.Attribute) and func.attr.value in TENSOR_METHODS:
            return False  # self.scale.view(-1): the receiver's method, read where it is called
        return torch_call_effect(call, self.scope.local_names, self.scope.module_names) is None

    def _rebind(self, target: cst.BaseExpression) -> None:
        """`obj.a = v` / `obj.a += v` / `del obj.a` rebinds attribute `a` of the object."""
        path = dotted_name(target) if isinstance(target, cst.Attribute) else None
        if path is not None:
            self.facts.rebinds.add(path)

    def visit_AugAssign(self, node: cst.AugAssign) -> bool:
        # `t += x` on a tensor writes into t's storage, which other names may share.
        self._rebind(node.target)
        roots = self._roots(node.target) - {"self"}
        self.facts.mutates |= roots
        # in place, `t` keeps its object (`h = x.view(-1); h *= s` leaves h on x's storage)
        self._link({r for r in roots if not r.startswith("self.")}, node.target)
        if isinstance(node.operator, _HOLDING_AUG_OPERATORS):
            before = set(self.facts.links)
            self._link(roots, node.value, into=True)  # `lst += [x]`, `n *= [x]` (a list of x)
            # the write of `t` itself happens before it holds what it is given: `h *= self.scale`
            # writes h's object, not the scale (Storage.write_reach)
            self.facts.late_links |= self.facts.links - before
        root = _root_name(node.target)
        if root is not None:
            self.facts.loads.add(root)
            if isinstance(node.target, cst.Name):
                self.facts.stores.add(root)
        if not isinstance(node.target, cst.Name):
            node.target.visit(self)
        node.value.visit(self)
        return False

    def visit_For(self, node: cst.For) -> None:
        self._store_target(node.target, node.iter)
        if _root_name(node.iter) in self.scope.work_locals and isinstance(node.target, cst.Name):
            self.scope.work_locals.add(node.target.value)  # for req in reqs: req.wait()
        self._bind_module(node.target, node.iter)

    def _bind_module(self, target: cst.BaseExpression, iterable: cst.BaseExpression) -> None:
        # `for expert in self.experts`, `for i, expert in enumerate(self.experts)`: calls of
        # `expert` are calls of the container's element module.
        if isinstance(iterable, cst.Call) and dotted_name(iterable.func) == "enumerate" and iterable.args:
            iterable = iterable.args[0].value
            if isinstance(target, cst.Tuple) and len(target.elements) == 2:
                target = target.elements[1].value
        path = dotted_name(iterable)
        if isinstance(target, cst.Name) and path and path.startswith("self."):
            self.scope.modules[target.value] = path + "[]"

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._store_target(node.asname.name, node.item)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> bool:
        self._store_target(node.target, node.value)
        node.value.visit(self)
        return False

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self._store_target(node.target, node.iter)

    def _bind_comprehension(self, node) -> None:
        # the element is visited before its `for`: bind loop modules first
        comp: cst.CompFor | None = node.for_in
        while comp is not None:
            self._bind_module(comp.target, comp.iter)
            comp = comp.inner_for_in

    def visit_GeneratorExp(self, node: cst.GeneratorExp) -> None:
        self._bind_comprehension(node)

    def visit_ListComp(self, node: cst.ListComp) -> None:
        self._bind_comprehension(node)

    def visit_SetComp(self, node: cst.SetComp) -> None:
        self._bind_comprehension(node)

    def visit_DictComp(self, node: cst.DictComp) -> None:
        self._bind_comprehension(node)

    def visit_Del(self, node: cst.Del) -> bool:
        # `del x` rebinds x (its object may be freed); `del x[0]` writes into x.
        targets = node.target.elements if isinstance(node.target, cst.Tuple) else []
        for target in [el.value for el in targets] or [node.target]:
            if isinstance(target, cst.Name):
                self.facts.stores.add(target.value)
            else:
                self._rebind(target)
                self._write(target.value if isinstance(target, (cst.Subscript, cst.Attribute)) else target)
        return False

    # calls and exits ------------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        self.facts.has_call = True
        callee = self_callee(node.func)
        if callee:
            self.facts.self_calls.append(callee)
            self.facts.calls.append(node)
        if isinstance(node.func, cst.Name) and node.func.value in self.scope.closures:
            self._called.add(id(node.func))
            closure = self.scope.closures[node.func.value]
            self.facts.loads |= closure.loads  # its free variables, read when it runs
            self.facts.mutates |= closure.mutates
            self.facts.rebinds |= closure.rebinds
            for name, why in closure.may_write.items():
                self.facts.may_write.setdefault(name, why)
            self.facts.unknown_callees |= closure.unknown_callees
            self.facts.unseen_work |= closure.unseen_work
            self.facts.barrier |= closure.barrier
            params, written_params = self.scope.closure_params.get(node.func.value, ((), frozenset()))
            for arg in _bound_to(node, params, written_params):
                self._write(arg)
        self._functions_passed(node)
        if id(node) in self.after_calls:
            return
        self._label = f"{dotted_name(node.func) or 'a call'}(...)"
        self._apply_effect(self.scope.effect_of(node))

    def _apply_effect(self, effect: CallEffect) -> None:
        """Records what one call does: its writes, what unseen callees may write, its kinds of work."""
        for written in effect.writes:
            # a write of `self` is a write of module state (a method writing it, a write through
            # `self.parameters()`): kept, as `self`
            self.facts.mutates |= self._roots(written)
            if effect.collective and isinstance(written, cst.Name):
                self.facts.stores.add(written.value)  # recv / all_reduce fill their buffer: a new value
        for written, why in effect.may_writes:
            # `self` handed to a callee msrewrite cannot see into counts only where it is all of
            # the state (`self.parameters()`): `self` itself is not a tensor
            roots = self._roots(written) - ({"self"} if _is_self(written) else set())
            for name in roots:
                self.facts.may_write.setdefault(name, why)
        for container, value in effect.stores:
            self._hold(container, value)
        self.facts.rebinds.update(effect.rebinds)
        if effect.pending_writes or effect.pending_reads:
            self.facts.async_ops.append(
                AsyncOp(
                    label=self._label,
                    writes={r for e in effect.pending_writes for r in self._roots(e)} - {"self"},
                    reads={r for e in effect.pending_reads for r in self._roots(e)} - {"self"},
                    waits_on_use=effect.waits_on_use,
                )
            )
        self.facts.unknown_callees |= set(effect.unknown)
        self.facts.unseen_work |= set(effect.unseen_work)
        self.facts.collective |= effect.collective
        self.facts.rng |= effect.rng
        self.facts.stream |= effect.stream
        self.facts.barrier |= effect.barrier

    def visit_Return(self, _node: cst.Return) -> None:
        self.facts.exits = True

    def visit_Raise(self, _node: cst.Raise) -> None:
        self.facts.exits = True
        self.facts.raises = True

    def visit_Assert(self, _node: cst.Assert) -> None:  # a raise when its test is false
        self.facts.exits = True
        self.facts.raises = True

    def visit_Yield(self, _node: cst.Yield) -> None:
        self.facts.exits = True

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        # A nested def's body runs later, when it is called: its reads and writes of the
        # enclosing function's names count at the call site.
        self.facts.stores.add(node.name.value)
        self._closure(node.name.value, node.params, node.body, node)
        return False

    def _closure(self, name: str, params: cst.Parameters, body: cst.CSTNode, node: cst.CSTNode) -> None:
        """Records nested function `name` (a def, or `name = lambda ...`): what its body reads
        and writes of the enclosing function's names (its free variables), counted where it is called."""
        inner = StatementFacts(index=-1, node=node, first_line=0, last_line=0)  # type: ignore[arg-type]
        inner_scope = Scope(
            resolver=self.scope.resolver,
            closures=dict(self.scope.closures),
            modules=dict(self.scope.modules),
            spreads=self.scope.spreads,
        )
        body.visit(_Collector(inner, inner_scope))
        named, star = parameter_names(params)
        written = frozenset((inner.mutates | set(inner.may_write)) & (set(named) | star))
        # a write through *args / **kwargs reaches every argument
        self.scope.closure_params[name] = (named, written | ({"*"} if written & star else set()))
        # `def f(t=x): t.mul_(2)`: a call that does not pass t writes the default, x
        inner.mutates |= self._written_defaults(params, written)
        own = set(named) | star | inner.stores
        inner.mutates -= own
        inner.may_write = {k: v for k, v in inner.may_write.items() if k not in own}
        inner.loads -= own
        self.scope.closures[name] = inner

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        # its body runs where it is called (_functions_passed, or a call of the name it is bound
        # to); what it reads of the enclosing function's names counts here too, where it is made
        inner = node_facts(node.body, self.scope)
        named, star = parameter_names(node.params)
        self.facts.loads |= inner.loads - set(named) - star
        return False

    def _functions_passed(self, call: cst.Call) -> None:
        """`map(lambda t: t.mul_(2), xs)`, `apply_all(f, xs)`: a function handed to a call may be
        called on any other argument, so where it writes its parameters, every other argument
        counts as written; a lambda's writes to the enclosing function's names count here."""
        for arg in call.args:
            value = arg.value
            if isinstance(value, cst.Lambda):
                inner = StatementFacts(index=-1, node=value, first_line=0, last_line=0)  # type: ignore[arg-type]
                value.body.visit(_Collector(inner, self.scope))
                named, star = parameter_names(value.params)
                own = set(named) | star
                self.facts.mutates |= inner.mutates - own
                for name, why in inner.may_write.items():
                    if name not in own:
                        self.facts.may_write.setdefault(name, why)
                self.facts.unknown_callees |= inner.unknown_callees
                self.facts.unseen_work |= inner.unseen_work
                self.facts.barrier |= inner.barrier
                written = frozenset((inner.mutates | set(inner.may_write)) & own)
                self.facts.mutates |= self._written_defaults(value.params, written)
                writes_params = bool(written)
            elif (
                isinstance(value, cst.Attribute)
                and is_inplace_name(value.attr.value)
                and value.attr.value in TENSOR_METHODS
            ):
                # map(torch.Tensor.mul_, xs, ys) writes what it is mapped over; map(x.mul_, ys) writes x
                if dotted(value.value) not in ("torch.Tensor", "Tensor"):
                    self._write(value.value)
                    continue
                writes_params = True
            elif isinstance(value, cst.Name) and value.value in self.scope.closure_params:
                writes_params = bool(self.scope.closure_params[value.value][1])
            else:
                continue
            if writes_params:
                for other in call.args:
                    if other is not arg:
                        self._write(other.value)

    def _written_defaults(self, params: cst.Parameters, written: frozenset[str]) -> set[str]:
        """What the default values of the parameters in `written` may share (evaluated where the
        function is made: a call that leaves such a parameter out writes its default)."""
        found: set[str] = set()
        for param in (*params.posonly_params, *params.params, *params.kwonly_params):
            if param.default is not None and param.name.value in written:
                found |= self._roots(param.default)
        return found


def parameter_names(params: cst.Parameters) -> tuple[tuple[str, ...], frozenset[str]]:
    """(the named parameters in order: positional-only, positional, keyword-only; the names of
    *args and **kwargs)."""
    named = tuple(p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params))
    star = frozenset(p.name.value for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param))
    return named, star


def _bound_to(call: cst.Call, params: tuple[str, ...], written: frozenset[str]) -> list[cst.BaseExpression]:
    """The arguments of `call` bound to the parameters in `written` (every argument when the call
    or the function spreads them: `f(*xs)`, a write through `*args`)."""
    if not written:
        return []
    if "*" in written or any(a.star for a in call.args):
        return [a.value for a in call.args]
    bound = []
    for position, arg in enumerate(a for a in call.args if a.keyword is None):
        if position < len(params) and params[position] in written:
            bound.append(arg.value)
    bound += [a.value for a in call.args if a.keyword is not None and a.keyword.value in written]
    return bound


_recent_facts: list[tuple[list, object, object, list[StatementFacts]]] = []  # suggest asks the same body many times


def statement_facts(
    body: list[cst.BaseStatement], positions: dict[cst.CSTNode, CodeRange], scope: Scope | None = None
) -> list[StatementFacts]:
    """Facts per top-level statement; with a scope that has a resolver, calls msrewrite cannot see
    into are recorded as possibly writing their arguments (`may_write`). The last few answers are
    remembered (suggest asks about the same body many times); callers get copies they own."""
    for seen, seen_positions, seen_scope, facts in _recent_facts:  # nodes are immutable
        if (
            seen_positions is positions
            and seen_scope is scope
            and len(seen) == len(body)
            and all(a is b for a, b in zip(seen, body, strict=True))
        ):
            return [_copy_facts(f) for f in facts]
    facts = _statement_facts(body, positions, scope)
    _recent_facts[:] = [(list(body), positions, scope, facts), *_recent_facts[:3]]
    return [_copy_facts(f) for f in facts]


def _copy_facts(f: StatementFacts) -> StatementFacts:
    """A copy whose sets, lists and dicts are the copy's own."""
    copies: dict[str, Any] = {
        k.name: type(v)(v) for k in dataclasses.fields(f) if isinstance(v := getattr(f, k.name), (set, list, dict))
    }
    return dataclasses.replace(f, **copies)


def _statement_facts(
    body: list[cst.BaseStatement], positions: dict[cst.CSTNode, CodeRange], scope: Scope | None
) -> list[StatementFacts]:
    facts = []
    scope = scope or Scope()
    scope.note_body(body)
    scope.escaped = {}  # counted from where each nested function is handed on, in this body's order
    for index, stmt in enumerate(body):
        where = positions[stmt]
        item = StatementFacts(index=index, node=stmt, first_line=where.start.line, last_line=where.end.line)
        stmt.visit(_Collector(item, scope))
        for free in scope.escaped.values():
            item.loads |= free
        item.loads.discard("self")
        facts.append(item)
    extend_pending(facts)
    return facts


def _waits(node: cst.CSTNode, handles: set[str]) -> bool:
    """Whether `node` waits one of `handles`: `work.wait()`, `reqs[0].wait()`, `for r in reqs:
    r.wait()`, `wait_tensor(y)` / `funcol.wait_tensor(y)`."""
    for call in all_calls(node):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "wait" and _root_name(func.value) in handles:
            return True
        if (dotted(func) or "").rpartition(".")[2] == "wait_tensor" and any(
            _root_name(a.value) in handles for a in call.args
        ):
            return True
    return False


def extend_pending(facts: list[StatementFacts]) -> list[AsyncOp]:
    """An asynchronous collective writes (reads) its buffers from its call until its result is
    waited: every statement after the call, up to and with the first that waits a name the call's
    statement bound (for an AsyncCollectiveTensor: the first that uses it), counts as writing
    (reading) them too, so no fork goes between and no side work moves across. Without such a wait
    (the work is discarded, returned, stored, or never waited) that is every statement to the end
    of the function. Returns the operations never waited here (a helper's caller keeps them)."""
    open_ops: list[AsyncOp] = []
    for f in facts:
        for op in f.async_ops:
            handles = (set(f.stores) | {t for _, t in f.links}) - op.writes - op.reads  # not the buffer it fills
            if _waits(f.node, handles):  # `if c: work = ...; work.wait()`: waited in the same statement
                continue
            end = None
            for g in facts[f.index + 1 :]:
                # `for r in reqs: r.wait()` waits through the name it binds
                if g.loads & handles and (_waits(g.node, handles | g.stores) or (op.waits_on_use and g.has_call)):
                    end = g.index
                    break
            last = end if end is not None else len(facts) - 1
            until = (
                f"until line {facts[end].first_line} waits for it"
                if end is not None
                else "and nothing here waits for it"
            )
            for g in facts[f.index + 1 : last + 1]:
                for name in op.writes:
                    g.mutates.add(name)
                    g.pending.setdefault(name, f"{op.label} at line {f.first_line} writes it asynchronously, {until}")
                for name in op.reads:
                    g.loads.add(name)
            if end is None:
                open_ops.append(op)
    return open_ops


def is_docstring(stmt: cst.BaseStatement) -> bool:
    """A bare string statement (a function's docstring when it comes first)."""
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def node_facts(
    node: cst.CSTNode, scope: Scope | None = None, after_calls: Set[int] = frozenset(), skip: Set[int] = frozenset()
) -> StatementFacts:
    """Loads, stores and mutations of any node, without source positions; the blocks in `skip`
    (ids of IndentedBlock / SimpleStatementSuite nodes) are left out."""
    item = StatementFacts(index=-1, node=node, first_line=0, last_line=0)  # type: ignore[arg-type]
    node.visit(_Collector(item, scope, after_calls, skip))
    item.loads.discard("self")
    return item


def expression_loads(node: cst.CSTNode) -> set[str]:
    item = StatementFacts(index=-1, node=node, first_line=0, last_line=0)  # type: ignore[arg-type]
    node.visit(_Collector(item))
    item.loads.discard("self")
    return item.loads


_recent_names: list[tuple[cst.CSTNode, frozenset[str]]] = []  # suggest asks the same function many times


def function_names(node: cst.CSTNode) -> set[str]:
    """Every name a node mentions (a function's parameters included): new names must avoid them."""
    for seen, known in _recent_names:  # nodes are immutable: the same node mentions the same names
        if seen is node:
            return set(known)
    names = _function_names(node)
    _recent_names[:] = [(node, frozenset(names)), *_recent_names[:3]]
    return names


def all_calls(node: cst.CSTNode) -> list[cst.Call]:
    """Every call in `node`, in source order, nested functions and lambdas included."""
    found: list[cst.Call] = []

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

    node.visit(_Calls())
    return found


def _function_names(node: cst.CSTNode) -> set[str]:
    names: set[str] = set()

    class _Names(Visitor):
        def visit_Name(self, n: cst.Name) -> None:
            names.add(n.value)

    node.visit(_Names())
    return names
