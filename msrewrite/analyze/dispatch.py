"""Dispatch through an object whose class is known only by its base (issue 26, item 2).

`self.quant_method.apply(self, x, bias)`, where `__init__` stores
`quant_config.get_quant_method(self, prefix)`: no source says which class that call returns, but
the framework declares what it is: the attribute's annotation (`self.quant_method:
QuantizeMethodBase | None = ...`), the annotation of the parameter it is stored from, or the
return annotation of the factory method (`def get_quant_method(...) -> QuantizeMethodBase | None`,
read on the class the receiver's own annotation names). The object is then an instance of that
base or of one of its subclasses, and a call on it runs the method as one of them resolves it: the
effect is the union over the base and every subclass of it that msrewrite finds.

That union is a closed world: the subclasses are searched in the package the base is defined in
(the folder of its top-level package, every `.py` file below it), in the file being analysed and in
the modules already read; a subclass defined anywhere else (an out-of-tree plugin) is not seen. The
call says so in its trust boundary (`unseen_work`), naming the base, the package and the count.
The search gives up, and the call stays "may write", when it cannot be complete for the package:
a class there whose base naming the class is not a plain name (`class X(make_base(Base))`), a
class nested in a function or class, a `Base.register(...)` virtual subclass, a base that is a
`Protocol` (structural: an implementation need not derive from it), a package with more than
MAX_TREE_FILES files, a union of more than MAX_SUBCLASSES classes, or a subclass msrewrite cannot
read (past the reading bounds).

Cost: the package's text is scanned once per process for `class` statements (no parse; about a
second for SGLang's 4,700 files), a base is matched by name (a same-named class elsewhere only makes
the union larger), and a class is read only when the union gets to it: it stops at the first one
that calls something msrewrite cannot see into, since the call may write already.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import libcst as cst

from msrewrite.analyze import packages
from msrewrite.analyze.defuse import dotted_name
from msrewrite.analyze.reach import _LocalBinds
from msrewrite.analyze.torch_effects import CallEffect
from msrewrite.analyze.walk import Visitor

if TYPE_CHECKING:
    from collections.abc import Callable

    from msrewrite.analyze.summaries import ModuleSummaries

Target = tuple["ModuleSummaries", str]

MAX_TREE_FILES = 20_000  # a larger tree is not searched: the union stays unknown
MAX_SUBCLASSES = 256

Site = tuple[Path, str]  # a class found by the search: its file (not read yet), its name

# package folder -> (its files as _tree_files gives them, its class index: _tree_index)
_indexes: dict[Path, tuple[tuple[tuple[Path, int, int], ...] | None, _TreeIndex | None]] = {}
# (package folder, class name) -> the classes there that derive from a class of that name, or why
# the search cannot be complete
_in_tree: dict[tuple[Path, str], tuple[Site, ...] | str] = {}


class _Header:
    """One `class Name(<bases>):` statement as written: its file, name, whether it starts a line
    (at module level, or in an `if`/`try` there: packages.py tells), and its base list's text."""

    __slots__ = ("file", "name", "indented", "bases")

    def __init__(self, file: Path, name: str, indented: bool, bases: str) -> None:
        self.file, self.name, self.indented, self.bases = file, name, indented, bases


class _TreeIndex:
    """The `class` statements of a package tree, found by reading its text (no parse): each by
    every identifier its base list names; the names each file's `import X as Y` binds (Y -> X);
    the names `X` of `X.register(...)` calls anywhere."""

    def __init__(self) -> None:
        self.by_word: dict[str, list[_Header]] = {}
        self.by_name: dict[tuple[Path, str], int] = {}  # how many `class` statements of a name a file has
        self.aliases: dict[Path, dict[str, str]] = {}
        self.aliased: dict[str, list[tuple[Path, str]]] = {}  # original -> (file, alias)
        self.registered: set[str] = set()


# annotations --------------------------------------------------------------------------------


