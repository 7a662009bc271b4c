"""Bad input, end to end through the console entry point: for `apply`, `suggest` and `verify`.

Every row must give exactly one `msrewrite: error: ...` line on stderr (other stderr lines are
`msrewrite: ` notes), no traceback, nothing on stdout, the documented exit code (2 bad input,
1 nothing to do) and leave every file in its folder byte-identical, with no file added.

Most rows run in this process through the CLI's `main` (each in its own folder, about 0.1 s); a
row with `proc` runs the real console entry point in a subprocess because it needs what only a
process has: a FIFO that could hang, a file-size limit, stdout on /dev/full or closed, a terminal
encoding. A row's `xfail` is an expected, strict failure with its reason: the two rows that
expect Python 3.12 syntax to be refused are xfail on 3.12 and later, which compiles it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import EXAMPLES, ROOT, main_in_process, runs_user_code, snapshot

CASE = ("--case", "moe-shared-expert")


@dataclass(frozen=True)
class Row:
    id: str
    args: tuple[str, ...]  # {name} is replaced by the path of that file in the row's folder
    code: int
    message: str
    xfail: str | None = None
    readonly: str | None = None  # a file to make read-only (chmod and faked os.access: we may be root)
    proc: str | None = None  # run in a subprocess: "plain", "fsize", "devfull", "closed" or "ascii"
    stdout_ok: bool = False  # output printed before the failure is allowed (suggest prints, then writes)


def _plan(path: Path) -> dict:
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    plans = plans_for_case(
        path,
        load(path).module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )
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
    shutil.copy(good, folder / "mödel.py")
    (folder / "plain.py").write_text(
        "import torch\n\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
    )
    (folder / "nooverlap.py").write_text(
        "class M:\n    def forward(self, x):\n        s = self.shared_experts(x)\n        return x + s\n"
    )
    (folder / "two.py").write_text(
        good.read_text() + "\n\nclass OtherMoE(DeepseekMoE):\n"
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
    # content: nesting and size
    (folder / "chain500.py").write_text("x = " + " + ".join(["a"] * 500) + "\n")
    (folder / "chain20k.py").write_text("x = " + " + ".join(["a"] * 20000) + "\n")
    (folder / "wrapped_chain.py").write_text(
        "x = (\n" + "".join("    + a\n" for _ in range(800)).replace("+", " ", 1) + ")\n"
    )
    (folder / "brackets5000.py").write_text("x = " + "(" * 5000 + "1" + ")" * 5000 + "\n")
    (folder / "lists190.py").write_text("x = " + "[" * 190 + "]" * 190 + "\n")
    (folder / "calls300.py").write_text("x = " + "f(" * 300 + "1" + ")" * 300 + "\n")
    (folder / "only_bom.py").write_bytes(b"\xef\xbb\xbf\n\n")
    (folder / "whitespace.py").write_text("  \n\t\n\n")
    (folder / "utf16.py").write_bytes("x = 1\n".encode("utf-16"))
    (folder / "surrogate.py").write_bytes(b"x = '\xed\xa0\x80'\n")
    (folder / "truncated_utf8.py").write_bytes(b"x = 1  # \xe2\x82")
    (folder / "nul_in_middle.py").write_bytes(good.read_bytes().replace(b"import torch", b"import\x00torch", 1))
    (folder / "lone_cr_end.py").write_bytes(good.read_bytes() + b"x = 1\r")
    (folder / "py312.py").write_text(good.read_text() + "\n\ntype Vector = list[float]\n")
    (folder / "generic312.py").write_text(good.read_text() + "\n\ndef first[T](xs: list[T]) -> T:\n    return xs[0]\n")
    (folder / "adir.py").mkdir()
    # paths and filesystem
    os.mkfifo(folder / "fifo.py")
    os.mkfifo(folder / "fifo.json")
    os.symlink(folder / "nowhere.py", folder / "dangling.py")
    os.symlink("/dev/zero", folder / "zero.py")
    (folder / "oldseries").mkdir()
    (folder / "oldseries" / "0001-old-change.patch").write_text("old\n")
    (folder / "dirseries").mkdir()
    (folder / "dirseries" / "0001-a-folder.patch").mkdir()
    (folder / "reports").mkdir()
    (folder / "reports" / "good-decode.md").mkdir()
    # git state: what a checkout can hand over instead of a model
    text = good.read_text()
    (folder / "conflict.py").write_text(
        text.replace(
            "        residuals = hidden_states\n",
            "<<<<<<< HEAD\n        residuals = hidden_states\n=======\n        residuals = x\n>>>>>>> theirs\n",
            1,
        )
    )
    (folder / "lfs_pointer.py").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 12345\n"
    )
    (folder / "submodule").mkdir()
    (folder / "submodule" / ".git").write_text("gitdir: ../.git/modules/submodule\n")
    (folder / "a_patch.py").write_text("--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n")
    (folder / "tabs.py").write_text(
        text.replace("        residuals = hidden_states\n", "        residuals = hidden_states\n\t\tunused = 0\n", 1)
    )
    (folder / "indent101.py").write_text(
        text
        + "\n\ndef deep(x):\n"
        + "".join("    " * (i + 1) + "if x:\n" for i in range(101))
        + "    " * 102
        + "pass\n"
    )
    (folder / "cookie_latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + good.read_bytes())
    (folder / "cookie_ascii_mismatch.py").write_bytes(b"# -*- coding: ascii -*-\n# caf\xe9\n" + good.read_bytes())
    (folder / "cookie_utf8_mismatch.py").write_bytes(b"# coding: utf-8\n# caf\xe9\n" + good.read_bytes())
    (folder / "cookie_unknown.py").write_bytes(b"# vim: set fileencoding=klingon :\n" + good.read_bytes())
    (folder / "cookie_bom_conflict.py").write_bytes(b"\xef\xbb\xbf# coding: latin-1\n" + good.read_bytes())
    (folder / "comments.py").write_text("# nothing but a comment\n")
    # harness and user code
    (folder / "exiting_harness.py").write_text("import sys\n\ndef make():\n    sys.exit(3)\n")
    (folder / "raising_harness.py").write_text("def make():\n    raise RuntimeError('no weights here')\n")
    (folder / "bad_return_harness.py").write_text("def make():\n    return 42\n")
    (folder / "import_error_harness.py").write_text("import no_such_module_xyz\n\ndef make():\n    pass\n")
    # a class that defines forward twice: only the second (the one Python keeps) runs
    (folder / "dead_forward.py").write_text(DEAD_FORWARD)
    # profiler traces whose msrewrite marker events are all unusable
    for name, change in (
        ("marker_ts_text.json", {"ts": "soon"}),
        ("marker_negative_dur.json", {"dur": -8}),
        ("marker_tid_text.json", {"tid": "stream seven"}),
    ):
        (folder / name).write_text(json.dumps(trace_with_markers(change, host_too=True)))


_PLAN = _plan(EXAMPLES / "deepseek_moe.py")

_BLOCK = """import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.gate(x)
        r = self.experts(h)
        return r + s

    def forward(self, x):
{second}

