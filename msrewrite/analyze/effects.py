"""Copy branches: side work whose effect is a write into a buffer, not a value the main path reads.

A KV-cache offload copies a device buffer to host memory (`host_kv[i].copy_(temp_kv)`); nothing on
the main path consumes the copy, so there is no data edge to join on. What orders it is buffer
reuse: the copy must not start before the main path finished writing what it reads, and must be
done before the main path writes that buffer again (a write-after-read hazard) or touches the
destination. Buffers are named by attribute paths (`offload_cache.temp_kv`, subscripts dropped),
so two fields of one object do not conflict while a buffer and the object holding it do.

When nothing in the function reuses the buffers, the join goes before the function returns: the
caller (the next layer) may overwrite them.

Calls are followed through the file's summaries (analyze/summaries.py, `CallBuffers`): a method of a
cache object whose class is known (`self.cache = OffloadCache(...)` in `__init__`, or a parameter
annotated with the class) or of the layer itself contributes the buffers it reads and writes,
rebased onto its receiver and arguments. Such a method whose copies move host memory is itself
side work (`self.cache.offload(i)`): the call moves to the copy stream and the method stays as it
is, so the flag-off path is the original. A callee msrewrite cannot see into may write every
buffer it is given (its receiver too): the join goes before it, and a copy helper that calls one
is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field

import libcst as cst
from libcst.metadata import CodeRange

from msrewrite.analyze.branch import NoBranch, SideBranch
from msrewrite.analyze.budget import charge
from msrewrite.analyze.defuse import StatementFacts, all_calls, is_docstring, statement_facts
from msrewrite.analyze.walk import Visitor
from msrewrite.records import record

INPLACE_WRITES = frozenset({"copy_", "index_copy_", "index_put_", "scatter_", "fill_", "zero_", "add_", "mul_"})


def buffer_path(node: cst.BaseExpression) -> str | None:
    """'offload_cache.host_kv' for offload_cache.host_kv[i] (subscripts dropped), else None."""
    parts: list[str] = []
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        if isinstance(node, cst.Attribute):
            parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name):
        return ".".join([node.value, *reversed(parts)])
    return None


@record
class BufferUse:
    reads: set[str] = field(default_factory=set)
    writes: set[str] = field(default_factory=set)


class _Buffers(Visitor):
    """The buffers (longest attribute paths) a statement reads and writes. `calls` (CallBuffers)
    adds what a callee does to the buffers it is given; True with it: the call is fully described."""

    def __init__(self, calls: CallBuffers | None = None) -> None:
        self.use = BufferUse()
        self.calls = calls

    def _chain(self, node: cst.BaseExpression) -> None:
        # the indices inside a.b[i].c are ordinary reads
        while isinstance(node, (cst.Attribute, cst.Subscript)):
            if isinstance(node, cst.Subscript):
                for element in node.slice:
                    element.visit(self)
            node = node.value
        if not isinstance(node, cst.Name):
            node.visit(self)

    def visit_Call(self, node: cst.Call) -> bool:
        func = node.func
        if self.calls is not None:
            extra, described = self.calls.call_use(node)
            self.use.reads |= extra.reads
            self.use.writes |= extra.writes
            if described:  # a followed method: its receiver counts only through what it touches
                if isinstance(func, cst.Attribute):
                    self._chain(func.value)
                for arg in node.args:
                    arg.value.visit(self)
                return False
        if isinstance(func, cst.Attribute):
            path = buffer_path(func.value)
            if path:
                if func.attr.value in INPLACE_WRITES:
                    self.use.writes.add(path)
                    if func.attr.value not in ("copy_", "fill_", "zero_"):
                        self.use.reads.add(path)
                else:
                    self.use.reads.add(path)
            self._chain(func.value)
        else:
            func.visit(self)
        for arg in node.args:
            arg.value.visit(self)
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> bool:
        if isinstance(node.target, (cst.Attribute, cst.Subscript)):
            path = buffer_path(node.target)
            if path:
                self.use.writes.add(path)
            self._chain(node.target)
            return False
        return True

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        path = buffer_path(node)
        if path:
            self.use.reads.add(path)
        self._chain(node)
        return False

    def visit_Subscript(self, node: cst.Subscript) -> bool:
        path = buffer_path(node)
        if path:
            self.use.reads.add(path)
        self._chain(node)
        return False

    def visit_Name(self, node: cst.Name) -> None:
        self.use.reads.add(node.value)


def buffer_use(node: cst.CSTNode, calls: CallBuffers | None = None) -> BufferUse:
    visitor = _Buffers(calls)
    node.visit(visitor)
    return visitor.use


def _overlap(a: set[str], b: set[str]) -> set[str]:
    """Paths of `a` that are, contain, or lie inside a path of `b` (self never counts)."""
    hits = set()
    for x in a:
        for y in b:
            if "self" in (x, y):
                continue
            if x == y or x.startswith(y + ".") or y.startswith(x + "."):
                hits.add(x)
    return hits


def find_copy_branch(
    func: cst.FunctionDef,
    positions: dict[cst.CSTNode, CodeRange],
    is_copy: Callable[[cst.Call], bool],
    calls: CallBuffers | None = None,
    is_host: Callable[[str], bool] | None = None,
) -> SideBranch:
    """The copies of `func` and where they fork and join. With `calls` (and `is_host`, which
    buffer paths are host memory), a statement that only calls a method whose copies move host
    memory (`self.cache.offload(i)`) is a copy too, and every call counts with what it touches."""
    body = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    facts = statement_facts(body, positions)
    uses = [buffer_use(f.node, calls) for f in facts]
    side = _copy_statements(facts, is_copy, calls, is_host)
    side_idx = {f.index for f in side}
    side_reads = set().union(*(uses[f.index].reads for f in side)) - set().union(*(uses[f.index].writes for f in side))
    side_writes = set().union(*(uses[f.index].writes for f in side))
    fork = _copy_fork(body, facts, uses, side, side_reads)
    join = _copy_join(facts, uses, side_idx, side_reads, side_writes)
    for f in facts[fork:join]:
        if f.index not in side_idx and f.exits:
            raise NoBranch(f"line {f.first_line} can return before the copy is joined")
    window = [f for f in facts[fork:join] if f.index not in side_idx]
    if not any(f.self_calls for f in window):
        raise NoBranch("no main-path work between the copy and its join: nothing to overlap")
    inputs = sorted({name for f in side for name in f.loads})
    # a local the copy reads (cache.offload(i, k, v)) and the main path rebinds before the join:
    # its old tensor must outlive the copy (record_stream on the copy stream)
    rebound = sorted({name for name in inputs for f in window if name in f.stores})
    return SideBranch(
        statements=side,
        hoists=[],
        fork=fork,
        join=join,
        inputs=inputs,
        outputs=[],
        rebound_inputs=rebound,
        facts=facts,
    )


def _copy_statements(
    facts: list[StatementFacts],
    is_copy: Callable[[cst.Call], bool],
    calls: CallBuffers | None,
    is_host: Callable[[str], bool] | None,
) -> list[StatementFacts]:
    """The statements that copy (a copy call, or a call of a followed copy helper); NoBranch when
    there are none or one also does other work."""

    def has_copy(f: StatementFacts) -> bool:
        found = []

        class _Copies(Visitor):
            def visit_Call(self, node: cst.Call) -> None:
                if is_copy(node):
                    found.append(node)

        f.node.visit(_Copies())
        return bool(found)

    helpers = {f.index: h for f in facts if (h := _copy_helper_call(f, calls, is_host)) is not None}
    side = [f for f in facts if has_copy(f) or f.index in helpers]
    if not side:
        if calls is not None and is_host is not None:
            _refuse_unseen_copy_helper(facts, calls, is_host)
        raise NoBranch("no cache copy in this function")
    for f in side:
        if f.index in helpers:
            _check_copy_helper(f, helpers[f.index])
        elif f.exits or f.self_calls:
            raise NoBranch(f"line {f.first_line}: the copy statement also does other work")
    return side


def _copy_fork(
    body: list[cst.BaseStatement],
    facts: list[StatementFacts],
    uses: list[BufferUse],
    side: list[StatementFacts],
    side_reads: set[str],
) -> int:
    """The body index the copies fork at: after every earlier main statement they depend on."""
    side_idx = {f.index for f in side}
    first = min(side_idx)
    # Fork: after the last main statement (before the first copy) that writes what the copies
    # read, or defines a name they read.
    fork = 1 if body and is_docstring(body[0]) else 0
    for f in facts[:first]:
        if _overlap(uses[f.index].writes, side_reads) or (f.stores & side_reads):
            fork = max(fork, f.index + 1)
    # Moving a copy earlier must not pass a statement that changes what it reads or touches what
    # it writes: the fork goes after the last such statement.
    moved = True
    while moved:
        moved = False
        for s in side:
            for f in facts[fork : s.index]:
                if f.index in side_idx:
                    continue
                reads_changed = _overlap(uses[f.index].writes, uses[s.index].reads) or (f.stores & uses[s.index].reads)
                writes_touched = _overlap(uses[f.index].reads | uses[f.index].writes, uses[s.index].writes)
                if reads_changed or writes_touched:
                    fork, moved = f.index + 1, True
    if fork > min(side_idx) and any(facts[i].index < fork for i in side_idx if i < fork):
        late = [facts[i] for i in sorted(side_idx) if i < fork]
        for f in late:
            for g in facts[f.index + 1 : fork]:
                if g.index not in side_idx and (
                    _overlap(uses[g.index].reads | uses[g.index].writes, uses[f.index].writes)
                    or _overlap(uses[g.index].writes, uses[f.index].reads)
                ):
                    raise NoBranch(f"line {g.first_line} sits between copies that must move together")
    return fork


def _copy_join(
    facts: list[StatementFacts], uses: list[BufferUse], side_idx: set[int], side_reads: set[str], side_writes: set[str]
) -> int:
    """The body index the copies join at: the first later statement that rewrites a buffer the
    copies read (write after read) or touches one they write; else before the function returns."""
    for f in facts[max(side_idx) + 1 :]:
        if f.index in side_idx:
            continue
        if (
            _overlap(uses[f.index].writes, side_reads)
            or _overlap(uses[f.index].reads | uses[f.index].writes, side_writes)
            or f.exits
        ):
            return f.index
    return len(facts)  # falls off the end: join at the very end


# Calls followed through the file's summaries ------------------------------------------------------
@record
class CopyHelper:
    """What a followed method does to buffers, as paths rooted at its receiver and arguments once
    rebased to a call site (`self.host_kv` in OffloadCache.offload -> `cache.host_kv`)."""

    label: str  # "OffloadCache.offload"
    reads: set[str] = field(default_factory=set)
    writes: set[str] = field(default_factory=set)
    copies: list[tuple[set[str], set[str]]] = field(default_factory=list)  # (destination, source) paths
    blocking: list[str] = field(default_factory=list)  # copies without non_blocking=True
    unseen: list[str] = field(default_factory=list)  # callees msrewrite could not see into
    other_work: str = ""  # "a collective", "RNG", "stream code"
    widened: bool = False  # a set of its paths went past MAX_PATHS and stands for their owners

    def rebased(self, mapping: dict[str, set[str]]) -> CopyHelper:
        move = lambda paths: _rebase(paths, mapping)  # noqa: E731
        return CopyHelper(
            self.label,
            move(self.reads),
            move(self.writes),
            [(move(d), move(s)) for d, s in self.copies],
            list(self.blocking),
            list(self.unseen),
            self.other_work,
            self.widened,
        )


# Bounds on buffer paths. A path only ever stands for the buffer it names and everything inside it
# (_overlap counts a path as touching every longer one), so cutting a path short, or a set of paths
# down to their owners, only widens what they may touch: a wider set orders more, never less.
MAX_PATH_PARTS = 8  # `a.b.c.d.e.f.g.h`: longer paths are cut to this many names
MAX_PATHS = 256  # a set of more paths (one local's aliases, one helper's reads) widens to their owners


def _cut(path: str, parts: int = MAX_PATH_PARTS) -> str:
    """`path` cut to its first `parts` names (it stands for everything inside it)."""
    if path.count(".") < parts:
        return path
    return ".".join(path.split(".")[:parts])


_widenings = 0  # sets _widened cut to their owners so far: a helper that needed one is not fully seen
_TOO_MANY = (
    f"a name in it may alias more than {MAX_PATHS} buffers, more than msrewrite follows one by one; "
    "it cannot tell which KV buffers the copy touches"
)


def _widened(paths: set[str]) -> set[str]:
    """Past MAX_PATHS: each path cut to its owner (`self.cache.host_kv[i].k` -> `self.cache`), which
    may alias anything the paths touched. Never to a bare `self`, which _overlap ignores."""
    global _widenings
    if len(paths) <= MAX_PATHS:
        return paths
    _widenings += 1
    return {_cut(path, 2) for path in paths}


def _minimal(paths: set[str]) -> set[str]:
    """`paths` without those inside another of them (`x.shape` when `x` is there): the same buffers
    for _overlap. A bare `self`, which _overlap ignores, covers nothing."""
    if len(paths) < 2:
        return paths
    kept: set[str] = set()
    for path in sorted(paths, key=lambda p: p.count(".")):
        parts = path.split(".")
        if not any(".".join(parts[:n]) in kept for n in range(1, len(parts)) if n > 1 or parts[0] != "self"):
            kept.add(path)
    return kept


def _rebase(paths: set[str], mapping: dict[str, set[str]]) -> set[str]:
    """Each path's root replaced by the paths it stands for (none for a fresh local); a root
    `mapping` does not name (a module-level buffer) stays as it is. Bounded: MAX_PATH_PARTS names
    a path, MAX_PATHS paths before the set widens."""
    out = set()
    for path in paths:
        root, dot, rest = path.partition(".")
        bases = mapping.get(root, {root})
        charge(len(bases))
        out |= {_cut(base + dot + rest) for base in bases}
    return _widened(_minimal(out))


def _alias_closure(aliases: dict[str, set[str]], roots: set[str]) -> dict[str, set[str]]:
    """Local -> the paths (rooted at `roots` or a module-level name) its value may share: the least
    fixpoint of `local = what its bindings mention`, each local's paths re-based onto what the
    locals they name stand for, computed on new paths only.

    A local bound from itself (`x = x.view(x.shape).to(x.dtype)`), or a chain of locals each bound
    from the last through its attributes, would stand for ever more, ever longer paths:
    `B.shape.dtype.shape...`, twice as many each link. `B` already stands for everything inside it,
    so a set keeps only its shortest paths (_minimal); cut and widened paths keep every set finite
    whatever the bindings."""
    # locals stand for what they were bound from; a parameter bound again stands for itself as well
    mapping: dict[str, set[str]] = {root: {root} for root in roots if root not in aliases}
    mapping.update({name: set() for name in aliases})
    new: dict[str, set[str]] = {name: {name} if name in roots else set() for name in aliases}
    users: dict[str, list[tuple[str, str]]] = {}  # local -> (a local bound from it, the rest of the path)
    for name, paths in aliases.items():
        for path in sorted(paths):
            root, dot, rest = path.partition(".")
            if root in aliases:
                users.setdefault(root, []).append((name, dot + rest))
            else:
                new[name] |= _rebase({path}, mapping)
    widened: set[str] = set()  # locals whose paths are cut to their owners from now on
    pending = sorted(name for name in aliases if new[name])
    while pending:
        local = pending.pop()
        fresh, new[local] = new[local], set()
        if local in widened:
            fresh = {_cut(path, 2) for path in fresh}
        grown = _minimal(mapping[local] | fresh)
        fresh = grown - mapping[local]  # what is new, not already inside a path the local stands for
        if not fresh:
            continue
        mapping[local] = _widened(grown)
        if len(mapping[local]) < len(grown):  # widened: pass on the owners, not the paths
            widened.add(local)
            fresh = mapping[local]
        for user, rest in users.get(local, ()):
            charge(len(fresh))
            found = {_cut(base + rest) for base in fresh} - mapping[user]
            if found:
                new[user] |= found
                if user not in pending:
                    pending.append(user)
    return mapping


class CallBuffers:
    """The buffers calls in one function touch inside their callees, from the file's summaries.

    `recv.method(...)` on an object of a known class (`self`, `self.cache` built in `__init__`, a
    parameter annotated with the class) is followed into the method: a `CopyHelper`. Any other call
    takes its effect from the torch table or the summaries; a callee msrewrite cannot see into may
    write every buffer it is given.
    """

    MAX_DEPTH = 4

    def __init__(
        self,
        summaries,
        cls: str | None,
        func: cst.FunctionDef,
        depth: int = 0,
        shared: dict[tuple[int, str, int], CopyHelper] | None = None,
    ) -> None:
        """`shared`: the helpers already followed in this run (one per method, class and depth), so
        that each method is read once per depth, not once per path of calls that reaches it."""
        from msrewrite.analyze.defuse import dotted_name

        self.summaries, self.cls, self.depth = summaries, cls, depth
        self.scope = summaries.scope_for(cls, func.name.value)
        self.annotated: dict[str, str] = {}  # parameter -> its annotated class name
        for param in (*func.params.posonly_params, *func.params.params, *func.params.kwonly_params):
            if param.annotation is not None:
                self.annotated[param.name.value] = dotted_name(param.annotation.annotation) or ""
        self.found: list[CopyHelper] = []  # helpers followed, rebased to this function
        self.followed: dict[int, CopyHelper] = {}  # id(method def) -> its helper, as written
        self._helpers = {} if shared is None else shared

    def receiver_class(self, path: str):
        """(summaries, class) of the object at `path`, or None when msrewrite cannot tell."""
        head, _, rest = path.partition(".")
        if head == "self" and self.cls is not None:
            if not rest:
                return self.summaries, self.cls
            if "." not in rest:
                return self.summaries.attribute_class(self.cls, rest)
            return None
        if not rest and head in self.annotated:
            return self.summaries.find_class(self.annotated[head].split(".")[-1])
        return None

    def helper_at(self, call: cst.Call) -> CopyHelper | None:
        """The followed method `call` runs, rebased onto the call's receiver and arguments."""
        from msrewrite.analyze.summaries import bind_args
        from msrewrite.analyze.torch_effects import torch_call_effect

        func = call.func
        if not isinstance(func, cst.Attribute) or torch_call_effect(call) is not None:
            return None
        receiver = buffer_path(func.value)
        owner = self.receiver_class(receiver) if receiver else None
        found = owner[0].method_of(owner[1], func.attr.value) if owner is not None else None
        if found is None or owner is None or receiver is None:  # no owner without a receiver
            return None
        summaries, cls = owner[0], owner[1]
        if receiver == "self" and self.summaries.attribute_values(cls).get(func.attr.value):
            return None  # self.sub(...) is a submodule, not this method
        helper = self._helper(summaries, cls, found[1])
        self.followed[id(found[1])] = helper
        summary = summaries.function_summary(cls, found[1])
        mapping: dict[str, set[str]] = {"self": {receiver}}
        for param, exprs in bind_args(summary, call).items():
            mapping[param] = set().union(*(buffer_use(e).reads for e in exprs)) if exprs else set()
        before = _widenings
        rebased = helper.rebased(mapping)
        rebased.widened = rebased.widened or _widenings != before
        return rebased

    def _helper(self, summaries, cls: str, method: cst.FunctionDef) -> CopyHelper:
        key = (id(method), cls, self.depth)
        if key in self._helpers:
            return self._helpers[key]
        label = f"{cls}.{method.name.value}"
        if self.depth >= self.MAX_DEPTH:
            return CopyHelper(label, unseen=[f"{label} (calls nested too deep)"])
        self._helpers[key] = CopyHelper(label, unseen=[f"{label} (recursive)"])
        try:
            helper = self._follow(summaries, cls, method, label)
        except BaseException:  # over budget: no half-made helper stays for the next function
            del self._helpers[key]
            raise
        self._helpers[key] = helper
        return helper

    def _follow(self, summaries, cls: str, method: cst.FunctionDef, label: str) -> CopyHelper:
        charge()
        summary = summaries.function_summary(cls, method)
        inner = CallBuffers(summaries, cls, method, self.depth + 1, self._helpers)
        use = buffer_use(method.body, inner)
        before = _widenings  # the helpers it calls say for themselves whether they were widened
        roots = {"self", *summary.params, *(n for n in (summary.vararg, summary.kwarg) if n)}
        mapping = _alias_closure(_local_aliases(method), roots)
        helper = CopyHelper(label, _rebase(use.reads, mapping), _rebase(use.writes, mapping))
        helper.unseen = sorted(summary.unknown)
        helper.other_work = (
            "a collective" if summary.collective else "RNG" if summary.rng else "stream code" if summary.stream else ""
        )

        class _Copies(Visitor):
            def visit_Call(self, node: cst.Call) -> None:
                func = node.func
                if isinstance(func, cst.Attribute) and func.attr.value == "copy_" and node.args:
                    dst = _rebase(buffer_use(func.value).reads, mapping)
                    src = _rebase(buffer_use(node.args[0].value).reads, mapping)
                    helper.copies.append((dst, src))
                    if not any(
                        a.keyword is not None
                        and a.keyword.value == "non_blocking"
                        and isinstance(a.value, cst.Name)
                        and a.value.value == "True"
                        for a in node.args
                    ):
                        helper.blocking.append(f"{label}: {cst.Module(body=[]).code_for_node(node)}")

        method.body.visit(_Copies())
        for nested in inner.found:  # helpers this one calls, already rebased into its frame
            helper.copies += [(_rebase(d, mapping), _rebase(s, mapping)) for d, s in nested.copies]
            helper.blocking += nested.blocking
            helper.unseen += [u for u in nested.unseen if u not in helper.unseen]
            helper.other_work = helper.other_work or nested.other_work
            helper.widened = helper.widened or nested.widened
        # the same copy reached by several calls counts once (else a chain of helpers multiplies them)
        helper.copies = list({(frozenset(d), frozenset(s)): (d, s) for d, s in helper.copies}.values())
        helper.blocking = list(dict.fromkeys(helper.blocking))
        helper.widened = helper.widened or _widenings != before
        return helper

    def call_use(self, call: cst.Call) -> tuple[BufferUse, bool]:
        """(what `call` touches beyond its own syntax, whether that describes it fully)."""
        helper = self.helper_at(call)
        if helper is not None:
            self.found.append(helper)
            use = BufferUse(set(helper.reads), set(helper.writes))
            if helper.unseen or helper.widened:  # what it could not see into may write anything the call can reach
                reach = [call.func.value, *(arg.value for arg in call.args)]  # type: ignore[attr-defined]
                use.writes |= set().union(*(buffer_use(e).reads for e in reach))
            return use, True
        effect = self.scope.effect_of(call)
        written = [*effect.writes, *(expr for expr, _ in effect.may_writes)]
        return BufferUse(writes=set().union(*(buffer_use(e).reads for e in written)) if written else set()), False


