"""Where side work hides in serving code, and where it already has a stream of its own.

- Helpers: `shared = self._forward_shared_experts(h)` (a method of the same class) or
  `shared = run_shared(self, h)` (a function of the same file) is side work when the helper does
  nothing but side work: every submodule it calls is a seed, it writes none of its arguments and no
  attribute of the module, runs no stream code, and calls nothing msrewrite cannot see into (only
  torch functions, tensor methods and a few builtins). The helper call is then the seed.
- Framework overlap: vLLM hands the shared expert to its fused-MoE layer in `__init__`
  (`FusedMoEFactory(shared_experts=self.shared_expert, ...)`, `SharedFusedMoE`), which runs it on
  its own stream; the forward then has no shared-expert call at all.
- Hand-written overlaps: `torch.cuda.stream(self.alt_stream)`, `wait_stream`, `aux_stream()`,
  `npu_stream_switch`: a second side stream stacked on them would only fight the first.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import field

import libcst as cst

from msrewrite.analyze.definitions import shadowed_defs
from msrewrite.analyze.defuse import dotted_name, node_facts, self_callee
from msrewrite.analyze.guards import assigned_self_attrs, source
from msrewrite.analyze.positions import ast_calls, ast_nodes
from msrewrite.analyze.walk import Visitor
from msrewrite.records import record

# a call that drives streams or events by hand: wait_stream, torch.cuda.stream, npu_stream_switch,
# aux_stream(), current_stream, record_event / wait_event ...
_STREAM_CALL = re.compile(r"(?:^|_)streams?(?:$|_)|^(?:record|wait)_event$|^Stream$", re.IGNORECASE)
_TRUSTED_ROOTS = frozenset({"torch", "F", "nn", "math"})
_TRUSTED_BUILTINS = frozenset(
    {"len", "isinstance", "getattr", "hasattr", "int", "float", "bool", "min", "max", "range", "tuple", "list", "dict"}
)
_EMITTED_PREFIX = "_ms_"  # msrewrite's own helpers: its own edits are not hand-written overlaps


def _calls(node: cst.CSTNode) -> list[cst.Call]:
    found: list[cst.Call] = []

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

        def visit_FunctionDef(self, _n: cst.FunctionDef) -> bool:
            return False  # a nested def runs elsewhere

    (node.body if isinstance(node, cst.FunctionDef) else node).visit(_Calls())
    return found


def _last_name(func: cst.BaseExpression) -> str:
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Name):
        return func.value
    return ""


def stream_calls(node: cst.CSTNode, calls: list[cst.Call] | None = None) -> list[cst.Call]:
    """Hand-written stream and event calls in `node` (none when msrewrite wrote them); `calls`
    are its calls when the caller has them already."""
    calls = _calls(node) if calls is None else calls
    if any((dotted_name(c.func) or "").startswith(_EMITTED_PREFIX) for c in calls):
        return []
    return [c for c in calls if _STREAM_CALL.search(_last_name(c.func)) and not _own_method(c.func)]


def stream_handing_calls(calls: list[cst.Call]) -> list[tuple[cst.Call, str]]:
    """(call, keyword) of each call that hands a stream to its callee (`execute_sbo(...,
    alt_stream=self.alt_stream)`): the callee overlaps work of its own on it, so the caller is
    already overlapped."""
    if any((dotted_name(c.func) or "").startswith(_EMITTED_PREFIX) for c in calls):
        return []
    return [
        (c, arg.keyword.value)
        for c in calls
        for arg in c.args
        if arg.keyword is not None
        and _STREAM_CALL.search(arg.keyword.value)
        and not (isinstance(arg.value, cst.Name) and arg.value.value == "None")
    ]


def most_telling(calls: list[cst.Call]) -> cst.Call:
    """The call that shows the overlap best: a stream switch or wait, not the `current_stream()` lookup."""
    return next((c for c in calls if _last_name(c.func) != "current_stream"), calls[0])


def _own_method(func: cst.BaseExpression) -> bool:
    """`self.forward_dual_stream(...)`: a method of the model, whatever its name says."""
    return isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self"


def calls_in(node: cst.CSTNode) -> list[cst.Call]:
    """Every call `node` makes (a function: its body, nested defs left out)."""
    return _calls(node)


def uses_api(calls: list[cst.Call], family: str) -> bool:
    """Do these calls go into `torch.<family>` (npu, cuda)?"""
    prefix = f"torch.{family}."
    return any((dotted_name(c.func) or "").startswith(prefix) for c in calls)


# Helpers -------------------------------------------------------------------------------------------
@record
class Helpers:
    """Helpers of one class (and the file's free functions) that do only side work."""

    methods: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)  # helper -> why it is not side work only

    def seed_predicate(self, is_seed: Callable[[str], bool]) -> Callable[[str], bool]:
        """`is_seed` widened to calls of these helpers (unchanged when there are none)."""
        if not self.methods and not self.functions:
            return is_seed
        methods, functions = set(self.methods), set(self.functions)

        def with_helpers(callee: str) -> bool:
            return is_seed(callee) or callee in methods

        if functions:

            def on_call(call: cst.Call) -> bool:
                callee = self_callee(call.func)
                if callee is not None:
                    return with_helpers(callee)
                return _free_helper_call(call, functions)

            with_helpers.on_call = on_call  # type: ignore[attr-defined]
        return with_helpers


