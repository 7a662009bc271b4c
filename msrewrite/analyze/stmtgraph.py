"""suggest's view of a model file: per function, the statement IR of analyze/defuse.py and its DAG.

This module computes no def-use facts of its own. Each function body is cut into its top-level
statements (a compound statement is one unit) and `defuse.statement_facts` gives each one its
facts, under the scope of the file's summaries (analyze/summaries.py), which is exactly what
`apply` (the branch finder, analyze/branch.py) reads for the same function: names read and bound,
objects written in place (through views and aliases, in-place torch functions, `out=`,
`inplace=True`, subscript and attribute stores), the storage links bindings make, what callees
msrewrite cannot see into may write, and collective/RNG/stream work. A `Statement` is a view of
those facts plus what suggest's report prints (lines, source, the `self.<sub>(...)` call sites).

Edges of the statement DAG (`FunctionInfo.graph`), u -> v when v must stay after u:
- "data": v reads a name u binds (read after write by name);
- "state": in-place writes, by storage: the storage tokens of summaries.Storage (the model apply
  uses) follow aliases, so a write through `h = x.view(-1)` orders against every reader and writer
  of x's object (read after write, write after read, write after write); a name an unseen callee
  may write counts as written. Statements that write `self` state, exit (return/yield/raise) or do
  collective, RNG or stream work are also kept in order among themselves, and a statement that
  orders streams (an event wait, a synchronize: `barrier` in the facts) stays before everything
  after it;
- "war": the write-after-read ones of those (v writes in place what u reads): a snapshot of what u
  reads, taken at a fork, lifts them (apply's --protect auto), so suggest's choices may cross them
  and leave the branch finder to decide;
- "name": v rebinds a name u reads or binds (write after read/write by name), which renaming
  removes; left out with renaming=True.
Where the facts are unsure (an unseen callee, a compound statement binding on some paths) they
over-approximate, so the DAG has an edge where unsure. Every candidate suggest prints is then
re-derived by the branch finder (plancheck.py) before it is printed.
"""

from __future__ import annotations

import ast
from dataclasses import field
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from msrewrite.analyze import digraph
from msrewrite.analyze.defuse import Scope, StatementFacts, expression_loads, is_docstring, statement_facts
from msrewrite.analyze.digraph import DiGraph
from msrewrite.analyze.positions import function_positions
from msrewrite.analyze.summaries import ModuleSummaries, Storage
from msrewrite.errors import BadInput
from msrewrite.records import record

_EMPTY = cst.Module(body=[])


@record(frozen=True)
class CallSite:
    """A `self.<sub>(...)` call inside a statement."""

    callee: str  # "shared_experts", "self_attn[1]", "mlps[0]"
    attr: str  # first attribute after self: "self_attn"
    first_line: int
    last_line: int
    source: str
    uses: frozenset[str]
    whole: bool  # the statement's value is this call (maybe behind .view/.reshape/[...])
    node: cst.Call | None = field(default=None, compare=False, repr=False)  # for the branch finder


@record
class Statement:
    """One top-level statement: a view of its StatementFacts (defuse.py) for suggest."""

    index: int
    first_line: int
    last_line: int
    source: str
    defs: frozenset[str] = frozenset()  # names it binds (StatementFacts.stores)
    uses: frozenset[str] = frozenset()  # names it reads (StatementFacts.loads)
    mutates: frozenset[str] = frozenset()  # names whose objects it writes, or an unseen callee may write
    calls: tuple[CallSite, ...] = ()
    has_call: bool = False
    compound: bool = False
    writes_self: bool = False
    exits: bool = False  # return / yield / raise
    effects: frozenset[str] = frozenset()  # "collective", "rng", "stream", "barrier": kept in order
    node: cst.BaseStatement | None = field(default=None, compare=False, repr=False)
    facts: StatementFacts | None = field(default=None, compare=False, repr=False)  # what apply reads

    @property
    def label(self) -> str:
        return f"L{self.first_line}" if self.first_line == self.last_line else f"L{self.first_line}-{self.last_line}"


