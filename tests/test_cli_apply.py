"""`msrewrite apply`: outputs, idempotence, errors. A few tests run the real console entry point in
a subprocess (`cases`, a diff and a patch series applied with git, bad input's exit code and one
line); the rest call the CLI's main() in this process (helpers.run_main), with the same argv,
streams and exit code."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from helpers import EXAMPLES, run_cli, run_main

CASE = ["--case", "moe-shared-expert"]


@pytest.mark.slow  # starts a process
def test_cases_lists_every_case_with_modes():
    result = run_cli("cases")
    assert result.returncode == 0
    assert "moe-shared-expert" in result.stdout
    assert "eager, npugraph-ex, ge-graph, cuda" in result.stdout


@pytest.mark.slow  # starts a process (git)
def test_diff_applies_with_git_apply_and_patch(git_repo):
    shutil.copy(EXAMPLES / "deepseek_moe.py", git_repo / "model.py")
    git_repo.git("add", ".")
    git_repo.git("commit", "-qm", "base")
    result = run_cli("apply", *CASE, "model.py", cwd=git_repo)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("--- a/model.py\n+++ b/model.py\n")
    assert "mode eager" in result.stderr
    (git_repo / "edit.diff").write_text(result.stdout)
    git_repo.git("apply", "--check", "edit.diff")
    subprocess.run(["patch", "-p1", "--dry-run", "-i", "edit.diff"], cwd=git_repo, check=True, capture_output=True)
    assert (git_repo / "model.py").read_text() == (EXAMPLES / "deepseek_moe.py").read_text(), "diff mode wrote"


@pytest.mark.slow  # starts a process (git)
def test_diff_paths_are_relative_to_git_root(git_repo):
    sub = git_repo / "pkg" / "models"
    sub.mkdir(parents=True)
    shutil.copy(EXAMPLES / "qwen_gated_moe.py", sub / "moe.py")
    result = run_main("apply", *CASE, str(sub / "moe.py"))
    assert result.returncode == 0, result.stderr
    assert "--- a/pkg/models/moe.py" in result.stdout


@pytest.mark.slow  # starts a process (git)
def test_patch_series_applies_with_git_am(git_repo, tmp_path):
    shutil.copy(EXAMPLES / "qwen_gated_moe.py", git_repo / "moe.py")
    git_repo.git("add", ".")
    git_repo.git("commit", "-qm", "base")
    out = tmp_path / "patches"
    result = run_cli("apply", *CASE, "moe.py", "-o", str(out), cwd=git_repo)
    assert result.returncode == 0, result.stderr
    patches = sorted(out.glob("*.patch"))
    assert [p.name[:5] for p in patches] == ["0001-"]
    text = patches[0].read_text()
    assert text.startswith("From ") and "Mon Sep 17 00:00:00 2001\n" in text.splitlines()[0] + "\n"
    assert "\nSubject: [PATCH] moe-shared-expert: " in text
    assert " 1 file changed" in text and "\n-- \nmsrewrite " in text
    assert (git_repo / "moe.py").read_text() == (EXAMPLES / "qwen_gated_moe.py").read_text(), "-o wrote the model"
    git_repo.git("am", "-q", str(patches[0]))
    log = git_repo.git("log", "--format=%s", "-1").stdout
    assert log.startswith("moe-shared-expert: overlap SparseMoeBlock")
    edited = (git_repo / "moe.py").read_text()
    assert "torch.npu.stream(shared_expert_stream)" in edited


def test_in_place_then_second_apply_is_a_no_op(tmp_path):
    model = tmp_path / "moe.py"
    shutil.copy(EXAMPLES / "deepseek_moe.py", model)
    first = run_main("apply", *CASE, "--in-place", str(model))
    assert first.returncode == 0, first.stderr
    assert first.stdout == ""
    edited = model.read_text()
    assert "_ms_side_stream(" in edited
    second = run_main("apply", *CASE, "--in-place", str(model))
    assert second.returncode == 1
    assert "already applied" in second.stderr
    assert model.read_text() == edited
    assert [p.name for p in tmp_path.iterdir()] == ["moe.py"], "no temp files left behind"


def test_in_place_keeps_file_mode(tmp_path):
    model = tmp_path / "moe.py"
    shutil.copy(EXAMPLES / "deepseek_moe.py", model)
    model.chmod(0o640)
    assert run_main("apply", *CASE, "-i", str(model)).returncode == 0
    assert stat.S_IMODE(model.stat().st_mode) == 0o640


def test_suggest_style_plan_file_round_trips(tmp_path):
    """apply --plan carries out a plan written as JSON, with the same result as --case."""
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    model = EXAMPLES / "qwen_gated_moe.py"
    plans = plans_for_case(
        model,
        load(model).module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )
    plan_file = tmp_path / "plans.json"
    plan_file.write_text(json.dumps({"candidates": [{"plan": plans[0].to_dict()}]}))
    by_plan = run_main("apply", "--plan", str(plan_file), "--candidate", "1", str(model))
    by_case = run_main("apply", *CASE, str(model))
    assert by_plan.returncode == 0, by_plan.stderr
    assert by_plan.stdout == by_case.stdout


def test_flag_attr_and_options_reach_the_code():
    result = run_main(
        "apply",
        *CASE,
        str(EXAMPLES / "deepseek_moe.py"),
        "--flag",
        "attr:enable_multi_stream",
        "--flag-default",
        "off",
        "--max-tokens",
        "64",
        "--stream-tag",
        "11",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "+        self.enable_multi_stream = False\n" in out
    assert '_ms_side_stream("11", self.enable_multi_stream and _ms_num_tokens(residuals) <= 64)' in out
    assert "side_11_stream" in out


def test_target_picks_one_and_reports_unknown(tmp_path):
    model = tmp_path / "two.py"
    model.write_text(
        (EXAMPLES / "deepseek_moe.py").read_text() + "\n\nclass OtherMoE(DeepseekMoE):\n"
        "    def forward(self, x):\n"
        "        y = self.shared_experts(x)\n"
        "        z = self.experts(x, *self.gate(x)[1:][::-1])\n"
        "        return z + y\n"
    )
    ambiguous = run_main("apply", *CASE, str(model))
    assert ambiguous.returncode == 2
    assert "ambiguous" in ambiguous.stderr and "--target" in ambiguous.stderr
    assert len(ambiguous.stderr.strip().splitlines()) == 2  # mode line + the error line
    picked = run_main("apply", *CASE, str(model), "--target", "OtherMoE.forward")
    assert picked.returncode == 0, picked.stderr
    assert "class OtherMoE" in picked.stdout or "OtherMoE.forward" in picked.stderr
    unknown = run_main("apply", *CASE, str(model), "--target", "Nope.forward")
    assert unknown.returncode == 2 and "no such function" in unknown.stderr


BAD_INPUTS = {
    "syntax-error": ("def broken(:\n", 2, "syntax error"),
    "empty": ("", 1, "empty file, nothing to do"),  # valid Python with nothing in it
    "not-utf8": (b"x = '\xff\xfe'\n", 2, "not UTF-8"),
    "binary": (b"\x00\x01\x02", 2, "binary"),
    "no-target": (
        "import torch\n\nclass M:\n    def forward(self, x):\n        return x\n",
        1,
        "no moe-shared-expert target",
    ),
    "no-overlap": (
        "class M:\n    def forward(self, x):\n        s = self.shared_experts(x)\n        return x + s\n",
        1,
        "nothing to overlap",
    ),
}


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_gives_one_line_and_writes_nothing(tmp_path, kind):
    content, code, message = BAD_INPUTS[kind]
    model = tmp_path / "model.py"
    model.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = model.read_bytes()
    result = run_cli("apply", *CASE, "--in-place", str(model))
    assert result.returncode == code, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert model.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py"]


def test_usage_errors(tmp_path):
    model = tmp_path / "m.py"
    shutil.copy(EXAMPLES / "deepseek_moe.py", model)
    cases = [
        (["apply", "--case", "no-such-case", str(model)], "unknown case"),
        (["apply", *CASE, str(tmp_path / "missing.py")], "no such file"),
        (["apply", *CASE, str(tmp_path)], "is a directory"),
        (["apply", *CASE, "--in-place", "-o", str(tmp_path / "p"), str(model)], "conflict"),
        (["apply", str(model)], "exactly one of --case or --plan"),
        (["apply", *CASE, "--mode", "tpu", str(model)], "unknown mode"),
        (["apply", *CASE, "--flag", "yaml:x", str(model)], "env:NAME or attr:NAME"),
    ]
    for args, message in cases:
        result = run_main(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert model.read_text() == (EXAMPLES / "deepseek_moe.py").read_text()


def test_read_only_in_place_is_refused(tmp_path, monkeypatch):
    """A file we may not write is refused before anything is written (checked in-process: root
    ignores permission bits, so the test fakes what os.access reports for the file)."""
    from msrewrite.commands import apply as apply_command
    from msrewrite.errors import BadInput

    model = tmp_path / "m.py"
    shutil.copy(EXAMPLES / "deepseek_moe.py", model)
    model.chmod(0o444)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == model else real_access(p, mode))
    with pytest.raises(BadInput, match="read-only"):
        apply_command.run_apply(
            file=model,
            case="moe-shared-expert",
            plan_path=None,
            candidate=None,
            mode="auto",
            target=None,
            flag="",
            flag_default="on",
            max_tokens=None,
            stream_tag=None,
            in_place=True,
            output=None,
            verify=False,
            harness=None,
        )
    assert model.read_text() == (EXAMPLES / "deepseek_moe.py").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["m.py"]


def test_mode_auto_detection(tmp_path):
    base = (EXAMPLES / "deepseek_moe.py").read_text()
    variants = {
        "ge-graph": base + "\n\ndef compile_decode(model):\n    config = torchair.CompilerConfig()\n"
        "    return torch.compile(model, backend=torchair.get_npu_backend(compiler_config=config))\n",
        "npugraph-ex": base
        + '\n\ndef compile_decode(model):\n    return torch.compile(model, backend="npugraph_ex")\n',
        "eager": base,
    }
    for mode, text in variants.items():
        model = tmp_path / f"{mode}.py"
        model.write_text(text)
        result = run_main("apply", *CASE, str(model))
        assert result.returncode == 0, result.stderr
        assert f"mode {mode} (auto:" in result.stderr


@pytest.mark.slow  # starts a process (git)
def test_phased_patch_series_applies_stage_by_stage(git_repo, tmp_path):
    """-o patches/stage1/ writes the inline refactor and the phases as two patches plus an
    apply_patches.sh that applies every stage with git am on a pristine checkout."""
    shutil.copy(EXAMPLES / "deepep_moe.py", git_repo / "moe.py")
    git_repo.git("add", ".")
    git_repo.git("commit", "-qm", "base")
    stage = tmp_path / "patches" / "stage1"
    result = run_main("apply", "--case", "moe-shared-expert-phased", "moe.py", "-o", str(stage), cwd=git_repo)
    assert result.returncode == 0, result.stderr
    patches = sorted(stage.glob("*.patch"))
    assert [p.name[:5] for p in patches] == ["0001-", "0002-"]
    assert "Subject: [PATCH 1/2] moe-shared-expert-phased: inline the shared expert" in patches[0].read_text()
    assert (
        "Subject: [PATCH 2/2] moe-shared-expert-phased: overlap Qwen2MoeSparseMoeBlock in 3 phases"
        in patches[1].read_text()
    )
    script = tmp_path / "patches" / "apply_patches.sh"
    assert os.access(script, os.X_OK)
    applied = subprocess.run(["bash", str(script)], cwd=git_repo, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    subjects = git_repo.git("log", "--format=%s").stdout.splitlines()
    assert subjects[:2] == [
        "moe-shared-expert-phased: overlap Qwen2MoeSparseMoeBlock in 3 phases on side stream shared_expert",
        "moe-shared-expert-phased: inline the shared expert into Qwen2MoeSparseMoeBlock",
    ]
    final = run_main("apply", "--case", "moe-shared-expert-phased", str(EXAMPLES / "deepep_moe.py"))
    assert final.returncode == 0
    assert (git_repo / "moe.py").read_text().count("re-enters the side stream") == 2


def test_anchor_option():
    result = run_main(
        "apply", "--case", "moe-shared-expert-phased", str(EXAMPLES / "deepep_moe.py"), "--anchor", "dispatch_output"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("re-enters the side stream after dispatch_output") == 1
    assert "after combine_input" not in result.stdout
    wrong = run_main("apply", "--case", "moe-shared-expert", str(EXAMPLES / "deepep_moe.py"), "--anchor", "x")
    assert wrong.returncode == 2 and "--anchor is for phased cases" in wrong.stderr
    late = run_main(
        "apply",
        "--case",
        "moe-shared-expert-phased",
        str(EXAMPLES / "deepep_moe.py"),
        "--anchor",
        "combine_input",
        "--anchor",
        "dispatch_output",
    )
    assert late.returncode == 1 and "program order" in late.stderr


@pytest.mark.slow  # starts a process (git)
def test_several_streams_one_patch_each(git_repo, tmp_path):
    """indexer-prolog writes one patch per side stream (q, weights, q quantization re-entering q)."""
    shutil.copy(EXAMPLES / "indexer_prolog.py", git_repo / "indexer.py")
    git_repo.git("add", ".")
    git_repo.git("commit", "-qm", "base")
    out = tmp_path / "patches"
    result = run_main("apply", "--case", "indexer-prolog", "indexer.py", "-o", str(out), cwd=git_repo)
    assert result.returncode == 0, result.stderr
    patches = sorted(out.glob("*.patch"))
    assert len(patches) == 3
    for patch in patches:
        git_repo.git("am", "-q", str(patch))
    subjects = git_repo.git("log", "--format=%s").stdout.splitlines()[:3]
    assert subjects == [
        "indexer-prolog: overlap Indexer q_quant on side stream indexer_q",
        "indexer-prolog: overlap Indexer weights on side stream indexer_weights",
        "indexer-prolog: overlap Indexer q on side stream indexer_q",
    ]
    again = run_main("apply", "--case", "indexer-prolog", "indexer.py", cwd=git_repo)
    assert again.returncode == 1 and "already applied" in again.stderr


def test_core_budgets_are_checked_against_the_device():
    model = str(EXAMPLES / "longcat_layer.py")
    over = run_main("apply", "--case", "attn-moe-limit-core", model, "--core-limit", "12/24,16/32")
    assert over.returncode == 2 and "exceeds a3's 24 AIC / 48 AIV" in over.stderr and "deadlock" in over.stderr
    a2 = run_main("apply", "--case", "attn-moe-limit-core", model, "--cores", "a2")
    assert a2.returncode == 0 and "_ms_core_limit(moe_shortcut_stream is not None, 12, 24):" in a2.stdout
    custom = run_main(
        "apply", "--case", "attn-moe-limit-core", model, "--core-limit", "12/24,12/24", "--mode", "ge-graph"
    )
    assert custom.returncode == 0 and "_ms_core_limit(True, 12, 24)" in custom.stdout
    wrong = run_main(
        "apply", "--case", "moe-shared-expert", model.replace("longcat_layer", "deepseek_moe"), "--cores", "a2"
    )
    assert wrong.returncode == 2 and "core-limit cases" in wrong.stderr
    bad = run_main("apply", "--case", "attn-moe-limit-core", model, "--core-limit", "8-16")
    assert bad.returncode == 2 and "SIDE_AIC/SIDE_AIV" in bad.stderr


@pytest.mark.slow  # the CLI with verify
def test_verify_hand_written_multi_stream_code(tmp_path):
    """verify also checks multi-stream code nobody generated: no flag, run as written."""
    fixture = Path(__file__).resolve().parent / "fixtures" / "handwritten_moe.py"
    clean = run_main("verify", str(fixture))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "OK: sanitizer clean [eager, no flag, checked as written]" in clean.stdout
    broken = tmp_path / "handwritten_moe.py"
    broken.write_text(fixture.read_text().replace("JOIN = True", "JOIN = False"))
    result = run_main("verify", str(broken))
    assert result.returncode == 1
    problems = [line for line in result.stdout.splitlines() if line.startswith("problem: ")]
    assert any("[race-raw]" in p and "handwritten_moe.py:31" in p for p in problems), problems
    assert any("[unjoined]" in p for p in problems)
