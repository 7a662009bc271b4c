"""Source files of installed packages, found without importing anything.

`from sglang.srt.layers.moe import FusedMoE` names a module by its dotted path. Importing it to
find its file would run the package (and its parents' `__init__`), which msrewrite never does.
Instead the path is walked the way the path-based finder searches it, one component at a
time, in the folders the previous component gave (a package's own folder, or every portion of
a namespace package). Only the file system is looked at: no finder, no parent `__init__` runs.

The roots are the `--source-path` folders (unpacked wheels, a checkout), then the folder that
holds the package the analysed file belongs to (a model file inside an unpacked SGLang or vLLM
tree reads its own framework without being told where it is), then `sys.path`.
torch, NumPy and the like are never read: torch's effects come from analyze/torch_effects.py,
and a compiled package has no source to read.

A module is indexed with `ast` (what it defines and imports: fast), and only the definitions a
summary needs are parsed with libcst. Indexes are kept per process, keyed by path, size and
modification time.
"""

from __future__ import annotations

import re
import sys
from dataclasses import field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msrewrite.analyze import platforms
from msrewrite.records import record

if TYPE_CHECKING:
    import libcst as cst


# Packages whose Python source says nothing useful about what their ops do to tensors.
NOT_READ = frozenset({"torch", "torch_npu", "torchair", "numpy", "triton", "jax", "tensorflow"})
MAX_FILE_BYTES = 1_000_000  # a larger file (generated tables, kernel zoos) is not read

_source_roots: tuple[Path, ...] = ()
_parsed: dict[tuple[Path, int, int], SourceIndex | None] = {}
_found: dict[tuple[tuple[str, ...], str], Path | None] = {}
_roots_for: dict[tuple, tuple[str, ...]] = {}
_enclosing: dict[tuple[Path, str], Path | None] = {}
# root -> (how it was found, the top-level packages read from it), for the run's summary line
_read_from: dict[str, tuple[str, set[str]]] = {}


def set_source_path(roots: list[Path] | tuple[Path, ...]) -> None:
    """Extra folders to read packages from, searched before `sys.path` (`--source-path DIR`).
    A folder that does not exist is bad input (exit 2), before anything is read."""
    global _source_roots
    for root in roots:
        if not Path(root).is_dir():
            from msrewrite.errors import BadInput

            raise BadInput(f"--source-path {root}: not a folder")
    _source_roots = tuple(Path(r).resolve() for r in roots)


def source_path() -> tuple[Path, ...]:
    return _source_roots


def enclosing_root(path: Path | None, top: str) -> Path | None:
    """The folder that holds package `top` when the file `path` lives inside it: the parent of the
    nearest folder above `path` named `top` (`.../python` for
    `.../python/sglang/srt/models/qwen2_moe.py` and `sglang`). Wheels leave `__init__.py` out of
    namespace portions (SGLang's `srt/`), so the folder's name is what marks the package, not a
    chain of `__init__.py` files. None for a file outside a folder of that name."""
    if path is None or not top:
        return None
    key = (path, top)
    if key not in _enclosing:
        found = None
        for folder in path.resolve().parents:
            if folder.name == top and folder.parent != folder:
                found = folder.parent
                break
        _enclosing[key] = found
    return _enclosing[key]


def _roots(own: Path | None = None) -> tuple[str, ...]:
    """`--source-path` folders, `own` (the folder of the package the importing file lives in),
    then `sys.path` without the standard library (its functions never receive a model's tensors in
    a way worth reading; they stay unknown)."""
    key = (_source_roots, own, tuple(sys.path))
    if key not in _roots_for:
        import sysconfig  # only when a package is looked up (most runs never do)

        stdlib = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
        given = tuple(str(r) for r in _source_roots)
        found = () if own is None or str(own) in given else (str(own),)
        rest = tuple(p for p in sys.path if p and p not in stdlib and Path(p).is_dir() and p not in found)
        _roots_for[key] = given + found + rest
    return _roots_for[key]


def module_file(dotted: str, near: Path | None = None) -> Path | None:
    """The source file of module `dotted` (`pkg/sub.py` or `pkg/sub/__init__.py`), or None.
    `near`: the file whose import names it; its own package's tree is searched too."""
    if not dotted or dotted.split(".")[0] in NOT_READ:
        return None
    top = dotted.split(".")[0]
    own = enclosing_root(near, top)
    roots = _roots(own)
    key = (roots, dotted)
    if key not in _found:
        _found[key] = _walk(dotted, roots)
    found = _found[key]
    # the lookup is hot: a package already recorded this run is not placed again
    if found is not None and not any(top in tops for _how, tops in _read_from.values()):
        _note_read(found, top, roots, own)
    return found


