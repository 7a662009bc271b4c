"""`msrewrite profile`: known answers on fixture traces in both formats (tests/fixtures/profile/,
written by make_traces.py, whose docstring derives every number below), the streamed reader, the
gantt, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_main
from msrewrite.errors import BadInput
from msrewrite.profile.analysis import analyze
from msrewrite.profile.gantt import gantt
from msrewrite.profile.jsonstream import TraceFormatError, iter_events
from msrewrite.profile.trace import load_trace
from msrewrite.suggest import mermaid

FIX = Path(__file__).parent / "fixtures" / "profile"
TRACES = {
    "torch": (FIX / "torch_on.json", FIX / "torch_off.json"),
    "torch-host-ranges": (FIX / "torch_on_host_ranges.json", FIX / "torch_off.json"),
    "torch_npu": (FIX / "npu_on", FIX / "npu_off"),
}


@pytest.mark.parametrize("kind", TRACES)
def test_known_answers(kind: str) -> None:
    on, off = TRACES[kind]
    from msrewrite.commands.profile import estimates_from

    profile = analyze(load_trace(on), load_trace(off), estimates_from(FIX / "plans.json"))
    (region,) = profile.regions
    assert (region.case, region.tag) == ("moe-shared-expert", "shared_expert")
    assert len(region.occurrences) == 4
    for occ in region.occurrences:
        assert (occ.side_busy, occ.main_busy, occ.overlap, occ.exposed, occ.tail) == (18, 14, 12, 6, 4)
    assert [s.step for s in region.steps] == ["ProfilerStep#1", "ProfilerStep#2"]
    for s in region.steps:
        assert (s.occurrences, s.side_busy, s.main_busy, s.overlap, s.exposed, s.tail) == (2, 36, 28, 24, 12, 8)
    assert profile.step_us == [53, 53] and profile.baseline_step_us == [73, 73]
    assert profile.saving_us == 20
    assert region.estimate_us == pytest.approx(12.0) and region.measured_us == 12
    # contention: only the routed experts slowed down (16 -> 20 µs per step); the unchanged
    # operators (router, shared expert, combine) did not grow, so they are not listed
    grown = {(g.kind, g.baseline_us, g.measured_us) for g in profile.contention}
    assert ("kernel", 16, 20) in grown
    assert all((g.baseline_us, g.measured_us) == (16, 20) for g in profile.contention)
    assert len([g for g in profile.contention if g.kind == "kernel"]) == 1
    if kind == "torch_npu":  # op_statistic.csv: by operator type as well
        assert [(g.operator, g.kind) for g in profile.contention if g.kind == "type"] == [("GroupedMatmul", "type")]


def test_threshold_above_the_growth_lists_nothing() -> None:
    on, off = TRACES["torch"]
    assert analyze(load_trace(on), load_trace(off), threshold=0.3).contention == []


def test_estimate_comes_from_suggest_cost_model() -> None:
    """The plan file's costs go through suggest's BranchCost.saving (min(side, main) - syncs)."""
    from msrewrite.commands.profile import estimates_from

    data = json.loads((FIX / "plans.json").read_text())
    data["candidates"][0]["cost"]["main_us"] = 30.0  # now the side branch (17) is the shorter one
    path = FIX.parent.parent / "_tmp_plans.json"
    try:
        path.write_text(json.dumps(data))
        assert estimates_from(path)[("moe-shared-expert", "shared_expert")] == pytest.approx(15.0)
    finally:
        path.unlink()


def test_edited_file_names_regions_missing_from_the_trace(tmp_path: Path) -> None:
    edited = tmp_path / "m.py"
    edited.write_text('_ms_range_start("msrewrite:indexer-prolog:q:side", s)\n')
    out = run_main("profile", str(FIX / "torch_on.json"), "--edit", str(edited), "--json")
    assert out.returncode == 0, out.stderr
    notes = json.loads(out.stdout)["notes"]
    assert any("indexer-prolog:q" in n and "not in the trace" in n for n in notes)


def test_cli_table_fits_80_columns_and_json_round_trips() -> None:
    on, off = TRACES["torch"]
    out = run_main("profile", str(on), "--baseline", str(off), "--edit", str(FIX / "plans.json"), "--gantt")
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("```")[0]
    assert all(len(line) <= 80 for line in table.splitlines()), table
    assert "saving 20.0 µs" in out.stdout and "(1.00x)" in out.stdout
    data = json.loads(run_main("profile", str(on), "--baseline", str(off), "--json").stdout)
    assert data["saving_per_step_us"] == 20.0
    assert data["regions"][0]["steps"][0]["overlap_us"] == 24.0
    assert mermaid.check(data["gantt"]) == []


@pytest.mark.parametrize("kind", TRACES)
def test_gantt_passes_the_strict_grammar(kind: str) -> None:
    profile = analyze(load_trace(TRACES[kind][0]))
    text = gantt(profile)
    assert mermaid.check(text) == [], text
    assert text.count(" window :crit, ") == 4  # two layers' side and main windows in the step
    assert mermaid.check(gantt(analyze(load_trace(TRACES[kind][1])))) == []  # a trace without regions


def test_gantt_checker_rejects_bad_charts() -> None:
    good = "gantt\n    title t\n    dateFormat x\n    axisFormat %L\n    section s\n    a :t1, 0, 4"
    assert mermaid.check(good) == []
    assert mermaid.check(good + "\n    b :t1, 4, 6")  # id reused
    assert mermaid.check(good + "\n    b :t2, 6, 4")  # ends before it starts
    assert mermaid.check(good + "\n    a::b :t3, 0, 1")  # a colon in the label
    assert mermaid.check(good.replace("    section s\n", ""))  # task before any section
    assert mermaid.check(good.replace("    dateFormat x\n", ""))


def test_no_regions_exits_1_and_says_how_to_get_them() -> None:
    out = run_main("profile", str(FIX / "torch_off.json"))
    assert out.returncode == 1
    assert "apply --markers" in out.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"schemaVersion": 1}', "no traceEvents array"),
        ('{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 2}', "not closed"),
        ('{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": "soon", "dur": 2, "args": {}}]}', "not a number"),
        ("[1, 2]", "unexpected byte"),
    ],
)
def test_bad_traces_are_one_line_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    out = run_main("profile", str(path))
    assert out.returncode == 2
    assert out.stderr.startswith("msrewrite: error: ") and message in out.stderr
    assert out.stderr.count("\n") == 1 and out.stdout == ""


def test_bad_npu_folder_and_unpaired_marker(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="ASCEND_PROFILER_OUTPUT"):
        load_trace(tmp_path)
    events = json.loads((FIX / "torch_on.json").read_text())
    events["traceEvents"] = [
        e
        for e in events["traceEvents"]
        if not (e.get("cat") == "gpu_user_annotation" and e["name"].endswith(":main") and e["ts"] > 2000)
    ]
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(events))
    with pytest.raises(BadInput, match="4 side and 3 main"):
        analyze(load_trace(path))


# the streamed reader --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["torch_on.json", "npu_on/ASCEND_PROFILER_OUTPUT/trace_view.json"])
@pytest.mark.parametrize("chunk", [64, 1000, 1 << 22])
def test_streamed_events_equal_json_load(name: str, chunk: int) -> None:
    path = FIX / name
    data = json.loads(path.read_text())
    expected = data["traceEvents"] if isinstance(data, dict) else data
    assert list(iter_events(path, chunk=chunk)) == expected
    kept = list(iter_events(path, keep=lambda text: b'"kernel"' in text, chunk=chunk))
    assert kept == [e for e in expected if e.get("cat") == "kernel"]


def test_separator_inside_an_event_falls_back_to_the_exact_reader(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "a}, {b", "ts": 1},
        {"ph": "X", "cat": "cpu_op", "args": {"objs": [{"a": 1}, {"b": {"c": {"d": 2}}}]}},
        {"ph": "X", "cat": "x", "name": 'n}, {"kernel"', "ts": 2},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, "traceName": "x"}))
    for chunk in (16, 1 << 22):
        assert list(iter_events(path, chunk=chunk)) == events
        assert list(iter_events(path, keep=lambda t: b"kernel" in t, chunk=chunk)) == [events[0], events[2]]


def test_cut_short_trace_raises(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    text = (FIX / "torch_on.json").read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(TraceFormatError):
        list(iter_events(path, chunk=256))


# suggest --report: profile acceptance ---------------------------------------------------------------
def test_report_profile_acceptance_section_is_filled_from_profile_json(tmp_path: Path) -> None:
    on, off = TRACES["torch"]
    measured = run_main("profile", str(on), "--baseline", str(off), "--edit", str(FIX / "plans.json"), "--json")
    (tmp_path / "profile.json").write_text(measured.stdout)
    example = Path(__file__).parents[1] / "examples" / "deepseek_moe.py"
    out = run_main(
        "suggest",
        "--static",
        str(example),
        "--report",
        str(tmp_path / "r"),
        "--profile",
        str(tmp_path / "profile.json"),
    )
    assert out.returncode == 0, out.stderr
    text = next((tmp_path / "r").glob("*.md")).read_text()
    section = text[text.index("### 11.5 Profile acceptance") : text.index("## 12.")]
    assert "| moe-shared-expert:shared_expert | 12.0 | 12.0 | 1.00x | 12.0 | 8.0 | 4 |" in section
    assert "20.0 µs per step" in section and "+25%" in section
    assert all(mermaid.check(b) == [] for b in mermaid.blocks(text))
    plain = run_main("suggest", "--static", str(example), "--report", str(tmp_path / "p"))
    assert plain.returncode == 0
    assert "### 11.5 Profile acceptance\n\nN/A (apply --markers" in next((tmp_path / "p").glob("*.md")).read_text()


def test_report_profile_needs_report_and_profile_json(tmp_path: Path) -> None:
    example = Path(__file__).parents[1] / "examples" / "deepseek_moe.py"
    bad = tmp_path / "p.json"
    bad.write_text('{"candidates": []}')
    for args in (["--profile", str(bad)], ["--profile", str(bad), "--report", str(tmp_path / "r")]):
        out = run_main("suggest", "--static", str(example), *args)
        assert out.returncode == 2 and out.stderr.startswith("msrewrite: error: --profile")


# the analysis' indexes ------------------------------------------------------------------------------
def test_kernel_index_and_step_finder_agree_with_the_plain_definitions() -> None:
    """KernelIndex.clipped equals clipped() (every kernel read), and the step finder equals the
    first step holding t, on random kernels that overlap on one stream, touch windows' edges and
    sit outside every step."""
    import random

    from msrewrite.profile.analysis import KernelIndex, _step_finder, clipped
    from msrewrite.profile.trace import Span

    rng = random.Random(5)
    for _ in range(40):
        kernels = [
            Span("k", a, a + rng.choice([0.0, 0.5, 3.0, 40.0]), rng.choice(["0:7", "0:20", "1:7"]))
            for a in (rng.randrange(0, 200) / 2 for _ in range(rng.randrange(1, 60)))
        ]
        index = KernelIndex(kernels)
        for _ in range(30):
            a = rng.randrange(-10, 210) / 2
            window = Span("w", a, a + rng.choice([0.0, 0.5, 7.0, 60.0]), "")
            for stream in ("0:7", "0:20", "1:7", "9:9"):
                assert index.clipped(stream, window) == clipped(kernels, stream, window)
        starts = sorted(rng.randrange(0, 100) for _ in range(rng.randrange(0, 8)))
        steps = [Span(f"s{i}", a, a + rng.choice([1, 5, 30]), "") for i, a in enumerate(starts)]
        step_of = _step_finder(steps)
        for t in range(-2, 140):
            expected = next((s.name for s in steps if s.start <= t / 1 < s.end), "-")
            assert step_of(t) == expected, (t, steps)


def test_analysis_reads_each_kernel_a_few_times_not_once_per_window() -> None:
    """100k kernels and 2000 windows: the old per-window scan read 200M kernels (minutes); the
    index reads the few near each window."""
    import time

    from msrewrite.profile.trace import Span, Trace

    kernels = [
        Span("k", i * 10.0 + (2 if s == "0:20" else 0), i * 10.0 + 6 + (2 if s == "0:20" else 0), s)
        for i in range(50_000)
        for s in ("0:7", "0:20")
    ]
    markers = []
    for j in range(1000):
        a = j * 400.0
        markers += [Span("msrewrite:c:t:side", a, a + 50, "0:20"), Span("msrewrite:c:t:main", a, a + 40, "0:7")]
    trace = Trace("x", "torch", kernels=kernels, markers=markers)
    started = time.process_time()
    (region,) = analyze(trace).regions
    assert time.process_time() - started < 20
    assert len(region.occurrences) == 1000
    # side window [a, a+50] on 0:20 holds [a+2, a+8] ... [a+42, a+48]: 5 x 6 = 30; main window
    # [a, a+40] on 0:7 holds [a, a+6] ... [a+30, a+36] (the one at a+40 is cut to nothing): 24;
    # they overlap on [a+2, a+6] ... [a+32, a+36]: 4 x 4 = 16; the side window ends 10 later
    assert all(
        (o.side_busy, o.main_busy, o.overlap, o.exposed, o.tail) == (30, 24, 16, 14, 10) for o in region.occurrences
    )


def test_npu_lanes_as_msprof_writes_them() -> None:
    """trace_view.json's device lanes as msprof writes them (make_traces.py cites the sources):
    tasks carry args["Task Type"]; an mstx range with a stream is an X event on the stream's
    thread of the Ascend Hardware process; another tool's range there is not a task."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_traces", FIX / "make_traces.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    trace = load_trace(FIX / "npu_on")
    hardware = make.HARDWARE_PID
    assert {k.name for k in trace.kernels} == set(make.NPU_OP.values())  # not hccl_allgather, not the ranges
    assert len(trace.kernels) == 20 and {k.stream for k in trace.kernels} == {f"{hardware}:2", f"{hardware}:5"}
    assert trace.stream_names == {f"{hardware}:2": "Stream 2", f"{hardware}:5": "Stream 5"}
    assert [(m.name.rsplit(":", 1)[1], m.stream) for m in trace.markers[:2]] == [
        ("main", f"{hardware}:2"),
        ("side", f"{hardware}:5"),
    ]
    assert trace.host_only_markers == []  # the host sides (MsprofTx layer) are seen on the device too
    assert len(trace.steps) == 2  # from kernel_details.csv's Step Id