@record
class FunctionInfo:
    qualname: str  # "Class.method" or "function"
    params: tuple[str, ...]
    first_line: int
    last_line: int
    statements: list[Statement] = field(default_factory=list)
    local_names: frozenset[str] = frozenset()
    # the function's libcst node and its line positions: what the branch finder reads
    node: cst.FunctionDef | None = field(default=None, compare=False, repr=False)
    positions: object = field(default=None, compare=False, repr=False)
    # the scope the facts were computed under (the file's summaries) and the whole parsed file
    scope: Scope | None = field(default=None, compare=False, repr=False)
    syntax: cst.Module | None = field(default=None, compare=False, repr=False)
    # per statement: storage token -> a name through which it is read / written (see graph)
    storage: tuple[list[dict], list[dict]] | None = field(default=None, compare=False, repr=False)

    def statement_at(self, line: int) -> Statement | None:
        for stmt in self.statements:
            if stmt.first_line <= line <= stmt.last_line:
                return stmt
        return None

    def graph(self, *, renaming: bool = True) -> DiGraph:
        """Statement DAG: u -> v when v must stay after u (the edge kinds: module docstring).

        With renaming=True the "name" edges are left out, which is the view branch detection
        wants; the branch finder checks rebinding itself."""
        dag = DiGraph()
        dag.add_nodes_from(s.index for s in self.statements)
        empty: list[dict] = [{} for _ in self.statements]
        reads, writes = self.storage if self.storage is not None else (empty, empty)
        walk = _Walk(dag, renaming)
        for stmt in self.statements:
            walk.step(stmt, reads[stmt.index], writes[stmt.index])
        return dag


class _Walk:
    """The DAG's edges, added statement by statement in program order."""

    def __init__(self, dag: DiGraph, renaming: bool) -> None:
        self.dag, self.renaming = dag, renaming
        self.last_def: dict[str, int] = {}
        self.name_readers: dict[str, list[int]] = {}
        self.last_write: dict[object, int] = {}  # storage token -> the statement that wrote it last
        self.token_readers: dict[object, list[int]] = {}
        self.state_writer: int | None = None
        self.barrier: int | None = None  # the last statement that orders streams

    def step(self, stmt: Statement, reads: dict, writes: dict) -> None:
        dag, i = self.dag, stmt.index
        if self.barrier is not None:  # nothing moves above a wait: it orders all that follows
            _link(dag, self.barrier, i, "state", "barrier")
        for name in stmt.uses:  # read after write, by name
            if name in self.last_def:
                _link(dag, self.last_def[name], i, "data", name)
        for token, name in (reads | writes).items():  # read/write after write, by storage
            if token in self.last_write:
                _link(dag, self.last_write[token], i, "state", name)
        for token, name in writes.items():  # write after read, by storage
            for reader in self.token_readers.get(token, []):
                _link(dag, reader, i, "war", name)
        if not self.renaming:  # rebinding after a read or a binding, by name
            for name in stmt.defs:
                for other in [*self.name_readers.get(name, []), self.last_def.get(name)]:
                    if other is not None:
                        _link(dag, other, i, "name", name)
        self._record(stmt, reads, writes)

    def _record(self, stmt: Statement, reads: dict, writes: dict) -> None:
        """What later statements order against: `stmt`'s reads, writes, bindings and state."""
        i = stmt.index
        if stmt.writes_self or stmt.exits or stmt.effects:
            if self.state_writer is not None:
                _link(self.dag, self.state_writer, i, "state", "self")
            self.state_writer = i
        if "barrier" in stmt.effects:
            self.barrier = i
        for token in reads:
            self.token_readers.setdefault(token, []).append(i)
        for token in writes:
            self.last_write[token] = i
            self.token_readers[token] = []
        for name in stmt.uses:
            self.name_readers.setdefault(name, []).append(i)
        for name in stmt.defs:
            self.last_def[name] = i
            self.name_readers[name] = []