def search_roots(dotted: str, near: Path | None = None) -> tuple[str, ...]:
    """The folders `module_file` searches for module `dotted` imported by the file `near`, in
    order (a refusal says where a source was looked for); () for a package never read (torch)."""
    if not dotted or dotted.split(".")[0] in NOT_READ:
        return ()
    return _roots(enclosing_root(near, dotted.split(".")[0]))


def _note_read(file: Path, top: str, roots: tuple[str, ...], own: Path | None) -> None:
    for root in roots:
        if file.is_relative_to(root):
            if root in (str(r) for r in _source_roots):
                how = "--source-path"
            elif own is not None and Path(root) == own:
                how = "the package the file is in"
            else:
                how = "installed"
            _read_from.setdefault(root, (how, set()))[1].add(top)
            return


def forget_reads() -> None:
    """Start a run's record of where package sources were read (a process may run several)."""
    _read_from.clear()


def roots_read() -> list[str]:
    """Where package sources were read from in this run: `sglang from /x/python (the package the
    file is in)`, one entry per root, in the order first read."""
    return [f"{', '.join(sorted(tops))} from {root} ({how})" for root, (how, tops) in _read_from.items()]


def _walk(dotted: str, roots: tuple[str, ...]) -> Path | None:
    """Each component is looked up in the folders the previous one gave, as the path-based
    finder does: `part/__init__.py` (a package), `part.py` (a module), or a plain `part/`
    folder (a portion of a namespace package; all portions are searched)."""
    locations = list(roots)
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        portions: list[str] = []
        for folder in locations:
            base = Path(folder) / part
            if (base / "__init__.py").is_file():
                if last:
                    return base / "__init__.py"
                portions = [str(base)]
                break
            if base.with_suffix(".py").is_file():
                return base.with_suffix(".py") if last else None  # a plain module has no submodules
            if base.is_dir():
                portions.append(str(base))
        if not portions or last:
            return None  # not found, or a namespace package: no source of its own
        locations = portions
    return None


@record
class SourceIndex:
    """What a module defines and imports, from a fast `ast` pass; each definition is parsed with
    libcst only when a summary needs it (`definition`)."""

    lines: list[str]
    spans: dict[str, tuple[int, int]]  # class or function name -> (first line incl. decorators, last line)
    classes: set[str]
    functions: set[str]
    imports: dict[str, tuple[int, str, str]]  # local name -> (dots, module, name)
    module_imports: dict[str, str]  # `import a.b as m`: m -> a.b; `import a.b`: a -> a
    patched: dict[str, str]  # function -> the class it is assigned to (Cls.forward = fn)
    star_imports: list[tuple[int, str]] = field(default_factory=list)  # `from <dots><module> import *`
    bases: dict[str, list[str]] = field(default_factory=dict)  # class -> its bases, dotted
    # (class, attribute) -> each module-level `Cls.attr = value`: the function's name, or None
    # for any other value (a lambda, a call)
    patches: dict[tuple[str, str], list[str | None]] = field(default_factory=dict)
    # module-level names that only ever hold a builtin container built by a literal (`CONFIGS =
    # {...}`): see `container_globals`
    containers: frozenset[str] = frozenset()
    platform_names: dict[str, str] = field(default_factory=dict)  # see module_platform_names
    # names the module binds anywhere other than by an import (summaries.bound_names)
    bound_besides_imports: frozenset[str] = frozenset()

    parsed: dict = field(default_factory=dict)  # name -> its libcst node (None: does not parse alone)

    def definition(self, name: str) -> cst.BaseStatement | None:
        if name not in self.parsed:
            self.parsed[name] = self._parse(name)
        return self.parsed[name]

    def _parse(self, name: str) -> cst.BaseStatement | None:
        import textwrap

        import libcst as cst

        first, last = self.spans[name]
        text = textwrap.dedent("".join(self.lines[first - 1 : last]))
        try:
            body = cst.parse_module(text).body
        except (cst.ParserSyntaxError, RecursionError):
            return None
        return body[0] if len(body) == 1 else None


