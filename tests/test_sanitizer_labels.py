"""Where a finding says a place no model line is behind: the module's inputs made by its caller
before the call (a missing fork wait), its locals freed as its forward returns (a missing
record_stream), rather than `<after the module returned>` for both."""

from __future__ import annotations

import pytest
import torch

from helpers import EXAMPLES, load_file, load_regen
from msrewrite.runtime import install
from msrewrite.sanitizer import Sanitizer
from msrewrite.sanitizer.calls import ModuleCalls

regen = load_regen()


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():
        yield


MODELS = """
import torch


class NoFork(torch.nn.Module):
    def forward(self, x):
        side = torch.npu.Stream()
        with torch.npu.stream(side):
            y = x * 2  # side reads
        torch.npu.current_stream().wait_stream(side)
        y.record_stream(torch.npu.current_stream())
        return y + 1


class NoRecord(torch.nn.Module):
    def forward(self, x):
        main, side = torch.npu.current_stream(), torch.npu.Stream()
        side.wait_stream(main)
        with torch.npu.stream(side):
            y = x * 2
        main.wait_stream(side)
        return x + y  # last op
"""


def _sanitized_call(tmp_path, name):
    path = tmp_path / "labels.py"
    path.write_text(MODELS)
    lines = MODELS.splitlines()
    line = {m: next(n for n, text in enumerate(lines, 1) if text.endswith(f"# {m}")) for m in ("side reads", "last op")}
    with install() as rt:
        model = getattr(load_file(path, "labels"), name)()
        with Sanitizer(rt, user_files=[path]) as san:
            x = torch.randn(4).clone()  # the caller makes the input, as verify's harness does
            san.check_output(model(x))
    return san.findings, str(path), line


def test_a_missing_fork_names_the_input_made_before_the_module_was_called(tmp_path):
    findings, path, line = _sanitized_call(tmp_path, "NoFork")
    (race,) = findings
    assert race.kind == "race-raw" and race.second == (path, line["side reads"])
    assert race.first == ("<before the module was called (the caller making its inputs)>", 0)
    assert (
        f"side:1 reads at {path}:{line['side reads']} a tensor written on main before the module was called "
        "(the caller making its inputs) with no event or wait_stream" in race.message
    )


def test_a_local_freed_as_the_forward_returns_names_the_end_of_the_forward(tmp_path):
    findings, path, line = _sanitized_call(tmp_path, "NoRecord")
    (lifetime,) = findings
    end = f"at the end of NoRecord.forward, as it returned (after its last op at {path}:{line['last op']})"
    assert lifetime.kind == "lifetime" and lifetime.second == (f"<{end}>", 0)
    assert f"and freed {end} with neither record_stream(main)" in lifetime.message


class _Probe(torch.nn.Module):
    """Model code: records what the labels say while it runs."""

    def __init__(self, calls: ModuleCalls, seen: list):
        super().__init__()
        self.calls, self.seen = calls, seen

    def forward(self, x):
        self.seen.append(self.calls.label()[0])
        return x


def test_module_calls_label_each_place_against_the_outermost_call():
    calls, seen = ModuleCalls(), []
    with calls:
        seen.append(calls.label()[0])
        torch.nn.Sequential(_Probe(calls, seen))(torch.ones(1))  # torch's forward outermost
        calls.last_user = ("model.py", 7)
        seen.append(calls.label()[0])
        _Probe(calls, seen)(torch.ones(1))  # model code outermost (asked once its frame is gone)
    assert seen == [
        "<before the module was called (the caller making its inputs)>",
        "<inside Sequential.forward (torch code)>",
        "<in the caller after Sequential.forward returned (after its last op at model.py:7)>",
        "<at the end of _Probe.forward, as it returned (after its last op at model.py:7)>",
    ]
    assert calls.depth == 0 and calls.caller is None and not calls._handles


@pytest.mark.slow
def test_verify_names_the_input_when_the_fork_wait_is_missing(tmp_path):
    from msrewrite.verify import verify_files

    golden, _ = regen.golden_paths("moe-shared-expert", "eager", "deepseek_moe")
    text = golden.read_text().replace("            shared_expert_stream.wait_stream(current_stream)\n", "", 1)
    edited = tmp_path / "deepseek_moe.py"
    edited.write_text(text)
    result = verify_files(edited, original=EXAMPLES / "deepseek_moe.py", inputs=0, train=False)
    (race,) = [f for f in result.findings if f.kind == "race-raw"]
    assert "written on main before the module was called (the caller making its inputs)" in race.message
    assert "after the module returned" not in " ".join(result.problems)
