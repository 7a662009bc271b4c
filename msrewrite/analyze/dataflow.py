"""Static def-use dataflow over the methods of a model file (libcst; never imports or runs it).

Each function body is cut into its top-level statements (a compound statement is one unit).
A statement knows the names it binds and reads, the `self.<sub>(...)` submodule calls inside it,
and whether it writes state (`self.x = ...`, in-place `x.add_(...)`). Edges between statements
follow names (read after write, plus write-after-read and write-after-write so reordering stays
safe), which gives a statement-level DAG per function.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from msrewrite.analyze.digraph import DiGraph
from msrewrite.analyze.positions import function_positions
from msrewrite.analyze.walk import Visitor
from msrewrite.errors import BadInput

_EMPTY = cst.Module(body=[])


@dataclass(frozen=True)
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


@dataclass
class Statement:
    index: int
    first_line: int
    last_line: int
    source: str
    defs: frozenset[str] = frozenset()
    uses: frozenset[str] = frozenset()
    mutates: frozenset[str] = frozenset()
    calls: tuple[CallSite, ...] = ()
    has_call: bool = False
    compound: bool = False
    writes_self: bool = False
    exits: bool = False
    node: cst.BaseStatement | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"L{self.first_line}" if self.first_line == self.last_line else f"L{self.first_line}-{self.last_line}"


@dataclass
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

    def statement_at(self, line: int) -> Statement | None:
        for stmt in self.statements:
            if stmt.first_line <= line <= stmt.last_line:
                return stmt
        return None

    def graph(self, *, renaming: bool = True) -> DiGraph:
        """Statement DAG: u -> v when v must stay after u.

        Edge kinds: "data" (v reads a name u binds), "state" (in-place writes and `self` state,
        which are true dependences), "name" (v rebinds a name u reads or binds: an anti/output
        dependence that renaming removes). With renaming=True the "name" edges are left out,
        which is the view branch detection wants; the planner checks rebinding itself.
        """
        dag = DiGraph()
        dag.add_nodes_from(s.index for s in self.statements)
        last_def: dict[str, int] = {}
        last_write: dict[str, int] = {}  # in-place writes to the object a name holds
        readers: dict[str, list[int]] = {}
        state_writer: int | None = None
        for stmt in self.statements:
            _link_names(dag, stmt, last_def, last_write, readers, renaming)
            if stmt.writes_self or stmt.exits:
                if state_writer is not None:
                    _link(dag, state_writer, stmt.index, "state", "self")
                state_writer = stmt.index
            for name in stmt.uses:
                readers.setdefault(name, []).append(stmt.index)
            for name in stmt.mutates:
                last_write[name] = stmt.index
                readers[name] = []
            for name in stmt.defs:
                last_def[name] = stmt.index
                last_write.pop(name, None)
                readers[name] = []
        dag.remove_edges_from([(u, v) for u, v in dag.edges if u == v])
        return dag


def _link_names(dag: DiGraph, stmt: Statement, last_def: dict[str, int], last_write: dict[str, int],
                readers: dict[str, list[int]], renaming: bool) -> None:
    """The edges into `stmt` through the names it reads, writes in place and (without renaming) binds."""
    for name in stmt.uses | stmt.mutates:
        for source in (last_def.get(name), last_write.get(name)):
            if source is not None:
                _link(dag, source, stmt.index, "data" if source == last_def.get(name) else "state", name)
    for name in stmt.mutates:  # write-after-read on the same object is a true hazard
        for reader in readers.get(name, []):
            _link(dag, reader, stmt.index, "state", name)
    if not renaming:
        for name in stmt.defs:
            for other in [*readers.get(name, []), last_def.get(name)]:
                if other is not None:
                    _link(dag, other, stmt.index, "name", name)


def _link(dag: DiGraph, u: int, v: int, kind: str, name: str) -> None:
    """Add u -> v; a data edge wins over weaker kinds on the same pair."""
    if u == v:
        return
    rank = {"data": 2, "state": 1, "name": 0}
    old = dag.get_edge_data(u, v)
    if old is None or rank[kind] > rank[old["kind"]]:
        dag.add_edge(u, v, kind=kind, name=name)


@dataclass
class ModuleInfo:
    path: Path
    functions: dict[str, FunctionInfo]
    classes: dict[str, list[str]]  # class name -> method names
    module_names: frozenset[str]  # imported or top-level names (globals)

    def drop_syntax(self) -> None:
        """Forget the libcst nodes and positions (what the branch finder read): the facts stay, and
        the info becomes cheap to send to another process."""
        for info in self.functions.values():
            info.node = info.positions = None
            for stmt in info.statements:
                stmt.node = None
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


def analyze_source(text: str, path: Path = Path("<memory>")) -> ModuleInfo:
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise BadInput(f"{path}: syntax error at line {exc.raw_line}") from None
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
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
                    functions[qual] = _function_info(qual, item, positions)
        elif isinstance(node, cst.FunctionDef):
            globals_.add(node.name.value)
            functions[node.name.value] = _function_info(node.name.value, node, positions)
        else:
            globals_ |= _top_level_names(node)
    return ModuleInfo(path=path, functions=functions, classes=classes, module_names=frozenset(globals_))


# The static tier ------------------------------------------------------------------------------
# `suggest --static` only looks at `Class.forward` methods, and a candidate needs a side branch and
# a main branch that each hold a `self.<sub>(...)` call: two call sites in one forward at least
# (see suggest/candidates.py `_static_choice`). An `ast` pass (several times cheaper than libcst)
# finds those forwards; libcst then parses each of them alone (cut out of the file, under a stub
# `class _:` header, so lines and indentation are the file's) and line numbers come from rendering
# that one function alone (analyze/positions.py `function_positions`), never from a
# whole-file PositionProvider pass. Statement text is rendered as before. A file without
# such a forward never reaches libcst. Whatever the cut-out parse could render differently from
# the whole-file parse (another default indent, "\r" newlines) falls back to the whole-file parse.
STATIC_FUNCTION = "forward"


def analyze_static(path: Path) -> ModuleInfo:
    """ModuleInfo for the static tier: the same as `analyze_file` for every `Class.forward` that can
    hold a candidate (two or more `self.<...>(...)` call sites); other functions are left out."""
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
        parsed = _parse_cut_out(text, tree, wanted)
        if parsed is None:
            parsed = _parse_whole(text, path, wanted)
        for qualname, (func, def_line) in parsed.items():
            functions[qualname] = _function_info(qualname, func, function_positions(func, def_line), def_line)
    return ModuleInfo(path=path, functions=functions, classes=classes, module_names=frozenset(module_names))


def _ast_outline(tree: ast.Module):
    """(classes, module names, {qualname: (index of its class in the module, index in the class
    body, function node)} to analyse), the first two as analyze_source finds them."""
    classes: dict[str, list[str]] = {}
    names: set[str] = set()
    last: dict[str, tuple[int, int, ast.FunctionDef | ast.AsyncFunctionDef]] = {}  # the last definition wins, as in analyze_source
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


def _first_line(node: ast.stmt) -> int:
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])


def _leading(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t\f"))]


def _default_indent(tree: ast.Module, lines: list[str]) -> str | None:
    """The indent libcst detects for the whole file (its first INDENT), or None when unsure."""
    for node in tree.body:
        if isinstance(node, ast.Match):
            return None
        body = getattr(node, "body", None)
        if not isinstance(body, list) or not body:
            continue
        first = body[0]
        line = _first_line(first)
        indent = _leading(lines[line - 1])
        column = first.col_offset if line == first.lineno else first.decorator_list[0].col_offset - 1
        if line > node.lineno and indent and len(indent) == column:
            return indent
        return None
    return None


def _parse_cut_out(text: str, tree: ast.Module, wanted) -> dict[str, tuple[cst.FunctionDef, int]] | None:
    """Parse each wanted forward alone; None where that could differ from the whole-file parse."""
    if "\r" in text:
        return None
    lines = text.split("\n")
    indent = _default_indent(tree, lines)
    if indent is None:
        return None
    found: dict[str, tuple[cst.FunctionDef, int]] = {}
    for qualname, (top, k, item) in wanted.items():
        cls = tree.body[top]
        start = _first_line(item)
        if k + 1 < len(cls.body):  # up to the next statement of the class, indented as it is
            stop = _first_line(cls.body[k + 1])
            follow = _leading(lines[stop - 1]) + "pass"
        elif top + 1 < len(tree.body):  # up to the next top-level statement
            stop = _first_line(tree.body[top + 1])
            follow = "pass"
        else:
            stop, follow = len(lines) + 1, None
        cut = ["class _:", *lines[start - 1 : stop - 1]]
        if follow is not None:
            cut.append(follow)
        source = "\n".join(cut)
        if not source.endswith("\n"):
            source += "\n"
        try:
            module = cst.parse_module(source)
        except Exception:
            return None
        if module.default_indent != indent or module.default_newline != "\n":
            return None
        stub = module.body[0]
        func = stub.body.body[0] if isinstance(stub, cst.ClassDef) else None
        if not isinstance(func, cst.FunctionDef) or func.name.value != item.name:
            return None
        found[qualname] = (func, item.lineno)
    return found


def _parse_whole(text: str, path: Path, wanted) -> dict[str, tuple[cst.FunctionDef, int]]:
    """The wanted forwards out of a whole-file libcst parse (the ast walk gives their `def` lines)."""
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
    return found


def _top_level_names(node: cst.CSTNode) -> set[str]:
    names: set[str] = set()
    if isinstance(node, cst.SimpleStatementLine):
        for small in node.body:
            if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    target = alias.asname.name if alias.asname else alias.name
                    names.add(_EMPTY.code_for_node(target).split(".")[0])
            elif isinstance(small, (cst.Assign, cst.AnnAssign)):
                names |= _Collector.target_names(small)
    return names


def _function_info(qualname: str, func: cst.FunctionDef, positions, first_line: int | None = None) -> FunctionInfo:
    """`positions` covers `func`'s nodes; without `first_line` it must also cover `func` itself."""
    params = tuple(p.name.value for p in _all_params(func.params))
    body = func.body.body if isinstance(func.body, cst.IndentedBlock) else ()
    statements: list[Statement] = []
    for index, node in enumerate(body):
        if _is_docstring(node, index):
            continue
        statements.append(_statement(len(statements), node, positions))
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
    )


