"""CLI conventions: one-line usage errors, --version, docs/commands.md = --help, 80-column tables, progress
and fallback said aloud, and a start-up that imports only what the command needs."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import pytest

import msrewrite.cli  # noqa: F401  (registers the commands)
from helpers import EXAMPLES, ROOT, run_cli, run_main
from msrewrite import __version__
from msrewrite.cliargs import COMMANDS, params


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("msrewrite: error: "), result.stderr
    return lines[0]


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize(
    "args, message",
    [
        (["apply", "--bogus", "x.py"], "unrecognized arguments: --bogus"),
        (["apply"], "the following arguments are required: FILE"),
        (["apply", "--case", "moe-shared-expert", "--candidate", "one", "x.py"], "invalid int value: 'one'"),
        (["apply", "x.py", "--stream-tag"], "--stream-tag: expected one argument"),
        (["suggest", "--jobs", "x", "a.py"], "invalid int value"),
        (["verify", "--atol", "tiny", "a.py"], "invalid float value"),
        (["cases", "extra"], "unrecognized arguments: extra"),
        (["frobnicate"], "no such command 'frobnicate'"),
    ],
)
def test_usage_errors_are_one_line(args, message):
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in _one_error_line(result)
    assert "╭" not in result.stderr and "Usage:" not in result.stderr
    assert result.stdout == ""


def test_every_command_builds_a_parser():
    """Options of a type cliargs does not parse fail here, not in a user's hands."""
    from msrewrite.cliargs import parser_for

    for name, func in COMMANDS.items():
        parser_for(name, func)


def _argparse_result(name, func, argv):
    from msrewrite.cliargs import UsageError, parser_for

    try:  # the parser for argv, as cliargs.parse builds it (a case's own options only with its --case)
        return vars(parser_for(name, func, argv).parse_intermixed_args(argv))
    except UsageError:
        return "usage error"


def test_plain_command_lines_parse_as_argparse_parses_them():
    """cliargs reads a plain command line without argparse; on generated command lines (valid
    and not) it must give argparse's answer whenever it answers at all, and leave the rest, every
    error included, to argparse."""
    from msrewrite.cliargs import _plain_parse

    rng = random.Random(12)
    values = ["x", "3", "0", "-5", "2.5", "-", "", "a b", "k=v", "--", "8/16,16/32", "env:FLAG", "dir/f.py"]
    answered = 0
    for name, func in COMMANDS.items():
        decls = [d for _n, _k, spec in params(func) for d in spec.decls]
        words = [*decls, *(d.split("/")[1] for d in decls if "/" in d), *(d.split("/")[0] for d in decls if "/" in d)]
        for _ in range(400):
            argv = []
            for _ in range(rng.randrange(0, 7)):
                pick = rng.random()
                if pick < 0.5 and words:
                    argv.append(rng.choice(words))
                    if rng.random() < 0.8:
                        argv.append(rng.choice(values))
                elif pick < 0.8:
                    argv.append(rng.choice(["model.py", "other.py", "p.json"]))
                elif pick < 0.9:
                    argv.append(rng.choice(["--bogus", "-z", "--case=x", "-iq", "--", "--cas"]))
                else:
                    argv.append(rng.choice(values))
            plain = _plain_parse(func, argv)
            if plain is not None:
                answered += 1
                assert plain == _argparse_result(name, func, argv), (name, argv)
    assert answered > 250  # it does read most plain command lines (an empty value is argparse's error)
    for argv in (
        ["--case", "moe-shared-expert", "m.py"],
        ["m.py", "-i", "--mode", "eager", "--anchor", "h", "--anchor", "g"],
    ):
        assert _plain_parse(COMMANDS["apply"], argv) == _argparse_result("apply", COMMANDS["apply"], argv)
        assert _plain_parse(COMMANDS["apply"], argv) is not None
    argv = ["--static", "a.py", "b.py", "-j", "2"]
    assert (
        _plain_parse(COMMANDS["suggest"], argv)
        == _argparse_result("suggest", COMMANDS["suggest"], argv)
        != "usage error"
    )


@pytest.mark.slow  # starts a process
def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout == f"msrewrite {__version__}\n"


@pytest.mark.slow  # starts a process
def test_help_stays_rich_and_lists_everything():
    top = run_cli("--help")
    assert top.returncode == 0
    for name in ("apply", "suggest", "verify", "cases", "--version"):
        assert name in top.stdout
    assert run_cli().stdout == top.stdout  # no arguments: the same help
    apply = run_cli("apply", "--help")
    assert apply.returncode == 0 and "╭─ Options" in apply.stdout
    for _name, _kind, spec in params(COMMANDS["apply"]):
        for decl in spec.decls:
            if decl.startswith("--"):
                assert decl in apply.stdout, decl


# docs/commands.md = --help ------------------------------------------------------------------------
def _documented_commands() -> str:
    return (ROOT / "docs" / "commands.md").read_text()


def _options_in(text: str) -> set[str]:
    found = set()
    for span in re.findall(r"`([^`]+)`", text):
        found |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+|-[a-z](?![\w-]))", span))
    return found


def _declared(command: str) -> set[str]:
    # "--train/--no-train" declares two options
    return {part for _n, _k, spec in params(COMMANDS[command]) for decl in spec.decls for part in decl.split("/")}


@pytest.mark.parametrize("command", ["apply", "suggest", "verify", "profile", "bench"])
def test_docs_document_exactly_the_options_of_each_command(command):
    section = _documented_commands()
    start = section.index(f"`{command}` options:")
    nxt = re.search(r"\n`\w+` options:|\nDiff paths", section[start + 1 :])
    block = section[start : start + 1 + nxt.start()] if nxt else section[start:]
    documented = _options_in(block)
    declared = _declared(command)
    assert documented == declared, (
        f"in docs/commands.md, not in --help: {sorted(documented - declared)}; "
        f"in --help, not in docs/commands.md: {sorted(declared - documented)}"
    )


