"""Statements the emitter writes, built from text, and the small rewrites it makes on statements.

The blocks it writes (`if <on>:` / `else:`, `with <stream>:`) are libcst templates
(`parse_template_statement`: `if {cond}:` with the condition as an expression node) whose
`pass` bodies are then replaced, with `with_changes`, by the statements they hold. Those must
stay the very nodes they were (emit/schedules.py and PlannedEdit find them again by identity),
and a template deep-clones every replacement (a suite too), so the bodies are not template
replacements. The statements the strategies write as text (emit/strategies.py: the stream
set-up, waits, records, joins; values through msrewrite/validate.py) are parsed as they are
(`parse_block`): turning each into a template is a rewrite of the strategies, not done.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TypeVar

import libcst as cst
from libcst.helpers import parse_template_statement

from msrewrite.analyze.outline import unique_name
from msrewrite.validate import comment_text

_EMPTY = cst.Module(body=[])


def code_of(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node)


def strip_leading(stmt: cst.BaseStatement) -> cst.BaseStatement:
    return stmt.with_changes(leading_lines=())


def parse_block(lines: list[str]) -> list[cst.BaseStatement]:
    """The statements of `lines` (code the strategies wrote), comments kept on their statement."""
    # A leading `pass` keeps a first comment line attached to its statement (libcst would
    # otherwise treat it as the module header).
    statements: list[cst.BaseStatement] = [*cst.parse_module("pass\n" + "\n".join(lines) + "\n").body[1:]]
    return statements


def leading_lines(stmt: cst.BaseStatement) -> Sequence[cst.EmptyLine]:
    """A statement's own leading lines (libcst declares them on each kind of statement, not on
    BaseStatement)."""
    assert isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
    return stmt.leading_lines


def rewritten(stmt: cst.BaseStatement, transformer: cst.CSTTransformer) -> cst.BaseStatement:
    """`stmt` visited by a transformer that rewrites inside statements (never removes one)."""
    new = stmt.visit(transformer)
    assert isinstance(new, cst.BaseStatement)
    return new


def comment(text: str) -> cst.EmptyLine:
    return cst.EmptyLine(comment=cst.Comment("# " + comment_text(text, "comment")))


def with_leading(stmts: list[cst.BaseStatement], leading: Sequence[cst.EmptyLine]) -> list[cst.BaseStatement]:
    if not stmts:
        return stmts
    first = stmts[0]
    return [first.with_changes(leading_lines=tuple(leading) + tuple(leading_lines(first))), *stmts[1:]]


_BLOCK = "\n    pass\n"  # a template's body, replaced by the statements the block holds
_IF, _IF_ELSE = "if {cond}:" + _BLOCK, "if {cond}:" + _BLOCK + "else:" + _BLOCK


def _holding(block: cst.BaseSuite, body: list[cst.BaseStatement]) -> cst.IndentedBlock:
    """A template's `pass` block holding `body`: the very nodes (a replacement would be cloned)."""
    assert isinstance(block, cst.IndentedBlock)
    return block.with_changes(body=body)


def _if(cond: str, on: list[cst.BaseStatement], off: list[cst.BaseStatement] | None = None) -> cst.If:
    stmt = parse_template_statement(_IF_ELSE if off else _IF, cond=cst.parse_expression(cond))
    assert isinstance(stmt, cst.If)
    stmt = stmt.with_changes(body=_holding(stmt.body, on))
    if off:
        assert isinstance(stmt.orelse, cst.Else)
        stmt = stmt.with_changes(orelse=stmt.orelse.with_changes(body=_holding(stmt.orelse.body, off)))
    return stmt


def if_block(
    cond: str, on: list[cst.BaseStatement], off_cond: str | None, off: list[cst.BaseStatement]
) -> list[cst.BaseStatement]:
    """`if cond: on [else: off]`; when `on` is empty, `if off_cond: off`."""
    if not on:
        assert off_cond is not None
        return [_if(off_cond, off)]
    return [_if(cond, on, off)]