def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""
# the first forward has a shared expert to overlap, the second (the one that runs) has none
DEAD_FORWARD = _BLOCK.format(second="        return self.experts(self.gate(x))\n")
# both have one: the edit must go to the second
TWO_FORWARDS = _BLOCK.format(
    second="        s = self.shared_experts(x)\n        h = self.gate(x)\n        r = self.experts(h)\n        return r + s + 1\n"
)


def trace_with_markers(change: dict, host_too: bool) -> dict:
    """tests/fixtures/profile/torch_on.json with `change` made to each device-side msrewrite marker
    event (and to the host-side ones with `host_too`)."""
    data = json.loads((ROOT / "tests" / "fixtures" / "profile" / "torch_on.json").read_text())
    cats = ("gpu_user_annotation", "user_annotation") if host_too else ("gpu_user_annotation",)
    for event in data["traceEvents"]:
        if str(event.get("name", "")).startswith("msrewrite:") and event.get("cat") in cats:
            event.update(change)
    return data


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
    Row(
        "apply-case-and-plan",
        ("apply", *CASE, "--plan", "{ok.json}", "{good.py}"),
        2,
        "exactly one of --case or --plan",
    ),
    Row("apply-neither-case-nor-plan", ("apply", "{good.py}"), 2, "exactly one of --case or --plan"),
    Row(
        "apply-candidate-without-plan", ("apply", *CASE, "--candidate", "1", "{good.py}"), 2, "--candidate needs --plan"
    ),
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
    Row(
        "apply-plan-candidate-out-of-range",
        ("apply", "--plan", "{ok.json}", "--candidate", "2", "{good.py}"),
        2,
        "has 1 candidate",
    ),
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
    Row(
        "verify-harness-no-function",
        ("verify", "{applied.py}", "--harness", "{good.py}:nomake"),
        2,
        "no function nomake",
    ),
]


BIG = str(20 * 1024 * 1024)  # over the 16 MiB default