def _link(dag: DiGraph, u: int, v: int, kind: str, name: str) -> None:
    """Add u -> v; a data edge wins over weaker kinds on the same pair."""
    if u == v:
        return
    rank = {"data": 2, "state": 1, "war": 0.5, "name": 0}
    old = dag.get_edge_data(u, v)
    if old is None or rank[kind] > rank[old["kind"]]:
        dag.add_edge(u, v, kind=kind, name=name)


def _storage_access(statements: list[Statement], params: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """Per statement, the storage tokens (summaries.Storage, as apply tracks them) it reads and
    writes, each with a name it reaches them through: a write through an alias is a write of
    every object the alias may hold, before or after the statement binds it."""
    facts = [s.facts for s in statements]
    storage = Storage([f for f in facts if f is not None], list(params))
    reads: list[dict] = []
    writes: list[dict] = []
    for stmt in statements:
        i = stmt.index
        read = {t: name for name in sorted(stmt.uses) for t in storage.held(name, i)}
        write = {t: name for name in sorted(stmt.mutates) for t in storage.held(name, i) | storage.held(name, i + 1)}
        reads.append(read)
        writes.append(write)
    return reads, writes


@record
class ModuleInfo:
    path: Path
    functions: dict[str, FunctionInfo]
    classes: dict[str, list[str]]  # class name -> method names
    module_names: frozenset[str]  # imported or top-level names (globals)

    def drop_syntax(self) -> None:
        """Forget the libcst nodes and positions (what the branch finder read): the facts stay, and
        the info becomes cheap to send to another process."""
        for info in self.functions.values():
            info.node = info.positions = info.scope = info.syntax = None
            for stmt in info.statements:
                stmt.node = stmt.facts = None
                for call in stmt.calls:
                    object.__setattr__(call, "node", None)  # frozen: the call's facts stay as they were


# Parsing --------------------------------------------------------------------------------------
def analyze_file(path: Path) -> ModuleInfo:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot read ({exc})") from None
    return analyze_source(text, path)


def analyze_source(text: str, path: Path = Path("<memory>"), whole: cst.Module | None = None) -> ModuleInfo:
    """`whole`: the parsed file `text` was cut from (suggest/source.py), whose summaries resolve
    calls as they do for apply; by default `text` is the whole file."""
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise BadInput(f"{path}: syntax error at line {exc.raw_line}") from None
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    summaries = _Summaries(whole or module, path)
    functions: dict[str, FunctionInfo] = {}
    classes: dict[str, list[str]] = {}
    globals_: set[str] = set()
    for node in module.body:
        if isinstance(node, cst.ClassDef):
            globals_.add(node.name.value)
            methods = classes.setdefault(node.name.value, [])
            for item in node.body.body:
                if isinstance(item, cst.FunctionDef):
                    methods.append(item.name.value)
                    qual = f"{node.name.value}.{item.name.value}"
                    functions[qual] = _function_info(qual, item, positions, summaries)
        elif isinstance(node, cst.FunctionDef):
            globals_.add(node.name.value)
            functions[node.name.value] = _function_info(node.name.value, node, positions, summaries)
        else:
            globals_ |= _top_level_names(node)
    return ModuleInfo(path=path, functions=functions, classes=classes, module_names=frozenset(globals_))


# what the reviewer vouched for (`suggest --assume-pure`, `--protect`): the same as apply is given,
# so that a candidate is what `apply --plan` re-derives; one setting per process, as --source-path
_vouched: tuple[tuple[str, ...], str] = ((), "auto")


def set_vouched(assume_pure: tuple[str, ...], protect: str) -> None:
    """`suggest --assume-pure NAME ... --protect MODE` for every file this process analyzes."""
    global _vouched
    _vouched = (tuple(assume_pure), protect)


def vouched() -> tuple[tuple[str, ...], str]:
    """(the --assume-pure names, the --protect mode) suggest analyzes with."""
    return _vouched


class _Summaries:
    """The file's summaries, made when the first function asks for its scope."""

    def __init__(self, module: cst.Module, path: Path) -> None:
        self.module = module
        self.path = path if path.is_file() else None
        self._summaries: ModuleSummaries | None = None

    def scope_for(self, qualname: str) -> Scope:
        """The scope `apply` gives `qualname` (plancheck.summaries_scope, with suggest's --assume-pure)."""
        if self._summaries is None:
            self._summaries = ModuleSummaries(self.module, _vouched[0], path=self.path)
        cls, _, name = qualname.rpartition(".")
        return self._summaries.scope_for(cls or None, name)


# The static tier ------------------------------------------------------------------------------
# `suggest --static` only looks at `Class.forward` methods, and a candidate needs a side branch and
# a main branch that each hold a `self.<sub>(...)` call: two call sites in one forward at least
# (see suggest/candidates.py `_static_choice`). An `ast` pass (several times cheaper than libcst)
# finds those forwards; a file without one never reaches libcst. Otherwise libcst parses the whole
# file once: the summaries that resolve calls need it (the branch finder reads the same parse for
# every candidate), and line numbers come from rendering each wanted forward alone
# (analyze/positions.py `function_positions`), never from a whole-file PositionProvider pass.
# A forward whose self-calls form one chain even on the torch table's facts is left out before
# its calls are resolved (`may_hold_a_branch`): resolving them can read whole packages.
STATIC_FUNCTION = "forward"


def analyze_static(path: Path) -> ModuleInfo:
    """ModuleInfo for the static tier: the same as `analyze_file` for every `Class.forward` that can
    hold a candidate (two or more `self.<...>(...)` call sites, not all in one chain); other
    functions are left out."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot read ({exc})") from None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return analyze_source(text, path)  # libcst raises its own one-line error (or copes)
    classes, module_names, wanted = _ast_outline(tree)
    functions: dict[str, FunctionInfo] = {}
    if wanted:
        module, parsed = _parse_whole(text, path, wanted)
        summaries = _Summaries(module, path)
        for qualname, (func, def_line) in parsed.items():
            positions = function_positions(func, def_line)
            if not may_hold_a_branch(_function_info(qualname, func, positions, _TORCH_ONLY, def_line)):
                continue  # resolving its calls (reading packages) could only add edges
            functions[qualname] = _function_info(qualname, func, positions, summaries, def_line)
    return ModuleInfo(path=path, functions=functions, classes=classes, module_names=frozenset(module_names))


def may_hold_a_branch(info: FunctionInfo) -> bool:
    """False when no two statements holding `self.<sub>(...)` calls are independent in the DAG and
    no statement holds a call the static tier splits out of it (suggest/candidates.py
    `_static_choices`): then no side branch exists. Asked of facts computed with the torch table
    only, it answers for the summaries' facts too: what resolving a call adds (writes, aliases,
    collective/RNG/stream work) only adds ways to reach one statement from another, so
    statements ordered without it stay ordered."""
    for stmt in info.statements:
        if not stmt.compound and (len(stmt.calls) >= 2 or any(not c.whole for c in stmt.calls)):
            return True
    heavy = [s.index for s in info.statements if s.calls]
    dag = info.graph(renaming=True)
    for k, later in enumerate(heavy[1:], 1):
        before = digraph.ancestors(dag, later)
        if any(earlier not in before for earlier in heavy[:k]):
            return True
    return False


class _TorchOnly:
    """Scopes that know only the torch effects table: every other call counts as pure."""

    module = None

    def scope_for(self, _qualname: str) -> Scope:
        return Scope()


_TORCH_ONLY = _TorchOnly()


def _ast_outline(tree: ast.Module):
    """(classes, module names, {qualname: (index of its class in the module, index in the class
    body, function node)} to analyse), the first two as analyze_source finds them."""
    classes: dict[str, list[str]] = {}
    names: set[str] = set()
    last: dict[
        str, tuple[int, int, ast.FunctionDef | ast.AsyncFunctionDef]
    ] = {}  # the last definition wins, as in analyze_source
    for top, node in enumerate(tree.body):
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            methods = classes.setdefault(node.name, [])
            for k, item in enumerate(node.body):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    methods.append(item.name)
                    last[f"{node.name}.{item.name}"] = (top, k, item)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= _ast_target_names(target)
    wanted = {q: v for q, v in last.items() if v[2].name == STATIC_FUNCTION and _self_call_sites(v[2]) >= 2}
    return classes, names, wanted


def _ast_target_names(target: ast.expr) -> set[str]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_ast_target_names(e) for e in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _ast_target_names(target.value)
    return {target.id} if isinstance(target, ast.Name) else set()


def _self_call_sites(func: ast.AST) -> int:
    """Calls in `func` whose callee starts `self.` (an upper bound of the CallSites libcst finds)."""
    count = 0
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            callee, above = node.func, None
            while isinstance(callee, (ast.Attribute, ast.Subscript, ast.Call)):
                callee, above = (callee.func if isinstance(callee, ast.Call) else callee.value), callee
            if isinstance(callee, ast.Name) and callee.id == "self" and isinstance(above, ast.Attribute):
                count += 1
    return count


def _parse_whole(text: str, path: Path, wanted) -> tuple[cst.Module, dict[str, tuple[cst.FunctionDef, int]]]:
    """The whole-file libcst parse and the wanted forwards in it (the ast walk gives their `def` lines)."""
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise BadInput(f"{path}: syntax error at line {exc.raw_line}") from None
    found: dict[str, tuple[cst.FunctionDef, int]] = {}
    for qualname, (_, _, item) in wanted.items():
        cls_name = qualname.split(".")[0]
        # `wanted` holds the last definition of each name, as analyze_source keeps it.
        for cls in reversed([n for n in module.body if isinstance(n, cst.ClassDef) and n.name.value == cls_name]):
            funcs = [f for f in cls.body.body if isinstance(f, cst.FunctionDef) and f.name.value == item.name]
            if funcs:
                found[qualname] = (funcs[-1], item.lineno)
                break
    return module, found


def _top_level_names(node: cst.CSTNode) -> set[str]:
    names: set[str] = set()
    if isinstance(node, cst.SimpleStatementLine):
        for small in node.body:
            if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    target = alias.asname.name if alias.asname else alias.name
                    names.add(_EMPTY.code_for_node(target).split(".")[0])
            elif isinstance(small, cst.Assign):
                for assigned in small.targets:
                    names |= _target_names(assigned.target)
            elif isinstance(small, cst.AnnAssign):
                names |= _target_names(small.target)
    return names


def _target_names(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, (cst.Tuple, cst.List)):
        return {n for element in target.elements for n in _target_names(element.value)}
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    return {target.value} if isinstance(target, cst.Name) else set()


def _function_info(
    qualname: str, func: cst.FunctionDef, positions, summaries: _Summaries | _TorchOnly, first_line: int | None = None
) -> FunctionInfo:
    """`positions` covers `func`'s nodes; without `first_line` it must also cover `func` itself."""
    params = tuple(p.name.value for p in _all_params(func.params))
    body = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    scope = summaries.scope_for(qualname)
    facts = statement_facts(body, positions, scope) if body else []  # what the branch finder reads
    statements: list[Statement] = []
    for index, item in enumerate(facts):
        if index == 0 and is_docstring(item.node):
            continue
        statements.append(_statement(len(statements), item, positions))
    local = set(params)
    for stmt in statements:
        local |= stmt.defs
    if first_line is None:
        where = positions[func]
        first_line, last_line = where.start.line, where.end.line
    else:  # a FunctionDef's range runs from `def` to the end of its body
        last_line = positions[func.body].end.line
    return FunctionInfo(
        qualname=qualname,
        params=params,
        first_line=first_line,
        last_line=last_line,
        statements=statements,
        local_names=frozenset(local),
        node=func,
        positions=positions,
        scope=scope,
        syntax=summaries.module,
        storage=_storage_access(statements, params),
    )


