"""Module-level additions of an edit: the `_ms_*` helper functions (once, after the imports) and
the imports they and the emitted code need.

The imports are inserted by hand, not with libcst's `AddImportsVisitor`: that visitor is a
metadata-dependent codemod, so it costs a `MetadataWrapper` (a copy of the module) and a visit
of the whole file per apply (tests/test_startup_budget.py counts those), and it places and merges
imports by its own rules (after the last top-level import, `import os` among them) where the
goldens pin ours (a stdlib import first, taking over the file's leading comments). Checked
on examples/deepseek_moe.py: AddImportsVisitor adds `import os` after
`from torch import nn`, golden/moe-shared-expert/eager/deepseek_moe.py has it before
`import torch`; using it would change every golden that adds an import.
"""

from __future__ import annotations

import libcst as cst

from msrewrite.analyze.outline import imports_module, is_import, top_level_bindings
from msrewrite.emit import helpers as helper_text
from msrewrite.emit.strategies import Emission
from msrewrite.emit.templates import code_of, comment, leading_lines, strip_leading
from msrewrite.emit.torchair_config import record_torchair_config
from msrewrite.errors import BadInput
from msrewrite.plan import HELPER_PREFIX


def _is_future(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(
        isinstance(s, cst.ImportFrom) and code_of(s.module or cst.Name("")) == "__future__" for s in stmt.body
    )


def _from_import_of(stmt: cst.BaseStatement, module: str) -> bool:
    """A one-line `from <module> import a, b` (no parentheses, no star) that a name can join."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
        return False
    imp = stmt.body[0]
    return (
        isinstance(imp, cst.ImportFrom)
        and not imp.relative
        and imp.module is not None
        and code_of(imp.module) == module
        and not isinstance(imp.names, cst.ImportStar)
        and imp.lpar is None
        and stmt.trailing_whitespace.comment is None
    )


def _wanted(emissions: list[Emission]):
    """(helper keys, guarded imports, stdlib modules, (module, name) framework imports), each in
    first-asked order without repeats."""
    keys: list[str] = []
    imports: list[str] = []
    stdlib: list[str] = []
    from_imports: list[tuple[str, str]] = []
    for em in emissions:
        from_imports += [i for i in em.from_imports if i not in from_imports]
        keys += [k for k in em.helpers if k not in keys]
        imports += [i for i in em.imports if i not in imports]
        stdlib += [name for name in (["os"] if em.needs_os else []) + em.stdlib if name not in stdlib]
    return keys, imports, stdlib, from_imports


def add_helpers(module: cst.Module, emissions: list[Emission], mode: str) -> cst.Module:
    keys, imports, stdlib, from_imports = _wanted(emissions)
    if "_ms_torchair_config" in keys:
        module = record_torchair_config(module)
    bound = top_level_bindings(module)
    _check_own_helpers(module, keys, bound, mode)
    missing = [k for k in helper_text.FUNCTIONS if k in keys and helper_text.defined_name(k) not in bound]
    parts = [helper_text.GUARDED_IMPORTS[imp] for imp in imports if imp not in bound]
    if any(k.startswith("_ms_side_stream") for k in missing) and "_MS_SIDE_STREAMS" not in bound:
        parts.append(helper_text.STREAM_CACHE)
    if missing:
        parts.append(helper_text.helper_source(missing))
    body: list[cst.BaseStatement] = [*module.body]
    if parts:
        _insert_helpers(module, body, parts, mode)
    # the framework's own names, imported as its model files do, after the file's last import
    for mod, name in from_imports:
        if name not in bound:
            _add_from_import(body, mod, name)
    for name in sorted(stdlib, reverse=True):  # each lands first: the final order is sorted
        if name not in bound and not imports_module(module, name):
            _add_stdlib_import(body, name)
    return module.with_changes(body=body)


def _check_own_helpers(module: cst.Module, keys: list[str], bound: set[str], mode: str) -> None:
    """A helper the file already defines must be ours for this mode, word for word."""
    for key in keys:
        name = helper_text.defined_name(key)
        if name in bound and key in helper_text.FUNCTIONS:
            existing = next(s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == name)
            if code_of(strip_leading(existing)).strip() != helper_text.FUNCTIONS[key].strip():
                raise BadInput(
                    f"the file already has {name}() for another execution mode; "
                    f"msrewrite never mixes API families in one file (asked for {mode})"
                )


def _insert_helpers(module: cst.Module, body: list[cst.BaseStatement], parts: list[str], mode: str) -> None:
    """The helper block after the file's helpers, else after its imports (before its first def or
    class), one blank line between its statements and two around functions."""
    helpers = "\n\n".join(p.rstrip("\n") + "\n" for p in parts)
    # in the file's own line endings: a multi-line docstring keeps its newlines as written
    block = list(cst.parse_module(helpers.replace("\n", module.default_newline)).body)
    block = [
        s.with_changes(leading_lines=[cst.EmptyLine()] * (2 if isinstance(s, cst.FunctionDef) else 1)) if i else s
        for i, s in enumerate(block)
    ]
    existing_helper = [
        i for i, s in enumerate(body) if isinstance(s, cst.FunctionDef) and s.name.value.startswith(HELPER_PREFIX)
    ]
    if existing_helper:
        at = existing_helper[-1] + 1
        block[0] = block[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    else:
        at = 0
        for i, stmt in enumerate(body):
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                break
            if is_import(stmt):
                at = i + 1
        block[0] = block[0].with_changes(
            leading_lines=[
                cst.EmptyLine(),
                comment(f"msrewrite: multi-stream helpers ({mode} mode). With the flag off, or without"),
                comment("the backend, each one falls back to the original single-stream behaviour."),
            ]
        )
    if at < len(body):
        following = body[at]
        blank = sum(1 for line in leading_lines(following) if line.comment is None and not line.whitespace.value)
        if blank < 2 and isinstance(block[-1], cst.FunctionDef):
            lead = [cst.EmptyLine()] * (2 - blank) + list(leading_lines(following))
            body[at] = following.with_changes(leading_lines=lead)
    body[at:at] = block


def _add_from_import(body: list[cst.BaseStatement], mod: str, name: str) -> None:
    same = next((i for i, s in enumerate(body) if _from_import_of(s, mod)), None)
    if same is not None:  # `from M import a` becomes `from M import a, name`
        line = body[same]
        assert isinstance(line, cst.SimpleStatementLine)  # _from_import_of
        imp = line.body[0]
        assert isinstance(imp, cst.ImportFrom) and not isinstance(imp.names, cst.ImportStar)
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        names = [*imp.names[:-1], imp.names[-1].with_changes(comma=comma), cst.ImportAlias(cst.Name(name))]
        body[same] = line.with_changes(body=[imp.with_changes(names=names)])
        return
    plain = [i for i, s in enumerate(body) if isinstance(s, cst.SimpleStatementLine) and is_import(s)]
    at = plain[-1] + 1 if plain else 0
    body.insert(at, cst.parse_statement(f"from {mod} import {name}\n"))


def _add_stdlib_import(body: list[cst.BaseStatement], name: str) -> None:
    at = next((i for i, s in enumerate(body) if is_import(s) and not _is_future(s)), None)
    new_import = cst.parse_statement(f"import {name}\n")
    if at is None:
        at = next((i + 1 for i, s in enumerate(body) if _is_future(s)), 0)
        body.insert(at, new_import)
    else:
        # take over the first import's leading comments/blank lines so they stay on top
        first = body[at]
        body[at] = strip_leading(first)
        body.insert(at, new_import.with_changes(leading_lines=leading_lines(first)))
