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
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import libcst as cst

from msrewrite.analyze import packages
from msrewrite.analyze.defuse import dotted_name
from msrewrite.analyze.reach import _LocalBinds
from msrewrite.analyze.walk import Visitor

if TYPE_CHECKING:
    from msrewrite.analyze.summaries import ModuleSummaries

Target = tuple["ModuleSummaries", str]

MAX_TREE_FILES = 20_000  # a larger tree is not searched: the union stays unknown
MAX_SUBCLASSES = 256

SEARCH_BYTES = 20_000_000  # source the subclass search may read to resolve bases (its own budget)

# package folder -> (its files as _tree_files gives them, identifier -> the files that may subclass
# a class of that name: _tree_index)
_indexes: dict[Path, tuple[tuple[tuple[Path, int, int], ...] | None, dict[bytes, list[Path]] | None]] = {}
# (path, size, mtime) -> the class statements of the file (see _class_statements)
_statements: dict[tuple[Path, int, int], _FileClasses | None] = {}
# (package folder, base file, base name) -> its subclasses there as (file, class), once all are found
_in_tree: dict[tuple[Path, Path, str], tuple[tuple[Path, str], ...]] = {}


class _ClassStatement:
    """One `class` statement of a file: its name, each base as a dotted name (None: an
    expression that is not one, with the names it mentions), and whether it is at module level."""

    __slots__ = ("name", "bases", "odd", "top")

    def __init__(self, name: str, bases: list[str], odd: set[str], top: bool) -> None:
        self.name, self.bases, self.odd, self.top = name, bases, odd, top


class _FileClasses:
    """What the subclass search needs of one file: its class statements, the names `X` of its
    `X.register(...)` calls, and its `from m import Original as local` aliases (local -> Original)."""

    __slots__ = ("classes", "registers", "aliases")

    def __init__(self) -> None:
        self.classes: list[_ClassStatement] = []
        self.registers: set[str] = set()
        self.aliases: dict[str, str] = {}


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
    """`self.<attr>: T` (with or without a value) in one method; nested functions skipped."""

    def __init__(self, method: cst.FunctionDef, attr: str) -> None:
        super().__init__()
        self.method, self.attr = method, attr
        self.found: list[cst.BaseExpression] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node is self.method

    def visit_ClassDef(self, _node: cst.ClassDef) -> bool:
        return False

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if dotted_name(node.target) == f"self.{self.attr}":
            self.found.append(node.annotation.annotation)


def attribute_annotations(owner: ModuleSummaries, cls: str, attr: str) -> list[cst.BaseExpression]:
    """Every annotation class `cls` (or a same-file base) gives `self.<attr>`: `attr: T` in the
    class body, `self.attr: T = ...` in a method."""
    found: list[cst.BaseExpression] = []
    seen: set[str] = set()
    todo = [cls]
    while todo:
        name = todo.pop()
        node = owner.classes.get(name) if name not in seen else None
        seen.add(name)
        if node is None or not isinstance(node.body, cst.IndentedBlock):
            continue
        for stmt in node.body.body:
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.AnnAssign) and dotted_name(small.target) == attr:
                        found.append(small.annotation.annotation)
            elif isinstance(stmt, cst.FunctionDef):
                visitor = _SelfAnnotations(stmt, attr)
                stmt.visit(visitor)
                found += visitor.found
        todo += [b for b in owner._bases(name) if b in owner.classes]
    return found


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


_WORD = re.compile(rb"[A-Za-z_]\w*")
_CLASS_HEAD = re.compile(rb"[ \t]+\w+[ \t]*\(")


def _class_base_words(data: bytes) -> set[bytes]:
    """Every identifier written inside the base list of a `class X(...)` statement of `data`."""
    words: set[bytes] = set()
    at = data.find(b"class ")
    while at >= 0:
        line = data.rfind(b"\n", 0, at) + 1
        head = _CLASS_HEAD.match(data, at + 5) if not data[line:at].strip(b" \t") else None
        if head is not None:
            depth, i = 1, head.end()
            while depth:  # to the parenthesis that closes the base list
                close = data.find(b")", i)
                if close < 0:
                    i = len(data)
                    break
                opened = data.find(b"(", i, close)
                depth, i = (depth + 1, opened + 1) if opened >= 0 else (depth - 1, close + 1)
            words.update(_WORD.findall(data, head.end(), i))
        at = data.find(b"class ", at + 6)
    return words


def _words_before(data: bytes, marker: bytes) -> set[bytes]:
    """The identifier right before each `marker` in `data`: ` as ` (`import Base as B`: a base may
    be written `B`), `.register(` (`Base.register(Other)`: a virtual subclass)."""
    words: set[bytes] = set()
    at = data.find(marker)
    while at >= 0:
        start = at
        while start > 0 and (data[start - 1 : start].isalnum() or data[start - 1] == 95):
            start -= 1
        if start < at:
            words.add(data[start:at])
        at = data.find(marker, at + len(marker))
    return words