def annotated_classes(owner: ModuleSummaries, annotation: cst.BaseExpression) -> list[Target] | None:
    """The classes an annotation names, resolved in `owner`'s file: `Base`, `m.Base`, `"Base"`,
    `Optional[Base]`, `Union[A, B]`, `A | None` (None adds no class). None when any part is
    not a class msrewrite reads (`Any`, `Callable[...]`, `nn.Module`, a type variable)."""
    if isinstance(annotation, cst.SimpleString):
        text = annotation.evaluated_value
        if not isinstance(text, str):
            return None
        try:
            annotation = cst.parse_expression(text)
        except cst.ParserSyntaxError:
            return None
    if isinstance(annotation, cst.Name) and annotation.value == "None":
        return []
    if isinstance(annotation, cst.BinaryOperation) and isinstance(annotation.operator, cst.BitOr):
        return _union([annotated_classes(owner, annotation.left), annotated_classes(owner, annotation.right)])
    if isinstance(annotation, cst.Subscript):
        head = (dotted_name(annotation.value) or "").split(".")[-1]
        if head not in ("Optional", "Union"):
            return None
        parts: list[list[Target] | None] = []
        for element in annotation.slice:
            if not isinstance(element.slice, cst.Index):
                return None
            parts.append(annotated_classes(owner, element.slice.value))
        return _union(parts)
    named = dotted_name(annotation) if isinstance(annotation, (cst.Name, cst.Attribute)) else None
    found = owner.find_class(named) if named else None
    return [found] if found is not None else None


def _union(parts: list[list[Target] | None]) -> list[Target] | None:
    out: list[Target] = []
    for part in parts:
        if part is None:
            return None
        out += [t for t in part if not any(t[0] is o[0] and t[1] == o[1] for o in out)]
    return out


class _SelfAnnotations(Visitor):
    """`self.<attr>: T` (with or without a value) in one method: attr -> its annotations; nested
    functions and classes skipped (their `self` is another object)."""

    def __init__(self, method: cst.FunctionDef, found: dict[str, list[cst.BaseExpression]]) -> None:
        super().__init__()
        self.method, self.found = method, found

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node is self.method

    def visit_ClassDef(self, _node: cst.ClassDef) -> bool:
        return False

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        target = node.target
        if isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name) and target.value.value == "self":
            self.found.setdefault(target.attr.value, []).append(node.annotation.annotation)


def attribute_annotations(owner: ModuleSummaries, cls: str, attr: str) -> list[cst.BaseExpression]:
    """Every annotation class `cls` (or a same-file base) gives `self.<attr>`: `attr: T` in the
    class body, `self.attr: T = ...` in a method."""
    found: list[cst.BaseExpression] = []
    seen: set[str] = set()
    todo = [cls]
    while todo:
        name = todo.pop()
        if name in seen or name not in owner.classes:
            continue
        seen.add(name)
        found += _class_annotations(owner, name).get(attr, [])
        todo += owner._bases(name)
    return found


def _class_annotations(owner: ModuleSummaries, cls: str) -> dict[str, list[cst.BaseExpression]]:
    """attr -> the annotations class `cls`'s own body and methods give `self.<attr>` (one pass
    per class, kept with the module's other answers about its code)."""
    key = ("annotations", cls)
    if key not in owner.reach_cache:
        found: dict[str, list[cst.BaseExpression]] = {}
        node = owner.classes.get(cls)
        for stmt in node.body.body if node is not None and isinstance(node.body, cst.IndentedBlock) else ():
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                        found.setdefault(small.target.value, []).append(small.annotation.annotation)
            elif isinstance(stmt, cst.FunctionDef):
                stmt.visit(_SelfAnnotations(stmt, found))
        owner.reach_cache[key] = found
    return owner.reach_cache[key]


def _parameter(home: cst.FunctionDef, name: str) -> cst.Param | None:
    """The parameter `name` of `home` when the body never binds it again (`config = other` would
    make its annotation say nothing about what it holds later); else None."""
    params = home.params
    for p in (*params.posonly_params, *params.params, *params.kwonly_params):
        if p.name.value == name:
            binds = _LocalBinds(home, name)
            home.visit(binds)
            return None if binds.values or binds.other or binds.imported else p
    return None


