"""Stream-ordering statements are barriers the fork is never hoisted above.

A layer that fills the MoE input on a stream of its own orders the MoE block after it with an
event wait (`ev.wait()`), a synchronize (`ev.synchronize()`, `stream.synchronize()`,
`torch.npu.synchronize()`), `stream.wait_event/wait_stream`, or a same-file helper doing one. The
side stream waits on the main stream only as far as the fork: work started above the wait does not
wait for what it orders. So such a statement is a dependence for everything after it, and the fork
goes after it. A wait msrewrite cannot see into (an event set from outside `__init__`, an object an
unknown factory made) counts as one too, and is named in the trust boundary.

A method named `wait` or `record` is stream ordering only on a stream or event object: on a
same-file object (`self.tracker.wait(x)` writing x in place) it is that method, and on an object
msrewrite cannot see into it is an unknown callee, named in the refusal.

Each must-place-correctly model has a twin without the wait that still edits with the fork at the
top; the ones verify can run are verified.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")

MODEL = """import torch
import torch.nn.functional as F
from torch import nn
{imports}

class MLP(nn.Module):
    def __init__(self, h=16, i=32):
        super().__init__()
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))

{helpers}

class Moe(nn.Module):
    def __init__(self, h=16, e=4):
        super().__init__()
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(MLP(h, 32) for _ in range(e))
        self.shared_experts = MLP(h, 32)
        self.input_ready = None
{init}
    def forward(self, x):
        w = torch.softmax(self.gate(x), dim=-1)
{wait}
        routed = self.routed(x, w)
        shared = self.shared_experts(x)
        return routed + shared

    def routed(self, x, w):
        return sum(ex(x) * w[..., i : i + 1] for i, ex in enumerate(self.experts))


def make():
    torch.manual_seed(0)
    return Moe().eval(), (torch.randn(8, 16),)
"""

_WAIT_HELPER = """
def _wait_input(mod):
    ev = getattr(mod, "input_ready", None)
    if ev is not None:
        ev.wait()
"""
_PREFETCHER = """
class _Prefetcher:
    def __init__(self):
        self.event = None

    def wait(self):
        if self.event is not None and hasattr(torch, "npu"):
            torch.npu.current_stream().wait_event(self.event)
"""
_STREAM_HELPER = """
def _order_after(stream):
    if stream is not None:
        torch.npu.current_stream().wait_stream(stream)
"""
# name -> (imports, helpers, __init__ lines, the wait statement in forward, what the trust boundary names)
BARRIERS = {
    "event-wait": (
        "",
        "",
        "",
        "if self.input_ready is not None:\n    self.input_ready.wait()",
        "self.input_ready.wait",
    ),
    "event-synchronize": (
        "",
        "",
        "",
        "if self.input_ready is not None:\n    self.input_ready.synchronize()",
        "self.input_ready.synchronize",
    ),
    "stream-synchronize": (
        "",
        "",
        "self.comm_stream = torch.npu.Stream() if hasattr(torch, 'npu') else None",
        "if self.comm_stream is not None:\n    self.comm_stream.synchronize()",
        "",
    ),
    "device-synchronize": ("", "", "", "if hasattr(torch, 'npu'):\n    torch.npu.synchronize()", ""),
    "helper-function-wait": ("", _WAIT_HELPER, "", "_wait_input(self)", "ev.wait (not visible to msrewrite)"),
    "same-file-prefetcher": ("", _PREFETCHER, "self.prefetcher = _Prefetcher()", "self.prefetcher.wait()", ""),
    "helper-wait-stream": (
        "",
        _STREAM_HELPER,
        "self.comm_stream = None",
        "_order_after(self.comm_stream)",
        "",
    ),
    "unknown-factory": (
        "from prefetch_lib import make_prefetcher",
        "",
        "self.prefetcher = make_prefetcher()",
        "self.prefetcher.wait()",
        "self.prefetcher.wait (make_prefetcher",
    ),
}
IMPORTABLE = sorted(set(BARRIERS) - {"unknown-factory"})


def _text(imports: str = "", helpers: str = "", init: str = "", wait: str = "") -> str:
    indent = lambda code, n: "".join(" " * n + line + "\n" for line in code.splitlines())  # noqa: E731
    return MODEL.format(imports=imports, helpers=helpers, init=indent(init, 8), wait=indent(wait, 8).rstrip("\n"))


def _edit(tmp_path: Path, name: str, text: str, case: str = "moe-shared-expert"):
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(text)
    src = load(path)
    return path, case_steps(path, src.text, src.module, case, "eager", None, FLAG, None)[-1]


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


@pytest.mark.parametrize("case", ["moe-shared-expert", "moe-shared-expert-phased"])
@pytest.mark.parametrize("name", sorted(BARRIERS))
def test_the_fork_goes_after_a_stream_wait(tmp_path, name, case):
    imports, helpers, init, wait, named = BARRIERS[name]
    text = _text(imports, helpers, init, wait)
    _, step = _edit(tmp_path, name, text, case)
    plan = step.plans[0]
    after = _line_of(text, "routed = self.routed(")
    assert plan.fork_line >= after, (plan.fork_line, after)
    boundary = " ".join(plan.trust_boundary)
    if named:
        assert named in boundary, boundary


@pytest.mark.parametrize("case", ["moe-shared-expert", "moe-shared-expert-phased"])
def test_without_the_wait_the_fork_stays_at_the_top(tmp_path, case):
    text = _text()
    _, step = _edit(tmp_path, "no_wait", text, case)
    assert step.plans[0].fork_line == _line_of(text, "w = torch.softmax("), step.plans[0].fork_line


@pytest.mark.slow  # runs the models through verify
@pytest.mark.parametrize("name", IMPORTABLE)
def test_the_edit_after_the_wait_verifies_clean(tmp_path, name):
    imports, helpers, init, wait, _ = BARRIERS[name]
    path, step = _edit(tmp_path, name, _text(imports, helpers, init, wait))
    edited = tmp_path / f"{path.stem}_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, inputs=0)
    assert result.ok, result.problems


# The model gathers its input on a comm stream of its own and records an event; the MoE block
# waits on it first. Hoisting the fork above the wait is a read-after-write race verify sees.
GATHERED = """
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = Moe()
        self.comm_stream = None

    def forward(self, x):
        gathered = torch.empty_like(x)
        if hasattr(torch, "npu"):
            if self.comm_stream is None:
                self.comm_stream = torch.npu.Stream()
            self.comm_stream.wait_stream(torch.npu.current_stream())
            with torch.npu.stream(self.comm_stream):
                gathered.copy_(x * 2.0)
            gathered.record_stream(self.comm_stream)
            event = torch.npu.Event()
            event.record(self.comm_stream)
            self.moe.input_ready = event
        else:
            gathered.copy_(x * 2.0)
        return self.moe(gathered)


