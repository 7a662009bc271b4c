"""Bad input, end to end through the console entry point: for `apply`, `suggest` and `verify`.

Every row must give exactly one `msrewrite: error: ...` line on stderr (other stderr lines are
`msrewrite: ` notes), no traceback, nothing on stdout, the documented exit code (2 bad input,
1 nothing to do) and leave every file in its folder byte-identical, with no file added.

The rows run concurrently in a module fixture (each in its own folder); the parametrized tests
only check the results. Rows marked xfail are real msrewrite bugs found by this suite.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import EXAMPLES, ROOT, run_cli

CASE = ("--case", "moe-shared-expert")

# Fakes os.access for the paths in MSREWRITE_TEST_READONLY: as root, permission bits are ignored,
# so a read-only file would be writable; the real check in apply must see it as read-only.
SITECUSTOMIZE = """
import os
_ro = [p for p in os.environ.get("MSREWRITE_TEST_READONLY", "").split(os.pathsep) if p]
if _ro:
    _real = os.access
    def _access(path, mode, *args, **kwargs):
        if os.path.abspath(os.fspath(path)) in _ro and mode & os.W_OK:
            return False
        return _real(path, mode, *args, **kwargs)
    os.access = _access
"""


@dataclass(frozen=True)
class Row:
    id: str
    args: tuple[str, ...]  # {name} is replaced by the path of that file in the row's folder
    code: int
    message: str
    xfail: str | None = None
    readonly: str | None = None  # a file to make read-only (chmod and faked os.access)


def _plan(path: Path) -> dict:
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    plans = plans_for_case(path, load(path).module, "moe-shared-expert", "eager", None,
                           FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"), None)
    return plans[0].to_dict()


def make_files(folder: Path) -> None:
    """The same inputs in every row's folder."""
    good = folder / "good.py"
    shutil.copy(EXAMPLES / "deepseek_moe.py", good)
    shutil.copy(ROOT / "golden" / "moe-shared-expert" / "cuda" / "deepseek_moe.py", folder / "applied.py")
    (folder / "syntax.py").write_text("def broken(:\n    pass\n")
    (folder / "latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")
    (folder / "empty.py").write_bytes(b"")
    (folder / "binary.py").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00")
    (folder / "adir").mkdir()
    (folder / "plain.py").write_text("import torch\n\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n        return x\n")
    (folder / "nooverlap.py").write_text(
        "class M:\n    def forward(self, x):\n        s = self.shared_experts(x)\n        return x + s\n")
    (folder / "two.py").write_text(
        good.read_text()
        + "\n\nclass OtherMoE(DeepseekMoE):\n"
        "    def forward(self, x):\n"
        "        y = self.shared_experts(x)\n"
        "        z = self.experts(x, *self.gate(x)[1:][::-1])\n"
        "        return z + y\n"
    )
    (folder / "notjson.json").write_text("{candidates: [")
    (folder / "malformed.json").write_text(json.dumps({"candidates": [{"plan": {"function": 3}}]}))
    plan = _PLAN
    (folder / "future.json").write_text(json.dumps({"candidates": [{"plan": {**plan, "version": 99}}]}))
    (folder / "stale.json").write_text(json.dumps({"candidates": [{"plan": {**plan, "join_line": 9999}}]}))
    (folder / "ok.json").write_text(json.dumps({"candidates": [{"plan": plan}]}))


_PLAN = _plan(EXAMPLES / "deepseek_moe.py")