ROWS += [
    # content: sizes, nesting, encodings and syntax the running Python cannot take
    Row("apply-chain-500-terms", ("apply", *CASE, "{chain500.py}"), 2, "nested 502 levels deep"),
    Row("apply-chain-20000-terms", ("apply", *CASE, "{chain20k.py}"), 2, "chain20k.py"),
    Row("apply-wrapped-chain-800-lines", ("apply", *CASE, "{wrapped_chain.py}"), 2, "levels deep"),
    Row("apply-brackets-5000-deep", ("apply", *CASE, "{brackets5000.py}"), 2, "too many nested parentheses"),
    Row("apply-lists-190-deep", ("apply", *CASE, "{lists190.py}"), 2, "levels deep"),
    Row("apply-calls-300-deep", ("apply", *CASE, "{calls300.py}"), 2, "too many nested parentheses"),
    Row("apply-over-max-bytes", ("apply", *CASE, "--max-bytes", "100", "{good.py}"), 2, "over the --max-bytes limit"),
    Row("apply-max-bytes-zero", ("apply", *CASE, "--max-bytes", "0", "{good.py}"), 2, "positive byte count"),
    Row("apply-only-bom", ("apply", *CASE, "{only_bom.py}"), 1, "empty file, nothing to do"),
    Row("apply-whitespace-only", ("apply", *CASE, "{whitespace.py}"), 1, "empty file, nothing to do"),
    Row("apply-utf16", ("apply", *CASE, "{utf16.py}"), 2, "binary file"),
    Row("apply-utf8-surrogate", ("apply", *CASE, "{surrogate.py}"), 2, "not UTF-8"),
    Row("apply-truncated-utf8", ("apply", *CASE, "{truncated_utf8.py}"), 2, "not UTF-8"),
    Row("apply-nul-in-source", ("apply", *CASE, "{nul_in_middle.py}"), 2, "binary file"),
    Row("apply-lone-cr-at-end", ("apply", *CASE, "{lone_cr_end.py}"), 2, "lone CR"),
    Row(
        "apply-py312-type-statement",
        ("apply", *CASE, "{py312.py}"),
        2,
        "needs Python 3.12",
        xfail=None if sys.version_info < (3, 12) else "3.12 compiles it",
    ),
    Row(
        "apply-py312-generic-function",
        ("apply", *CASE, "{generic312.py}"),
        2,
        "needs Python 3.12",
        xfail=None if sys.version_info < (3, 12) else "3.12 compiles it",
    ),
    Row(
        "apply-plan-over-max-bytes",
        ("apply", "--plan", "{ok.json}", "--max-bytes", "10", "{good.py}"),
        2,
        "over the --max-bytes limit",
    ),
    Row("suggest-chain-500-terms", ("suggest", "--static", "{chain500.py}"), 2, "levels deep"),
    Row("suggest-brackets-5000-deep", ("suggest", "--static", "{brackets5000.py}"), 2, "too many nested parentheses"),
    Row("suggest-over-max-bytes", ("suggest", "--static", "--max-bytes", "100", "{good.py}"), 2, "--max-bytes"),
    Row("suggest-utf16", ("suggest", "--static", "{utf16.py}"), 2, "binary file"),
    Row("verify-chain-500-terms", ("verify", "{chain500.py}"), 2, "levels deep"),
    Row("verify-over-max-bytes", ("verify", "--max-bytes", "100", "{applied.py}"), 2, "--max-bytes"),
    # paths and filesystem
    Row("apply-fifo", ("apply", *CASE, "{fifo.py}"), 2, "is a FIFO", proc="plain"),
    Row("apply-plan-fifo", ("apply", "--plan", "{fifo.json}", "{good.py}"), 2, "is a FIFO", proc="plain"),
    Row("suggest-fifo", ("suggest", "--static", "{fifo.py}"), 2, "is a FIFO", proc="plain"),
    Row("verify-fifo", ("verify", "{fifo.py}"), 2, "is a FIFO", proc="plain"),
    Row("apply-dev-zero", ("apply", *CASE, "/dev/zero"), 2, "is a device"),
    Row("apply-dev-null", ("apply", *CASE, "/dev/null"), 2, "is a device"),
    Row("apply-symlink-to-dev-zero", ("apply", *CASE, "{zero.py}"), 2, "is a device"),
    Row("apply-dangling-symlink", ("apply", *CASE, "-i", "{dangling.py}"), 2, "no such file"),
    Row("apply-directory-named-py", ("apply", *CASE, "{adir.py}"), 2, "is a directory"),
    Row("suggest-dev-zero", ("suggest", "--static", "/dev/zero"), 2, "is a device"),
    Row("verify-dev-zero", ("verify", "/dev/zero"), 2, "is a device"),
    Row("apply-output-holds-a-series", ("apply", *CASE, "-o", "{oldseries}", "{good.py}"), 2, "--force"),
    Row("apply-output-holds-a-patch-folder", ("apply", *CASE, "-o", "{dirseries}", "{good.py}"), 2, "--force"),
    Row("apply-force-without-output", ("apply", *CASE, "--force", "{good.py}"), 2, "--force is for -o"),
    Row(
        "apply-output-unwritable",
        ("apply", *CASE, "-o", "/proc/msrewrite-test/patches", "{good.py}"),
        2,
        "cannot write the patches",
    ),
    Row(
        "apply-output-file-size-limit",
        ("apply", *CASE, "-o", "{patches}", "{good.py}"),
        2,
        "File too large",
        proc="fsize",
    ),
    Row("apply-in-place-file-size-limit", ("apply", *CASE, "-i", "{good.py}"), 2, "File too large", proc="fsize"),
    Row("apply-stdout-full", ("apply", *CASE, "{good.py}"), 2, "No space left on device", proc="devfull"),
    Row("apply-stdout-closed", ("apply", *CASE, "{good.py}"), 2, "standard output is closed", proc="closed"),
    Row("suggest-stdout-full", ("suggest", "--static", "{good.py}"), 2, "No space left on device", proc="devfull"),
    Row("suggest-stdout-closed", ("suggest", "--static", "{good.py}"), 2, "standard output is closed", proc="closed"),
    Row("cases-stdout-full", ("cases",), 2, "No space left on device", proc="devfull"),
    Row("suggest-ascii-terminal", ("suggest", "--static", "{mödel.py}"), 2, "terminal's encoding", proc="ascii"),
    Row(
        "suggest-report-unwritable",
        ("suggest", "--static", "--report", "/proc/msrewrite-test/r", "{good.py}"),
        2,
        "--report",
    ),
    Row(
        "suggest-report-file-is-a-folder",
        ("suggest", "--static", "--report", "{reports}", "{good.py}"),
        2,
        "good-decode.md",
        stdout_ok=True,
    ),
    # signals and concurrency (the races themselves: test_writes.py)
    Row(
        "apply-in-place-verify-fails-first",
        ("apply", *CASE, "-i", "--verify", "--harness", "{good.py}:nomake", "{good.py}"),
        2,
        "no function nomake",
    ),
    Row(
        "apply-output-verify-fails-first",
        ("apply", *CASE, "-o", "{patches}", "--verify", "--harness", "{good.py}:nomake", "{good.py}"),
        2,
        "no function nomake",
    ),
    # harness and user code
    Row(
        "apply-verify-harness-missing",
        ("apply", *CASE, "--verify", "--harness", "{missing.py}:make", "{good.py}"),
        2,
        "missing.py",
    ),
    Row(
        "apply-verify-harness-raises",
        ("apply", *CASE, "-i", "--verify", "--harness", "{raising_harness.py}:make", "{good.py}"),
        2,
        "no weights here",
    ),
    Row(
        "apply-verify-harness-bad-return",
        ("apply", *CASE, "-i", "--verify", "--harness", "{bad_return_harness.py}:make", "{good.py}"),
        2,
        "bad_return_harness",
    ),
    Row(
        "apply-verify-harness-import-error",
        ("apply", *CASE, "--verify", "--harness", "{import_error_harness.py}:make", "{good.py}"),
        2,
        "no_such_module_xyz",
    ),
    Row(
        "verify-harness-raises",
        ("verify", "{applied.py}", "--harness", "{raising_harness.py}:make"),
        2,
        "no weights here",
    ),
    Row(
        "apply-verify-harness-exits",
        ("apply", *CASE, "-i", "--verify", "--harness", "{exiting_harness.py}:make", "{good.py}"),
        2,
        "exiting_harness",
    ),
    # git state and what a checkout may hand over
    Row("apply-merge-conflict-markers", ("apply", *CASE, "{conflict.py}"), 2, "syntax error"),
    Row("apply-git-lfs-pointer", ("apply", *CASE, "{lfs_pointer.py}"), 2, "syntax error"),
    Row("apply-submodule-folder", ("apply", *CASE, "{submodule}"), 2, "is a directory"),
    Row("apply-a-patch-not-a-model", ("apply", *CASE, "{a_patch.py}"), 2, "syntax error"),
    Row("suggest-merge-conflict-markers", ("suggest", "--static", "{conflict.py}"), 2, "syntax error"),
    # content Python itself refuses
    Row("apply-tabs-and-spaces-mixed", ("apply", *CASE, "{tabs.py}"), 2, "tabs and spaces"),
    Row("apply-101-indentation-levels", ("apply", *CASE, "{indent101.py}"), 2, "indentation levels"),
    # coding cookies (PEP 263): honoured, so only bytes that contradict them are bad input
    Row(
        "apply-coding-cookie-mismatch",
        ("apply", *CASE, "{cookie_ascii_mismatch.py}"),
        2,
        "not ascii, as its coding cookie says",
    ),
    Row("apply-coding-cookie-utf8-mismatch", ("apply", *CASE, "{cookie_utf8_mismatch.py}"), 2, "not UTF-8"),
    Row("apply-coding-cookie-unknown", ("apply", *CASE, "{cookie_unknown.py}"), 2, "unknown encoding: klingon"),
    Row(
        "apply-coding-cookie-contradicts-bom",
        ("apply", *CASE, "{cookie_bom_conflict.py}"),
        2,
        "UTF-8 BOM, but its coding cookie",
    ),
    Row(
        "apply-coding-cookie-latin1-output-series",
        ("apply", *CASE, "-o", "{patches}", "{cookie_latin1.py}"),
        2,
        "patch files are UTF-8",
    ),
    Row(
        "apply-in-place-coding-cookie-mismatch",
        ("apply", *CASE, "-i", "{cookie_ascii_mismatch.py}"),
        2,
        "coding cookie says",
    ),
    Row(
        "suggest-coding-cookie-mismatch", ("suggest", "--static", "{cookie_ascii_mismatch.py}"), 2, "coding cookie says"
    ),
    Row("suggest-coding-cookie-unknown", ("suggest", "--static", "{cookie_unknown.py}"), 2, "unknown encoding"),
    Row("verify-coding-cookie-mismatch", ("verify", "{cookie_ascii_mismatch.py}"), 2, "coding cookie says"),
    # options added for the progress display
    Row("apply-quiet-takes-no-value", ("apply", *CASE, "--quiet=yes", "{good.py}"), 2, "--quiet"),
    Row("verify-quiet-takes-no-value", ("verify", "--quiet=1", "{applied.py}"), 2, "--quiet"),
    Row("apply-comments-only", ("apply", *CASE, "{comments.py}"), 1, "no moe-shared-expert target"),
    # a dead definition is never the target: the forward Python keeps has nothing to overlap
    Row("apply-dead-duplicate-forward", ("apply", *CASE, "{dead_forward.py}"), 1, "no moe-shared-expert target"),
    Row(
        "apply-dead-duplicate-forward-target",
        ("apply", *CASE, "--target", "Block.forward", "{dead_forward.py}"),
        1,
        "Block.forward",
    ),
    # a trailing slash names a folder: never the file without it
    Row("apply-trailing-slash-on-a-file", ("apply", *CASE, "{good.py}/"), 2, "good.py/: not a directory"),
    Row("suggest-trailing-slash-on-a-file", ("suggest", "--static", "{good.py}/"), 2, "not a directory"),
    Row("verify-trailing-slash-on-a-file", ("verify", "{applied.py}/"), 2, "not a directory"),
    Row(
        "apply-output-trailing-slash-on-a-file",
        ("apply", *CASE, "-o", "{plain.py}/", "{good.py}"),
        2,
        "not a directory",
    ),
    # an empty value never falls back to the option's default
    Row("apply-empty-flag", ("apply", *CASE, "--flag", "", "{good.py}"), 2, "--flag: an empty value"),
    Row("apply-empty-flag-equals", ("apply", *CASE, "--flag=", "{good.py}"), 2, "--flag: an empty value"),
    Row("verify-empty-flag", ("verify", "--flag", "", "{applied.py}"), 2, "--flag: an empty value"),
    Row("apply-empty-stream-tag", ("apply", *CASE, "--stream-tag", "", "{good.py}"), 2, "--stream-tag: an empty"),
    Row("apply-empty-target", ("apply", *CASE, "--target", "", "{good.py}"), 2, "--target: an empty value"),
    Row("verify-empty-target", ("verify", "--target", "", "{applied.py}"), 2, "--target: an empty value"),
    Row("suggest-empty-target", ("suggest", "--target", "", "{good.py}"), 2, "--target: an empty value"),
    Row(
        "apply-empty-anchor",
        ("apply", "--case", "moe-shared-expert-phased", "--anchor", "", "{good.py}"),
        2,
        "--anchor: an empty value",
    ),
    Row("apply-empty-start-after", ("apply", *CASE, "--start-after", "", "{good.py}"), 2, "--start-after: an empty"),
    Row("apply-empty-harness", ("apply", *CASE, "--verify", "--harness", "", "{good.py}"), 2, "--harness: an empty"),
    Row("verify-empty-harness", ("verify", "--harness", "", "{applied.py}"), 2, "--harness: an empty value"),
    Row("apply-empty-output", ("apply", *CASE, "-o", "", "{good.py}"), 2, "--output: an empty value"),
    Row("apply-empty-plan", ("apply", "--plan", "", "{good.py}"), 2, "--plan: an empty value"),
    Row("apply-empty-source-path", ("apply", *CASE, "--source-path", "", "{good.py}"), 2, "--source-path: an empty"),
    Row("apply-empty-file", ("apply", *CASE, ""), 2, "FILE: an empty value"),
    Row("suggest-empty-report", ("suggest", "--static", "--report", "", "{good.py}"), 2, "--report: an empty value"),
    Row("verify-empty-original", ("verify", "--original", "", "{applied.py}"), 2, "--original: an empty value"),
    Row("profile-empty-edit", ("profile", "--edit", "", "{marker_ts_text.json}"), 2, "--edit: an empty value"),
    # a trace whose only marker events cannot be placed: one line, with how many and why
    Row(
        "profile-marker-ts-not-a-number",
        ("profile", "{marker_ts_text.json}"),
        2,
        "16 msrewrite marker events (16 with a ts that is not a number)",
    ),
    Row("profile-marker-negative-dur", ("profile", "{marker_negative_dur.json}"), 2, "(16 with a negative dur)"),
    Row(
        "profile-marker-tid-not-an-integer",
        ("profile", "{marker_tid_text.json}"),
        2,
        "with a tid that is not an integer",
    ),
    Row(
        "profile-json-marker-negative-dur",
        ("profile", "--json", "{marker_negative_dur.json}"),
        2,
        "no usable marker event",
    ),
]


