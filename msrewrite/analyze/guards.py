"""Conditions that cannot change over an overlap window, and the `if`s they guard.

Serving code wraps the shared expert in an `if` on configuration:

    if self.shared_experts is not None:
        shared = self.shared_experts(hidden_states)
        out += shared

The side call cannot move out of that `if` unconditionally, but it can move under the same
condition: a guarded fork (`if <stream> and <condition>:`) as early as its inputs exist, and the
original `if`, which now holds the join. That is only right when the condition reads the same
at the fork as at the `if`; `invariance_problem` says why not when it cannot show that.

A condition is invariant when it reads only
  - attributes of `self` (configuration, submodules) that the function never assigns,
  - tensor shapes (`x.shape[0]`, `x.size(0)`, `x.dim()`, `x.ndim`, `x.numel()`, `len(x)`),
  - `NAME is None` / `NAME is not None` on a local (identity, not data),
  - locals bound only from such expressions (`num_tokens = x.shape[0]`),
  - constants and module-level names that no function rebinds (`global`),
combined by comparisons, `not`, `and`, `or` and arithmetic; the caller checks that no local it
reads is rebound or written in place between the fork and the `if`.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

import libcst as cst

from msrewrite.analyze.defuse import StatementFacts, dotted_name
from msrewrite.analyze.walk import Visitor
from msrewrite.records import record

_EMPTY = cst.Module(body=[])
_SHAPE_ATTRS = frozenset({"shape", "ndim", "is_cuda", "device", "dtype"})
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "ndimension", "nelement"})
_PURE_BUILTINS = frozenset({"len", "isinstance", "hasattr", "getattr"})
# the negation of each comparison operator, for `else:` branches (`is None` -> `is not None`)
_NEGATED = {
    cst.Is: cst.IsNot,
    cst.IsNot: cst.Is,
    cst.Equal: cst.NotEqual,
    cst.NotEqual: cst.Equal,
    cst.LessThan: cst.GreaterThanEqual,
    cst.GreaterThanEqual: cst.LessThan,
    cst.GreaterThan: cst.LessThanEqual,
    cst.LessThanEqual: cst.GreaterThan,
    cst.In: cst.NotIn,
    cst.NotIn: cst.In,
}


@record(frozen=True)
class Guard:
    """The `if` at top-level statement `index` runs the side branch in its `body` (or `orelse`)
    when `condition` (already negated for the `else:` branch) holds."""

    index: int
    line: int
    condition: str
    in_orelse: bool
    locals_read: frozenset[str]  # function locals the condition reads (must not change before the `if`)
    size: int = 0  # statements in the guarded block

    @property
    def inside(self) -> range:
        return range(self.index, self.index + self.size)


# One step from an `if` into the branch that holds the side work: (the `if`, into its `else`/`elif`).
GuardStep = tuple[cst.If, bool]


def guard_path(
    node: cst.If, holds: Callable[[cst.CSTNode], bool], main_work: Callable[[cst.CSTNode], bool] | None = None
) -> tuple[list[GuardStep], cst.BaseSuite] | str:
    """The steps from the top-level `if` `node` to the one block that holds the side work
    (`holds`), through `elif`s and through an `if` that is the only statement of its block:

        if a:                 if a:               -> [(if a, False), (if b, False)], condition `a and b`
            if b:                 ...
                <side>        elif b:             -> [(if a, True), (if b, False)], `not a and b`
                                  <side>

    When both branches of one `if` hold side work and `main_work` says only one of them also
    holds main work (`if self.has_experts: moe = self.experts(h); h = moe + self.shared(h)`
    / `else: h = self.shared(h)`), the path goes into that one: the other branch has nothing to
    overlap, and it stays as it is (under the split condition it does not run).

    A reason (str) when no single block holds it: both branches of one `if`, or its condition."""
    path: list[GuardStep] = []
    current = node
    while True:
        if holds(current.test):
            return f"the side call is in the condition of `if {source(current.test)}`"
        in_body = holds(current.body)
        orelse = current.orelse
        in_orelse = orelse is not None and holds(orelse)
        if in_body and in_orelse and orelse is not None:  # in_orelse implies an orelse
            busy = [main_work(current.body), main_work(orelse)] if main_work is not None else [True, True]
            if busy[0] == busy[1]:
                why = "and both also do main work" if busy[0] else "and neither does main work to overlap"
                return (
                    f"both branches of `if {source(current.test)}` call the side branch {why}; "
                    "msrewrite does not merge them into one fork"
                )
            in_body, in_orelse = busy[0], busy[1]
        if in_orelse and isinstance(orelse, cst.If):  # elif
            path.append((current, True))
            current = orelse
            continue
        block = orelse.body if in_orelse else current.body  # type: ignore[union-attr]
        path.append((current, in_orelse))
        if isinstance(block, cst.IndentedBlock) and len(block.body) == 1 and isinstance(block.body[0], cst.If):
            current = block.body[0]  # `if a:` whose whole block is `if b:`
            continue
        return path, block


def path_condition(path: list[GuardStep]) -> str:
    """What holds exactly when the guarded block runs: each step's test, negated into an `else`."""
    parts = [negate(step.test) if in_orelse else source(step.test) for step, in_orelse in path]
    if len(parts) == 1:
        return parts[0]
    wrapped = []
    for part in parts:
        expr = cst.parse_expression(part)
        needs = isinstance(expr, (cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.NamedExpr)) and not expr.lpar
        wrapped.append(f"({part})" if needs else part)
    return " and ".join(wrapped)


