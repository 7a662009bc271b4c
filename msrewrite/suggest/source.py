"""Parse only what the trace ran: the classes whose forwards executed, the rest stubbed out.

libcst parses about 4k lines/s and its PositionProvider costs as much again, so the traced tier
does not hand the whole modeling file to the dataflow analysis: classes and top-level functions
that no traced module runs are replaced by a one-line stub (`class Name: pass`) and blank lines.
Line numbers, top-level names (imports, assignments, class names) and the analysis of every kept
function are unchanged: calls still resolve through the summaries of the whole file (one plain
parse, no positions), as they do for apply. Stdlib `ast` finds the spans (about 6x faster than
libcst).
"""

from __future__ import annotations

import ast
from pathlib import Path

import libcst as cst

from msrewrite.analyze.stmtgraph import ModuleInfo, analyze_file, analyze_source
from msrewrite.errors import BadInput


def analyze_kept(path: Path, keep: set[str]) -> ModuleInfo:
    """ModuleInfo of `path` with only the top-level classes/functions named in `keep` analyzed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return analyze_file(path)  # let the full analysis raise its own error
    pruned = prune(text, tree, keep)
    if pruned == text:
        return analyze_source(text, Path(path))
    try:  # calls resolve through the whole file's summaries, as they do for apply
        whole = cst.parse_module(text)
    except cst.ParserSyntaxError:
        return analyze_file(path)
    return analyze_source(pruned, Path(path), whole)


def prune(text: str, tree: ast.Module, keep: set[str]) -> str:
    lines = text.splitlines(keepends=True)
    for node in tree.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in keep:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = node.end_lineno or node.lineno
        stub = f"class {node.name}: pass\n" if isinstance(node, ast.ClassDef) else f"def {node.name}(): pass\n"
        for line in range(start, end + 1):
            lines[line - 1] = "\n"
        lines[start - 1] = stub
    return "".join(lines)


def traced_roots(trace, model_file: Path) -> set[str]:
    """Top-level names (class or function) holding the forward of some module the trace ran."""
    from msrewrite.suggest.graph import forward_qualname

    wanted = str(Path(model_file).resolve())
    roots: set[str] = set()
    files: dict[str, bool] = {}
    for module in trace.modules.values():
        where = forward_qualname(module)
        if where is None:
            continue
        same = files.get(where[1])
        if same is None:
            same = files[where[1]] = str(Path(where[1]).resolve()) == wanted
        if same:
            roots.add(where[0].split(".")[0])
    return roots


__all__ = ["BadInput", "analyze_kept", "prune", "traced_roots"]