def _returned_by(
    owner: ModuleSummaries, value: cst.Call, home: cst.FunctionDef | None
) -> tuple[list[Target], str] | None:
    """The classes the call `value` is declared to return: `recv.method(...)` where `recv` is a
    parameter of `home` annotated with classes that define `method` with a return annotation,
    or `factory(...)` of a free function with one. (classes, where that was read) or None."""
    func = value.func
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and home is not None:
        param = _parameter(home, func.value.value)
        if param is None or param.annotation is None:
            return None
        receivers = annotated_classes(owner, param.annotation.annotation)
        if not receivers:
            return None
        out: list[Target] = []
        where: list[str] = []
        for module, klass in receivers:
            hit = module._inherited(klass, func.attr.value)
            if hit is None or hit[2].returns is None:
                return None
            classes = annotated_classes(hit[0], hit[2].returns.annotation)
            if classes is None:
                return None
            out = _union([out, classes]) or []
            where.append(f"{hit[1]}.{func.attr.value}")
        return out, f"the return annotation of {', '.join(where)}"
    named = dotted_name(func)
    found = owner.find_function(named) if named else None
    if found is None:
        return None
    factory = found[0].functions[found[1]]
    if not isinstance(factory, cst.FunctionDef) or factory.returns is None or factory.decorators:
        return None
    classes = annotated_classes(found[0], factory.returns.annotation)
    return (classes, f"the return annotation of {found[1]}") if classes is not None else None


def declared_bases(
    owner: ModuleSummaries, cls: str, attr: str, value: cst.BaseExpression, home: cst.FunctionDef | None
) -> tuple[list[Target], str] | None:
    """The base classes `self.<attr>` holding `value` (stored in `home`) is declared to be an
    instance of, and where that is declared; None when nothing declares it. The attribute's own
    annotation first; else the parameter's a plain name is stored from; else the return annotation
    of the call it is stored from."""
    annotations = attribute_annotations(owner, cls, attr)
    if annotations:
        classes = _union([annotated_classes(owner, a) for a in annotations])
        return (classes, f"the annotation of self.{attr}") if classes else None
    if isinstance(value, cst.Name) and home is not None:
        param = _parameter(home, value.value)
        if param is None or param.annotation is None:
            return None
        classes = annotated_classes(owner, param.annotation.annotation)
        return (classes, f"the annotation of parameter {value.value}") if classes else None
    if isinstance(value, cst.Call):
        found = _returned_by(owner, value, home)
        return found if found is not None and found[0] else None
    return None


# the subclass search ------------------------------------------------------------------------


def package_tree(path: Path | None) -> Path | None:
    """The folder of the top-level package the file `path` belongs to: the highest folder above
    it holding an `__init__.py` (a namespace portion without one, SGLang's `srt/`, in between is
    part of it); the file's own folder when none does."""
    if path is None:
        return None
    path = path.resolve()
    top = None
    for folder in path.parents:
        if folder.parent == folder:
            break
        if (folder / "__init__.py").is_file():
            top = folder
    return top if top is not None else path.parent


_WORD = re.compile(r"[A-Za-z_]\w*")
_CLASS_HEAD = re.compile(rb"class[ \t]+(\w+)[ \t]*\(")
_AFTER_AS = re.compile(rb"as[ \t]+([A-Za-z_]\w*)")
_REGISTER_AT = re.compile(rb"[ \t]*\.[ \t]*register[ \t]*\(")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:[ \t]*\.[ \t]*[A-Za-z_]\w*)*")
_WORD_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")

# The tree is read as bytes (a text search over a framework's 60 MB is what costs): only the
# names and base lists found are decoded.


def _word_before(data: bytes, at: int) -> str:
    """The identifier that ends right before position `at` of `data` (after spaces), or ""."""
    end = at
    while end > 0 and data[end - 1] in b" \t":
        end -= 1
    start = end
    while start > 0 and data[start - 1] in _WORD_BYTES:
        start -= 1
    return data[start:end].decode("ascii", "replace")