def _tree_files(tree: Path) -> tuple[tuple[Path, int, int], ...] | None:
    """(file, size, mtime) of every `.py` file below `tree`, in a fixed order; None for more than
    MAX_TREE_FILES."""
    found: list[tuple[Path, int, int]] = []
    for folder, dirs, files in os.walk(tree):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            file = Path(folder) / name
            try:
                stat = file.stat()
            except OSError:
                continue
            found.append((file, stat.st_size, stat.st_mtime_ns))
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


def _tree_index(tree: Path) -> dict[bytes, list[Path]] | None:
    """identifier -> the files of `tree` that name it in a class's base list, before an `as` or
    before `.register(` (a file that may define a subclass of a class of that name). One pass over
    the tree's text, kept per process; None for a tree of more than MAX_TREE_FILES files."""
    if tree in _indexes:
        return _indexes[tree][1]
    files = _tree_files(tree)
    index: dict[bytes, list[Path]] | None = None if files is None else {}
    for file, size, _mtime in files or ():
        if size > packages.MAX_FILE_BYTES:
            continue  # packages.py reads no such file either: a class there is never resolved
        try:
            data = file.read_bytes()
        except OSError:
            continue
        for word in _class_base_words(data) | _words_before(data, b" as ") | _words_before(data, b".register("):
            index.setdefault(word, []).append(file)  # type: ignore[union-attr]
    _indexes[tree] = (files, index)
    return index


def _class_statements(path: Path) -> _FileClasses | None:
    """Every `class` statement of `path` (at any depth), its `X.register(...)` calls and its
    import aliases; cached by path, size and mtime. None when it does not parse."""
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _statements:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
            _statements[key] = None
            return None
        top = {id(s) for s in _module_level(tree.body)}
        found = _FileClasses()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                found.aliases.update({a.asname: a.name for a in node.names if a.asname})
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register"
                and (receiver := packages.ast_dotted(node.func.value)) is not None
            ):
                found.registers.add(receiver.split(".")[-1])  # `Base.register(Other)`: an ABC's virtual subclass
            elif isinstance(node, ast.ClassDef):
                bases: list[str] = []
                odd: set[str] = set()
                for base in node.bases:
                    plain = base.value if isinstance(base, ast.Subscript) else base  # Generic[T], Base[T]
                    named = packages.ast_dotted(plain)
                    if named is not None:
                        bases.append(named)
                    else:
                        odd |= {n.id for n in ast.walk(base) if isinstance(n, ast.Name)}
                        odd |= {n.attr for n in ast.walk(base) if isinstance(n, ast.Attribute)}
                found.classes.append(_ClassStatement(node.name, bases, odd, id(node) in top))
        _statements[key] = found
    return _statements[key]


def _module_level(body: list) -> list:
    out = []
    for stmt in body:
        if isinstance(stmt, (ast.If, ast.Try)):
            out += _module_level(stmt.body) + _module_level(stmt.orelse)
        else:
            out.append(stmt)
    return out


def _same(a: Target, b: Target) -> bool:
    return a[1] == b[1] and (a[0] is b[0] or (a[0].path is not None and a[0].path == b[0].path))


class Incomplete(Exception):
    """The subclass search cannot be complete (its message says why)."""


def subclasses(base: Target) -> Iterator[Target]:
    """`base`, then every class msrewrite finds that derives from it, found lazily (a caller that
    stops early reads no more); raises Incomplete when the search cannot be complete. See the
    module docstring for where it looks."""
    module, name = base
    tree = package_tree(module.path)
    if tree is None or module.path is None:
        raise Incomplete(f"{name} is not defined in a file")
    node = module.classes.get(name)
    if node is not None and any((dotted_name(b.value) or "").split(".")[-1] == "Protocol" for b in node.bases):
        raise Incomplete(f"{name} is a Protocol (a class need not derive from it to match it)")
    yield base
    if tree not in module._reading.checked_trees:
        module._reading.checked_trees.add(tree)
        refresh(tree)
    found: list[Target] = [base]
    key = (tree, module.path.resolve(), name)
    pairs = _in_tree[key] if key in _in_tree else _search_tree(tree, key[1], name)
    for file, cls in pairs:
        reader = _reader(module, file)
        hit = reader.find_class(cls) if reader is not None else None
        if hit is None:
            raise Incomplete(f"{file} is past the reading bounds")
        found.append(hit)
        yield hit
    # classes of the file analysed and of modules read outside the package
    outside = [m for m in _read_modules(module) if m.path is None or not m.path.resolve().is_relative_to(tree)]
    todo = list(found)
    while todo:
        parent = todo.pop(0)
        for other in outside:
            for cls_name, parents in other._all_bases().items():
                if any(_may_name(other, b, parent[1]) and _same_hit(other, b, parent) for b in parents):
                    child = (other, cls_name)
                    if not any(_same(child, f) for f in found):
                        found.append(child)
                        todo.append(child)
                        yield child
        if len(found) > MAX_SUBCLASSES:
            raise Incomplete(f"{name} has more than {MAX_SUBCLASSES} subclasses")


