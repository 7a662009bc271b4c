"""A behaviour-preserving refactor that phased overlaps need first: inline and flatten side calls.

`y = self.shared_expert(x)` becomes the statements of the submodule's forward, with `self`
pointing at the submodule, and every nested call or arithmetic step bound to its own name:

    gate_proj_out = self.shared_expert.gate_proj(x)
    act_fn_out = self.shared_expert.act_fn(gate_proj_out)
    up_proj_out = self.shared_expert.up_proj(x)
    mul_out = act_fn_out * up_proj_out
    y = self.shared_expert.down_proj(mul_out)

Each step can then be issued in its own phase. Inlining skips the submodule's `__call__`, so its
forward hooks no longer fire on this path; a submodule whose forward is more than straight-line
statements ending in `return` is left as a call.
"""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst

from msrewrite.analyze.definitions import kept_method
from msrewrite.analyze.defuse import function_names, node_facts, self_callee
from msrewrite.analyze.walk import Visitor
from msrewrite.records import record

_OP_NAMES = {
    cst.Multiply: "mul",
    cst.Add: "add",
    cst.Subtract: "sub",
    cst.Divide: "div",
    cst.MatrixMultiply: "matmul",
}


@record
class _Namer:
    taken: set[str]
    keeps_underscore: bool = False  # the function never names `_`: an inlined `x, _ = ...` may bind it

    def __call__(self, hint: str, suffix: str = "_out") -> str:
        base = f"{hint}{suffix}"
        name, n = base, 2
        while name in self.taken:
            name, n = f"{base}_{n}", n + 1
        self.taken.add(name)
        return name