def _aliases(data: bytes) -> dict[str, str]:
    """`X as Y` in `data`: Y -> X (an import alias; a `with ... as` or `except ... as` one only adds
    names)."""
    found: dict[str, str] = {}
    at = data.find(b" as ")
    while at >= 0:
        original, alias = _word_before(data, at), _AFTER_AS.match(data, at + 1)
        if original and alias is not None:
            name = alias.group(1).decode("ascii", "replace")
            if name != original:
                found[name] = original
        at = data.find(b" as ", at + 4)
    return found


def _registered(data: bytes) -> set[str]:
    """The names `X` of the `X.register(` calls in `data`."""
    found: set[str] = set()
    at = data.find(b"register")
    while at >= 0:
        dot = data.rfind(b".", 0, at)
        if dot >= 0 and not data[dot + 1 : at].strip() and _REGISTER_AT.match(data, dot):
            word = _word_before(data, dot)
            if word:
                found.add(word)
        at = data.find(b"register", at + 8)
    return found


def _class_headers(file: Path, data: bytes) -> list[_Header]:
    """Every `class Name(...)` statement of `data`, with its base list's text (to the parenthesis
    that closes it; a parenthesis inside a string there ends it early, which only adds words)."""
    found: list[_Header] = []
    at = data.find(b"class ")
    while at >= 0:
        line = data.rfind(b"\n", 0, at) + 1
        head = _CLASS_HEAD.match(data, at) if not data[line:at].strip(b" \t") else None
        if head is not None:
            depth, i = 1, head.end()
            while depth:
                close = data.find(b")", i)
                if close < 0:
                    i = len(data)
                    break
                opened = data.find(b"(", i, close)
                depth, i = (depth + 1, opened + 1) if opened >= 0 else (depth - 1, close + 1)
            bases = data[head.end() : i - 1].decode("utf-8", "replace")
            found.append(_Header(file, head.group(1).decode("ascii", "replace"), at > line, bases))
        at = data.find(b"class ", at + 6)
    return found


def _tree_files(tree: Path) -> tuple[tuple[Path, int, int], ...] | None:
    """(file, size, mtime) of every `.py` file below `tree`, in a fixed order; None for more than
    MAX_TREE_FILES."""
    found: list[tuple[Path, int, int]] = []
    todo = [str(tree)]
    while todo:
        folder = todo.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir():
                    if not entry.name.startswith(".") and entry.name != "__pycache__":
                        todo.append(entry.path)
                elif entry.name.endswith(".py"):
                    stat = entry.stat()
                    found.append((Path(entry.path), stat.st_size, stat.st_mtime_ns))
            except OSError:
                continue
        if len(found) > MAX_TREE_FILES:
            return None
    return tuple(found)


def refresh(tree: Path) -> None:
    """Forget what was found in `tree` when a file there was added, removed or changed since
    (once per analysis: a process may analyse again after the sources changed)."""
    if tree in _indexes and _indexes[tree][0] != _tree_files(tree):
        del _indexes[tree]
        for key in [k for k in _in_tree if k[0] == tree]:
            del _in_tree[key]


def _tree_index(tree: Path) -> _TreeIndex | None:
    """The class index of `tree` (one pass over its text, kept per process); None for a tree of
    more than MAX_TREE_FILES files."""
    if tree in _indexes:
        return _indexes[tree][1]
    files = _tree_files(tree)
    index = None if files is None else _TreeIndex()
    for file, size, _mtime in files or ():
        if size > packages.MAX_FILE_BYTES:
            continue  # packages.py reads no such file either: a class there is never resolved
        try:
            data = file.read_bytes()
        except OSError:
            continue
        assert index is not None
        for header in _class_headers(file, data):
            for word in set(_WORD.findall(header.bases)):
                index.by_word.setdefault(word, []).append(header)
            key = (file, header.name)
            index.by_name[key] = index.by_name.get(key, 0) + 1
        if b" as " in data:
            aliases = _aliases(data)
            if aliases:
                index.aliases[file] = aliases
                for alias, original in aliases.items():
                    index.aliased.setdefault(original, []).append((file, alias))
        if b"register" in data:
            index.registered |= _registered(data)
    _indexes[tree] = (files, index)
    return index