def rebuild_path(path: list[GuardStep], statements: list[cst.BaseStatement]) -> cst.If:
    """The top-level `if` of `path` with its guarded block's statements replaced."""
    node, in_orelse = path[-1]
    new = _with_block(node, in_orelse, statements)
    for node, in_orelse in reversed(path[:-1]):
        if in_orelse and isinstance(node.orelse, cst.If):
            new = node.with_changes(orelse=new)
        else:
            new = _with_block(node, in_orelse, [new])
    return new


def follow_turns(node: cst.If, turns: tuple[bool, ...]) -> list[GuardStep]:
    """The path through `node` (an `if` rebuilt by `rebuild_path`) that takes `turns`, each step's
    `in_orelse`, as the original path did."""
    path: list[GuardStep] = []
    current = node
    for i, in_orelse in enumerate(turns):
        path.append((current, in_orelse))
        if i == len(turns) - 1:
            break
        if in_orelse and isinstance(current.orelse, cst.If):
            current = current.orelse
        else:
            block = current.orelse.body if in_orelse else current.body  # type: ignore[union-attr]
            current = block.body[0]  # type: ignore[assignment]
    return path


def block_of(path: list[GuardStep]) -> list[cst.BaseStatement]:
    """The statements of the guarded block at the end of `path`."""
    node, in_orelse = path[-1]
    block = node.orelse.body if in_orelse else node.body  # type: ignore[union-attr]
    return list(block.body)


def _with_block(node: cst.If, in_orelse: bool, statements: list[cst.BaseStatement]) -> cst.If:
    if in_orelse:
        orelse = node.orelse
        return node.with_changes(orelse=orelse.with_changes(body=orelse.body.with_changes(body=statements)))  # type: ignore[union-attr]
    return node.with_changes(body=node.body.with_changes(body=statements))


def source(node: cst.CSTNode) -> str:
    """The node's code on one line: a condition written over several lines (`if (a\n and b):`)
    is emitted in a comment and in a one-line `if`, so its line breaks and comments go."""
    text = _EMPTY.code_for_node(node).strip()
    if "\n" not in text and "\r" not in text:
        return text
    flat = node.visit(_OneLine())
    assert isinstance(flat, cst.CSTNode)  # _OneLine only replaces whitespace
    text = _EMPTY.code_for_node(flat).strip()
    if "\n" in text or "\r" in text:  # a string literal spanning lines: Python's own spelling
        text = ast.unparse(ast.parse(_EMPTY.code_for_node(node).strip(), mode="eval"))
    return text


class _OneLine(cst.CSTTransformer):
    """Line breaks inside brackets and backslash continuations become one space; comments go."""

    def leave_ParenthesizedWhitespace(
        self, _original: cst.ParenthesizedWhitespace, _updated: cst.ParenthesizedWhitespace
    ) -> cst.SimpleWhitespace:
        return cst.SimpleWhitespace(" ")

    def leave_SimpleWhitespace(
        self, _original: cst.SimpleWhitespace, updated: cst.SimpleWhitespace
    ) -> cst.SimpleWhitespace:
        return cst.SimpleWhitespace(" ") if "\\" in updated.value else updated


