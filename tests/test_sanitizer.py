"""The stream sanitizer on the CPU stand-ins: clean hand-written DAGs, their mutants, sync tables."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from msrewrite.runtime import install
from msrewrite.sanitizer import KINDS, Finding, Sanitizer, static_mixed_api
from msrewrite.sanitizer.findings import where

FIXTURE = Path(__file__).parent / "fixtures" / "abcd_dag.py"
_spec = importlib.util.spec_from_file_location("abcd_dag", FIXTURE)
dag = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dag)


@pytest.fixture(autouse=True)
def _inference():
    # Inference, as msrewrite targets: autograd would keep freed intermediates alive.
    with torch.no_grad():
        yield


def _run(model_class, mutant=None, graph=False):
    x = torch.randn(4, 8)
    with install() as rt:
        model = model_class(mutant)
        with Sanitizer(rt, user_files=[FIXTURE]) as san:
            with rt.graph_mode() if graph else _nothing():
                out = model(x)
                san.check_output(out)
        assert torch.allclose(out, dag.reference(model, x), atol=1e-6)
    return san.findings


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _at(marker: str) -> tuple[str, int]:
    return (str(FIXTURE), dag.line_of(marker))


def _named(loc: tuple[str, int]) -> str:
    """How a message names a location: file:line, or the phrase of a place no line is behind."""
    return f"{loc[0]}:{loc[1]}" if loc[1] else where(loc)


STYLES = {"eager": (dag.EagerABCD, False), "npugraph_ex": (dag.NpugraphExABCD, False), "ge": (dag.GeABCD, True)}


@pytest.mark.parametrize("style", STYLES)
def test_correct_dag_is_clean(style):
    model_class, graph = STYLES[style]
    assert _run(model_class, graph=graph) == []


def test_early_free_is_clean_when_record_stream_covers_it():
    # Same as the no-record-free-early mutant, but with out_a.record_stream(side) kept.
    class FreeEarlyWithRecord(dag.NpugraphExABCD):
        def forward(self, x):
            out_a = self.a(x)
            out_a.record_stream(self.side)
            self.events[0].record()
            with torch.npu.stream(self.side):
                self.events[0].wait()
                out_b = torch.relu(self.b(out_a))
                self.events[1].record()
            out_c = torch.relu(self.c(out_a))
            del out_a
            out_b.record_stream(torch.npu.current_stream())
            self.events[1].wait()
            return self.d(out_b + out_c)

    assert _run(FreeEarlyWithRecord) == []


# (style, mutant) -> the finding that must be there (kind, first marker, second marker or None),
# and every kind the run may report.
MUTANTS = {
    ("eager", "no-fork"): (("race-raw", "eager-A", "eager-B"), {"race-raw"}),
    ("eager", "no-join"): (("race-raw", "eager-B", "eager-D"), {"race-raw", "unjoined", "lifetime"}),
    ("eager", "late-join"): (("race-raw", "eager-B", "eager-D"), {"race-raw"}),
    ("eager", "no-record"): (("lifetime", "eager-D", None), {"lifetime"}),
    ("eager", "free-early"): (("lifetime", "eager-B", "eager-free"), {"lifetime"}),
    ("eager", "unjoined-return"): (("unjoined", "eager-late-side", None), {"unjoined"}),
    ("npugraph_ex", "no-fork"): (("race-raw", "ex-A", "ex-B"), {"race-raw"}),
    ("npugraph_ex", "no-join"): (("race-raw", "ex-B", "ex-D"), {"race-raw", "unjoined", "lifetime"}),
    ("npugraph_ex", "late-join"): (("race-raw", "ex-B", "ex-D"), {"race-raw"}),
    ("npugraph_ex", "no-record-free-early"): (("lifetime", "ex-B", "ex-free"), {"lifetime"}),
    ("npugraph_ex", "unjoined-return"): (("unjoined", "ex-late-side", None), {"unjoined"}),
    ("ge", "discarded-wait"): (("ge-discarded-wait", "ge-discarded", "ge-B"), {"ge-discarded-wait"}),
    ("ge", "mixed-api"): (("mixed-api", "ge-switch", "ge-native"), {"mixed-api"}),
}


def test_every_fixture_mutant_has_an_expectation():
    listed = {("eager", m) for m in dag.EAGER_MUTANTS} | {("npugraph_ex", m) for m in dag.NPUGRAPH_EX_MUTANTS}
    listed |= {("ge", m) for m in dag.GE_MUTANTS}
    assert listed == set(MUTANTS)


@pytest.mark.parametrize("style,mutant", MUTANTS)
def test_mutant_is_reported_at_the_right_lines(style, mutant):
    (kind, first, second), allowed_kinds = MUTANTS[style, mutant]
    model_class, graph = STYLES[style]
    findings = _run(model_class, mutant, graph)
    assert {f.kind for f in findings} <= allowed_kinds, findings
    matching = [
        f for f in findings if f.kind == kind and f.first == _at(first) and (second is None or f.second == _at(second))
    ]
    assert matching, findings
    for finding in findings:
        assert finding.kind in KINDS
        assert _named(finding.first) in finding.message
        assert _named(finding.second) in finding.message
        assert "\n" not in finding.message


def test_ge_code_run_eagerly_fails_like_real_torchair():
    with install():
        model = dag.GeABCD()
        with pytest.raises(NotImplementedError):
            model(torch.randn(2, 8))


# --- CSAN-style sync cases: a tensor written on main, read on a side stream ---------------
def _write_then_read(sync: str) -> None:
    main, side = torch.npu.current_stream(), torch.npu.Stream()
    data = torch.ones(4)
    data.mul_(2)  # write on main
    event = torch.npu.Event()
    if sync == "wait_stream":
        side.wait_stream(main)
    elif sync == "event":
        event.record(main)
        event.wait(side)
    elif sync == "synchronize":
        torch.npu.synchronize()
    elif sync == "read-before-wait":
        event.record(main)
    with torch.npu.stream(side):
        total = data.sum()  # read on side
        if sync == "read-before-wait":
            event.wait(side)
    main.wait_stream(side)
    return total


@pytest.mark.parametrize(
    "sync,race",
    [
        ("wait_stream", False),
        ("event", False),
        ("none", True),
        ("synchronize", False),
        ("read-before-wait", True),
    ],
)
def test_csan_sync_cases(sync, race):
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            _write_then_read(sync)
    kinds = [f.kind for f in san.findings]
    assert kinds == (["race-raw"] if race else [])


# --- torch_npu sanitizer record_stream table: allocate on main, use on side, free -----------
def _allocate_use_free(sync: str) -> None:
    main, side = torch.npu.current_stream(), torch.npu.Stream()
    created = torch.ones(4) * 3  # allocated on the creation stream (main)
    if sync in ("usage-waits-creation", "both"):
        side.wait_stream(main)
    if sync == "device-synchronize":
        torch.npu.synchronize()
    with torch.npu.stream(side):
        used = created + 1  # used on the usage stream (side)
    if sync in ("creation-waits-usage", "both"):
        main.wait_stream(side)
    if sync == "device-synchronize":
        torch.npu.synchronize()
    del created  # freed: main's allocator may hand the block out again
    main.wait_stream(side)
    return used


@pytest.mark.parametrize(
    "sync,race,needs_record_stream",
    [
        ("none", True, True),
        ("usage-waits-creation", False, True),
        ("creation-waits-usage", True, False),
        ("both", False, False),
        ("device-synchronize", False, False),
    ],
)
def test_npu_sanitizer_record_stream_table(sync, race, needs_record_stream):
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            _allocate_use_free(sync)
    kinds = {f.kind for f in san.findings}
    assert ("race-raw" in kinds) == race
    assert ("lifetime" in kinds) == needs_record_stream
    assert kinds <= {"race-raw", "lifetime"}


def test_record_stream_fixes_the_table_lifetime_case():
    with install() as rt:
        with Sanitizer(rt) as san:
            main, side = torch.npu.current_stream(), torch.npu.Stream()
            created = torch.ones(4) * 3
            side.wait_stream(main)
            with torch.npu.stream(side):
                used = created + 1
            created.record_stream(side)
            del created
            main.wait_stream(side)
    assert san.findings == [] and used.sum() == 16


# --- the other checks -------------------------------------------------------------------
def test_write_after_read_and_write_after_write_races():
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            main, side = torch.npu.current_stream(), torch.npu.Stream()
            data, other = torch.ones(4), torch.ones(4)
            side.wait_stream(main)
            with torch.npu.stream(side):
                data.sum()
                other.fill_(1)
            data.fill_(0)  # WAR with the side read
            other.fill_(2)  # WAW with the side write
            main.wait_stream(side)
    assert sorted(f.kind for f in san.findings) == ["race-war", "race-waw"]


def test_side_allocated_output_returned_without_record_stream():
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            main, side = torch.npu.current_stream(), torch.npu.Stream()
            with torch.npu.stream(side):
                out = torch.ones(4) * 2
            main.wait_stream(side)
            san.check_output(out)
    assert [f.kind for f in san.findings] == ["lifetime"]
    assert "record_stream(main)" in san.findings[0].message


def test_unjoined_work_is_reported_at_exit_without_check_output():
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            with torch.npu.stream(torch.npu.Stream()):
                torch.ones(2).add_(1)
    assert [f.kind for f in san.findings] == ["unjoined"]


def test_item_synchronizes_the_current_stream():
    with install() as rt:
        with Sanitizer(rt) as san:
            main, side = torch.npu.current_stream(), torch.npu.Stream()
            data = torch.ones(4)
            side.wait_stream(main)
            with torch.npu.stream(side):
                data.add_(1)
                data.sum().item()  # host waits for side
            data.add_(1)
    assert san.findings == []


def test_torchair_tagged_events_order_streams_in_eager():
    with install() as rt:
        from torchair import ops as tops

        with Sanitizer(rt) as san:
            fork, join = tops.npu_create_tagged_event("fork"), tops.npu_create_tagged_event("join")
            data = torch.ones(4) * 2
            tops.npu_tagged_event_record(fork)
            with torch.npu.stream(torch.npu.Stream()):
                tops.npu_tagged_event_wait(fork)
                out = data + 1
                tops.npu_tagged_event_record(join)
                tops.npu_record_tagged_stream(out, "default")
            tops.npu_tagged_event_wait(join)
            san.check_output(out * 1)
    # The events order both streams; only the torch.npu.stream() next to torchair.ops is flagged.
    assert [f.kind for f in san.findings] == ["mixed-api"]


def test_graph_mode_cross_stream_data_dependencies_are_not_races():
    with install() as rt:
        import torchair

        with Sanitizer(rt) as san, rt.graph_mode():
            data = torch.ones(4) * 2
            with torchair.scope.npu_stream_switch("7", 0):
                side_out = data + 1  # no wait: GE orders data edges itself
            data.add_(1)
            result = side_out * data
            san.check_output(result)
    assert san.findings == []


def test_mixed_api_is_reported_once_per_function():
    def mixed():
        import torchair

        with torchair.scope.npu_stream_switch("1", 0):
            pass
        torch.npu.current_stream()
        torch.npu.Event()

    with install() as rt:
        with Sanitizer(rt) as san:
            mixed()
            mixed()
    assert [f.kind for f in san.findings] == ["mixed-api"]
    assert isinstance(san.findings[0], Finding)


def test_static_mixed_api_finds_the_ge_forward_only():
    findings = static_mixed_api(FIXTURE.read_text(), str(FIXTURE))
    assert [(f.kind, f.first, f.second) for f in findings] == [("mixed-api", _at("ge-switch"), _at("ge-native"))]
    clean = "def f(s, x):\n    with torch.npu.stream(s):\n        x.record_stream(s)\n"
    assert static_mixed_api(clean) == []