def _same(a: Target, b: Target) -> bool:
    return a[1] == b[1] and (a[0] is b[0] or (a[0].path is not None and a[0].path == b[0].path))


class Incomplete(Exception):
    """The subclass search cannot be complete (its message says why)."""


def subclasses(base: Target) -> list[Site]:
    """`base`, then every class msrewrite finds that derives from it, as (file, name): none of
    them is read here (call_through_base reads those it gets to). Raises Incomplete when the
    search cannot be complete. See the module docstring for where it looks."""
    module, name = base
    tree = package_tree(module.path)
    if tree is None or module.path is None:
        raise Incomplete(f"{name} is not defined in a file")
    node = module.classes.get(name)
    if node is not None and any((dotted_name(b.value) or "").split(".")[-1] == "Protocol" for b in node.bases):
        raise Incomplete(f"{name} is a Protocol (a class need not derive from it to match it)")
    if tree not in module._reading.checked_trees:
        module._reading.checked_trees.add(tree)
        refresh(tree)
    key = (tree, name)
    if key not in _in_tree:
        _in_tree[key] = _search_tree(tree, name)
    in_tree = _in_tree[key]
    if isinstance(in_tree, str):
        raise Incomplete(in_tree)
    found: list[Site] = [(_resolved(module), name)]
    found += [site for site in in_tree if site != found[0]]
    seen = set(found)
    # classes of the file analysed and of modules read outside the package, by the names of their bases
    inside = str(tree) + os.sep
    outside: dict[str, list[tuple[ModuleSummaries, str, str]]] = {}
    for other in _read_modules(module):
        if other.path is not None and not str(_resolved(other)).startswith(inside):
            for cls_name, parents in other._all_bases().items():
                for b in parents:
                    imported = other.imports.get(b)
                    for written in {b.split(".")[-1], imported[2] if imported else ""} - {""}:
                        outside.setdefault(written, []).append((other, cls_name, b))
    todo = list(found)
    while todo:
        parent = todo.pop(0)
        for other, cls_name, b in outside.get(parent[1], []):
            site = (_resolved(other), cls_name)
            if site not in seen and _names(other, b, parent):
                seen.add(site)
                found.append(site)
                todo.append(site)
        if len(found) > MAX_SUBCLASSES:
            raise Incomplete(f"{name} has more than {MAX_SUBCLASSES} subclasses")
    return found


def _names(module: ModuleSummaries, base: str, parent: Site) -> bool:
    """Whether the base `base`, as written in `module`, is the class `parent`."""
    if not _may_name(module, base, parent[1]):
        return False
    hit = module.find_class(base)
    return hit is not None and hit[1] == parent[1] and hit[0].path is not None and _resolved(hit[0]) == parent[0]


def _search_tree(tree: Path, name: str) -> tuple[Site, ...] | str:
    """The (file, class) pairs of `tree` whose bases name a class `name`, or a class found so; or
    why the search cannot be complete. A base is matched by its name, not resolved: a same-named
    class of another module makes the union larger (more conservative), never smaller, and only
    the classes the union gets to are read."""
    index = _tree_index(tree)
    if index is None:
        return f"the package {tree} has more than {MAX_TREE_FILES} files"
    found: list[Site] = []
    seen: set[Site] = set()
    todo = [name]
    while todo:
        parent = todo.pop(0)
        if parent in index.registered:
            return f"a file of the package registers a virtual subclass of {parent} (`{parent}.register(...)`)"
        headers = list(index.by_word.get(parent, []))
        for file, alias in index.aliased.get(parent, []):  # `from .base import Base as B`: `class X(B)`
            headers += [h for h in index.by_word.get(alias, []) if h.file == file]
        for header in headers:
            why = _derives(index, header, parent)
            if why is None:
                continue
            if why:
                return why
            site = (header.file.resolve(), header.name)
            if site not in seen:
                seen.add(site)
                found.append(site)
                todo.append(header.name)
        if len(found) > MAX_SUBCLASSES:
            return f"{name} has more than {MAX_SUBCLASSES} subclasses"
    return tuple(found)