def test_a_branch_plans_estimate_is_keyed_like_its_ranges(tmp_path: Path) -> None:
    """apply --markers names a several-stream case's window by its branch
    (msrewrite:indexer-prolog:q_quant:side); the plan file's estimate must land on that region,
    not on the stream tag another branch shares (q and q_quant both run on indexer_q)."""
    from msrewrite.commands.profile import estimates_from
    from msrewrite.plan import OverlapPlan

    data = json.loads((FIX / "plans.json").read_text())
    q_quant = data["candidates"][0]
    q_quant["plan"].update(case="indexer-prolog", case_branch="q_quant", stream_tag="indexer_q")
    q = json.loads(json.dumps(q_quant))
    q["plan"]["case_branch"] = "q"
    q["cost"]["side_us"] = 3.0  # a different estimate: min(3, 14) - 2 = 1 µs
    data["candidates"] = [q, q_quant]
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(data))
    estimates = estimates_from(path)
    assert estimates == {
        ("indexer-prolog", "q"): pytest.approx(1.0),
        ("indexer-prolog", "q_quant"): pytest.approx(12.0),
    }
    assert OverlapPlan.from_dict(q_quant["plan"]).region_tag == "q_quant"
    edited = tmp_path / "m.py"  # the edited file's ranges name the same regions
    edited.write_text(
        '_ms_range_start("msrewrite:indexer-prolog:q_quant:side", s)\n'
        '_ms_range_start("msrewrite:indexer-prolog:q-quant-2:main", s)\n'
    )
    assert set(estimates_from(edited)) == {("indexer-prolog", "q_quant"), ("indexer-prolog", "q-quant-2")}


def test_the_fixture_plans_file_is_what_make_traces_writes() -> None:
    """plans.json is a plan file as suggest writes it today: a new plan field must reach it
    (regenerate with `python tests/fixtures/profile/make_traces.py`)."""
    from helpers import load_file

    make_traces = load_file(FIX / "make_traces.py", "make_traces")
    assert json.loads((FIX / "plans.json").read_text()) == json.loads(json.dumps(make_traces.plans()))
