"""Declared effects: what an op's registration says it writes, read from source (never imported).

A custom op's tensor effects are declared where it is registered, and torch relies on that
declaration (torch.compile's functionalization reorders and copies around it):
  - `@torch.library.custom_op("ns::name", mutates_args=("x",))` and
    `torch.library.custom_op("ns::name", mutates_args=())(fn)`: the op writes exactly its
    `mutates_args` parameters; its result is a new tensor (torch checks at run time that no
    output aliases an input: torch/_library/custom_ops.py, `_c_check_aliasing_constraint`);
  - schema strings, `torch.library.define("ns::op", "(Tensor(a!) x, Tensor y) -> ()")` and
    `Library("ns", "FRAGMENT").define("op(Tensor(a!) x) -> Tensor(a)")`: `(a!)` arguments are
    written, a result annotated `Tensor(a)` aliases the argument with that annotation, any other
    result is new (read with torch's own parser, `torch._C.parse_schema`, imported on first use);
  - the frameworks' registration helpers (FRAMEWORK_HELPERS), which define the op from the
    function's signature and `mutates_args` (`infer_schema`) and register the function itself as
    its implementation, with no check of its result: the result may alias the arguments it
    writes (SGLang's own example, `return x.add_(y)` with mutates_args=["x"]), and is new otherwise.

A declaration is used only when it is read exactly: the decorator or helper resolves through the
file's imports to torch.library or to one of FRAMEWORK_HELPERS, `mutates_args` is a literal list
of parameter names, the schema a literal. Anything else ("unknown", a variable, an op name built
at run time) leaves the call unknown, and says why.

The declaration covers tensor writes only. Whether the op runs a collective, draws random numbers
or touches streams is what its body says; a body msrewrite cannot see all of is kept as
`unseen_work` (the callees it could not see), which the collective and RNG checks count.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import field
from pathlib import Path
from typing import Any

import libcst as cst

from msrewrite.analyze import packages
from msrewrite.records import record

# torch's own op decorator / function, as the file's imports name it (qualified)
TORCH_CUSTOM_OP = frozenset({"torch.library.custom_op", "torch._library.custom_ops.custom_op"})
TORCH_DEFINE = frozenset({"torch.library.define"})
TORCH_LIBRARY = frozenset({"torch.library.Library"})

# The framework helpers whose registration msrewrite trusts, by the file that defines them (the
# function found by following the caller's imports, so a re-export resolves to the same file).
# Each one reads `mutates_args` as torch.library does and registers `op_func` as the op:
#   - vLLM `vllm/utils/torch_utils.py` direct_register_custom_op(op_name, op_func, mutates_args=None,
#     fake_impl, target_lib, ...): `infer_schema(op_func, mutates_args)`, `lib.define(op_name + schema)`,
#     `lib.impl(op_name, op_func)`; library "vllm" unless target_lib is given; None means [];
#   - SGLang `sglang/srt/utils/common.py` direct_register_custom_op (the same shape, library "sglang");
#   - SGLang `sglang/srt/utils/custom_op.py` register_custom_op(fn=None, *, op_name, mutates_args=None,
#     ...): `CustomOpWrapper(..., mutates_args=mutates_args or [])` hands them to the one above; in
#     eager on CUDA it calls the function itself (`_call_directly_in_eager`), which the declaration
#     covers all the same: the framework's torch.compile runs depend on it being exact.
# helper name -> (path suffixes of the files that define it, the library it registers into)
FRAMEWORK_HELPERS: dict[str, tuple[tuple[str, ...], str]] = {
    "direct_register_custom_op": (
        ("vllm/utils/torch_utils.py", "vllm/utils/__init__.py", "sglang/srt/utils/common.py"),
        "",  # the library is the helper's package: "vllm" or "sglang"
    ),
    "register_custom_op": (("sglang/srt/utils/custom_op.py",), "sglang"),
}

# Bounds on the search for an op's registration in a package tree (per process, per tree): past
# either the op stays unknown ("search bound")
MAX_REGISTRY_FILES = 8000
MAX_REGISTRY_BYTES = 120_000_000
# a file is parsed only if its text holds one of these (every registration form above does)
_MARKERS = ("custom_op(", ".define(")


@record
class Declaration:
    """What one registration declares for an op (or why it cannot be read)."""

    label: str  # how it was declared, for messages: "@torch.library.custom_op('ns::op')"
    params: list[str] = field(default_factory=list)  # parameter names, in order
    kwonly: list[str] = field(default_factory=list)  # keyword-only parameter names
    writes: set[str] = field(default_factory=set)
    returns: set[str] = field(default_factory=set)  # parameters the result may alias
    why: str = ""  # non-empty: the declaration could not be read exactly (the op stays unknown)
    where: str = ""  # file:line of the registration
    op_func: str = ""  # the implementing function's name in the registering file (mutates_args kinds)
    # what its body was seen to do besides tensor writes, and the callees in it not seen into
    collective: bool = False
    rng: bool = False
    stream: bool = False
    barrier: bool = False
    unseen_work: set[str] = field(default_factory=set)

    def key(self) -> tuple:
        return (tuple(self.params), tuple(self.kwonly), frozenset(self.writes), frozenset(self.returns), self.why)


def literal_names(node: cst.BaseExpression | None) -> tuple[list[str] | None, str]:
    """(the names a `mutates_args` value lists, "") or (None, why it is not read)."""
    if node is None:
        return [], ""
    if isinstance(node, cst.SimpleString) and node.evaluated_value == "unknown":
        return None, 'mutates_args="unknown"'
    if isinstance(node, cst.Name) and node.value == "None":
        return [], ""
    if isinstance(node, (cst.List, cst.Tuple, cst.Set)):
        names: list[str] = []
        for el in node.elements:
            if isinstance(el, cst.StarredElement) or not isinstance(el.value, cst.SimpleString):
                return None, "mutates_args is not a literal list of names"
            value = el.value.evaluated_value
            if not isinstance(value, str):
                return None, "mutates_args is not a literal list of names"
            names.append(value)
        return names, ""
    return None, "mutates_args is not a literal list of names"


def from_mutates(label: str, func: cst.FunctionDef, names: list[str] | None, why: str, helper: bool) -> Declaration:
    """The declaration of an op implemented by `func` with `mutates_args` = `names`; `helper`: a
    framework helper registered it (its result may alias what it writes)."""
    params = [p.name.value for p in (*func.params.posonly_params, *func.params.params)]
    kwonly = [p.name.value for p in func.params.kwonly_params]
    decl = Declaration(label=label, params=params, kwonly=kwonly, op_func=func.name.value)
    if names is None:
        decl.why = why
        return decl
    if isinstance(func.params.star_arg, cst.Param) or func.params.star_kwarg is not None:
        decl.why = "its function takes *args or **kwargs (no schema can be inferred)"
        return decl
    unknown = [n for n in names if n not in (*params, *kwonly)]
    if unknown:
        decl.why = f"mutates_args names {unknown[0]!r}, which is no parameter of {func.name.value}"
        return decl
    decl.writes = set(names)
    decl.returns = set(names) if helper else set()
    return decl


def ast_names(node: ast.expr | None, given: bool) -> tuple[list[str] | None, str]:
    """`literal_names` for a value read with `ast` (a registration found by the tree search)."""
    if not given or (isinstance(node, ast.Constant) and node.value is None):
        return [], ""
    if isinstance(node, ast.Constant) and node.value == "unknown":
        return None, 'mutates_args="unknown"'
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        names = [_string(el) for el in node.elts]
        if all(n is not None for n in names):
            return [n for n in names if n is not None], ""
    return None, "mutates_args is not a literal list of names"


# ---- schema strings -----------------------------------------------------------------------

# an alias annotation in a schema's text: `(a)`, `(a!)`, `(a -> *)`, `(*)`; and a bare `!`
_ANNOTATION = re.compile(r"\(\s*[a-z0-9*]+\s*!?\s*(?:->\s*\*\s*)?\)")


@functools.lru_cache(maxsize=4096)
def parse_schema(schema: str) -> tuple[Any, str]:
    """(torch's parse of `schema`, "") or (None, why it does not parse). torch's own parser, the
    one `Library.define` uses, imported here on first use: the analysis does not import torch
    for files that declare no schema."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; a broken install reads nothing
        return None, "torch is not importable to read the schema"
    try:
        return torch._C.parse_schema(schema), ""
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "it does not parse"
        return None, f"the schema does not parse ({first})"


def _top_arrow(text: str) -> int:
    """Where the `->` that separates a schema's arguments from its results is (-1: none)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "(["
        depth -= ch in ")]"
        if depth == 0 and text.startswith("->", i) and i > 0 and text[:i].rstrip().endswith(")"):
            return i
    return -1


def from_schema(label: str, schema: str) -> tuple[str, Declaration]:
    """(the op name the schema gives, with its overload, and its declaration) for
    `name.overload(Tensor(a!) x, Tensor y, *, Tensor(b!) out) -> Tensor(a)`, read with torch's
    parser: `!` arguments are written; a result annotated with an argument's alias set may alias
    that argument; a wildcard `(*)` result may alias any argument; any other result is new.
    An annotation the parser keeps out of sight (inside a list or optional) is taken at its
    widest: a `!` msrewrite cannot place leaves the op unread, a result annotation it cannot
    place may alias every annotated argument."""
    decl = Declaration(label=label)
    text = schema.strip()
    name = text.split("(")[0].strip()
    parsed, why = parse_schema(text)
    if parsed is None:
        decl.why = why
        return name, decl
    name = parsed.name + (f".{parsed.overload_name}" if parsed.overload_name else "")
    sets: dict[str, set[str]] = {}  # alias set -> the arguments annotated with it
    annotated: list[str] = []
    for arg in parsed.arguments:
        (decl.kwonly if arg.kwarg_only else decl.params).append(arg.name)
        info = arg.alias_info
        if info is None:
            continue
        annotated.append(arg.name)
        if info.is_write:
            decl.writes.add(arg.name)
        for alias in info.before_set:
            sets.setdefault(alias, set()).add(arg.name)
    arrow = _top_arrow(text)
    args_text, results_text = (text[:arrow], text[arrow + 2 :]) if arrow >= 0 else (text, "")
    if args_text.count("!") > len(decl.writes):
        decl.why = "it marks a write msrewrite cannot place on an argument"
        return name, decl
    placed = False
    for result in parsed.returns:
        info = result.alias_info
        if info is None or not info.before_set:  # `Tensor(a)[]`: torch keeps the element's set out of sight
            continue
        placed = True
        for alias in info.before_set:
            if alias == "*":
                decl.returns |= set(decl.params) | set(decl.kwonly)
            elif alias not in sets:
                decl.why = f"its result's alias set ({alias}) names no argument"
                return name, decl
            else:
                decl.returns |= sets[alias]
    if not placed and _ANNOTATION.search(results_text):
        decl.returns |= set(annotated)  # `-> Tensor(a)[]`: the list's elements alias its argument
    return name, decl


# ---- the registrations in a package tree --------------------------------------------------


@record
class Site:
    """One registration found in a file: the op it registers and how (read again on lookup)."""

    file: Path
    line: int
    namespace: str  # "" when it is not known (a library object msrewrite cannot follow)
    op: str
    kind: str  # "custom_op", "custom_op_call", "helper", "schema"
    helper: str = ""  # the helper's (or decorator's) name as the file calls it
    schema: str = ""
    op_func: str = ""  # the implementing function's name, for the mutates_args kinds
    mutates: ast.expr | None = None  # the mutates_args value (None: not given)
    mutates_given: bool = False


# per process: a file by its path, size and modification time (it may be edited between runs
# of one process); a tree by its path (a framework tree is not edited under a run)
_marked: dict[tuple, tuple[list[tuple[Path, bytes]], str]] = {}
_file_sites: dict[tuple[Path, int], list[Site]] = {}


def registrations(root: Path, op: str) -> tuple[list[Site], str]:
    """The registrations of op `op` (any namespace) found under `root` (a file or a package
    folder), and why the search is incomplete ("" when it is not). The tree is read once per
    process, keeping the files whose text holds a registration marker; of those, only the files
    that hold the op's name are parsed (with `ast`, once). Sound for what msrewrite reads: every
    registration it can read names the op literally in its file (`"ns::op"`, `op_name="op"`, a
    schema `"op(...)"`, or `def op` for a decorator that takes the function's name)."""
    files, incomplete = _marked_files(root)
    wanted = op.encode()
    found: list[Site] = []
    for file, data in files:
        if wanted in data:
            key = (file, len(data))
            if key not in _file_sites:
                try:
                    _file_sites[key] = _sites(file, ast.parse(data))
                except (SyntaxError, ValueError, RecursionError):
                    _file_sites[key] = []
            found += [s for s in _file_sites[key] if s.op == op]
    return found, incomplete


def _marked_files(root: Path) -> tuple[list[tuple[Path, bytes]], str]:
    """The files under `root` whose text holds a registration marker, with their bytes."""
    root = root.resolve()
    try:
        stat = root.stat()
    except OSError:
        return [], ""
    key = (root, stat.st_size, stat.st_mtime_ns) if root.is_file() else (root,)
    if key in _marked:
        return _marked[key]
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    kept: list[tuple[Path, bytes]] = []
    incomplete = ""
    total = 0
    if len(files) > MAX_REGISTRY_FILES:
        incomplete = f"{root} holds more than {MAX_REGISTRY_FILES} files (search bound)"
        files = []
    for file in files:
        try:
            data = file.read_bytes()
        except OSError:
            continue
        total += len(data)
        if total > MAX_REGISTRY_BYTES:
            incomplete = f"{root} holds more than {MAX_REGISTRY_BYTES // 1_000_000} MB of source (search bound)"
            break
        if any(m.encode() in data for m in _MARKERS):
            kept.append((file, data))
    _marked[key] = (kept, incomplete)
    return _marked[key]


def _dotted(node: ast.expr) -> str:
    return packages.ast_dotted(node) or ""


def _kwarg(call: ast.Call, name: str, at: int | None = None) -> tuple[ast.expr | None, bool]:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value, True
    if at is not None and len(call.args) > at and not any(isinstance(a, ast.Starred) for a in call.args[: at + 1]):
        return call.args[at], True
    return None, False


def _string(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _sites(file: Path, tree: ast.Module) -> list[Site]:
    """The registrations in one file, at any depth (a registration inside an `if` or a function
    counts as much as one at module level)."""
    libraries = _libraries(tree)
    sites: list[Site] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sites += [s for d in node.decorator_list if (s := _decorator_site(file, node.name, d)) is not None]
        elif isinstance(node, ast.Call):
            site = _call_site(file, node, libraries)
            if site is not None:
                sites.append(site)
    return sites


def _libraries(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Library objects bound at module level, `lib = Library("ns", "FRAGMENT")`: name ->
    (namespace, the constructor as written), for the namespace of `lib.define(...)`."""
    found: dict[str, tuple[str, str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            if _dotted(stmt.value.func).split(".")[-1] == "Library":
                ns = _string(stmt.value.args[0]) if stmt.value.args else None
                for target in stmt.targets:
                    if isinstance(target, ast.Name):
                        found[target.id] = (ns or "", _dotted(stmt.value.func))
    return found


def _decorator_site(file: Path, function: str, d: ast.expr) -> Site | None:
    """`@custom_op("ns::op", mutates_args=...)` or `@register_custom_op(...)` on `function`."""
    if not isinstance(d, ast.Call):
        return None
    leaf = _dotted(d.func).split(".")[-1]
    value, given = _kwarg(d, "mutates_args")
    if leaf == "custom_op":
        full = _string(d.args[0]) if d.args else _string(_kwarg(d, "name")[0])
        if full and "::" in full:
            ns, _, op = full.partition("::")
            schema = _string(_kwarg(d, "schema")[0]) or ""
            return Site(file, d.lineno, ns, op, "custom_op", _dotted(d.func), schema, function, value, given)
    elif leaf == "register_custom_op":
        op = _string(_kwarg(d, "op_name")[0]) or function
        return Site(file, d.lineno, "?", op, "helper", _dotted(d.func), "", function, value, given)
    return None


def _call_site(file: Path, node: ast.Call, libraries: dict[str, tuple[str, str]]) -> Site | None:
    """A registering call: `custom_op("ns::op", ...)(fn)`, a framework helper's call, a schema's
    `define`. A name or schema built at run time (the helpers' own bodies) is not a site."""
    name = _dotted(node.func)
    leaf = name.split(".")[-1]
    if isinstance(node.func, ast.Call) and _dotted(node.func.func).split(".")[-1] == "custom_op":
        inner = node.func
        full = _string(inner.args[0]) if inner.args else None
        fn = node.args[0] if node.args else None
        if full and "::" in full and isinstance(fn, ast.Name):
            ns, _, op = full.partition("::")
            value, given = _kwarg(inner, "mutates_args")
            schema = _string(_kwarg(inner, "schema")[0]) or ""
            return Site(file, node.lineno, ns, op, "custom_op", _dotted(inner.func), schema, fn.id, value, given)
        return None
    if leaf == "direct_register_custom_op" or (leaf == "register_custom_op" and node.args):
        direct = leaf == "direct_register_custom_op"
        op_name = _string(_kwarg(node, "op_name", 0 if direct else None)[0])
        fn = _kwarg(node, "op_func", 1)[0] if direct else node.args[0]
        if not direct and op_name is None and isinstance(fn, ast.Name):
            op_name = fn.id
        if op_name is None:
            return None
        value, given = _kwarg(node, "mutates_args", 2 if direct else None)
        target, has_target = _kwarg(node, "target_lib", 4)
        # "?": the helper's own library (known once the helper is); "": a library passed in
        ns = "" if has_target and not (isinstance(target, ast.Constant) and target.value is None) else "?"
        op_func = fn.id if isinstance(fn, ast.Name) else ""
        return Site(file, node.lineno, ns, op_name, "helper", name, "", op_func, value, given)
    if leaf != "define" or not node.args:
        return None
    first = _string(node.args[0])
    if first and "::" in first:  # torch.library.define("ns::op", "(...) -> ...")
        text = _string(node.args[1]) if len(node.args) >= 2 else None
        if text is None:
            return None
        ns, _, op = first.partition("::")
        return Site(file, node.lineno, ns, op, "schema", name, f"{op}{text}")
    if first is None or "(" not in first:
        return None
    owner = node.func.value if isinstance(node.func, ast.Attribute) else None
    ns, ctor = "", ""  # a library msrewrite cannot name: the op may be in any namespace
    if isinstance(owner, ast.Name):
        ns, ctor = libraries.get(owner.id, ("", ""))
    elif isinstance(owner, ast.Call) and _dotted(owner.func).split(".")[-1] == "Library" and owner.args:
        ns, ctor = _string(owner.args[0]) or "", _dotted(owner.func)
    op = first.split("(")[0].strip().split(".")[0]
    return Site(file, node.lineno, ns, op, "library", ctor, first)