def negate(test: cst.BaseExpression) -> str:
    """`not test`, written the way a person would: `x is None` -> `x is not None`."""
    bare = test.with_changes(lpar=[], rpar=[]) if hasattr(test, "lpar") else test
    if isinstance(bare, cst.UnaryOperation) and isinstance(bare.operator, cst.Not):
        return source(bare.expression.with_changes(lpar=[], rpar=[]))
    if isinstance(bare, cst.Comparison) and len(bare.comparisons) == 1:
        target = bare.comparisons[0]
        flipped = _NEGATED.get(type(target.operator))
        if flipped is not None:
            op: Any = target.operator  # every operator _NEGATED knows has whitespace_before/_after
            new_op = (
                flipped(whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after)
                if flipped
                not in (
                    cst.IsNot,
                    cst.NotIn,
                )
                else flipped(
                    whitespace_before=op.whitespace_before,
                    whitespace_between=cst.SimpleWhitespace(" "),
                    whitespace_after=op.whitespace_after,
                )
            )
            return source(bare.with_changes(comparisons=[target.with_changes(operator=new_op)]))
    if isinstance(bare, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)):
        return f"not {source(bare)}"
    return f"not ({source(bare)})"


def conjoin(first: str, condition: str) -> str:
    """`first and condition`, parenthesizing a condition that `and` would otherwise split."""
    expr = cst.parse_expression(condition)
    if isinstance(expr, (cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.NamedExpr)) and not expr.lpar:
        condition = f"({condition})"
    return f"{first} and {condition}"