def _fill(arg: str, folder: Path) -> str:
    out = arg
    while "{" in out:
        start, end = out.index("{"), out.index("}")
        out = out[:start] + str(folder / out[start + 1 : end]) + out[end + 1 :]
    return out


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def run_in_process(args: list[str], cwd: Path) -> Outcome:
    """The CLI's main() in this process, with its own argv, cwd, stdout and stderr."""
    result = main_in_process(*args, cwd=cwd)
    return Outcome(result.returncode, result.stdout, result.stderr)


def run_in_subprocess(row: Row, args: list[str], cwd: Path) -> Outcome:
    env = dict(os.environ)
    stdout = subprocess.PIPE
    preexec = None
    if row.proc == "ascii":
        env["PYTHONIOENCODING"] = "ascii"
    elif row.proc == "fsize":

        def preexec():  # the patches and the rewritten file are each over 4 KiB
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    elif row.proc == "devfull":
        stdout = open("/dev/full", "w")
    elif row.proc == "closed":

        def preexec():
            os.close(1)

    try:
        result = subprocess.run(
            [sys.executable, "-m", "msrewrite", *args],
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            preexec_fn=preexec,
        )
    finally:
        if stdout is not subprocess.PIPE:
            stdout.close()
    return Outcome(result.returncode, result.stdout or "", result.stderr)