def _free_helper_call(call: cst.Call, functions: set[str]) -> bool:
    return (
        isinstance(call.func, cst.Name)
        and call.func.value in functions
        and bool(call.args)
        and isinstance(call.args[0].value, cst.Name)
        and call.args[0].value.value == "self"
        and call.args[0].keyword is None
    )


def find_helpers(
    module: cst.Module,
    cls: cst.ClassDef | None,
    is_seed: Callable[[str], bool],
    methods: set[str] | None = None,
    functions: bool | set[str] = True,
) -> Helpers:
    """The methods of `cls` (only those named in `methods`, when given) and the module's functions
    that reach a seed and do nothing else."""
    helpers = Helpers()
    candidates: list[tuple[str, cst.FunctionDef, str, bool]] = []  # (name, def, self name, is method)
    if cls is not None and isinstance(cls.body, cst.IndentedBlock):
        dead = shadowed_defs(cls.body.body)  # a def a later one replaces never runs
        for stmt in cls.body.body:
            if (
                isinstance(stmt, cst.FunctionDef)
                and id(stmt) not in dead
                and stmt.name.value not in ("__init__", "forward")
                and (methods is None or stmt.name.value in methods)
            ):
                params = stmt.params.params
                if params and params[0].name.value == "self":
                    candidates.append((stmt.name.value, stmt, "self", True))
    dead_functions = shadowed_defs(module.body) if functions else set()
    for stmt in module.body if functions else ():
        if id(stmt) in dead_functions:
            continue
        if isinstance(functions, set) and not (isinstance(stmt, cst.FunctionDef) and stmt.name.value in functions):
            continue
        if isinstance(stmt, cst.FunctionDef) and stmt.params.params:
            candidates.append((stmt.name.value, stmt, stmt.params.params[0].name.value, False))
    for name, func, self_name, is_method in candidates:
        if not _reaches_seed(func, self_name, is_seed) or _does_main_work(func, self_name, is_seed):
            continue  # no helper: a function that also runs main work is a target of its own
        problem = side_work_problem(func, self_name, is_seed)
        if problem:
            helpers.refused[name] = problem
        elif is_method:
            helpers.methods.add(name)
        else:
            helpers.functions.add(name)
    return helpers


def _callee_on(call: cst.Call, self_name: str) -> str | None:
    callee = self_callee(call.func) if self_name == "self" else None
    if callee is None and self_name != "self":
        renamed = call.func
        parts: list[str] = []
        while isinstance(renamed, (cst.Attribute, cst.Subscript)):
            if isinstance(renamed, cst.Attribute):
                parts.append(renamed.attr.value)
            renamed = renamed.value
        if isinstance(renamed, cst.Name) and renamed.value == self_name and parts:
            callee = ".".join(reversed(parts))
    return callee


def _does_main_work(func: cst.FunctionDef, self_name: str, is_seed: Callable[[str], bool]) -> bool:
    return any((c := _callee_on(call, self_name)) is not None and not is_seed(c) for call in _calls(func.body))


def _reaches_seed(func: cst.FunctionDef, self_name: str, is_seed: Callable[[str], bool]) -> bool:
    return any((c := _callee_on(call, self_name)) is not None and is_seed(c) for call in _calls(func.body))