def make():
    torch.manual_seed(0)
    return Layer().eval(), (torch.randn(8, 16),)
"""


@pytest.mark.slow  # runs the model through verify
def test_the_gathered_input_is_read_after_the_event_wait(tmp_path):
    text = _text(wait=BARRIERS["event-wait"][3]).split("\n\ndef make():")[0] + "\n" + GATHERED
    # the gate reads the gathered input too: in this model the wait comes first
    gate = "        w = torch.softmax(self.gate(x), dim=-1)\n"
    text = text.replace(gate, "").replace("        routed = self.routed(", gate + "        routed = self.routed(")
    path, step = _edit(tmp_path, "gathered", text)
    assert step.plans[0].fork_line > _line_of(text, "self.input_ready.wait()")
    edited = tmp_path / "gathered_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, inputs=0)
    # the layer's own comm stream runs with the flag off too: the original issues those ops as well
    assert result.ok, result.problems


# A method named like stream ordering, on an object that is not a stream or event.
TRACKER = """
class _Tracker:
    def wait(self, t):
        t.mul_(2.0)

    def record(self, t):
        t.clamp_(-1.0, 1.0)

    def keep(self, t):
        return t
"""
SHARED_FIRST = """import torch
import torch.nn.functional as F
from torch import nn
{imports}

class MLP(nn.Module):
    def __init__(self, h=16, i=32):
        super().__init__()
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))

{helpers}

class Moe(nn.Module):
    def __init__(self, h=16, e=4):
        super().__init__()
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(MLP(h, 32) for _ in range(e))
        self.shared_experts = MLP(h, 32)
        self.tracker = {tracker}

    def forward(self, x):
        shared = self.shared_experts(x)
        {call}
        w = torch.softmax(self.gate(x), dim=-1)
        routed = self.routed(x, w)
        return routed + shared

    def routed(self, x, w):
        return sum(ex(x) * w[..., i : i + 1] for i, ex in enumerate(self.experts))


def make():
    torch.manual_seed(0)
    return Moe().eval(), (torch.randn(8, 16),)
"""
# name -> (imports, tracker constructor, the call, what the refusal says)
NOT_ORDERING = {
    "same-file-wait-writes": ("", "_Tracker()", "self.tracker.wait(x)", "line 37 writes 'x' in place"),
    "same-file-record-writes": ("", "_Tracker()", "self.tracker.record(x)", "line 37 writes 'x' in place"),
    "unknown-receiver-record": (
        "from tracker_lib import make_tracker",
        "make_tracker()",
        "self.tracker.record(x)",
        "self.tracker.record (make_tracker, not visible to msrewrite) may write 'x'",
    ),
}


@pytest.mark.parametrize("name", sorted(NOT_ORDERING))
def test_a_wait_or_record_method_that_writes_its_argument_is_refused(tmp_path, name):
    imports, tracker, call, why = NOT_ORDERING[name]
    with pytest.raises(NothingToDo) as refused:
        _edit(tmp_path, name, SHARED_FIRST.format(imports=imports, helpers=TRACKER, tracker=tracker, call=call))
    assert why in str(refused.value), str(refused.value)


def test_a_same_file_method_that_writes_nothing_still_edits(tmp_path):
    text = SHARED_FIRST.format(imports="", helpers=TRACKER, tracker="_Tracker()", call="self.tracker.keep(x)")
    _, step = _edit(tmp_path, "keeps", text)
    assert step.plans[0].fork_line == _line_of(text, "shared = self.shared_experts(x)")


@pytest.mark.slow  # runs the model through verify
def test_the_writing_wait_method_is_a_race_verify_sees_when_forced(tmp_path):
    """The refused edit, made by hand: the main path's `self.tracker.wait(x)` doubles x while the
    shared expert reads it."""
    text = SHARED_FIRST.format(imports="", helpers=TRACKER, tracker="_Tracker()", call="self.tracker.keep(x)")
    path, step = _edit(tmp_path, "forced", text)
    path.write_text(text.replace("self.tracker.keep(x)", "self.tracker.wait(x)"))
    edited = tmp_path / "forced_ms.py"
    edited.write_text(step.new.replace("self.tracker.keep(x)", "self.tracker.wait(x)"))
    result = verify_files(edited, original=path, inputs=0)
    assert not result.ok and any("race" in p for p in result.problems), result.problems