def index_file(path: Path) -> SourceIndex | None:
    """The index of `path` (cached per process by path, size and mtime), or None when it cannot be
    read, is too large, or does not parse."""
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _parsed:
        index = None
        if stat.st_size <= MAX_FILE_BYTES:
            try:
                text = path.read_text(encoding="utf-8")
                index = _index(text)
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
                index = None
        _parsed[key] = index
    return _parsed[key]


def ast_dotted(node) -> str | None:
    """'a.b.c' for an `ast` Name / Attribute chain, else None."""
    import ast

    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _note_patch(index: SourceIndex, stmt) -> None:
    """`Cls.attr = value` at module level: a method replaced (or set) from outside the class."""
    import ast

    for target in stmt.targets:
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            value = stmt.value.id if isinstance(stmt.value, ast.Name) else None
            index.patches.setdefault((target.value.id, target.attr), []).append(value)
            if value is not None:
                index.patched[value] = target.value.id


def _index(text: str) -> SourceIndex:
    import ast

    tree = ast.parse(text)
    index = SourceIndex(text.splitlines(keepends=True), {}, set(), set(), {}, {}, {})

    def visit(body: list) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.If, ast.Try)):  # optional imports, guarded classes
                visit(stmt.body)
                visit(stmt.orelse)
                continue
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([stmt.lineno, *(d.lineno for d in stmt.decorator_list)])
                index.spans[stmt.name] = (first, stmt.end_lineno or stmt.lineno)
                index.classes.discard(stmt.name)  # a later definition of the name wins
                index.functions.discard(stmt.name)
                (index.classes if isinstance(stmt, ast.ClassDef) else index.functions).add(stmt.name)
                if isinstance(stmt, ast.ClassDef):
                    index.bases[stmt.name] = [n for n in (ast_dotted(b) for b in stmt.bases) if n]
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if alias.name != "*":
                        index.imports[alias.asname or alias.name] = (stmt.level, stmt.module or "", alias.name)
                    else:
                        index.star_imports.append((stmt.level, stmt.module or ""))
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        index.module_imports[alias.asname] = alias.name
                    else:
                        head = alias.name.split(".")[0]
                        index.module_imports[head] = head
            elif isinstance(stmt, ast.Assign):
                _note_patch(index, stmt)

    visit(tree.body)
    counts, imported = binding_walk(tree)
    index.containers = container_globals(tree, counts)
    index.platform_names = platform_names_in(tree, counts)
    index.bound_besides_imports = frozenset(name for name, n in counts.items() if n > imported.get(name, 0))
    return index


_CONTAINER_DISPLAYS = ("Dict", "List", "Set", "Tuple", "DictComp", "ListComp", "SetComp")
_CONTAINER_CALLS = frozenset({"dict", "list", "set", "tuple"})


def container_globals(tree, counts: dict[str, int] | None = None) -> frozenset[str]:
    """Names the module binds only at its top level, only to a dict, list, set or tuple display or
    comprehension (or a bare `dict()`...), and that nothing else in the file binds, deletes,
    declares `global` or takes as a parameter: wherever the file reads such a name it is that
    container, so its read methods (`CONFIGS.get(key)`) touch no tensor. `counts`: the tree's
    binding_counts, when already made."""
    import ast

    counts = binding_counts(tree) if counts is None else counts
    top = []
    todo = list(tree.body)
    while todo:  # top-level statements, also inside top-level if/try (guarded tables)
        stmt = todo.pop()
        if isinstance(stmt, (ast.If, ast.Try)):
            todo += stmt.body + stmt.orelse
        else:
            top.append(stmt)
    displays: dict[str, int] = {}  # name -> how many of its bindings are to a display
    for stmt in top:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            continue
        value = stmt.value
        if type(value).__name__ in _CONTAINER_DISPLAYS or (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in _CONTAINER_CALLS
            and not counts.get(value.func.id)  # `dict = ...` rebinding the builtin: nothing is known
            and not value.args
            and not value.keywords
        ):
            for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                if isinstance(target, ast.Name):
                    displays[target.id] = displays.get(target.id, 0) + 1
    return frozenset(name for name, n in displays.items() if counts.get(name) == n)


def binding_counts(tree) -> dict[str, int]:
    """How many times the file binds each name, anywhere (an assignment, `global`, import,
    parameter, definition, `except ... as`, a match capture): one walk of an `ast` tree."""
    return binding_walk(tree)[0]


