"""Start-up regression guards that do not time anything (issue #12): the passes `apply` makes
over the whole file, and the modules it imports. A change that adds a whole-file walk, parse
or render, or an import apply does not need, fails here; one that removes one lowers a budget.
Timed figures are bench/startup.py's (`--instructions` for a count machine load does not move)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import EXAMPLES, ROOT

# Counts whole-file passes in a fresh process (caches keyed by the text start empty, as in a run).
# A module counts as the file when it has at least as many statements as the parsed file.
COUNTER = r"""
import ast, builtins, collections, contextlib, io, json, sys
import libcst as cst
import libcst._parser.entrypoints as entrypoints
from msrewrite.analyze import walk as walk_module

path = sys.argv[1]
text = open(path, encoding="utf-8").read()
statements = len(cst.parse_module(text).body)
counts = collections.Counter()


def whole(module):
    return isinstance(module, cst.Module) and len(module.body) >= statements


visit = cst.Module.visit
def module_visit(self, visitor):
    if whole(self):
        counts["libcst visit of the module"] += 1
    return visit(self, visitor)
cst.Module.visit = module_visit

walker = walk_module._walker
def counted_walker(visitor, plan):
    inner = walker(visitor, plan)
    if inner is None:
        return None
    def run(node, leave_it=True):
        if whole(node) and leave_it:  # leave_it=False: under Module.visit, counted there
            counts["walk of the module"] += 1
        return inner(node, leave_it)
    return run
walk_module._walker = counted_walker

code_for_node = cst.Module.code_for_node  # Module.code renders through it
def module_code_for_node(self, node):
    if whole(node):
        counts["render of the module"] += 1
    return code_for_node(self, node)
cst.Module.code_for_node = module_code_for_node

parse = entrypoints._parse
def libcst_parse(entrypoint, source, config, **kwargs):
    if len(source) >= len(text) // 2:
        counts["libcst parse of the file"] += 1
    return parse(entrypoint, source, config, **kwargs)
entrypoints._parse = libcst_parse

ast_walk = ast.walk
def counted_ast_walk(node):
    if isinstance(node, ast.Module):
        counts["ast.walk of the module"] += 1
    return ast_walk(node)
ast.walk = counted_ast_walk

compile_ = builtins.compile
def counted_compile(source, *args, **kwargs):
    if isinstance(source, str) and len(source) >= len(text) // 2:
        flags = args[2] if len(args) > 2 else kwargs.get("flags", 0)
        counts["ast parse of the file" if flags & ast.PyCF_ONLY_AST else "compile of the file"] += 1
    return compile_(source, *args, **kwargs)
builtins.compile = counted_compile

sys.argv = ["msrewrite", *sys.argv[2:], path]
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        from msrewrite.cli import main
        main()
except SystemExit as exc:
    code_ = exc.code
print(json.dumps({"exit": code_, "diff": out.getvalue().startswith("---"), "counts": counts}))
"""

# What `apply --case moe-shared-expert` on a model file may do to the whole file: parse it once
# with libcst and once with ast (the cheap pre-filters), visit it once to swap the edited
# functions in, render the edit once and compile it once. The analysis itself reads only the
# functions it analyses.
APPLY_BUDGET = {
    "libcst parse of the file": 1,
    "ast parse of the file": 1,
    "libcst visit of the module": 1,
    "render of the module": 1,
    "compile of the file": 1,
}


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("example", ["deepseek_moe", "guarded_moe"])
def test_apply_reads_the_whole_file_a_fixed_number_of_times(example):
    done = subprocess.run(
        [sys.executable, "-c", COUNTER, str(EXAMPLES / f"{example}.py"), "apply", "--case", "moe-shared-expert"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exit"] == 0 and result["diff"], result
    assert result["counts"] == APPLY_BUDGET, (
        "whole-file passes changed; a new one costs every apply about what a parse or render costs. "
        f"Got {result['counts']}, budget {APPLY_BUDGET} (lower the budget if you removed one)"
    )


# Modules `apply --case moe-shared-expert` must not import: the other commands' machinery,
# other cases' analyses, and standard modules it has no use for on this path (libcst itself
# imports json, tokenize, subprocess, signal and inspect, so those are not listed).
NOT_FOR_APPLY = (
    "msrewrite.verify",
    "msrewrite.harness",
    "msrewrite.suggest",
    "msrewrite.sanitizer",
    "msrewrite.profile",
    "msrewrite.plancheck",
    "msrewrite.cores",
    "msrewrite.analyze.effects",
    "msrewrite.analyze.stmtgraph",
    "msrewrite.emit.microbatch",
    "msrewrite.emit.inline",
    "msrewrite.emit.markers",
    "msrewrite.emit.schedules",
    "msrewrite.cases.kvcache_offload",
    "msrewrite.cases.prefill_microbatch",
    "msrewrite.codemods",
    "msrewrite.output.inplace",
    "msrewrite.output.patch",
    "sysconfig",
    "tempfile",
    "hashlib",
    "shutil",
    "unicodedata",
    "argparse",
    "gettext",
)


@pytest.mark.slow  # starts a process
def test_apply_imports_only_what_it_uses():
    code = (
        "import io, sys, contextlib\n"
        f"sys.argv = ['msrewrite', 'apply', '--case', 'moe-shared-expert', {str(EXAMPLES / 'deepseek_moe.py')!r}]\n"
        "from msrewrite.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n"
        "        main()\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted(m for m in sys.modules if m in {NOT_FOR_APPLY!r}))\n"
        # a dataclass compiles its methods when its module is imported; a record (msrewrite/records.py) does not
        "import dataclasses\n"
        "print(sorted(f'{name}.{v.__qualname__}' for name, m in list(sys.modules.items()) if name.startswith('msrewrite')"
        " for v in vars(m).values() if isinstance(v, type) and v.__module__ == name and dataclasses.is_dataclass(v)"
        " and '__record_spec__' not in vars(v)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    imported, dataclasses_made = done.stdout.strip().splitlines()
    assert imported == "[]", imported
    assert dataclasses_made == "[]", f"dataclasses on apply's path (make them records): {dataclasses_made}"


@pytest.mark.slow  # runs verify
def test_verify_parses_the_unedited_file_once(monkeypatch):
    """Finding the plans again and the late and interleaved variants all start from the original."""
    import torch

    import msrewrite.load
    from msrewrite.emit import schedules
    from msrewrite.verify import verify_files

    original = EXAMPLES / "deepseek_moe.py"
    text = original.read_text()
    parses = []
    parse_source = msrewrite.load.parse_source

    def counted(path, source, *args, **kwargs):
        if source == text:
            parses.append(path)
        return parse_source(path, source, *args, **kwargs)

    monkeypatch.setattr(msrewrite.load, "parse_source", counted)
    monkeypatch.setattr(schedules, "_recent_parses", [])
    schedules._derive.cache_clear()
    schedules._variant.cache_clear()
    golden = ROOT / "golden" / "moe-shared-expert" / "eager" / "deepseek_moe.py"
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    result = verify_files(golden, original=original, inputs=0, train=False)
    assert result.ok and result.schedules == ["early", "late", "interleaved"], (result.problems, result.schedules)
    assert len(parses) == 1, parses
    # torch.manual_seed queues a seed, with the whole stack, for CUDA and each other device not
    # initialized: verify seeds the CPU generator itself (harness.manual_seed); the calls left
    # are the example's own make(), run for the original and again for each model verify
    # rebuilds from the edited file (so that what make() sets up reaches it too)
    assert seeded and set(seeded) == {0}, seeded
