"""The serving framework's own switches and phase predicates, found in the file being edited.

`--flag sglang:NAME` reads SGLang's `get_bool_env_var`, `--flag vllm-ascend:NAME` a field of
vllm-ascend's `get_ascend_config()`; `--gate capture|prefill|decode` becomes the predicate the
framework already uses: SGLang's `get_is_capture_mode()`, a forward parameter `with_prefill`
(vllm-ascend) or `is_prefill`, or `forward_batch.forward_mode.is_extend()` / `.is_decode()`
(SGLang). Names are imported the way the framework's own model files import them, and only into
a file that already imports from that framework; anything else is refused, naming what was
looked for, so the edit never guesses at an API.
"""

from __future__ import annotations

import re
from pathlib import Path

import libcst as cst

from msrewrite.analyze.walk import Visitor
from msrewrite.errors import BadInput
from msrewrite.plan import FlagSpec

# (module, name) as the framework's model files import them (SGLang 0.5.23, vllm-ascend 0.23)
SGLANG_ENV = ("sglang.srt.utils", "get_bool_env_var")
SGLANG_CAPTURE = ("sglang.srt.model_executor.runner", "get_is_capture_mode")
# where SGLang releases define get_is_capture_mode, newest first: `runner` (0.5.2x), and
# `cuda_graph_runner` before it; the installed or enclosing SGLang's own source decides
SGLANG_CAPTURE_MODULES = ("sglang.srt.model_executor.runner", "sglang.srt.model_executor.cuda_graph_runner")
VLLM_ASCEND_CONFIG = ("vllm_ascend.ascend_config", "get_ascend_config")

_FRAMEWORK_ROOT = {"sglang": "sglang", "vllm-ascend": "vllm_ascend"}

# forward parameters, in the order they are tried: (name, prefill predicate, decode predicate)
_PHASE_PARAMS = (
    ("with_prefill", "{p}", "not {p}"),  # vllm-ascend
    ("is_prefill", "{p}", "not {p}"),
    ("forward_batch", "{p}.forward_mode.is_extend()", "{p}.forward_mode.is_decode()"),  # SGLang ForwardBatch
)


def imported_roots(module: cst.Module) -> set[str]:
    """Top-level packages the module imports at module level (`from sglang.srt... import` -> sglang)."""
    roots: set[str] = set()
    for stmt in module.body:
        nodes = []
        if isinstance(stmt, cst.SimpleStatementLine):
            nodes = list(stmt.body)
        elif isinstance(stmt, cst.Try) and isinstance(stmt.body, cst.IndentedBlock):
            nodes = [s for line in stmt.body.body if isinstance(line, cst.SimpleStatementLine) for s in line.body]
        for node in nodes:
            if isinstance(node, cst.ImportFrom) and node.module is not None and not node.relative:
                roots.add(_dotted(node.module).split(".")[0])
            elif isinstance(node, cst.Import):
                roots |= {_dotted(alias.name).split(".")[0] for alias in node.names}
    return roots


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""


def _require(framework: str, roots: set[str], what: str) -> None:
    if _FRAMEWORK_ROOT[framework] not in roots:
        raise BadInput(
            f"{what} needs a {framework} model file, and this file imports nothing from "
            f"{_FRAMEWORK_ROOT[framework]}; use --flag env:NAME or attr:NAME here"
        )


def assigned_names(func: cst.FunctionDef) -> set[str]:
    """Names the function's body assigns (a phase parameter it reassigns cannot gate)."""
    names: set[str] = set()

    class _Stores(Visitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            names.update(n.value for n in _names_in(node.target))

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            names.update(n.value for n in _names_in(node.target))

        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            names.update(n.value for n in _names_in(node.target))

        def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
            names.update(n.value for n in _names_in(node.target))

        def visit_For(self, node: cst.For) -> None:
            names.update(n.value for n in _names_in(node.target))

    func.body.visit(_Stores())
    return names


def _names_in(target: cst.BaseExpression) -> list[cst.Name]:
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in _names_in(el.value)]
    if isinstance(target, cst.StarredElement):
        return _names_in(target.value)
    return []


def _param(func: cst.FunctionDef, name: str) -> cst.Param | None:
    params = func.params
    for p in [*params.posonly_params, *params.params, *params.kwonly_params]:
        if p.name.value == name:
            return p
    return None