def binding_walk(tree) -> tuple[dict[str, int], dict[str, int]]:
    """(binding_counts, the same counted for import statements alone): one walk, dispatched on the
    node's type (the walk visits every node of every module a run reads)."""
    import ast

    counts: dict[str, int] = {}
    imported: dict[str, int] = {}
    node: Any  # dispatched on its exact type below
    for node in ast.walk(tree):
        kind = type(node)
        if kind is ast.Name:
            if type(node.ctx) is not ast.Load:
                counts[node.id] = counts.get(node.id, 0) + 1
            continue
        names: list[str] | tuple[str, ...] = ()
        if kind is ast.alias:
            name = node.asname or node.name.split(".")[0]
            imported[name] = imported.get(name, 0) + 1
            names = (name,)
        elif kind is ast.arg:
            names = (node.arg,)
        elif kind in _DEFINITIONS:
            names = (node.name,)
        elif kind is ast.Global or kind is ast.Nonlocal:
            names = node.names
        elif kind in _CAPTURES and node.name:
            names = (node.name,)
        elif kind is ast.MatchMapping and node.rest:
            names = (node.rest,)
        for name in names:
            counts[name] = counts.get(name, 0) + 1
    return counts, imported


def _ast_kinds(*names: str) -> tuple[type, ...]:
    import ast

    return tuple(getattr(ast, n) for n in names)


_DEFINITIONS = _ast_kinds("FunctionDef", "AsyncFunctionDef", "ClassDef")
_CAPTURES = _ast_kinds("ExceptHandler", "MatchAs", "MatchStar")


@lru_cache(maxsize=8)
def text_facts(text: str) -> tuple[frozenset[str], dict[str, str]]:
    """(container_globals, module_platform_names) of a file's text; nothing for a text `ast`
    cannot parse."""
    import ast

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return frozenset(), {}
    counts = binding_counts(tree)
    return container_globals(tree, counts), platform_names_in(tree, counts)


# platform tests (analyze/platforms.py) --------------------------------------------------------
def module_platform_names(text: str) -> dict[str, str]:
    """Module-level names bound once, to a platform helper call (`_is_npu = is_npu()`), and never
    bound again anywhere in the file: not by another assignment, a `global`, an import, a loop,
    a parameter or a local of the same name (which would shadow it in that function). A file
    that calls no helper (`is_npu()`, `current_platform.is_cuda()`...) is not parsed for it."""
    if not _HELPER_CALL.search(text):
        return {}
    return text_facts(text)[1]


# a call of a platform helper with no arguments, as platforms.helper_platform knows them
_HELPER_CALL = re.compile(r"\bis_(?:npu|npu_arch35|cuda|cuda_alike|hip|rocm|cpu|xpu|hpu|musa|mps|tpu)\(\s*\)")


def platform_names_in(tree, counts: dict[str, int] | None = None) -> dict[str, str]:
    """module_platform_names of a parsed `ast.Module` (`counts`: its binding_counts). A name bound
    once to `X and <test>` (`_use_aiter = get_bool_env_var("SGLANG_USE_AITER") and _is_hip`,
    the test a helper call or a name found before it) is true only on that test's platform: its
    value carries platforms.IMPLIED, since it may be false there too."""
    import ast

    def helper_kind(value) -> str | None:
        if isinstance(value, ast.Call) and not value.args and not value.keywords:
            return platforms.helper_platform(ast_dotted(value.func) or "")
        return None

    def implied_kind(value, names: dict[str, str]) -> str | None:
        if isinstance(value, ast.BoolOp) and isinstance(value.op, ast.And):
            for part in value.values:
                kind = (
                    names.get(part.id) if isinstance(part, ast.Name) else helper_kind(part) or implied_kind(part, names)
                )
                if kind is not None:
                    return platforms.implied(kind)
        return None

    assigns = [  # (name, value) of each `name = value` at the top level, in order
        (stmt.targets[0].id, stmt.value)
        for stmt in tree.body
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
    ]
    found: dict[str, str] = {}
    for name, value in assigns:
        kind = helper_kind(value)
        if kind is not None:
            found[name] = kind
    if not found:
        return {}
    counts = binding_counts(tree) if counts is None else counts
    exact = {name: kind for name, kind in found.items() if counts.get(name) == 1}
    names = dict(exact)
    for name, value in assigns:  # in order: a name found before may be the test
        kind = implied_kind(value, names) if name not in exact and counts.get(name) == 1 else None
        if kind is not None:
            names[name] = kind
    return names
