"""What verify checks beyond one forward's outputs: dtypes, the caller's inputs, gradients, a batch of
one, a second call, a caller's own stream, and hand-written edits in every scenario.

Each row breaks the deepseek golden edit in one way a device would get wrong (or a user would
notice) and that one eval forward of make()'s inputs cannot show; verify must name it. The
unbroken golden verifies clean (tests/test_mutants.py runs every golden)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import EXAMPLES
from msrewrite.verify import RunResult, verify_files

pytestmark = pytest.mark.slow  # a verify run per row

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "moe-shared-expert" / "eager" / "deepseek_moe.py"
JOIN = "            current_stream.wait_stream(shared_expert_stream)\n"
FORK = "            shared_expert_stream.wait_stream(current_stream)\n"
RETURN = "        hidden_states = hidden_states + shared_experts_output  # shared experts see every token\n"
NO_FLAG = [
    (
        '_ms_env_flag("ENABLE_MOE_SHARED_EXPERT_STREAM", True)\n',
        "True\n",
    ),
    (
        '_ms_side_stream("shared_expert", self.enable_moe_shared_expert_stream)',
        '_ms_side_stream("shared_expert", True)',
    ),
]


@dataclass(frozen=True)
class Row:
    name: str
    swaps: list[tuple[str, str]]
    problem: str  # a substring one of verify's problems must hold


ROWS = [
    Row(
        "output dtype changed with the flag on",
        [
            (
                RETURN,
                RETURN
                + "        if shared_expert_stream is not None:\n            hidden_states = hidden_states.double()\n",
            )
        ],
        "flag on: output 0 has dtype torch.float64, original torch.float32",
    ),
    Row(
        "the caller's input written in place",
        [(RETURN, RETURN + "        if shared_expert_stream is not None:\n            residuals.zero_()\n")],
        "flag on: input 0 differs from original after the forward (written in place)",
    ),
    Row(
        "the side output detached: the shared expert stops training",
        [
            (
                "                shared_experts_output = self.shared_experts(residuals)\n",
                "                shared_experts_output = self.shared_experts(residuals).detach()\n",
            )
        ],
        "train: flag on: no gradient for parameter shared_experts.gate_proj.weight",
    ),
    Row(
        "join skipped for a batch of one",
        [(JOIN, "            if orig_shape[0] > 1:\n    " + JOIN)],
        "[race-raw] main reads",
    ),
    Row(
        "fork wait made on the first call only",
        [
            (
                FORK,
                "            if not getattr(self, '_ms_forked', False):\n    "
                + FORK
                + "                self._ms_forked = True\n",
            )
        ],
        "[race-raw] side:1 reads",
    ),
    Row(
        "the default stream taken for the current one",
        [("current_stream = torch.npu.current_stream()", "current_stream = torch.npu.default_stream()")],
        "a tensor written on caller",
    ),
    Row(
        "the side stream used with the flag off",
        [NO_FLAG[1]],
        "flag off: 14 ops still ran off the main stream (side:1)",
    ),
    Row(
        "no flag, join skipped for zero tokens",
        [*NO_FLAG, (JOIN, "            if orig_shape[1] > 0:\n    " + JOIN)],
        "[race-raw] main reads",
    ),
    Row(
        "no flag, join skipped in train",
        [*NO_FLAG, (JOIN, "            if not self.training:\n    " + JOIN)],
        "[unjoined]",
    ),
]


def broken(tmp_path: Path, row: Row) -> Path:
    text = GOLDEN.read_text()
    for old, new in row.swaps:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "deepseek_moe.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_verify_names_the_break(tmp_path, row):
    result = verify_files(broken(tmp_path, row), original=EXAMPLES / "deepseek_moe.py")
    assert not result.ok
    assert any(row.problem in p for p in result.problems), result.problems


def test_the_draws_cut_the_batch_and_the_tokens():
    result = verify_files(GOLDEN, original=EXAMPLES / "deepseek_moe.py", schedules=("early",))
    assert result.ok, result.problems
    assert result.scenarios == ["eval", "train", "zero tokens", "draw 1 (batch 1)", "draw 2 (1 token)"]


def test_a_hand_written_edit_runs_every_scenario(tmp_path):
    clean = broken(tmp_path, Row("no flag", NO_FLAG, ""))
    result = verify_files(clean, original=EXAMPLES / "deepseek_moe.py")
    assert result.ok, result.problems
    assert result.flag.kind == "none"
    assert result.scenarios == ["eval", "train", "zero tokens", "draw 1 (batch 1)", "draw 2 (1 token)"]


def test_a_change_flag_off_shows_too_is_not_called_a_race(monkeypatch):
    import torch

    from msrewrite import verify

    leaks = []
    monkeypatch.setattr(verify, "_leak", lambda *a: leaks.append(a) or "race: ...")
    job = SimpleNamespace(
        atol=0.0,
        rtol=0.0,
        scaled=False,
        variant_paths={"late": Path("late.py")},
        window_source=object(),
        result=SimpleNamespace(problems=[]),
    )

    def runs(off: float, late: float) -> list[RunResult]:
        names = [("original", 1.0), ("flag off", off), ("flag on", 1.0), ("flag on, late schedule", late)]
        return [RunResult(name, [torch.tensor([value])]) for name, value in names]

    verify._compare_runs(job, verify.Scenario(""), runs(off=1.0, late=2.0))  # only the late run differs: timing
    assert len(leaks) == 1 and job.result.problems[-1].endswith("; race: ..."), job.result.problems
    job.result.problems.clear()
    verify._compare_runs(job, verify.Scenario(""), runs(off=2.0, late=2.0))  # flag off too: the code changed
    assert len(leaks) == 1 and not any("race" in p for p in job.result.problems), job.result.problems