def run_row(row: Row, folder: Path, monkeypatch) -> tuple[Outcome, dict, dict]:
    folder.mkdir()
    make_files(folder)
    if row.readonly:
        target = folder / row.readonly
        target.chmod(0o444)
        real_access = os.access

        def access(path, mode, *args, **kwargs):
            if os.path.abspath(os.fspath(path)) == str(target) and mode & os.W_OK:
                return False
            return real_access(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)
    before = snapshot(folder)
    args = [_fill(a, folder) for a in row.args]
    result = run_in_subprocess(row, args, folder) if row.proc else run_in_process(args, folder)
    return result, before, snapshot(folder)


def _param(row: Row):
    marks = [pytest.mark.xfail(strict=True, reason=row.xfail)] if row.xfail else []
    if row.proc or runs_user_code(row.args) or "-o" in row.args:
        # a subprocess, a fork for user code, or git (format-patch series): the slow layer
        marks.append(pytest.mark.slow)
    return pytest.param(row, id=row.id, marks=marks)


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_bad_input(row, tmp_path, monkeypatch):
    result, before, after = run_row(row, tmp_path / "row", monkeypatch)
    where = f"msrewrite {' '.join(row.args)}\nexit {result.returncode}\nstdout: {result.stdout[-500:]!r}\nstderr: {result.stderr[-1500:]}"
    assert "Traceback" not in result.stderr, where
    assert result.returncode == row.code, where
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("msrewrite: error: ")]
    assert len(errors) == 1, where
    assert row.message in errors[0], where
    assert all(line.startswith("msrewrite: ") for line in lines), where
    assert row.stdout_ok or result.stdout == "", where
    assert after == before, "files changed, added or removed:\n" + where
    leftovers = [p for p in (tmp_path / "row").parent.iterdir() if p.name != "row"]
    assert not leftovers, f"left beside the folder: {leftovers}\n" + where


