"""apply --markers / --no-markers: profiler ranges around the side and main windows, switched by
the edit's flag, removed byte for byte, carried by the plan, and proved by verify."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import EXAMPLES, run_main
from msrewrite.emit import markers


def edited(tmp_path: Path, example: str, case: str, mode: str, *extra: str) -> str:
    path = tmp_path / f"{example}.py"
    shutil.copy(EXAMPLES / f"{example}.py", path)
    out = run_main("apply", "--case", case, "--mode", mode, "-i", *extra, str(path))
    assert out.returncode == 0, out.stderr
    return path.read_text()


@pytest.mark.parametrize(
    "example, case, mode",
    [
        ("deepseek_moe", "moe-shared-expert", "cuda"),
        ("deepseek_moe", "moe-shared-expert", "eager"),
        ("guarded_moe", "moe-shared-expert", "cuda"),
        # two side streams, three windows: q_quant re-enters q's stream after q's join
        ("indexer_prolog", "indexer-prolog", "eager"),
        # the stream handed down by the model's constructor (self.shared_mlp_stream), events sync
        ("hunyuan_moe", "moe-shared-mlp-init", "cuda"),
        ("hunyuan_moe", "moe-shared-mlp-init", "eager"),
    ],
)
def test_markers_then_no_markers_is_the_plain_edit_byte_for_byte(tmp_path, example, case, mode):
    plain = edited(tmp_path / "plain", example, case, mode) if (tmp_path / "plain").mkdir() is None else ""
    (tmp_path / "marked").mkdir()
    marked = edited(tmp_path / "marked", example, case, mode, "--markers")
    windows = 3 if case == "indexer-prolog" else 1
    if case == "indexer-prolog":  # in file order; each window its branch's name
        assert [line.split(":")[2] for line in marked.splitlines() if ':side", ' in line] == ["weights", "q", "q_quant"]
    assert marked.count('_ms_range_start("msrewrite:') == 2 * windows
    assert marked.count(':side", ') == windows and marked.count(':main", ') == windows
    assert marked.count("_ms_range_end(") == 2 * windows + 1  # and the helper's docstring
    api = "torch.profiler.record_function" if mode == "cuda" else "torch.npu.mstx.range_start"
    assert api in marked
    path = tmp_path / "marked" / f"{example}.py"
    out = run_main("apply", "--no-markers", "-i", str(path))
    assert out.returncode == 0, out.stderr
    assert path.read_text() == plain
    again = run_main("apply", "--no-markers", str(path))
    assert again.returncode == 1 and "no msrewrite profiler ranges" in again.stderr


def test_every_range_line_sits_under_the_flag(tmp_path):
    """With the flag off the side stream is None, so nothing inside `if <stream> is not None` runs."""
    import libcst as cst

    (tmp_path / "m").mkdir()
    text = edited(tmp_path / "m", "deepseek_moe", "moe-shared-expert", "cuda", "--markers")
    module = cst.parse_module(text)
    found = []

    class Walk(cst.CSTVisitor):
        def __init__(self):
            self.conditions: list[str] = []

        def visit_If(self, node):
            self.conditions.append(module.code_for_node(node.test))

        def leave_If(self, _node):
            self.conditions.pop()

        def visit_Call(self, node):
            if isinstance(node.func, cst.Name) and node.func.value in (markers.START, markers.END):
                found.append(list(self.conditions))

    module.visit(Walk())
    assert len(found) == 4
    assert all(conds and conds[-1] == "shared_expert_stream is not None" for conds in found)


def test_ranges_run_balanced_with_the_flag_on_and_not_at_all_off(tmp_path, monkeypatch):
    from msrewrite.harness import load_module
    from msrewrite.runtime import install

    (tmp_path / "m").mkdir()
    edited(tmp_path / "m", "deepseek_moe", "moe-shared-expert", "eager", "--markers")
    for flag, expected in (("1", ["start:side", "end", "start:main", "end"]), ("0", [])):
        monkeypatch.setenv("ENABLE_MOE_SHARED_EXPERT_STREAM", flag)
        calls = []
        with install():
            module = load_module(tmp_path / "m" / "deepseek_moe.py", name=f"marked_{flag}")
            monkeypatch.setattr(
                module,
                "_ms_range_start",
                lambda name, _stream, calls=calls: calls.append("start:" + name.rsplit(":", 1)[1]) or 7,
            )
            monkeypatch.setattr(module, "_ms_range_end", lambda _handle, calls=calls: calls.append("end"))
            model, inputs = module.make()
            model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        assert calls == expected


def test_markers_come_from_the_plan_file(tmp_path):
    path = tmp_path / "deepseek_moe.py"
    shutil.copy(EXAMPLES / "deepseek_moe.py", path)
    suggested = run_main("suggest", "--static", "--json", str(path))
    data = json.loads(suggested.stdout)
    assert "markers" not in data["candidates"][0]["plan"]  # plan files without markers read as before
    data["candidates"][0]["plan"]["markers"] = True
    (tmp_path / "plans.json").write_text(json.dumps(data))
    out = run_main("apply", "--plan", str(tmp_path / "plans.json"), "--candidate", "1", "--mode", "cuda", str(path))
    assert out.returncode == 0, out.stderr
    assert '+                side_range = _ms_range_start("msrewrite:' in out.stdout
    data["candidates"][0]["plan"]["markers"] = "yes"
    (tmp_path / "plans.json").write_text(json.dumps(data))
    bad = run_main("apply", "--plan", str(tmp_path / "plans.json"), str(path))
    assert bad.returncode == 2 and "markers" in bad.stderr and bad.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--case", "moe-shared-expert", "--mode", "ge-graph", "--markers"], "ge-graph mode is not supported"),
        (["--case", "moe-shared-expert-phased", "--mode", "eager", "--markers"], "phased"),
        (["--case", "moe-shared-expert", "--no-markers"], "--no-markers takes only the edited file"),
    ],
)
def test_markers_refusals_are_one_line(tmp_path, args, message):
    path = tmp_path / "qwen_gated_moe.py"
    shutil.copy(EXAMPLES / "qwen_gated_moe.py", path)
    out = run_main("apply", *args, str(path))
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("msrewrite: error: ")]
    assert len(errors) == 1 and message in errors[0] and out.stderr.splitlines()[-1] == errors[0]
    assert out.stdout == ""


@pytest.mark.slow  # the CLI with verify
@pytest.mark.parametrize("mode", ["cuda", "eager"])
def test_verify_passes_with_markers_on(mode):
    out = run_main(
        "apply",
        "--case",
        "moe-shared-expert",
        "--mode",
        mode,
        "--markers",
        "--verify",
        str(EXAMPLES / "deepseek_moe.py"),
    )
    assert out.returncode == 0, out.stderr
    assert "schedules: early, late, interleaved" in out.stderr and "sanitizer clean" in out.stderr


@pytest.mark.slow  # runs the marked models
@pytest.mark.parametrize(
    "example, case, mode, flag, expected",
    [
        (
            "indexer_prolog",
            "indexer-prolog",
            "eager",
            "ENABLE_INDEXER_PROLOG_STREAMS",
            [
                "start:weights:side",
                "end",
                "start:weights:main",
                "start:q:side",
                "end",
                "start:q:main",
                "start:q_quant:side",
                "end",
                "start:q_quant:main",
                "end",
                "end",
                "end",
            ],
        ),
        (
            "hunyuan_moe",
            "moe-shared-mlp-init",
            "cuda",
            "ENABLE_SHARED_MLP_STREAM",
            ["start:shared_mlp:side", "end", "start:shared_mlp:main", "end"],
        ),
    ],
)
def test_every_window_opens_and_closes_its_ranges(tmp_path, monkeypatch, example, case, mode, flag, expected):
    """The re-entered stream's second window and the constructor-passed stream get their ranges,
    each opened once and closed once per forward, and none with the flag off."""
    from msrewrite.harness import load_module
    from msrewrite.runtime import install

    (tmp_path / "m").mkdir()
    edited(tmp_path / "m", example, case, mode, "--markers")
    layers = None
    for value, want in (("1", expected), ("0", [])):
        monkeypatch.setenv(flag, value)
        calls, handles = [], iter(range(1000))
        with install():
            module = load_module(tmp_path / "m" / f"{example}.py", name=f"marked_{example}_{value}")

            def start(name, _stream, calls=calls, handles=handles):
                calls.append("start:" + name.split(":", 2)[2])
                return next(handles)

            monkeypatch.setattr(module, "_ms_range_start", start)
            monkeypatch.setattr(module, "_ms_range_end", lambda _handle, calls=calls: calls.append("end"))
            model, inputs = module.make()
            model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        if want and len(calls) != len(want):  # a model of several layers runs the windows once per layer
            layers = len(calls) // len(want)
            want = want * layers
        assert calls == want


def test_a_plan_whose_stream_cannot_be_found_is_refused():
    """The marker pass finds a plan's stream by the comment the emitter opens its prelude with;
    without it (the edit changed by hand), it refuses in one line instead of marking another window."""
    import libcst as cst

    from msrewrite.commands.apply import case_steps
    from msrewrite.errors import BadInput
    from msrewrite.plan import FlagSpec

    path = EXAMPLES / "indexer_prolog.py"
    text = path.read_text()
    steps = case_steps(path, text, cst.parse_module(text), "indexer-prolog", "eager", None, FlagSpec(), None)
    plans = [p for step in steps for p in step.plans]
    assert [p.case_branch for p in plans] == ["q", "weights", "q_quant"]
    edit = steps[-1].new
    assert markers.add(edit, plans).count('_ms_range_start("msrewrite:') == 6
    cut = edit.replace(
        "# msrewrite(indexer-prolog: q_quant): the q quantization runs on", "# the q quantization runs on"
    )
    assert cut != edit
    with pytest.raises(BadInput, match="no side stream for 'indexer-prolog: q_quant'"):
        markers.add(cut, plans)


@pytest.mark.slow  # starts a process or runs verify
@pytest.mark.parametrize(
    "case, example, mode",
    [
        ("indexer-prolog", "indexer_prolog", "eager"),
        ("moe-shared-mlp-init", "hunyuan_moe", "cuda"),
        ("moe-shared-mlp-init", "hunyuan_moe", "eager"),
    ],
)
def test_verify_passes_with_markers_on_the_new_windows(case, example, mode):
    """Every schedule runs with the ranges on: the later ones re-issue the last step's plans on its
    unmarked input and mark every window again, reproducing the marked edit first."""
    out = run_main("apply", "--case", case, "--mode", mode, "--markers", "--verify", str(EXAMPLES / f"{example}.py"))
    assert out.returncode == 0, out.stderr
    assert "schedules: early, late, interleaved" in out.stderr and "sanitizer clean" in out.stderr