def _derives(index: _TreeIndex, header: _Header, parent: str) -> str | None:
    """ "" when the class `header` writes derives from a class named `parent`, None when it does
    not, else why that cannot be told."""
    aliases = index.aliases.get(header.file, {})
    named = False
    for piece in _top_level_pieces(header.bases):
        if "=" in piece.split("(")[0].split("[")[0]:
            continue  # metaclass=..., a keyword
        dotted = _DOTTED.match(piece)
        rest = piece[dotted.end() :].strip() if dotted else piece
        words = set(_WORD.findall(piece))
        if parent not in words and not any(aliases.get(w) == parent for w in words):
            continue
        plain = "".join(dotted.group(0).split()) if dotted else ""
        if not plain or (rest and not rest.startswith("[")):
            return f"{header.file.name}: class {header.name} has a base msrewrite cannot name ({piece})"
        named = named or plain.split(".")[-1] == parent or aliases.get(plain) == parent
    if not named:
        return None
    if index.by_name.get((header.file, header.name), 0) > 1:
        return f"{header.file.name} defines {header.name} more than once"
    if header.indented:
        readable = packages.index_file(header.file)
        if readable is None or header.name not in readable.classes:
            return f"{header.file.name}: class {header.name} is defined inside a function or class"
    return ""


def _top_level_pieces(text: str) -> list[str]:
    """`text` split at the commas outside brackets, each piece stripped of comments and space."""
    text = "\n".join(line.split("#")[0] for line in text.splitlines())
    pieces, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    pieces.append(text[start:])
    return [p.strip() for p in pieces if p.strip()]


def _may_name(module: ModuleSummaries, base: str, name: str) -> bool:
    """Whether the base `base`, as written in `module`, may be class `name`: its last part is the
    name, or it is an alias an import binds to something of that name."""
    if base.split(".")[-1] == name:
        return True
    imported = module.imports.get(base)  # `from .base import Base as B`; `class X(B)`
    return imported is not None and imported[2] == name


def _reader(module: ModuleSummaries, file: Path) -> ModuleSummaries | None:
    """The summaries of `file` in the analysis `module` belongs to (read now if not yet)."""
    root = module._reading.root
    if root is not None and root.path is not None and _resolved(root) == file:
        return root
    # read as the file analysed would read one of its imports: found by the search, not through
    # the chain of imports that led to the base (whose depth would bound what it can resolve)
    return (root or module)._read(file, package=True)


def _resolved(module: ModuleSummaries) -> Path:
    """The module's file, resolved once (a read module's path is resolved already)."""
    key = ("resolved path",)
    if key not in module.reach_cache:
        module.reach_cache[key] = module.path.resolve() if module.path is not None else Path()
    return module.reach_cache[key]


def _read_modules(module: ModuleSummaries) -> list[ModuleSummaries]:
    reading = module._reading
    found = [m for m in reading.loaded.values() if m is not None]
    if reading.root is not None and not any(m is reading.root for m in found):
        found.append(reading.root)
    return found


# the call ----------------------------------------------------------------------------------


def call_through_base(
    owner: ModuleSummaries,
    call: cst.Call,
    value: cst.BaseExpression,
    label: str,
    rest: str,
    cls: str,
    attr: str,
    home: cst.FunctionDef | None,
    union_effects: Callable[[list[CallEffect]], CallEffect],
    unknown: Callable[[cst.Call, str], CallEffect],
):
    """The effect of `call` on `self.<attr>` (`rest`: the method called on it, or "" for the
    object itself) when `attr` holds `value` whose class no source names, but a declaration
    (declared_bases) says it derives from a base: the union, over the base and every subclass
    of it the search finds, of calling an instance of that class. None when nothing declares a
    base. A union that cannot be complete is the unknown callee it was before, saying why."""
    declared = declared_bases(owner, cls, attr, value, home)
    if declared is None:
        return None
    return _union_over(owner, call, declared, label, rest, union_effects, unknown)