def test_every_command_and_kind_is_covered():
    """The suite's promise: at least ten kinds for apply, and the relevant ones for suggest and verify."""
    by_command: dict[str, set[str]] = {}
    for row in ROWS:
        by_command.setdefault(row.args[0], set()).add(row.id.split("-", 1)[1])
    assert len(by_command["apply"]) >= 10
    for kind in ("syntax-error", "not-utf8", "empty", "binary", "directory", "missing"):
        for command in ("apply", "suggest", "verify"):
            assert kind in by_command[command], (command, kind)
    assert {
        "unknown-case",
        "ambiguous-target",
        "target-not-found",
        "read-only-in-place",
        "already-applied",
        "in-place-and-output",
    } <= by_command["apply"]


# Output channels: stderr closed or broken, duplicate definitions, temporary folders, dropped trace events
def _cli(args, cwd: Path, stderr="pipe", env=None, timeout=300) -> Outcome:
    """The console entry point in a subprocess; stderr "pipe", "closed" (the shell's `2>&-`: fd 2
    closed before Python starts) or "full" (/dev/full)."""
    preexec = None
    err = subprocess.PIPE
    if stderr == "closed":

        def preexec():
            os.close(2)

        err = subprocess.DEVNULL  # replaced by the close in the child
    elif stderr == "full":
        err = open("/dev/full", "w")  # noqa: SIM115 - closed below
    try:
        result = subprocess.run(
            [sys.executable, "-m", "msrewrite", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=timeout,
            preexec_fn=preexec,
        )
    finally:
        if stderr == "full":
            err.close()
    return Outcome(result.returncode, result.stdout, result.stderr or "")


STDERR_RUNS = [
    pytest.param(("verify", "--inputs", "0", "{applied.py}", "--original", "{good.py}"), id="verify"),
    pytest.param(("verify", "--json", "--no-train", "{applied.py}", "--original", "{good.py}"), id="verify-json"),
    pytest.param(("apply", *CASE, "--mode", "cuda", "--verify", "{good.py}"), id="apply-verify"),
    pytest.param(("apply", *CASE, "{good.py}"), id="apply"),
    pytest.param(("apply", *CASE, "--target", "Nope.forward", "{good.py}"), id="apply-error"),
    pytest.param(("suggest", "--static", "{good.py}"), id="suggest"),
    pytest.param(("suggest", "--static", "--json", "{good.py}"), id="suggest-json"),
    pytest.param(("suggest", "{good.py}"), id="suggest-traced"),
    pytest.param(("suggest", "--static", "-j", "2", "{good.py}", "{applied.py}"), id="suggest-jobs"),
    pytest.param(("cases",), id="cases"),
    pytest.param(("profile", str(ROOT / "tests" / "fixtures" / "profile" / "torch_on.json")), id="profile"),
    pytest.param(("profile", "{partly_dropped.json}"), id="profile-dropped-events"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args", STDERR_RUNS)
def test_a_closed_or_full_stderr_changes_neither_stdout_nor_the_exit_code(args, tmp_path):
    """stderr carries only notes and errors: closed (`2>&-`) or full, its lines are dropped, never
    sent to stdout, and the verdict (exit code, stdout) is the one a working stderr gets. verify's
    child inherits fd 2: a pipe opened after a closed fd 2 must not take its place."""
    folder = tmp_path / "row"
    folder.mkdir()
    make_files(folder)
    (folder / "partly_dropped.json").write_text(json.dumps(trace_with_markers({"dur": -1}, host_too=False)))
    argv = [_fill(a, folder) for a in args]
    reference = _cli(argv, folder)
    assert "Traceback" not in reference.stderr, reference.stderr
    for kind in ("closed", "full"):
        got = _cli(argv, folder, stderr=kind)
        where = f"stderr {kind}: msrewrite {' '.join(argv)}\nexit {got.returncode} (reference {reference.returncode})"
        assert got.returncode == reference.returncode, where + f"\nstdout: {got.stdout[-800:]}"
        assert not any(line.startswith("msrewrite: ") for line in got.stdout.splitlines()), where
        assert got.stdout == reference.stdout, where
        if "--json" in args:
            json.loads(got.stdout)


@pytest.mark.slow
def test_bench_with_stderr_closed_prints_its_json(tmp_path):
    """bench's timings differ run to run: its exit code and JSON (the arrangements) do not."""
    shutil.copy(EXAMPLES / "deepseek_moe.py", tmp_path / "m.py")
    args = ["bench", "--dry-run", *CASE, "--iters", "3", "--warmup", "0", "--json", "m.py"]
    reference = _cli(args, tmp_path)
    got = _cli(args, tmp_path, stderr="closed")
    assert reference.returncode == got.returncode == 0, got.stdout
    labels = [[v["label"] for v in json.loads(r.stdout)["variants"]] for r in (reference, got)]
    assert labels[0] == labels[1] and labels[0]


@pytest.mark.slow
def test_apply_verify_with_stderr_closed_keeps_a_good_edit(tmp_path):
    """The issue's run: `apply --verify -i 2>&-` on a good edit writes it, exit 0."""
    shutil.copy(EXAMPLES / "deepseek_moe.py", tmp_path / "m.py")
    before = (tmp_path / "m.py").read_text()
    got = _cli(["apply", *CASE, "--mode", "cuda", "--verify", "-i", "m.py"], tmp_path, stderr="closed")
    assert got.returncode == 0, got.stdout
    assert got.stdout == ""
    assert (tmp_path / "m.py").read_text() != before


def test_the_definition_python_keeps_is_the_target(tmp_path):
    """A class defining forward twice: the first is dead code. The edit goes to the second (its
    plan's lines lie inside it), and where only the dead one has work to overlap there is no target."""
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    path = tmp_path / "two.py"
    path.write_text(TWO_FORWARDS)
    second_def = TWO_FORWARDS.splitlines().index("    def forward(self, x):", 14) + 1
    plans = plans_for_case(path, load(path).module, "moe-shared-expert", "cuda", None, FlagSpec(name="F"), None)
    assert [p.function for p in plans] == ["Block.forward"]
    assert plans[0].fork_line > second_def and plans[0].join_line > second_def
    result = main_in_process("suggest", "--static", "--json", str(path), cwd=tmp_path)
    lines = [c["join_line"] for c in json.loads(result.stdout)["candidates"]]
    assert lines and all(line > second_def for line in lines)
    dead = tmp_path / "dead.py"
    dead.write_text(DEAD_FORWARD)
    result = main_in_process("suggest", "--static", "--json", str(dead), cwd=tmp_path)
    assert json.loads(result.stdout)["candidates"] == []


@pytest.mark.slow
def test_the_edit_of_a_twice_defined_forward_changes_what_runs(tmp_path):
    """The must-edit twin: the edit of the forward Python keeps passes verify, and the flag acts
    at run time (the edited module runs side-stream work)."""
    path = tmp_path / "two.py"
    path.write_text(TWO_FORWARDS)
    edited = _cli(["apply", *CASE, "--mode", "cuda", "--verify", "-i", "two.py"], tmp_path)
    assert edited.returncode == 0, edited.stderr
    text = path.read_text()
    assert text.count("def forward(self, x):") == 2
    assert "side_stream" not in text.split("def forward(self, x):")[1]  # the dead one is left as it is
    assert "side_stream" in text.split("def forward(self, x):")[2]
    got = _cli(["verify", "--json", "two.py"], tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    streams = [run["streams"] for run in json.loads(got.stdout)["runs"].values() if "side:1" in run["streams"]]
    assert streams  # the flag reaches the code that runs


HANGING_HARNESS = "import time\n\n\ndef make():\n    time.sleep(600)\n"
HANGING_MODEL = TWO_FORWARDS.replace(
    "        return r + s + 1\n", "        import time\n        time.sleep(600)\n        return r + s + 1\n"
)


def _leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, code",
    [
        pytest.param(
            ("bench", "--dry-run", *CASE, "--harness", "hang.py:make", "--timeout", "3", "m.py"), 2, id="bench"
        ),
        pytest.param(("verify", "--timeout", "8", "model.py"), 1, id="verify-in-the-forward"),
    ],
)
def test_a_timed_out_child_leaves_no_temporary_folder(args, code, tmp_path):
    """User code that hangs is killed after --timeout; the folders made for it (bench's, verify's
    schedules). apply has no --timeout: its folders are in the signal test below."""
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), tmp.mkdir()
    (work / "hang.py").write_text(HANGING_HARNESS)
    shutil.copy(EXAMPLES / "deepseek_moe.py", work / "m.py")
    (work / "model.py").write_text(HANGING_MODEL)  # edited in place: verify hangs in the forward
    assert _cli(["apply", *CASE, "--mode", "cuda", "-i", "model.py"], work).returncode == 0
    got = _cli(list(args), work, env={**os.environ, "TMPDIR": str(tmp)}, timeout=200)
    assert got.returncode == code, got.stdout + got.stderr
    assert "timed out" in got.stdout + got.stderr
    assert _leftovers(tmp) == [], got.stderr


SIGNAL_RUNS = [
    pytest.param(("verify", "--harness", "hang.py:make", "applied.py"), signal.SIGTERM, id="verify-sigterm"),
    pytest.param(
        ("apply", *CASE, "--verify", "--harness", "hang.py:make", "m.py"), signal.SIGINT, id="apply-verify-sigint"
    ),
    pytest.param(("bench", "--dry-run", *CASE, "--harness", "hang.py:make", "m.py"), signal.SIGHUP, id="bench-sighup"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, signum", SIGNAL_RUNS)
def test_a_signal_while_the_child_runs_leaves_no_folder_and_no_process(args, signum, tmp_path):
    """Ctrl-C, SIGTERM or SIGHUP to msrewrite while its child runs user code: the child's group
    is killed, every folder made for it removed, and the run ends with one line, exit 2."""
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), tmp.mkdir()
    (work / "hang.py").write_text(HANGING_HARNESS)
    shutil.copy(EXAMPLES / "deepseek_moe.py", work / "m.py")
    shutil.copy(ROOT / "golden" / "moe-shared-expert" / "cuda" / "deepseek_moe.py", work / "applied.py")
    proc = subprocess.Popen(
        [sys.executable, "-m", "msrewrite", *args],
        cwd=work,
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp.glob("msrewrite-child-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(tmp.glob("msrewrite-child-*")), "the child never started"
    time.sleep(1.0)  # into make()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "Traceback" not in err and "msrewrite: interrupted" in err, err
    assert out == ""
    assert _leftovers(tmp) == []
    assert (work / "m.py").read_bytes() == (EXAMPLES / "deepseek_moe.py").read_bytes()
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "hang.py:make"], capture_output=True, text=True).stdout
    assert not left.strip(), left


def test_a_trace_with_some_dropped_marker_events_says_how_many(tmp_path):
    """The device-side marker events are unusable, the host-side ones are kept: the run goes on,
    and stderr and --json say how many events were dropped and why."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace_with_markers({"tid": "seven"}, host_too=False)))
    text = main_in_process("profile", str(path), cwd=tmp_path)
    assert "Traceback" not in text.stderr
    assert "dropped 8 msrewrite marker events (8 with a tid that is not an integer)" in text.stderr
    data = main_in_process("profile", "--json", str(path), cwd=tmp_path)
    assert json.loads(data.stdout)["dropped_events"] == {"trace": {"a tid that is not an integer": 8}, "baseline": None}
    clean = main_in_process("profile", "--json", str(ROOT / "tests" / "fixtures" / "profile" / "torch_on.json"))
    assert json.loads(clean.stdout)["dropped_events"]["trace"] == {}
    assert "dropped" not in clean.stderr