def _all_params(params: cst.Parameters) -> list[cst.Param]:
    found = list(params.posonly_params) + list(params.params) + list(params.kwonly_params)
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            found.append(star)
    return found


def statement_source(node: cst.BaseStatement) -> str:
    return _EMPTY.code_for_node(node.with_changes(leading_lines=())).strip()


def _statement(index: int, facts: StatementFacts, positions) -> Statement:
    """Statement `index` of suggest's view, read off the IR's facts for it."""
    node = facts.node
    value = _statement_value(node)
    target = _unwrap_value(value) if value is not None else None
    calls = []
    for call in facts.calls:
        callee = _self_callee(call.func)
        if callee is None:
            continue
        where = positions[call]
        uses: set[str] = set()
        for arg in call.args:
            uses |= expression_loads(arg.value)
        calls.append(
            CallSite(
                callee=callee,
                attr=callee.split(".")[0].split("[")[0],
                first_line=where.start.line,
                last_line=where.end.line,
                source=_EMPTY.code_for_node(call),
                uses=frozenset(uses),
                whole=target is call,
                node=call,
            )
        )
    written = facts.mutates | set(facts.may_write)
    self_state = written | facts.self_stores | {t for _, t in facts.links}
    effects = {name for name in ("collective", "rng", "stream", "barrier") if getattr(facts, name)}
    return Statement(
        index=index,
        first_line=facts.first_line,
        last_line=facts.last_line,
        source=statement_source(node),
        defs=frozenset(facts.stores),
        uses=frozenset(facts.loads),
        mutates=frozenset(written),
        calls=tuple(calls),
        has_call=facts.has_call,
        compound=not isinstance(node, cst.SimpleStatementLine),
        writes_self=any(name.startswith("self.") for name in self_state),
        exits=facts.exits,
        effects=frozenset(effects),
        node=node,
        facts=facts,
    )