def test_docs_name_no_option_that_does_not_exist():
    every = set().union(*(_declared(c) for c in COMMANDS)) | {"--version", "--help"}
    assert _options_in(_documented_commands()) <= every


# Tables fit 80 columns ------------------------------------------------------------------------
@pytest.mark.slow  # starts a process
def test_cases_fits_80_columns():
    result = run_cli("cases")
    assert result.returncode == 0
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


@pytest.mark.slow  # starts a process
def test_suggest_table_fits_80_columns():
    files = [str(p) for p in sorted(EXAMPLES.glob("*.py"))]
    result = run_cli("suggest", "--static", *files)
    assert result.returncode == 0, result.stderr
    table = [line for line in result.stdout.splitlines() if not line.startswith("best: ")]
    assert len(table) > 10 and max(len(line) for line in table) <= 80


def test_fit_table_shrinks_in_order_and_marks_cuts():
    from msrewrite.commands.suggest import fit_table

    header = ["#", "function", "side"]
    rows = [["1", "VeryLongClassName.forward", "1,2,3,4,5,6,7,8,9,10,11,12"]]
    lines = fit_table(header, rows, shrink={2: 6, 1: 10}, width=30)
    assert all(len(line) <= 30 for line in lines)
    assert lines[1].endswith("…") and "VeryLongClassName.forward"[:8] in lines[1]
    assert (
        fit_table(header, rows, shrink={2: 6}, width=200)[1]
        == "1  VeryLongClassName.forward  1,2,3,4,5,6,7,8,9,10,11,12"
    )


# Progress and fallback said aloud --------------------------------------------------------------
def test_progress_only_on_a_terminal_and_not_with_quiet(monkeypatch, capsys):
    from msrewrite.commands import suggest

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    say = suggest._progress(quiet=False)
    say("tracing")
    say("costs")
    assert capsys.readouterr().err == "msrewrite: [1] tracing\nmsrewrite: [2] costs\n"
    assert suggest._progress(quiet=True) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert suggest._progress(quiet=False) is None


UNTRACEABLE = """import torch


class Block(torch.nn.Module):
    def __init__(self, hidden, experts):
        super().__init__()
        self.shared_experts = torch.nn.Linear(hidden, hidden)
        self.experts = torch.nn.Linear(hidden, hidden)
        self.gate = torch.nn.Linear(hidden, experts)

    def forward(self, x):
        residual = x
        g = self.gate(x)
        y = self.experts(x) * g.sum()
        return y + self.shared_experts(residual)
"""


@pytest.mark.slow  # the CLI with a traced suggest (fork server)
def test_traced_suggest_says_it_fell_back_to_static(tmp_path):
    model = tmp_path / "block.py"
    model.write_text(UNTRACEABLE)
    result = run_main("suggest", str(model))  # no config class, no harness: the trace cannot start
    assert result.returncode == 0, result.stderr
    assert "trace failed" in result.stderr and "fell back to the static tier" in result.stderr
    quiet = run_main("suggest", "--quiet", "--json", str(model))
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert json.loads(quiet.stdout)["candidates"]


# Start-up: each command imports only what it needs ----------------------------------------------
HEAVY = ("typer", "rich", "pydantic", "torch", "networkx", "multiprocessing", "email")


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize(
    "args",
    [
        ["cases"],
        ["apply", "--case", "moe-shared-expert", str(EXAMPLES / "deepseek_moe.py")],
        ["suggest", "--static", str(EXAMPLES / "deepseek_moe.py"), str(EXAMPLES / "hunyuan_moe.py")],
        ["apply", "--bogus"],
    ],
)
def test_commands_do_not_import_heavy_packages(args):
    code = (
        "import io, sys, contextlib\n"
        f"sys.argv = ['msrewrite', *{args!r}]\n"
        "from msrewrite.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n"
        "        main()\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


# The networkx stand-in -------------------------------------------------------------------------
def test_digraph_matches_networkx_on_random_dags():
    nx = pytest.importorskip("networkx")
    from msrewrite.analyze import digraph

    rng = random.Random(12)
    for _ in range(60):
        n = rng.randint(1, 14)
        order = list(range(n))
        rng.shuffle(order)  # node insertion order is not topological
        edges = [(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.3]
        ours, theirs = digraph.DiGraph(), nx.DiGraph()
        for g in (ours, theirs):
            g.add_nodes_from(order)
            for a, b in edges:
                g.add_edge(a, b, kind="data")
        assert list(ours.nodes) == list(theirs.nodes) and list(ours.edges) == list(theirs.edges)
        assert ours.edges(data=True) == list(theirs.edges(data=True))
        for node in order:
            assert digraph.descendants(ours, node) == nx.descendants(theirs, node)
            assert digraph.ancestors(ours, node) == nx.ancestors(theirs, node)
            assert list(ours.predecessors(node)) == list(theirs.predecessors(node))
            assert ours.in_degree(node) == theirs.in_degree(node)
        assert list(digraph.transitive_reduction(ours).edges) == list(nx.transitive_reduction(theirs).edges)
        assert digraph.descendants(theirs, order[0]) == nx.descendants(theirs, order[0])  # accepts networkx too
    cyclic = digraph.DiGraph([(0, 1), (1, 0)])
    with pytest.raises(ValueError):
        digraph.transitive_reduction(cyclic)