def with_block(with_open: str, inner: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """`<with_open>` (a `with ...:` line the strategies wrote) around `inner`; `inner` itself
    without one."""
    if not with_open:
        return inner
    stmt = parse_template_statement(with_open + _BLOCK)
    assert isinstance(stmt, cst.With)
    return [stmt.with_changes(body=_holding(stmt.body, inner))]


def assign(name: str, value: cst.BaseExpression) -> cst.SimpleStatementLine:
    """`name = <value>` (the value deep-cloned, as libcst's templates do)."""
    stmt = parse_template_statement(f"{name} = {{value}}", value=value)
    assert isinstance(stmt, cst.SimpleStatementLine)
    return stmt


def returns(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(isinstance(s, cst.Return) for s in stmt.body)


# Rewrites of side statements ----------------------------------------------------------------------
class Rename(cst.CSTTransformer):
    """Every name `old` becomes `new`; attribute names (x.old) and keyword names (f(old=...)) stay:
    they name a field or a parameter, not the variable."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def leave_Name(self, _original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        return updated_node.with_changes(value=self.new) if updated_node.value == self.old else updated_node

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.Attribute:
        # keep attribute names (x.old) untouched
        if updated_node.attr.value == self.new and original_node.attr.value == self.old:
            return updated_node.with_changes(attr=original_node.attr)
        return updated_node

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        # f(old=old) -> f(old=new): the callee's parameter keeps its name
        if original_node.keyword is not None:
            return updated_node.with_changes(keyword=original_node.keyword)
        return updated_node


def _no_space_equal() -> cst.AssignEqual:
    return cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))


def _comma() -> cst.Comma:
    return cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


class NonBlocking(cst.CSTTransformer):
    """x.copy_(y) -> x.copy_(y, non_blocking=True): on its own stream the copy need not block the host."""

    def leave_Call(self, _original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        func = updated_node.func
        if not (isinstance(func, cst.Attribute) and func.attr.value in ("copy_", "to")):
            return updated_node
        if any(arg.keyword is not None and arg.keyword.value == "non_blocking" for arg in updated_node.args):
            return updated_node
        args = list(updated_node.args)
        if args:
            args[-1] = args[-1].with_changes(comma=_comma())
        flag = cst.Arg(keyword=cst.Name("non_blocking"), value=cst.Name("True"), equal=_no_space_equal())
        return updated_node.with_changes(args=[*args, flag])


class AsyncComm(cst.CSTTransformer):
    """`dist.send(t, dst)` -> `send_work = dist.isend(t, dst)` (recv likewise), noting the handles."""

    def __init__(self, taken: set[str]) -> None:
        self.taken = taken
        self.handles: list[tuple[str, str]] = []

    def leave_SimpleStatementLine(
        self, _original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if len(updated_node.body) != 1 or not isinstance(updated_node.body[0], cst.Expr):
            return updated_node
        call = updated_node.body[0].value
        if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)):
            return updated_node
        kind = call.func.attr.value
        if kind not in ("send", "recv"):
            return updated_node
        handle = unique_name(f"{kind}_work", self.taken)
        self.handles.append((kind, handle))
        async_call = call.with_changes(func=call.func.with_changes(attr=cst.Name("i" + kind)))
        return updated_node.with_changes(
            body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(handle))], value=async_call)]
        )


class ReplaceCalls(cst.CSTTransformer):
    """Calls (by identity in the original tree) -> the names of their hoisted results."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        name = self.names.get(id(original_node))
        return cst.Name(name) if name is not None else updated_node


def keyword_arg(name: str, value: str) -> cst.Arg:
    """`name=value`, written without spaces around `=` as a keyword argument is."""
    return cst.Arg(keyword=cst.Name(name), value=cst.Name(value), equal=_no_space_equal())


def keyword_param(name: str, default: str) -> cst.Param:
    return cst.Param(name=cst.Name(name), default=cst.parse_expression(default), equal=_no_space_equal())


_Listed = TypeVar("_Listed", cst.Arg, cst.Param)


def with_comma(node: _Listed) -> _Listed:
    return node.with_changes(comma=_comma())


def flag_attribute(flag_name: str) -> str:
    """self.<attr> holding an env switch: ENABLE_X_STREAM -> enable_x_stream (one per switch, so
    several streams behind one switch share it)."""
    attr = re.sub(r"\W+", "_", flag_name).strip("_").lower()
    return attr if attr.startswith("enable") else f"enable_{attr}"