def side_work_problem(func: cst.FunctionDef, self_name: str, is_seed: Callable[[str], bool]) -> str | None:
    """Why `func` is more than side work (it must only call seeds and torch), or None."""
    where = f"{func.name.value}()"
    streams = stream_calls(func)
    if streams:
        return f"{where} runs its own stream code (`{source(streams[0].func)}`)"
    if self_name == "self" and assigned_self_attrs(func):
        return f"{where} assigns `self.{sorted(assigned_self_attrs(func))[0]}`"
    params = {p.name.value for p in (*func.params.params, *func.params.kwonly_params, *func.params.posonly_params)}
    facts = node_facts(func.body)
    if facts.exits and _yields(func):
        return f"{where} is a generator"
    # tensors the helper was given: its parameters and anything bound from them (views alias them)
    derived = set(params) - {self_name}
    for stmt in _assignments(func.body):
        if node_facts(stmt.value).loads & derived:
            for target in stmt.targets:
                derived |= node_facts(target.target).stores
    written = facts.mutates & derived
    if written:
        return f"{where} writes its argument `{sorted(written)[0]}` in place"
    for call in _calls(func.body):
        callee = _callee_on(call, self_name)
        if callee is not None:
            if not is_seed(callee):
                return f"{where} also calls `{self_name}.{callee}`, which is not side work"
            continue
        name = dotted_name(call.func) or ""
        root = name.split(".")[0]
        if any(arg.keyword is not None and arg.keyword.value in ("out", "inplace") for arg in call.args):
            return f"{where} calls `{name or source(call.func)}` with an output or in-place argument"
        if root in _TRUSTED_ROOTS and not name.endswith("_"):
            continue
        if name in _TRUSTED_BUILTINS:
            continue
        if isinstance(call.func, cst.Attribute) and name.split(".")[0] not in _TRUSTED_ROOTS:
            continue  # a tensor method (x.view, y.float): in-place ones are caught above
        return f"{where} calls `{name or source(call.func)}`, which msrewrite cannot see into"
    return None


def _yields(func: cst.FunctionDef) -> bool:
    found = False

    class _Yield(Visitor):
        def visit_Yield(self, _n: cst.Yield) -> None:
            nonlocal found
            found = True

    func.body.visit(_Yield())
    return found


def _assignments(node: cst.CSTNode) -> list[cst.Assign]:
    found: list[cst.Assign] = []

    class _Assigns(Visitor):
        def visit_Assign(self, n: cst.Assign) -> None:
            found.append(n)

    node.visit(_Assigns())
    return found


# Framework overlap -----------------------------------------------------------------------------------
def framework_overlap(layers: dict[str, str], callees) -> str | None:
    """'already overlapped by the framework (X, given `shared_experts=` in __init__)' when the
    function calls a layer that `__init__` handed side work (`layers`, from framework_layers)."""
    for callee in sorted(callees):
        if callee in layers:
            return f"already overlapped by the framework ({layers[callee]}): it runs that work itself"
    return None


# Cheap pre-filters over the file's `ast` (libcst visits cost more than the parse) -------------------
def free_function_candidates(tree: ast.Module | None, is_seed: Callable[[str], bool]) -> set[str]:
    """Top-level functions that call a seed on their first parameter (`block.shared_experts(x)`)."""
    names: set[str] = set()
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.FunctionDef) and node.args.args:
            first = node.args.args[0].arg
            for call in ast_calls(node):  # ast.walk's calls, without its generator per node
                callee = _ast_callee(call.func, first)
                if callee and is_seed(callee):
                    names.add(node.name)
                    break
    return names


def framework_layers(tree: ast.Module | None, is_seed: Callable[[str], bool]) -> dict[str, dict[str, str]]:
    """Class name (dotted when nested) -> {self.<attr>: the layer class built in __init__ with a seed
    keyword (`shared_experts=`)}."""
    found: dict[str, dict[str, str]] = {}

    def walk(body, prefix: str) -> None:
        for node in body:
            if not isinstance(node, ast.ClassDef):
                continue
            name = prefix + node.name
            walk(node.body, name + ".")
            for item in node.body:
                if not (isinstance(item, ast.FunctionDef) and item.name == "__init__"):
                    continue
                for assign in ast_nodes(item):
                    if not (
                        isinstance(assign, ast.Assign)
                        and len(assign.targets) == 1
                        and isinstance(assign.value, ast.Call)
                    ):
                        continue
                    target = assign.targets[0]
                    if not (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        continue
                    for keyword in assign.value.keywords:
                        if keyword.arg and is_seed(keyword.arg):
                            layer = ast.unparse(assign.value.func)
                            found.setdefault(name, {})[target.attr] = f"{layer}, given `{keyword.arg}=` in __init__"

    walk(tree.body if tree is not None else [], "")
    return found


def _ast_callee(func: ast.expr, owner: str) -> str | None:
    parts: list[str] = []
    while isinstance(func, (ast.Attribute, ast.Subscript)):
        if isinstance(func, ast.Attribute):
            parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name) and func.id == owner and parts:
        return ".".join(reversed(parts))
    return None