def _search_tree(tree: Path, file: Path, name: str) -> Iterator[tuple[Path, str]]:
    """The (file, class) pairs of `tree` that derive from class `name` of `file`, through each
    other, found lazily; kept per process once all are found. Raises Incomplete when the search
    cannot be complete. Bases are resolved through a reading of their own (the analysis' reading
    bounds are for what it summarizes)."""
    from msrewrite.analyze.summaries import ModuleSummaries

    index = _tree_index(tree)
    if index is None:
        raise Incomplete(f"the package {tree} has more than {MAX_TREE_FILES} files")
    resolver = ModuleSummaries(cst.Module(body=[]), path=tree / "__msrewrite_subclass_search__.py")
    resolver._reading.bytes_read = -SEARCH_BYTES  # a budget of its own
    base = resolver._read(file, package=True)
    if base is None:
        raise Incomplete(f"{file} cannot be read")
    found: list[tuple[Path, str]] = []
    todo: list[Target] = [(base, name)]
    while todo:
        parent = todo.pop(0)
        for hit_file in index.get(parent[1].encode(), []):
            before = len(found)
            why = _subclasses_in(resolver, hit_file, parent, found, todo)
            yield from found[before:]
            if why:
                raise Incomplete(why)
        if len(found) > MAX_SUBCLASSES:
            raise Incomplete(f"{name} has more than {MAX_SUBCLASSES} subclasses")
    _in_tree[(tree, file, name)] = tuple(found)


def _subclasses_in(
    resolver: ModuleSummaries, file: Path, parent: Target, found: list[tuple[Path, str]], todo: list[Target]
) -> str:
    """Adds the classes of `file` that derive from `parent` to `found` (and `todo`, to search for
    theirs); returns why the search cannot be complete, or ""."""
    statements = _class_statements(file)
    if statements is None:
        return ""  # does not parse: Python could not import it either
    if parent[1] in statements.registers:
        return f"{file.name} registers a virtual subclass of {parent[1]} (`.register(...)`)"
    reader = None
    for stmt in statements.classes:
        if parent[1] in stmt.odd:
            return f"{file.name}: class {stmt.name} has a base msrewrite cannot name"
        named = [b for b in stmt.bases if b.split(".")[-1] == parent[1] or statements.aliases.get(b) == parent[1]]
        if not named:
            continue
        if not stmt.top:
            return f"{file.name}: class {stmt.name} is defined inside a function or class"
        reader = reader or resolver._read(file, package=True)
        if reader is None:
            return f"{file} cannot be read"
        for base_name in named:
            hit = reader.find_class(base_name)
            if hit is None:
                return f"{file.name}: the base {base_name} of {stmt.name} is not found"
            if _same(hit, parent):
                if (
                    sum(s.top and s.name == stmt.name for s in statements.classes) > 1
                    or stmt.name not in reader.classes
                ):
                    return f"{file.name} defines {stmt.name} more than once"
                pair = (file.resolve(), stmt.name)
                if pair not in found:
                    found.append(pair)
                    todo.append((reader, stmt.name))
                break
    return ""


def _same_hit(module: ModuleSummaries, base: str, parent: Target) -> bool:
    hit = module.find_class(base)
    return hit is not None and _same(hit, parent)


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
    if root is not None and root.path is not None and root.path.resolve() == file:
        return root
    # read as the file analysed would read one of its imports: found by the search, not through
    # the chain of imports that led to the base (whose depth would bound what it can resolve)
    return (root or module)._read(file, package=True)


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
):
    """The effect of `call` on `self.<attr>` (`rest`: the method called on it, or "" for the
    object itself) when `attr` holds `value` whose class no source names, but a declaration
    (declared_bases) says it derives from a base: the union, over the base and every subclass
    of it the search finds, of calling an instance of that class. None when nothing declares a
    base. A union that cannot be complete is the unknown callee it was before, saying why."""
    from msrewrite.analyze.summaries import _union as union_effects
    from msrewrite.analyze.summaries import _unknown
    from msrewrite.analyze.torch_effects import CallEffect

    declared = declared_bases(owner, cls, attr, value, home)
    if declared is None:
        return None
    bases, where = declared
    method = rest or "forward"
    effects = []
    for base in bases:
        count = 0
        try:
            for module, name in subclasses(base):
                effect = module._instance_call(call, (module, name), label, name, rest)
                if rest:  # the method's own labels say `self.<rest>`: name the class it runs in
                    _relabel(effect, f"self.{rest}", f"{label} ({name}.{rest})")
                effects.append(effect)
                count += 1
                if effect.unknown:
                    # "may write" already, through a callee not seen into: the other classes are not
                    # read (a union of every quantization method would read most of the framework)
                    why = f"the rest of its subclasses not read after {name}.{method}"
                    raise Incomplete(why)
        except Incomplete as stop:
            effects.append(
                _unknown(call, f"{label} (an instance of {base[1]}, by {where}; {stop}; not visible to msrewrite)")
            )
            continue
        subs = count - 1
        tree = package_tree(base[0].path)
        note = (
            f"{label} (an instance of {base[1]}, by {where}: its {method} is the union over {base[1]} and its "
            f"{subs} subclass{'' if subs == 1 else 'es'} in package {tree.name if tree else '?'}; a subclass "
            "defined outside it is not seen)"
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