def _statement_value(node: cst.BaseStatement) -> cst.BaseExpression | None:
    if isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1:
        small = node.body[0]
        if isinstance(small, (cst.Assign, cst.AnnAssign, cst.Expr, cst.Return)):
            return small.value
    return None


_SHAPE_METHODS = {"view", "reshape", "contiguous", "to", "float", "type_as", "squeeze", "unsqueeze"}


def _unwrap_value(value: cst.BaseExpression) -> cst.BaseExpression:
    """`self.f(x).view(shape)` and `self.f(x)[0]` count as the call `self.f(x)` itself."""
    while True:
        if isinstance(value, cst.Subscript):
            value = value.value
        elif (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Attribute)
            and value.func.attr.value in _SHAPE_METHODS
            and isinstance(value.func.value, cst.Call)
        ):
            value = value.func.value
        else:
            return value


def _self_callee(func: cst.BaseExpression) -> str | None:
    """How suggest names a self call: 'shared_experts' for self.shared_experts, 'self_attn[1]' for
    self.self_attn[1]; None for a tensor method on an attribute (self.x.view(...))."""
    text = _EMPTY.code_for_node(func)
    if not text.startswith("self."):
        return None
    callee = text[len("self.") :]
    head = callee.split(".")[0].split("[")[0]
    if not head.isidentifier():
        return None
    if "." in callee and callee.rsplit(".", 1)[1] in _SHAPE_METHODS:
        return None
    return callee