def _copy_helper_call(f: StatementFacts, calls: CallBuffers | None, is_host) -> tuple[CopyHelper, cst.Call] | None:
    """(the helper, its call) when statement `f` is only a call of a method that copies host memory."""
    node = f.node
    if calls is None or is_host is None or not isinstance(node, cst.SimpleStatementLine) or len(node.body) != 1:
        return None
    expr = node.body[0]
    if not (isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Call)):
        return None
    helper = calls.helper_at(expr.value)
    if helper is None or not any(is_host(p) for d, s in helper.copies for p in d | s):
        return None
    return helper, expr.value


def _check_copy_helper(f: StatementFacts, found: tuple[CopyHelper, cst.Call]) -> None:
    """A copy helper moves as a whole: everything it does must be seen, and be copies that let the
    host run ahead."""
    from msrewrite.analyze.defuse import self_callee

    helper, call = found
    where = f"line {f.first_line}: {helper.label}"
    if helper.unseen:
        raise NoBranch(f"{where} calls {helper.unseen[0]}: msrewrite cannot see what it does to the KV buffers")
    if helper.widened:
        raise NoBranch(f"{where}: {_TOO_MANY}")
    if helper.other_work:
        raise NoBranch(f"{where} also holds {helper.other_work}: only copies move to the copy stream")
    if helper.blocking:
        raise NoBranch(
            f"{where} copies without non_blocking=True ({helper.blocking[0].split(': ', 1)[1]}): on the copy stream "
            "it would hold the host until the copy ends and overlap nothing; pass non_blocking=True in the helper"
        )
    own = self_callee(call.func)
    if f.exits or any(c != own for c in f.self_calls):
        raise NoBranch(f"line {f.first_line}: the copy statement also does other work")