def capture_import(module: cst.Module, file: Path | None) -> tuple[str, str]:
    """Where this file's SGLang defines `get_is_capture_mode`: the sglang module the file already
    imports it from; else the first of SGLANG_CAPTURE_MODULES whose source (the SGLang tree the file lives
    in, or an installed one: read, never imported) defines or re-exports it; else, with no SGLang
    source to read, the newest layout. BadInput when the source is there and defines it nowhere."""
    name = SGLANG_CAPTURE[1]
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for node in stmt.body:
            if (
                isinstance(node, cst.ImportFrom)
                and node.module is not None
                and not node.relative
                and _dotted(node.module).split(".")[0] == "sglang"  # another package's is refused later
            ):
                if not isinstance(node.names, cst.ImportStar) and any(
                    _dotted(alias.name) == name and alias.asname is None for alias in node.names
                ):
                    return _dotted(node.module), name
    from msrewrite.analyze import packages

    searched = []
    for candidate in SGLANG_CAPTURE_MODULES:
        source = packages.module_file(candidate, near=file)
        if source is None:
            continue
        searched.append(str(source))
        index = packages.index_file(source)
        if index is not None and (name in index.functions or name in index.imports):
            return candidate, name
    if searched:
        raise BadInput(
            f"--gate capture: this SGLang defines {name}() in none of its modules msrewrite knows "
            f"({', '.join(searched)}); use --flag-default or another --gate"
        )
    return SGLANG_CAPTURE


def phase_predicate(
    gate: str, func: cst.FunctionDef, roots: set[str], qualified: str, module: cst.Module, file: Path | None
) -> tuple[str, list[tuple[str, str]]]:
    """(the predicate expression for `gate` in `func`, the framework imports it needs)."""
    if gate == "capture":
        if "sglang" not in roots:
            raise BadInput(
                f"--gate capture: {qualified} has no capture predicate: looked for SGLang's "
                "get_is_capture_mode() (the file imports nothing from sglang)"
            )
        return f"{SGLANG_CAPTURE[1]}()", [capture_import(module, file)]
    rebound = assigned_names(func)
    for name, prefill, decode in _PHASE_PARAMS:
        param = _param(func, name)
        if param is None:
            continue
        if name in rebound:  # the fork would read a value the function computed, not the caller's
            raise BadInput(
                f"--gate {gate}: {qualified} assigns its parameter {name!r}; the phase cannot be read from it"
            )
        expr = (prefill if gate == "prefill" else decode).format(p=name)
        optional = isinstance(param.default, cst.Name) and param.default.value == "None"
        if optional and name == "forward_batch":  # SGLang passes None outside a model runner: not that phase
            expr = f"{name} is not None and {expr}"
        return expr, []
    looked = ", ".join(name for name, _, _ in _PHASE_PARAMS)
    raise BadInput(f"--gate {gate}: {qualified} has no phase predicate: looked for a forward parameter {looked}")


def flag_imports(flag: FlagSpec, roots: set[str]) -> list[tuple[str, str]]:
    """The framework import the flag's reader needs; BadInput for a file of another framework."""
    if flag.kind == "sglang":
        _require("sglang", roots, f"--flag sglang:{flag.name}")
        return [SGLANG_ENV]
    if flag.kind == "vllm-ascend":
        _require("vllm-ascend", roots, f"--flag vllm-ascend:{flag.name}")
        return [VLLM_ASCEND_CONFIG]
    return []


# --- torch.compile fullgraph regions ---------------------------------------------------------------
def _callee_name(node: cst.BaseExpression) -> str:
    node = node.func if isinstance(node, cst.Call) else node
    return _dotted(node).rsplit(".", 1)[-1]


def _fullgraph_keyword(call: cst.Call) -> bool:
    """fullgraph=True with a backend that does not handle stream code itself: inductor (no backend)
    or another one; torchair's get_npu_backend and npugraph_ex lower streams in the graph."""
    keywords = {arg.keyword.value: arg.value for arg in call.args if arg.keyword is not None}
    fullgraph = keywords.get("fullgraph")
    if not (isinstance(fullgraph, cst.Name) and fullgraph.value == "True"):
        return False
    backend = keywords.get("backend")
    return backend is None or "npu" not in cst.Module([]).code_for_node(backend)