ROWS = [
    # apply: the file itself
    Row("apply-syntax-error", ("apply", *CASE, "{syntax.py}"), 2, "syntax error"),
    Row("apply-not-utf8", ("apply", *CASE, "{latin1.py}"), 2, "not UTF-8"),
    Row("apply-empty", ("apply", *CASE, "{empty.py}"), 1, "empty file, nothing to do"),
    Row("apply-binary", ("apply", *CASE, "{binary.py}"), 2, "binary file"),
    Row("apply-directory", ("apply", *CASE, "{adir}"), 2, "is a directory"),
    Row("apply-missing", ("apply", *CASE, "{missing.py}"), 2, "no such file"),
    # apply: what it is asked to do
    Row("apply-unknown-case", ("apply", "--case", "no-such-case", "{good.py}"), 2, "unknown case"),
    Row("apply-ambiguous-target", ("apply", *CASE, "{two.py}"), 2, "ambiguous target"),
    Row("apply-no-target", ("apply", *CASE, "{plain.py}"), 1, "no moe-shared-expert target"),
    Row("apply-target-not-found", ("apply", *CASE, "--target", "Nope.forward", "{good.py}"), 2, "no such function"),
    Row("apply-nothing-to-overlap", ("apply", *CASE, "{nooverlap.py}"), 1, "nothing to overlap"),
    Row("apply-already-applied", ("apply", *CASE, "{applied.py}"), 1, "already applied"),
    Row("apply-already-applied-in-place", ("apply", *CASE, "-i", "{applied.py}"), 1, "already applied"),
    Row("apply-read-only-in-place", ("apply", *CASE, "--in-place", "{good.py}"), 2, "read-only", readonly="good.py"),
    # apply: options
    Row("apply-in-place-and-output", ("apply", *CASE, "-i", "-o", "{patches}", "{good.py}"), 2, "conflict"),
    Row("apply-case-and-plan", ("apply", *CASE, "--plan", "{ok.json}", "{good.py}"), 2, "exactly one of --case or --plan"),
    Row("apply-neither-case-nor-plan", ("apply", "{good.py}"), 2, "exactly one of --case or --plan"),
    Row("apply-candidate-without-plan", ("apply", *CASE, "--candidate", "1", "{good.py}"), 2, "--candidate needs --plan"),
    Row("apply-unknown-mode", ("apply", *CASE, "--mode", "tpu", "{good.py}"), 2, "unknown mode"),
    Row("apply-bad-flag", ("apply", *CASE, "--flag", "yaml:x", "{good.py}"), 2, "env:NAME or attr:NAME"),
    Row("apply-bad-flag-name", ("apply", *CASE, "--flag", "attr:1x", "{good.py}"), 2, "not a valid identifier"),
    Row("apply-bad-flag-default", ("apply", *CASE, "--flag-default", "maybe", "{good.py}"), 2, "on or off"),
    Row("apply-bad-max-tokens", ("apply", *CASE, "--max-tokens", "0", "{good.py}"), 2, "positive token count"),
    Row("apply-start-after-not-ge", ("apply", *CASE, "--start-after", "x", "{good.py}"), 2, "ge-graph start gate"),
    Row("apply-output-is-a-file", ("apply", *CASE, "-o", "{plain.py}", "{good.py}"), 2, "not a folder"),
    Row("apply-output-under-a-file", ("apply", *CASE, "-o", "{plain.py}/patches", "{good.py}"), 2, "plain.py"),
    # apply --plan
    Row("apply-plan-not-json", ("apply", "--plan", "{notjson.json}", "{good.py}"), 2, "notjson.json"),
    Row("apply-plan-not-utf8", ("apply", "--plan", "{latin1.py}", "{good.py}"), 2, "not UTF-8"),
    Row("apply-plan-malformed", ("apply", "--plan", "{malformed.json}", "{good.py}"), 2, "malformed plan"),
    Row("apply-plan-future-version", ("apply", "--plan", "{future.json}", "{good.py}"), 2, "not supported"),
    Row("apply-plan-stale", ("apply", "--plan", "{stale.json}", "{good.py}"), 2, "stale plan"),
    Row("apply-plan-candidate-out-of-range", ("apply", "--plan", "{ok.json}", "--candidate", "2", "{good.py}"), 2,
        "has 1 candidate"),
    Row("apply-plan-missing", ("apply", "--plan", "{missing.json}", "{good.py}"), 2, "no such file"),
    # suggest
    Row("suggest-syntax-error", ("suggest", "--static", "{syntax.py}"), 2, "syntax error"),
    Row("suggest-traced-syntax-error", ("suggest", "{syntax.py}"), 2, "syntax error"),
    Row("suggest-not-utf8", ("suggest", "--static", "{latin1.py}"), 2, "latin1.py"),
    Row("suggest-empty", ("suggest", "--static", "{empty.py}"), 1, "empty file, nothing to do"),
    Row("suggest-binary", ("suggest", "--static", "{binary.py}"), 2, "binary file"),
    Row("suggest-directory", ("suggest", "--static", "{adir}"), 2, "adir"),
    Row("suggest-missing", ("suggest", "--static", "{missing.py}"), 2, "no such file"),
    Row("suggest-missing-extra-file", ("suggest", "--static", "{good.py}", "{missing.py}"), 2, "no such file"),
    Row("suggest-unknown-device", ("suggest", "--static", "--device", "tpu", "{good.py}"), 2, "unknown device"),
    Row("suggest-bad-phase", ("suggest", "--static", "--phase", "x", "{good.py}"), 2, "--phase"),
    Row("suggest-bad-input-shape", ("suggest", "--input-shape", "1,a", "{good.py}"), 2, "--input-shape"),
    Row("suggest-report-is-a-file", ("suggest", "--static", "--report", "{plain.py}", "{good.py}"), 2, "plain.py"),
    # verify (each run imports torch, ~2 s: only the file kinds and the verify-specific refusals)
    Row("verify-syntax-error", ("verify", "--mode", "cuda", "--flag", "env:X", "{syntax.py}"), 2, "SyntaxError"),
    Row("verify-not-utf8", ("verify", "{latin1.py}"), 2, "not UTF-8"),
    Row("verify-empty", ("verify", "{empty.py}"), 2, "empty file"),
    Row("verify-binary", ("verify", "{binary.py}"), 2, "binary file"),
    Row("verify-directory", ("verify", "{adir}"), 2, "is a directory"),
    Row("verify-missing", ("verify", "{missing.py}"), 2, "no such file"),
    Row("verify-not-an-edit", ("verify", "{good.py}"), 2, "no msrewrite multi-stream edit found"),
    Row("verify-original-missing", ("verify", "{applied.py}", "--original", "{missing.py}"), 2, "no such file"),
    Row("verify-harness-no-function", ("verify", "{applied.py}", "--harness", "{good.py}:nomake"), 2, "no function nomake"),
]