def assigned_self_attrs(func: cst.FunctionDef) -> set[str]:
    """First attribute of every `self.<a>...` the function assigns, deletes or setattr()s."""
    names: set[str] = set()

    def note(target: cst.BaseExpression) -> None:
        while isinstance(target, (cst.Attribute, cst.Subscript)):
            inner = target.value
            if isinstance(target, cst.Attribute) and isinstance(inner, cst.Name) and inner.value == "self":
                names.add(target.attr.value)
                return
            target = inner
        if isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                note(element.value)

    class _Writes(Visitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            note(node.target)

        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            note(node.target)

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            note(node.target)

        def visit_Del(self, node: cst.Del) -> None:
            note(node.target)

        def visit_Call(self, node: cst.Call) -> None:
            if dotted_name(node.func) in ("setattr", "delattr", "object.__setattr__") and node.args:
                first = node.args[0].value
                if isinstance(first, cst.Name) and first.value == "self":
                    names.add("*")  # any attribute

    func.body.visit(_Writes())
    return names


def global_names(module_or_func: cst.CSTNode) -> set[str]:
    """Names some function declares `global` (so a call may rebind them)."""
    names: set[str] = set()

    class _Globals(Visitor):
        def visit_Global(self, node: cst.Global) -> None:
            names.update(item.name.value for item in node.names)

    module_or_func.visit(_Globals())
    return names


class _Checker:
    """Walks a condition; `problem` is the first reason it is not provably invariant."""

    def __init__(self, func: cst.FunctionDef, facts: list[StatementFacts], locals_: set[str], scope=None) -> None:
        self.scope = scope  # resolves a called function, so a refusal can say what it reaches
        self.self_writes = assigned_self_attrs(func)
        self.globals = global_names(func)
        self.facts = facts
        self.locals = locals_
        self.locals_read: set[str] = set()
        self.seen: set[str] = set()

    def check(self, expr: cst.BaseExpression) -> str | None:
        if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString)):
            return None
        if isinstance(expr, cst.Name):
            return self._name(expr.value)
        if isinstance(expr, cst.Attribute):
            return self._attribute(expr)
        if isinstance(expr, cst.UnaryOperation):
            return self.check(expr.expression)
        if isinstance(expr, cst.BooleanOperation):
            return self.check(expr.left) or self.check(expr.right)
        if isinstance(expr, cst.BinaryOperation):
            return self.check(expr.left) or self.check(expr.right)
        if isinstance(expr, cst.Comparison):
            if self._identity_test(expr):
                return None
            return self.check(expr.left) or next(
                (p for p in (self.check(c.comparator) for c in expr.comparisons) if p), None
            )
        if isinstance(expr, cst.Subscript):
            bad = self.check(expr.value)
            for element in expr.slice:
                index = element.slice
                if isinstance(index, cst.Index):
                    bad = bad or self.check(index.value)
                else:
                    bad = bad or "slices a value"
            return bad
        if isinstance(expr, (cst.Tuple, cst.List)):
            return next((p for p in (self.check(e.value) for e in expr.elements) if p), None)
        if isinstance(expr, cst.Call):
            return self._call(expr)
        return f"uses {type(expr).__name__.lower()} `{source(expr)}`"

    # pieces --------------------------------------------------------------------------------
    def _name(self, name: str) -> str | None:
        if name in ("None", "True", "False", "self"):
            return None
        if name in self.locals:
            return self._local_value(name)
        if name in self.globals:
            return f"reads `{name}`, which a function rebinds with `global`"
        return None  # a module-level constant, a builtin or an import

    def _local_value(self, name: str) -> str | None:
        """A bare local is invariant only when every binding of it is itself invariant."""
        self.locals_read.add(name)
        if name in self.seen:
            return None
        self.seen.add(name)
        bindings = [f for f in self.facts if name in f.stores]
        if not bindings:
            return f"reads the value of `{name}`, which may change"  # a parameter: its value is data
        for f in bindings:
            value = _assigned_value(f.node, name)
            if value is None:
                return f"reads `{name}`, bound at line {f.first_line} by more than a plain assignment"
            bad = self.check(value)
            if bad:
                return bad
        return None

    def _attribute(self, expr: cst.Attribute) -> str | None:
        chain = dotted_name(expr)
        if chain is not None and chain.startswith("self."):
            first = chain.split(".")[1]
            if first in self.self_writes or "*" in self.self_writes:
                return f"reads `{chain}`, which this function assigns"
            return None
        if expr.attr.value in _SHAPE_ATTRS:
            return self._shape_of(expr.value)
        return f"reads `{source(expr)}`, an attribute of a value that may change"

    def _shape_of(self, value: cst.BaseExpression) -> str | None:
        root = value
        while isinstance(root, (cst.Attribute, cst.Subscript)):
            root = root.value
        if isinstance(root, cst.Name):
            if root.value in self.locals:
                self.locals_read.add(root.value)
                return None
            return self._name(root.value)
        return f"reads the shape of `{source(value)}`"

    def _call(self, call: cst.Call) -> str | None:
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in _SHAPE_METHODS:
            bad = self._shape_of(func.value)
            return bad or next((p for p in (self.check(a.value) for a in call.args) if p), None)
        name = dotted_name(func)
        if name in _PURE_BUILTINS and name not in self.locals:
            if name == "len" and call.args:
                return self._shape_of(call.args[0].value)
            return next((p for p in (self.check(a.value) for a in call.args) if p), None)
        return f"calls `{source(func)}`, which msrewrite cannot see into{self._reaches(call)}"

    def _reaches(self, call: cst.Call) -> str:
        """' (it reaches forward_mode.is_idle, not visible to msrewrite)': why a function the summaries
        read is still not proof, when they did read it."""
        if self.scope is None or self.scope.resolver is None:
            return ""
        effect = self.scope.effect_of(call)
        deeper = [u for u in effect.unknown if not u.startswith(source(call.func) + " (")]
        if deeper:
            return f" as a condition (it reaches {deeper[0].split(' -> ')[-1]})"
        if effect.writes or effect.may_writes:
            return " as a condition (it writes its arguments)"
        return " as a condition (a call is not proven to give the same answer at the fork)"

    def _identity_test(self, expr: cst.Comparison) -> bool:
        """`NAME is None` / `NAME is not None` on a local: identity does not depend on tensor data."""
        if len(expr.comparisons) != 1 or not isinstance(expr.comparisons[0].operator, (cst.Is, cst.IsNot)):
            return False
        left, right = expr.left, expr.comparisons[0].comparator
        if isinstance(right, cst.Name) and right.value == "None" and isinstance(left, cst.Name):
            if left.value in self.locals:
                self.locals_read.add(left.value)
                return True
        return False


def _assigned_value(stmt: cst.BaseStatement, name: str) -> cst.BaseExpression | None:
    """The value of `name = <value>` (or `a, name = <shape>`), else None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
        return small.value
    if not isinstance(small, cst.Assign) or len(small.targets) != 1:
        return None
    target = small.targets[0].target
    if isinstance(target, cst.Name):
        return small.value if target.value == name else None
    if isinstance(target, (cst.Tuple, cst.List)):
        # `num_tokens, hidden = x.shape`: each element of a shape is a shape
        value = small.value
        if isinstance(value, cst.Attribute) and value.attr.value == "shape":
            return value
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "size":
            return value
    return None


def invariance_problem(
    test: cst.BaseExpression, func: cst.FunctionDef, facts: list[StatementFacts], locals_: set[str], scope=None
) -> tuple[str | None, frozenset[str]]:
    """(why `test` may change during the window, or None; the locals it reads). `scope` (optional)
    only makes a refusal say what a called function reaches."""
    checker = _Checker(func, facts, locals_, scope)
    problem = checker.check(test)
    return problem, frozenset(checker.locals_read)