def _compiled_roots(module: cst.Module) -> dict[str, str]:
    """Top-level classes and functions compiled as one graph -> how: vLLM's @support_torch_compile,
    @torch.compile(fullgraph=True), or torch.compile(X, fullgraph=True) anywhere in the file."""
    roots: dict[str, str] = {}
    for stmt in module.body:
        if not isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            continue
        for deco in stmt.decorators:
            name = _callee_name(deco.decorator)
            if name == "support_torch_compile":
                roots[stmt.name.value] = f"vLLM's @support_torch_compile on {stmt.name.value}"
            elif name == "compile" and isinstance(deco.decorator, cst.Call) and _fullgraph_keyword(deco.decorator):
                roots[stmt.name.value] = f"@torch.compile(fullgraph=True) on {stmt.name.value}"

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            if _callee_name(call) == "compile" and _dotted(call.func) != "re.compile" and _fullgraph_keyword(call):
                if call.args and call.args[0].keyword is None:
                    target = _callee_name(call.args[0].value)  # torch.compile(Model(...)) or (self.forward)
                    if target:
                        roots.setdefault(target, f"torch.compile(..., fullgraph=True) of {target}")

    module.visit(_Calls())
    return roots


_FULLGRAPH_KEYWORD = re.compile(r"\bfullgraph\s*=")  # `fullgraph=`, not `_can_compile_fullgraph =`


def _built_classes(cls: cst.ClassDef, classes: set[str]) -> set[str]:
    """The classes among `classes` that `cls` calls (builds)."""
    found: set[str] = set()

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            callee = _callee_name(call)
            if callee in classes:
                found.add(callee)

    cls.visit(_Calls())
    return found


def fullgraph_refusal(module: cst.Module, qualified: str, text: str | None = None) -> str | None:
    """Why no stream code can go into `qualified`: it runs inside a fullgraph compile; else None."""
    compiled = fullgraph_region(module, qualified, text)
    if compiled is None:
        return None
    return (
        f"{qualified} runs inside a torch.compile fullgraph region ({compiled}): stream code there "
        "would be traced into the graph; vLLM keeps its own stream code inside a custom op"
    )


def fullgraph_region(module: cst.Module, qualified: str, text: str | None = None) -> str | None:
    """How `qualified` ("Class.method" or "function") runs inside a fullgraph compile, else None.
    A class is inside when a compiled class constructs it, directly or through other classes of the
    file (vLLM's model class builds its layers in __init__). `text`, the module's source when the
    caller has it, skips the walk over the whole module when neither name a root needs is in it."""
    if (
        text is not None
        and "support_torch_compile" not in text
        and (
            "fullgraph" not in text or not _FULLGRAPH_KEYWORD.search(text)  # the substring test first: 100x cheaper
        )
    ):
        return None
    roots = _compiled_roots(module)
    if not roots:
        return None
    parts = qualified.split(".")
    for part in parts:  # the class itself, or the method (torch.compile(self.forward, ...))
        if part in roots:
            return roots[part]
    classes = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}
    builds: dict[str, set[str]] = {}
    for name, cls in classes.items():
        builds[name] = _built_classes(cls, set(classes)) - {name}
    for root, how in roots.items():
        seen, todo = set(), [root]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if name == parts[0]:
                return f"{how}, which builds {parts[0]}"
            todo += builds.get(name, ())
    return None


def check_own_bindings(module: cst.Module, imports: list[tuple[str, str]]) -> None:
    """BadInput when the file binds one of the framework names itself (a def, a class, an
    assignment, or an import from another package): the edit would call that, not the framework's."""
    wanted = {name: mod.split(".")[0] for mod, name in imports}
    for stmt in module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.name.value in wanted:
            raise BadInput(f"the file defines its own {stmt.name.value}(); the edit needs {wanted[stmt.name.value]}'s")
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for node in stmt.body:
            if isinstance(node, cst.ImportFrom) and not isinstance(node.names, cst.ImportStar):
                source = _dotted(node.module).split(".")[0] if node.module is not None and not node.relative else "."
                for alias in node.names:
                    bound = alias.asname.name if alias.asname else alias.name
                    name = bound.value if isinstance(bound, cst.Name) else ""
                    if name in wanted and (source != wanted[name] or alias.asname is not None):
                        raise BadInput(f"the file binds {name} by another import; the edit needs {wanted[name]}'s")
            elif isinstance(node, (cst.Assign, cst.AnnAssign)):
                targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
                for target in targets:
                    for n in _names_in(target):
                        if n.value in wanted:
                            raise BadInput(f"the file assigns its own {n.value}; the edit needs {wanted[n.value]}'s")