def call_on_returned(
    owner: ModuleSummaries,
    call: cst.Call,
    label: str,
    union_effects: Callable[[list[CallEffect]], CallEffect],
    unknown: Callable[[cst.Call, str], CallEffect],
):
    """The effect of `call`, a method called on what a call returns (`get_backend().is_fast()`),
    when the function called first declares the classes it returns (`def get_backend() ->
    Backend`): the union, over those classes and every subclass of them the search finds, of
    that method. None when the function declares no class (or is not a function msrewrite reads)."""
    func = call.func
    if not isinstance(func, cst.Attribute) or not isinstance(func.value, cst.Call):
        return None
    declared = _returned_by(owner, func.value, None)
    if declared is None or not declared[0]:
        return None
    return _union_over(owner, call, declared, label, func.attr.value, union_effects, unknown)


def _union_over(
    owner: ModuleSummaries,
    call: cst.Call,
    declared: tuple[list[Target], str],
    label: str,
    rest: str,
    union_effects: Callable[[list[CallEffect]], CallEffect],
    unknown: Callable[[cst.Call, str], CallEffect],
):
    """The union over the declared bases and their subclasses of calling method `rest` (or the
    object itself) on an instance of one (call_through_base)."""
    bases, where = declared
    method = rest or "forward"
    effects = []
    for base in bases:
        try:
            sites = subclasses(base)
        except Incomplete as why:
            effects.append(
                unknown(call, f"{label} (an instance of {base[1]}, by {where}; {why}; not visible to msrewrite)")
            )
            continue
        # the base's own file first (parsed already), then in the search's order; the union stops at
        # the first class that calls something not seen into (the call may write already)
        own = [site for site in sites if site[0] == sites[0][0]]
        for file, name in own + [site for site in sites if site not in own]:
            module = base[0] if (file, name) == sites[0] else _reader(owner, file)
            if module is None or name not in module.classes:
                stop = f"{file} is past the reading bounds"
            else:
                effect = module._instance_call(call, (module, name), label, name, rest)
                if rest:  # the method's own labels say `self.<rest>`: name the class it runs in
                    _relabel(effect, f"self.{rest}", f"{label} ({name}.{rest})")
                effects.append(effect)
                if not effect.unknown:
                    continue
                # "may write" already, through a callee not seen into: the other classes are not read
                # (a union over every quantization method would read most of the framework)
                stop = f"the rest of its {len(sites) - 1} subclasses not read after {name}.{method}"
            effects.append(
                unknown(call, f"{label} (an instance of {base[1]}, by {where}; {stop}; not visible to msrewrite)")
            )
            break
        else:
            subs = len(sites) - 1
            tree = package_tree(base[0].path)
            note = (
                f"{label} (an instance of {base[1]}, by {where}: its {method} is the union over {base[1]} and "
                f"its {subs} subclass{'' if subs == 1 else 'es'} in package {tree.name if tree else '?'}; a "
                "subclass defined outside it is not seen)"
            )
            effects.append(CallEffect(unseen_work=[note]))
    return union_effects(effects)


def _relabel(effect, old: str, new: str) -> None:
    """Entries of `effect` that start with the callee label `old` start with `new` instead."""

    def swap(text: str) -> str:
        return new + text[len(old) :] if text == old or text.startswith((f"{old} ", f"{old} -> ")) else text

    effect.may_writes = [(expr, swap(why)) for expr, why in effect.may_writes]
    effect.unknown = [swap(u) for u in effect.unknown]
    effect.unseen_work = [swap(u) for u in effect.unseen_work]