def _refuse_unseen_copy_helper(facts: list[StatementFacts], calls: CallBuffers, is_host) -> None:
    """A method named for host memory (`cache.offload(i)`) that msrewrite cannot follow: say so."""
    for f in facts:
        for call in all_calls(f.node):
            func = call.func
            if not (isinstance(func, cst.Attribute) and is_host(func.attr.value)):
                continue
            receiver = buffer_path(func.value) or "its receiver"
            callee = f"{receiver}.{func.attr.value}()"
            helper = calls.helper_at(call)
            if helper is None:
                raise NoBranch(
                    f"line {f.first_line}: {callee} may copy the KV buffers, but msrewrite cannot see into it: "
                    f"the class of `{receiver}` is not known (assign it in __init__ or annotate the parameter)"
                )
            if helper.unseen:
                raise NoBranch(
                    f"line {f.first_line}: {callee} ({helper.label}) calls {helper.unseen[0]}: msrewrite cannot "
                    "see what it does to the KV buffers"
                )
            if helper.widened:
                raise NoBranch(f"line {f.first_line}: {callee} ({helper.label}): {_TOO_MANY}")


def _local_aliases(func: cst.FunctionDef) -> dict[str, set[str]]:
    """Local name -> the buffers (paths, before rebasing) its value may share: every buffer its
    binding expression mentions (`dst = self.host_kv[i]` -> self.host_kv, i)."""
    aliases: dict[str, set[str]] = {}

    def bind(target: cst.BaseExpression, value: cst.CSTNode) -> None:
        names = [n.value for n in _target_names(target)]
        if names:
            paths = buffer_use(value).reads
            for name in names:
                aliases.setdefault(name, set()).update(paths)

    class _Bindings(Visitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            for target in node.targets:
                bind(target.target, node.value)

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            if node.value is not None:
                bind(node.target, node.value)

        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            bind(node.target, node.value)

        def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
            bind(node.target, node.value)

        def visit_For(self, node: cst.For) -> None:
            bind(node.target, node.iter)

        def visit_WithItem(self, node: cst.WithItem) -> None:
            if node.asname is not None:
                bind(node.asname.name, node.item)

        def visit_CompFor(self, node: cst.CompFor) -> None:
            bind(node.target, node.iter)

    func.body.visit(_Bindings())
    return aliases


def _target_names(target: cst.BaseExpression) -> list[cst.Name]:
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in _target_names(el.value)]
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    return []