def _bare(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`expr` without its outer parentheses, unless they hold it together across lines
    (`(a\n if c\n else b)` is only valid Python inside them)."""
    if not getattr(expr, "lpar", None) or "\n" in cst.Module(body=[]).code_for_node(
        expr.with_changes(lpar=[], rpar=[])
    ):
        return expr
    return expr.with_changes(lpar=[], rpar=[])


def _assign(name: str, value: cst.BaseExpression) -> cst.SimpleStatementLine:
    return cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(name))], value=_bare(value))])


def _hint(expr: cst.BaseExpression) -> str:
    if isinstance(expr, cst.Call):
        func = expr.func
        while isinstance(func, cst.Subscript):
            func = func.value
        if isinstance(func, cst.Attribute):
            return func.attr.value
        if isinstance(func, cst.Name):
            return func.value
        return "call"
    if isinstance(expr, cst.BinaryOperation):
        return _OP_NAMES.get(type(expr.operator), "op")
    return "value"


Inliner = Callable[[cst.Call, "_Namer", list], "cst.BaseExpression | None"]


def flatten(
    expr: cst.BaseExpression,
    namer: _Namer,
    out: list[cst.BaseStatement],
    bind: bool,
    inline: Inliner | None = None,
) -> cst.BaseExpression:
    """Bind every nested call and arithmetic step of `expr` to a name, appending the assignments;
    `inline` may replace a call by the statements of its forward."""
    if isinstance(expr, cst.Call):
        inlined = inline(expr, namer, out) if inline is not None else None
        if inlined is not None:
            expr = inlined
            if not bind or isinstance(expr, cst.Name):
                return expr
        else:
            args = [arg.with_changes(value=flatten(arg.value, namer, out, True, inline)) for arg in expr.args]
            expr = expr.with_changes(args=args)
    elif isinstance(expr, cst.BinaryOperation):
        # one line per step: drop the line breaks a parenthesized original may have had
        space = cst.SimpleWhitespace(" ")
        expr = expr.with_changes(
            left=flatten(expr.left, namer, out, True, inline),
            right=flatten(expr.right, namer, out, True, inline),
            operator=expr.operator.with_changes(whitespace_before=space, whitespace_after=space),
        )
    elif isinstance(expr, cst.UnaryOperation):  # -x stays inline; its operand may be a step
        return expr.with_changes(expression=flatten(expr.expression, namer, out, True, inline))
    else:
        return expr
    if not bind:
        return expr
    name = namer(_hint(expr))
    out.append(_assign(name, expr))
    return cst.Name(name)


class _Rebase(cst.CSTTransformer):
    """Inside an inlined forward: self -> self.<sub>, parameters -> arguments, locals -> fresh names,
    parameters left to their defaults -> those constants (`values`)."""

    def __init__(
        self, sub: str | None, renames: dict[str, str], values: dict[str, cst.BaseExpression] | None = None
    ) -> None:
        self.sub, self.renames, self.values = sub, renames, values or {}

    def leave_Attribute(self, original, updated):
        updated = updated.with_changes(attr=original.attr)  # a field name, never a local
        if self.sub is not None and isinstance(original.value, cst.Name) and original.value.value == "self":
            return updated.with_changes(value=cst.Attribute(value=cst.Name("self"), attr=cst.Name(self.sub)))
        return updated

    def leave_Arg(self, original, updated):
        return updated.with_changes(keyword=original.keyword)

    def leave_Name(self, _original, updated):
        if updated.value in self.values:
            return self.values[updated.value]
        return updated.with_changes(value=self.renames[updated.value]) if updated.value in self.renames else updated

    def leave_BooleanOperation(self, _original, updated):
        """`False or False` (two defaults) -> `False`: constants folded where a default made them."""
        left, right = (_literal_bool(updated.left), _literal_bool(updated.right))
        if left is None or right is None:
            return updated
        value = (left or right) if isinstance(updated.operator, cst.Or) else (left and right)
        return cst.Name("True" if value else "False")


def _literal_bool(node: cst.BaseExpression) -> bool | None:
    if isinstance(node, cst.Name) and node.value in ("True", "False") and not node.lpar:
        return node.value == "True"
    return None


def _constant(node: cst.BaseExpression | None) -> bool:
    """A default the inliner may write in place of its parameter: a literal."""
    if isinstance(node, cst.Name):
        return node.value in ("True", "False", "None")
    return isinstance(node, (cst.Integer, cst.Float, cst.SimpleString))


def _bind_params(
    call: cst.Call, params: list[cst.Param]
) -> tuple[list[tuple[cst.Param, cst.Arg]], list[cst.Param]] | None:
    """(parameters given positionally with their arguments, the rest left to constant defaults), or
    None when the call passes keywords, stars, too many arguments, or leaves out one without a
    constant default."""
    if any(a.keyword is not None or a.star for a in call.args) or len(call.args) > len(params):
        return None
    rest = params[len(call.args) :]
    if any(not _constant(p.default) for p in rest):
        return None
    return list(zip(params, call.args, strict=False)), rest  # params beyond the args: `rest`


def _submodule_classes(cls: cst.ClassDef) -> dict[str, str]:
    """self.<attr> = ClassName(...) assignments in __init__."""
    found: dict[str, str] = {}
    init = kept_method(cls, "__init__")
    if init is None:
        return found

    class _Assigns(Visitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            if len(node.targets) != 1 or not isinstance(node.value, cst.Call):
                return
            t = node.targets[0].target
            if (
                isinstance(t, cst.Attribute)
                and isinstance(t.value, cst.Name)
                and t.value.value == "self"
                and isinstance(node.value.func, cst.Name)
            ):
                found[t.attr.value] = node.value.func.value

    init.visit(_Assigns())
    return found


def _simple_forward(module: cst.Module, class_name: str) -> cst.FunctionDef | None:
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == class_name:
            item = kept_method(stmt, "forward")
            if item is not None:
                return item if _straight_line(item) else None
    return None


def _fold_named_return(body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """`x = expr; return x` -> `return expr`, so the caller's own name receives the value."""
    if len(body) < 2:
        return body
    tail, prev = body[-1], body[-2]
    if not (isinstance(tail, cst.SimpleStatementLine) and isinstance(prev, cst.SimpleStatementLine)):
        return body
    last, before = tail.body[0], prev.body
    if (
        isinstance(last, cst.Return)
        and isinstance(last.value, cst.Name)
        and len(before) == 1
        and isinstance(before[0], cst.Assign)
        and len(before[0].targets) == 1
        and isinstance(before[0].targets[0].target, cst.Name)
        and before[0].targets[0].target.value == last.value.value
    ):
        folded = tail.with_changes(body=[last.with_changes(value=before[0].value)])
        return [*body[:-2], folded]
    return body


def _inline_call(
    call: cst.Call,
    sub: str | None,
    forward: cst.FunctionDef,
    namer: _Namer,
    out: list[cst.BaseStatement],
    inline: Inliner | None = None,
) -> cst.BaseExpression | None:
    """The statements of `forward` for `call` appended to `out`, its result returned; `sub` is the
    submodule `self` stands for inside it (None: a method of the caller's own class)."""
    bound = _bind_params(call, list(forward.params.params)[1:])
    if bound is None:
        return None
    given, defaulted = bound
    params = [p.name.value for p in forward.params.params][1:]
    body = _fold_named_return(_block(forward))
    prefix = f"{sub}_" if sub else ""
    stored = set()
    for stmt in body[:-1]:
        stored |= node_facts(stmt).stores
    renames, values = _bind_arguments(given, defaulted, stored, _sequential(body[:-1]), prefix, namer, out)
    if _sequential(body[:-1]):
        return _inline_sequential(body, sub, prefix, given, defaulted, renames, values, namer, out, inline)
    local_names = function_names(forward.body) - set(params) - {"self"}
    for name in sorted(stored & local_names):
        renames[name] = namer(f"{prefix}{name}", suffix="")
    rebase = _Rebase(sub, renames, values)
    for stmt in body[:-1]:
        for small in _line(stmt.visit(rebase)).body:
            if isinstance(small, cst.Assign) and len(small.targets) == 1:
                value = flatten(small.value, namer, out, False, inline)
                out.append(cst.SimpleStatementLine(body=[small.with_changes(value=_bare(value))]))
            else:
                out.append(cst.SimpleStatementLine(body=[small]))
    result = _expression(_returned(body[-1]).visit(rebase))
    return flatten(result, namer, out, False, inline)


def _bind_arguments(
    given, defaulted, stored: set[str], sequential: bool, prefix: str, namer: _Namer, out: list[cst.BaseStatement]
) -> tuple[dict[str, str], dict[str, cst.BaseExpression]]:
    """(parameter -> the caller's name for it, parameter -> the constant it defaults to); the
    arguments that need a local of their own are assigned to one in `out`."""
    renames: dict[str, str] = {}
    values: dict[str, cst.BaseExpression] = {}
    for param_node, arg in given:
        param = param_node.name.value
        value = flatten(arg.value, namer, out, True)
        if isinstance(value, cst.Name) and (param not in stored or sequential):
            renames[param] = value.value
        else:  # the forward reassigns its parameter: never rebind the caller's variable
            renames[param] = namer(f"{prefix}{param}", suffix="")
            out.append(_assign(renames[param], value))
    for param_node in defaulted:  # left to its default: the constant itself, or a local holding it
        param = param_node.name.value
        if param in stored:
            renames[param] = namer(f"{prefix}{param}", suffix="")
            out.append(_assign(renames[param], param_node.default))  # type: ignore[arg-type]
        else:
            values[param] = param_node.default  # type: ignore[assignment]
    return renames, values


def _inline_sequential(
    body, sub, prefix, given, defaulted, renames, values, namer: _Namer, out: list[cst.BaseStatement], inline
) -> cst.BaseExpression | None:
    """A forward of one assignment per statement: one name per binding, in order. A parameter the
    forward rebinds reads the caller's argument until then (`x = self.act_fn(gate_up)` ->
    `shared_expert_x = ...`), no copy first."""
    current = {p.name.value: (renames.get(p.name.value) or p.name.value) for p, _ in given}
    consts = {k: v for k, v in values.items()}
    for param_node in defaulted:
        if param_node.name.value in renames:
            current[param_node.name.value] = renames[param_node.name.value]
    for stmt in body[:-1]:
        small = _line(stmt).body[0]
        assert isinstance(small, cst.Assign)  # _sequential
        value = _expression(small.value.visit(_Rebase(sub, current, consts)))
        value = flatten(value, namer, out, False, inline)
        for name in sorted(node_facts(stmt).stores):
            consts.pop(name, None)
            if name == "_":  # a discarded value: `_` itself when the function never binds or reads it
                current[name] = "_" if namer.keeps_underscore else namer(f"_{prefix}unused", suffix="")
            else:
                current[name] = namer(f"{prefix}{name}", suffix="")
        target = small.targets[0].target.visit(_Rebase(sub, current, {}))
        out.append(
            cst.SimpleStatementLine(
                body=[small.with_changes(targets=[small.targets[0].with_changes(target=target)], value=_bare(value))]
            )
        )
    result = _expression(_returned(body[-1]).visit(_Rebase(sub, current, consts)))
    return flatten(result, namer, out, False, inline)


def _sequential(statements: list[cst.BaseStatement]) -> bool:
    """Straight-line statements, each one plain `targets = value` (no walrus, no augmented or
    annotated assignment): each binding can get a name of its own, in order."""
    for stmt in statements:
        if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
            return False
        small = stmt.body[0]
        if not (isinstance(small, cst.Assign) and len(small.targets) == 1) or _has_any(stmt, (cst.NamedExpr,)):
            return False
    return True


def _simple_method(cls: cst.ClassDef | None, name: str) -> cst.FunctionDef | None:
    """A method of `cls` written as straight-line statements ending in `return <value>`."""
    item = kept_method(cls, name)
    return item if item is not None and _straight_line(item) else None


def _straight_line(item: cst.FunctionDef) -> bool:
    body = item.body.body if isinstance(item.body, cst.IndentedBlock) else []
    if not body or not all(isinstance(s, cst.SimpleStatementLine) for s in body):
        return False
    last = _line(body[-1]).body
    if len(last) != 1 or not isinstance(last[0], cst.Return) or last[0].value is None:
        return False
    params = item.params
    if params.star_arg is not cst.MaybeSentinel.DEFAULT and params.star_arg is not None:
        return False
    return not (params.kwonly_params or params.star_kwarg)


def _structured_method(cls: cst.ClassDef | None, name: str) -> cst.FunctionDef | None:
    """A method of `cls` made of assignments and `if`/`elif`/`else` blocks of them, ending in its
    only `return <value>` (SGLang 0.5's `_forward_shared_experts`: `shared_output = None; if
    self.shared_expert is not None: ...; return shared_output`); None otherwise."""
    if cls is None or not isinstance(cls.body, cst.IndentedBlock):
        return None
    method = kept_method(cls, name)
    if method is None or not isinstance(method.body, cst.IndentedBlock) or method.decorators:
        return None
    params = method.params
    if (
        (params.star_arg is not cst.MaybeSentinel.DEFAULT and params.star_arg is not None)
        or params.kwonly_params
        or params.star_kwarg
        or params.posonly_params
        or not params.params
        or params.params[0].name.value != "self"
    ):
        return None
    body = _without_docstring(list(method.body.body))
    if not body or not isinstance(body[-1], cst.SimpleStatementLine) or len(body[-1].body) != 1:
        return None
    last = body[-1].body[0]
    if not isinstance(last, cst.Return) or last.value is None:
        return None

    def plain(statements) -> bool:
        for stmt in statements:
            if isinstance(stmt, cst.SimpleStatementLine):
                if not all(
                    isinstance(small, (cst.Assign, cst.AugAssign, cst.Pass))
                    or (isinstance(small, cst.AnnAssign) and small.value is not None)
                    for small in stmt.body
                ):
                    return False
            elif isinstance(stmt, cst.If):
                if not _plain_if(stmt, plain):
                    return False
            else:
                return False
        return True

    if not plain(body[:-1]) or _has_any(
        method.body,
        (cst.Yield, cst.Await, cst.Global, cst.Nonlocal, cst.Lambda, cst.FunctionDef, cst.ClassDef, cst.NamedExpr),
    ):
        return None
    return method


def _plain_if(node: cst.If, plain) -> bool:
    if not isinstance(node.body, cst.IndentedBlock) or not plain(node.body.body):
        return False
    if node.orelse is None:
        return True
    if isinstance(node.orelse, cst.If):
        return _plain_if(node.orelse, plain)
    return isinstance(node.orelse.body, cst.IndentedBlock) and plain(node.orelse.body.body)


def _has_any(node: cst.CSTNode, kinds: tuple) -> bool:
    found = False

    class _Find(Visitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            nonlocal found
            found = found or isinstance(n, kinds)
            return not found

    node.visit(_Find())
    return found


def _block(func: cst.FunctionDef) -> list[cst.BaseStatement]:
    """The statements of a function the checks here found to have an indented body."""
    assert isinstance(func.body, cst.IndentedBlock)
    return list(func.body.body)


def _statement(node: object) -> cst.BaseStatement:
    """A statement a rewrite of it returned (the rewrites here never remove one)."""
    assert isinstance(node, cst.BaseStatement)
    return node


def _expression(node: object) -> cst.BaseExpression:
    """An expression a rename returned (renames never remove one)."""
    assert isinstance(node, cst.BaseExpression)
    return node


def _line(node: object) -> cst.SimpleStatementLine:
    """A statement the checks here found to be a simple line."""
    assert isinstance(node, cst.SimpleStatementLine)
    return node


def _returned(stmt: cst.BaseStatement) -> cst.BaseExpression:
    """The value of the `return <value>` line that ends a function the checks here accepted."""
    ret = _line(stmt).body[0]
    assert isinstance(ret, cst.Return) and ret.value is not None
    return ret.value


def _without_docstring(body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    first = body[0] if body else None
    if (
        isinstance(first, cst.SimpleStatementLine)
        and len(first.body) == 1
        and isinstance(first.body[0], cst.Expr)
        and isinstance(first.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    ):
        return body[1:]
    return body


def _inline_structured(
    call: cst.Call,
    method: cst.FunctionDef,
    target: str,
    namer: _Namer,
    flatten_block: Callable[[list[cst.BaseStatement]], list[cst.BaseStatement]],
) -> list[cst.BaseStatement] | None:
    """`target = self.helper(args)` as the statements of `helper` (a _structured_method), `self`
    unchanged, parameters bound to the arguments, locals renamed, and the local it returns written
    as `target` itself when nothing the helper reads is called that; every nested call and step of
    its assignments is then flattened (`flatten_block`). None when the call does not fit."""
    bound = _bind_params(call, list(method.params.params)[1:])
    if bound is None:
        return None
    given, defaulted = bound
    body = _without_docstring(_block(method))
    result = _returned(body[-1])
    stored: set[str] = set()
    for stmt in body[:-1]:
        stored |= node_facts(stmt).stores
    params = {p.name.value for p in method.params.params[1:]}
    out: list[cst.BaseStatement] = []
    renames: dict[str, str] = {}
    values: dict[str, cst.BaseExpression] = {}
    arg_names: set[str] = set()
    for param_node, arg in given:
        param = param_node.name.value
        value = flatten(arg.value, namer, out, True)
        arg_names |= node_facts(value).loads
        if isinstance(value, cst.Name) and param not in stored:
            renames[param] = value.value
        else:
            renames[param] = namer(param, suffix="")
            out.append(_assign(renames[param], value))
    for param_node in defaulted:
        param = param_node.name.value
        if param in stored:
            renames[param] = namer(param, suffix="")
            out.append(_assign(renames[param], param_node.default))  # type: ignore[arg-type]
        else:
            values[param] = param_node.default  # type: ignore[assignment]
    returned = result.value if isinstance(result, cst.Name) and result.value in stored - params else None
    for name in sorted(stored - params):
        if name == returned and target not in arg_names and target not in renames.values():
            renames[name] = target  # the helper's result, under the name the caller gives it
        else:
            renames[name] = namer(name, suffix="")
    rebase = _Rebase(None, renames, values)
    out += flatten_block([_statement(stmt.visit(rebase)) for stmt in body[:-1]])
    final = _expression(result.visit(rebase))
    if not (isinstance(final, cst.Name) and final.value == target):
        out += flatten_block([_assign(target, final)])
    return out


def inline_and_flatten(
    module: cst.Module, cls: cst.ClassDef | None, func: cst.FunctionDef, is_seed: Callable[[str], bool]
) -> cst.FunctionDef:
    """`func` with every top-level side statement (`name = <expr with seed calls>`) flattened and
    its `self.<sub>(...)` calls inlined where the submodule's forward allows it; a helper method
    of the same class (`self._forward_shared_experts(x)`) is inlined with `self` unchanged. Side
    statements in the block of a top-level `if` (a guarded shared expert) are flattened too."""
    flattener = _Flattener(module, cls, func, is_seed)
    return func.with_changes(body=func.body.with_changes(body=flattener.statements(flattener.top)))


@record
class InlineTrace:
    """What inline_and_flatten did to one function: each original statement it rewrote, with the
    statements that replaced it (code, leading lines stripped), and each submodule whose forward it
    copied in, as (attribute, class)."""

    groups: list[tuple[cst.BaseStatement, tuple[str, ...]]]
    modules: list[tuple[str, str]]


def inline_trace(
    module: cst.Module, cls: cst.ClassDef | None, func: cst.FunctionDef, is_seed: Callable[[str], bool]
) -> InlineTrace:
    """inline_and_flatten's walk again (it names the same way), recording what it replaced."""
    flattener = _Flattener(module, cls, func, is_seed)
    flattener.statements(flattener.top)
    return InlineTrace(flattener.groups, list(dict.fromkeys(flattener.modules)))


def statement_code(stmt: cst.BaseStatement) -> str:
    """A statement's code without its leading blank lines and comments, for matching."""
    if isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        stmt = stmt.with_changes(leading_lines=[])
    return cst.Module(body=[]).code_for_node(stmt).strip()


class _Flattener:
    """inline_and_flatten's walk over one function (one namer for all of it)."""

    def __init__(
        self, module: cst.Module, cls: cst.ClassDef | None, func: cst.FunctionDef, is_seed: Callable[[str], bool]
    ) -> None:
        self.module, self.cls, self.is_seed = module, cls, is_seed
        assert isinstance(func.body, cst.IndentedBlock)  # the edited function's body is a block (plan_edit)
        self.top = func.body.body
        self.subclasses = _submodule_classes(cls) if cls is not None else {}
        self.namer = _Namer(function_names(func), keeps_underscore="_" not in function_names(func))
        self.groups: list[tuple[cst.BaseStatement, tuple[str, ...]]] = []  # inline_trace's record
        self.modules: list[tuple[str, str]] = []

    def in_block(self, block: cst.BaseSuite) -> cst.BaseSuite:
        if not isinstance(block, cst.IndentedBlock):
            return block
        return block.with_changes(body=self.statements(block.body))

    def statements(self, statements) -> list[cst.BaseStatement]:
        new_body: list[cst.BaseStatement] = []
        for stmt in statements:
            if isinstance(stmt, cst.If) and statements is self.top:
                orelse = stmt.orelse
                if isinstance(orelse, cst.Else):
                    orelse = orelse.with_changes(body=self.in_block(orelse.body))
                new_body.append(stmt.with_changes(body=self.in_block(stmt.body), orelse=orelse))
                continue
            replaced = self.statement(stmt)
            if replaced != [stmt]:
                self.groups.append((stmt, tuple(statement_code(s) for s in replaced)))
            new_body += replaced
        return new_body

    def inlined(self, statements) -> list[cst.BaseStatement]:
        """An inlined helper's statements: assignments flattened, `if` blocks too, at any depth."""
        new_body: list[cst.BaseStatement] = []
        for stmt in statements:
            if isinstance(stmt, cst.If):
                new_body.append(self.inlined_if(stmt))
            else:
                new_body += self.statement(stmt)
        return new_body

    def inlined_if(self, node: cst.If) -> cst.If:
        orelse = node.orelse
        if isinstance(orelse, cst.If):
            orelse = self.inlined_if(orelse)
        elif isinstance(orelse, cst.Else):
            orelse = orelse.with_changes(body=orelse.body.with_changes(body=self.inlined(orelse.body.body)))
        return node.with_changes(body=node.body.with_changes(body=self.inlined(node.body.body)), orelse=orelse)

    def _seeds(self, value: cst.BaseExpression) -> list[cst.Call]:
        seeds: list[cst.Call] = []
        is_seed = self.is_seed

        class _Seeds(Visitor):
            def visit_Call(self, node: cst.Call) -> None:
                callee = self_callee(node.func)
                if callee and is_seed(callee):
                    seeds.append(node)

        value.visit(_Seeds())
        return seeds

    def statement(self, stmt: cst.BaseStatement) -> list[cst.BaseStatement]:
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            return [stmt]
        small = stmt.body[0]
        if not (
            isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)
        ):
            return [stmt]
        if not self._seeds(small.value):
            return [stmt]
        value = small.value
        cls, namer = self.cls, self.namer
        callee = self_callee(value.func) if isinstance(value, cst.Call) else None
        if (
            isinstance(value, cst.Call)
            and callee
            and "." not in callee
            and callee not in self.subclasses
            and _simple_method(cls, callee) is None
        ):
            # a helper with `if` blocks (`shared = None; if self.shared_expert is not None: ...`)
            method = _structured_method(cls, callee)
            target = small.targets[0].target
            assert isinstance(target, cst.Name)  # checked at the top
            inlined = (
                _inline_structured(value, method, target.value, namer, self.inlined) if method is not None else None
            )
            if inlined:
                inlined[0] = inlined[0].with_changes(leading_lines=stmt.leading_lines)
                return inlined
        out: list[cst.BaseStatement] = []
        value = flatten(small.value, namer, out, False, self.inline)
        out.append(
            cst.SimpleStatementLine(
                body=[small.with_changes(value=_bare(value))], trailing_whitespace=stmt.trailing_whitespace
            )
        )
        out[0] = out[0].with_changes(leading_lines=stmt.leading_lines)
        return out

    def inline(self, call: cst.Call, namer: _Namer, out: list) -> cst.BaseExpression | None:
        callee = self_callee(call.func)
        if not callee or "." in callee or not self.is_seed(callee):
            return None
        if callee in self.subclasses:
            forward = _simple_forward(self.module, self.subclasses[callee])
            inlined = _inline_call(call, callee, forward, namer, out) if forward is not None else None
            if inlined is not None:
                self.modules.append((callee, self.subclasses[callee]))
            return inlined
        method = _simple_method(self.cls, callee)  # a helper method: its body, `self` unchanged
        return _inline_call(call, None, method, namer, out, self.inline) if method is not None else None


def inline_blockers(module: cst.Module, cls: cst.ClassDef | None, is_seed: Callable[[str], bool]) -> list[str]:
    """Why inlining the side calls of `cls` would not be the original code, visibly in this file:
    inlining copies one class's `forward` (or one helper method) into the caller, skipping the
    module's `__call__`, so a subclass, a module-level `Cls.forward = f`, or a hook registered on
    the submodule would no longer run, with the flag off too. Empty when none is seen. Hooks a
    framework registers at run time cannot be seen here (docs/cases.md: moe-shared-expert-phased)."""
    from msrewrite.analyze.summaries import ModuleSummaries

    if cls is None:
        return []
    summaries = ModuleSummaries(module)
    owner = cls.name.value
    found: list[str] = []
    subs_of_owner = summaries.subclasses(owner)
    for attr, sub_cls in sorted(_submodule_classes(cls).items()):
        if not is_seed(attr):
            continue
        derived = summaries.subclasses(sub_cls)
        if derived:
            found.append(f"{derived[0]} in this file derives from {sub_cls}, the class of self.{attr}")
        for base in summaries._ancestors(sub_cls):
            for method in ("forward", "__call__"):
                if summaries.patches.get((base, method)):
                    found.append(f"{base}.{method} is reassigned at module level (self.{attr} is a {sub_cls})")
        hooks = summaries._hooks(owner, attr)
        if hooks:
            found.append(f"a hook is registered on self.{attr} ({hooks[0]})")
        for sub in subs_of_owner:
            mine = summaries.attribute_values(sub).get(attr, [])
            theirs = summaries.attribute_values(owner).get(attr, [])
            if any(not any(v is w for w in theirs) for v in mine):
                found.append(f"{sub}, a subclass of {owner}, puts another module in self.{attr}")
    for sub in subs_of_owner:
        node = summaries.classes[sub]
        overrides = [
            s.name.value
            for s in node.body.body  # type: ignore[union-attr]
            if isinstance(s, cst.FunctionDef) and is_seed(s.name.value)
        ]
        if overrides:
            found.append(f"{sub}, a subclass of {owner}, overrides {overrides[0]}")
    if "register_module_forward" in module.code:
        found.append("the file registers a global module hook (register_module_forward_*)")
    return found


def _off_branch(test: cst.BaseExpression, streams: set[str]) -> bool | None:
    """Which branch of `if <test>:` runs with the side stream off: True its body, False its
    `else:`, None neither (`test` does not read the switch)."""
    if isinstance(test, cst.Name) and test.value in streams:
        return False
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return True if isinstance(test.expression, cst.Name) and test.expression.value in streams else None
    if not (
        isinstance(test, cst.Comparison)
        and isinstance(test.left, cst.Name)
        and test.left.value in streams
        and len(test.comparisons) == 1
        and isinstance(test.comparisons[0].comparator, cst.Name)
        and test.comparisons[0].comparator.value == "None"
    ):
        return None
    op = test.comparisons[0].operator
    return True if isinstance(op, cst.Is) else False if isinstance(op, cst.IsNot) else None


def restore_calls(
    module: cst.Module, function: str, original: cst.FunctionDef, inlined: cst.FunctionDef, trace: InlineTrace
) -> cst.Module:
    """The edited module with the flag-off path of `function` calling as `original` did: in each
    block that runs when the side stream is off (`if <stream> is None:`, `if not <stream>:`, the
    `else:` of `if <stream> is not None:` / `if <stream>:`), each run of statements that inlining
    made of one original statement is that statement again. NothingToDo when a flag-off block still
    reads or binds a name only the inlining introduced (a statement split across blocks)."""
    from msrewrite.emit.locate import locate
    from msrewrite.errors import NothingToDo

    located = locate(module, function)
    func = located.func
    introduced = function_names(inlined) - function_names(original)  # the inlined body's own names
    streams = function_names(func) - function_names(inlined)  # the switch is a name the edit added
    groups = [(stmt, codes) for stmt, codes in trace.groups if codes]
    leftovers: list[str] = []

    def restored(stmts: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        codes = [statement_code(s) for s in stmts]
        out: list[cst.BaseStatement] = []
        i = 0
        while i < len(stmts):
            for stmt, expansion in groups:
                if tuple(codes[i : i + len(expansion)]) == expansion:
                    out.append(stmt.with_changes(leading_lines=getattr(stmts[i], "leading_lines", ())))
                    i += len(expansion)
                    break
            else:
                out.append(stmts[i])
                i += 1
        for stmt in out:
            names = function_names(stmt) & introduced
            if names:
                leftovers.append(sorted(names)[0])
        return out

    class _Off(cst.CSTTransformer):
        def leave_If(self, _original: cst.If, updated_node: cst.If) -> cst.If:
            which = _off_branch(updated_node.test, streams)
            if which is True and isinstance(updated_node.body, cst.IndentedBlock):
                body = updated_node.body
                return updated_node.with_changes(body=body.with_changes(body=restored(list(body.body))))
            if which is False and isinstance(updated_node.orelse, cst.Else):
                orelse = updated_node.orelse
                block = orelse.body
                if isinstance(block, cst.IndentedBlock):
                    block = block.with_changes(body=restored(list(block.body)))
                return updated_node.with_changes(orelse=orelse.with_changes(body=block))
            return updated_node

    new_func = cst.ensure_type(func.visit(_Off()), cst.FunctionDef)
    if leftovers:
        raise NothingToDo(
            f"no safe edit: {function}: the flag-off path cannot call as the original does "
            f"(it would still use {leftovers[0]}, which only the inlined shared expert binds)"
        )
    return cst.ensure_type(module.deep_replace(func, new_func), cst.Module)