def _all_params(params: cst.Parameters) -> list[cst.Param]:
    found = list(params.posonly_params) + list(params.params) + list(params.kwonly_params)
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            found.append(star)
    return found


def _is_docstring(node: cst.CSTNode, index: int) -> bool:
    return (
        index == 0
        and isinstance(node, cst.SimpleStatementLine)
        and len(node.body) == 1
        and isinstance(node.body[0], cst.Expr)
        and isinstance(node.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def statement_source(node: cst.BaseStatement) -> str:
    return _EMPTY.code_for_node(node.with_changes(leading_lines=())).strip()


def _statement(index: int, node: cst.BaseStatement, positions) -> Statement:
    collector = _Collector(positions)
    node.visit(collector)
    where = positions[node]
    value = _statement_value(node)
    calls = tuple(
        CallSite(
            callee=c.callee,
            attr=c.attr,
            first_line=c.first_line,
            last_line=c.last_line,
            source=c.source,
            uses=c.uses,
            whole=value is not None and _unwrap_value(value) is c.node,
            node=c.node,
        )
        for c in collector.calls
    )
    return Statement(
        index=index,
        first_line=where.start.line,
        last_line=where.end.line,
        source=statement_source(node),
        defs=frozenset(collector.defs),
        uses=frozenset(collector.uses),
        mutates=frozenset(collector.mutates),
        calls=calls,
        has_call=collector.has_call,
        compound=not isinstance(node, cst.SimpleStatementLine),
        writes_self=collector.writes_self,
        exits=collector.exits,
        node=node,
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


@dataclass
class _RawCall:
    node: cst.Call
    callee: str
    attr: str
    first_line: int
    last_line: int
    source: str
    uses: frozenset[str]


class _Collector(Visitor):
    """Names bound and read by one statement, its self-submodule calls and state writes."""

    def __init__(self, positions) -> None:
        self.positions = positions
        self.defs: set[str] = set()
        self.uses: set[str] = set()
        self.mutates: set[str] = set()
        self.calls: list[_RawCall] = []
        self.has_call = False
        self.writes_self = False
        self.exits = False
        self._targets: set[int] = set()

    @staticmethod
    def target_names(node: cst.CSTNode) -> set[str]:
        names: set[str] = set()
        targets = []
        if isinstance(node, cst.Assign):
            targets = [t.target for t in node.targets]
        elif isinstance(node, (cst.AnnAssign, cst.AugAssign)):
            targets = [node.target]
        for target in targets:
            for sub in _flatten_target(target):
                if isinstance(sub, cst.Name):
                    names.add(sub.value)
        return names

    def _bind(self, target: cst.BaseExpression) -> None:
        for sub in _flatten_target(target):
            if isinstance(sub, cst.Name):
                self.defs.add(sub.value)
                self._targets.add(id(sub))
            else:
                root = _root_name(sub)
                if root == "self":
                    self.writes_self = True
                elif root:
                    self.mutates.add(root)  # x[i] = ..., x.attr = ...

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            self._bind(target.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._bind(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._bind(node.target)
        if isinstance(node.target, cst.Name):
            self.uses.add(node.target.value)

    def visit_For(self, node: cst.For) -> None:
        self._bind(node.target)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._bind(node.asname.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._bind(node.target)

    def visit_Name(self, node: cst.Name) -> None:
        if id(node) not in self._targets:
            self.uses.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)  # the attribute name itself is not a variable
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)  # keyword names are not variables
        return False

    def visit_Return(self, _node: cst.Return) -> None:
        self.exits = True

    def visit_Yield(self, _node: cst.Yield) -> None:
        self.exits = True

    def visit_Call(self, node: cst.Call) -> None:
        self.has_call = True
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value.endswith("_") and not func.attr.value.startswith("_"):
            root = _root_name(func.value)
            if root == "self":
                self.writes_self = True
            elif root:
                self.mutates.add(root)  # torch convention: add_, copy_, index_add_ write the receiver
        callee = _self_callee(func)
        if callee is not None:
            where = self.positions[node]
            arg_uses: set[str] = set()
            for arg in node.args:
                arg_uses |= _names_in(arg.value)
            self.calls.append(
                _RawCall(
                    node=node,
                    callee=callee,
                    attr=callee.split(".")[0].split("[")[0],
                    first_line=where.start.line,
                    last_line=where.end.line,
                    source=_EMPTY.code_for_node(node),
                    uses=frozenset(arg_uses - {"self"}),
                )
            )

    def visit_FunctionDef(self, _node: cst.FunctionDef) -> bool:
        return False

    def visit_Lambda(self, _node: cst.Lambda) -> bool:
        return False


def _flatten_target(target: cst.BaseExpression):
    if isinstance(target, (cst.Tuple, cst.List)):
        for element in target.elements:
            yield from _flatten_target(element.value)
    elif isinstance(target, cst.StarredElement):
        yield from _flatten_target(target.value)
    else:
        yield target


def _root_name(node: cst.BaseExpression) -> str | None:
    while isinstance(node, (cst.Attribute, cst.Subscript, cst.Call)):
        node = node.func if isinstance(node, cst.Call) else node.value
    return node.value if isinstance(node, cst.Name) else None


def _self_callee(func: cst.BaseExpression) -> str | None:
    """'shared_experts' for self.shared_experts, 'self_attn[1]' for self.self_attn[1]."""
    text = _EMPTY.code_for_node(func)
    if not text.startswith("self."):
        return None
    callee = text[len("self.") :]
    head = callee.split(".")[0].split("[")[0]
    if not head.isidentifier():
        return None
    # self.x.view(...) is a tensor method on an attribute, not a submodule call.
    if "." in callee and callee.rsplit(".", 1)[1] in _SHAPE_METHODS:
        return None
    return callee


class _NameFinder(Visitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False


def _names_in(node: cst.CSTNode) -> set[str]:
    finder = _NameFinder()
    node.visit(finder)
    return finder.names