def _fill(arg: str, folder: Path) -> str:
    out = arg
    while "{" in out:
        start, end = out.index("{"), out.index("}")
        out = out[:start] + str(folder / out[start + 1:end]) + out[end + 1:]
    return out


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under folder -> sha256 of its bytes (folders map to "dir")."""
    return {
        p.relative_to(folder).as_posix(): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def run(row: Row):
        folder = tmp_path_factory.mktemp(row.id)
        make_files(folder)
        env = dict(os.environ)
        if row.readonly:
            target = folder / row.readonly
            target.chmod(0o444)
            env["MSREWRITE_TEST_READONLY"] = str(target)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        before = snapshot(folder)
        result = run_cli(*[_fill(a, folder) for a in row.args], cwd=folder, env=env)
        return result, before, snapshot(folder)

    with ThreadPoolExecutor(max_workers=max(2, min(8, 2 * (os.cpu_count() or 1)))) as pool:
        return dict(zip((r.id for r in ROWS), pool.map(run, ROWS)))


def _param(row: Row):
    marks = [pytest.mark.xfail(strict=True, reason=row.xfail)] if row.xfail else []
    return pytest.param(row, id=row.id, marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_bad_input(outcomes, row):
    result, before, after = outcomes[row.id]
    where = f"msrewrite {' '.join(row.args)}\nexit {result.returncode}\nstdout: {result.stdout[-500:]!r}\nstderr: {result.stderr[-1500:]}"
    assert "Traceback" not in result.stderr, where
    assert result.returncode == row.code, where
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("msrewrite: error: ")]
    assert len(errors) == 1, where
    assert row.message in errors[0], where
    assert all(line.startswith("msrewrite: ") for line in lines), where
    assert result.stdout == "", where
    assert after == before, "files changed, added or removed:\n" + where


def test_every_command_and_kind_is_covered():
    """The suite's promise: at least ten kinds for apply, and the relevant ones for suggest and verify."""
    by_command: dict[str, set[str]] = {}
    for row in ROWS:
        by_command.setdefault(row.args[0], set()).add(row.id.split("-", 1)[1])
    assert len(by_command["apply"]) >= 10
    for kind in ("syntax-error", "not-utf8", "empty", "binary", "directory", "missing"):
        for command in ("apply", "suggest", "verify"):
            assert kind in by_command[command], (command, kind)
    assert {"unknown-case", "ambiguous-target", "target-not-found", "read-only-in-place", "already-applied",
            "in-place-and-output"} <= by_command["apply"]
