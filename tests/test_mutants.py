"""Mutants of every golden edit: each broken sync is caught by `verify`, with the right kind and line.

The unmutated golden edits verify clean (tests/test_golden.py pins their text; here they run).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import EXAMPLES, load_regen
from msrewrite.cases import all_cases
from msrewrite.commands.apply import plans_for_case
from msrewrite.emit.engine import apply_plans
from msrewrite.load import load
from msrewrite.plan import FlagSpec, StartGate
from msrewrite.verify import verify_files

pytestmark = pytest.mark.slow  # a verify run of every golden edit, then of each mutant

regen = load_regen()
EXAMPLE_NAMES = ["deepseek_moe", "qwen_gated_moe"]


def drop_line(pattern: str) -> Callable[[str], tuple[str, str]]:
    """Remove the single line matching `pattern`; the expected finding points at `anchor`."""

    def mutate(text: str) -> str:
        lines = text.splitlines(keepends=True)
        hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        assert len(hits) == 1, (pattern, hits)
        del lines[hits[0]]
        return "".join(lines)

    return mutate


def drop_lines(pattern: str, count: int) -> Callable[[str], str]:
    """Remove every one of the `count` lines matching `pattern`."""

    def mutate(text: str) -> str:
        lines = text.splitlines(keepends=True)
        kept = [line for line in lines if not re.search(pattern, line)]
        assert len(lines) - len(kept) == count, pattern
        return "".join(kept)

    return mutate


def join_block(lines: list[str]) -> tuple[int, int]:
    """[start, end) of the emitted join block: its comment through its last indented line."""
    start = next(i for i, line in enumerate(lines) if "join the side stream before" in line)
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 2
    while end < len(lines) and (
        len(lines[end]) - len(lines[end].lstrip()) > indent or lines[end].lstrip().startswith("else")
    ):
        end += 1
    return start, end


def join_after_consumer(wait_pattern: str, cond: str) -> Callable[[str], str]:
    """Move the join's wait from before the first consumer to just after it."""

    def mutate(text: str) -> str:
        lines = text.splitlines(keepends=True)
        start, end = join_block(lines)
        wait_at = next(i for i in range(start, end) if re.search(wait_pattern, lines[i]))
        wait = lines.pop(wait_at)
        consumer_at = end - 1  # the block lost one line
        indent = lines[consumer_at][: len(lines[consumer_at]) - len(lines[consumer_at].lstrip())]
        lines[consumer_at + 1 : consumer_at + 1] = [f"{indent}if {cond}:\n", indent + "    " + wait.lstrip()]
        return "".join(lines)

    return mutate


def unjoined_at_return(text: str) -> str:
    """Drop the join and every use of the side output: the side work is never waited for."""
    lines = text.splitlines(keepends=True)
    start, end = join_block(lines)
    outputs = re.search(r"before the first use of ([\w, ]+)\.", lines[start]).group(1).split(", ")
    consumer = lines[end]
    for name in outputs:
        if re.fullmatch(rf"\s*\w+ [+*]= {name}\s*", consumer):  # `out += shared`: nothing left to keep
            consumer = consumer[: len(consumer) - len(consumer.lstrip())] + "pass\n"
        consumer = re.sub(rf"\s*[+*]\s*{name}\b|\b{name}\s*[+*]\s*", "", consumer)
    lines[start : end + 1] = [consumer]
    return "".join(lines)


@dataclass
class Mutant:
    name: str
    mutate: Callable[[str], str]
    kind: str  # the finding kind that must be reported
    line_marker: str  # a regex for the line the finding must point at (either location)
    full: bool = False  # needs the train run and the random draws, not only the eval run


def in_window(template: str) -> Callable[[str], str]:
    """Insert a main-path statement just before the join block: `{x}` is the side input the shared
    expert reads, `{m}` the shared expert attribute."""

    def mutate(text: str) -> str:
        lines = text.splitlines(keepends=True)
        call = re.search(r"self\.(shared_experts?)\((\w+)\)", text)
        start, _ = join_block(lines)
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        statement = template.format(x=call.group(2), m=call.group(1))
        lines[start:start] = [indent + line + "\n" for line in statement.split("\n")]
        return "".join(lines)

    return mutate


# New finding kinds (issue 11): each one is a main-path statement inside the window.
WINDOW = [
    Mutant("storage-free-in-window", in_window("{x}.untyped_storage().resize_(0)"), "lifetime", r"resize_\(0\)"),
    Mutant("data-dependent-write", in_window("{x}[{x} > 1.0] = 0.0"), "race-war", r"\] = 0\.0"),
    Mutant("train-only-write", in_window("if self.training:\n    {x}.mul_(1.01)"), "race-war", r"mul_\(1\.01\)", True),
    Mutant(
        "shared-buffer-write",
        in_window("next(self.{m}.parameters()).data.mul_(1.0)"),
        "race-war",
        r"parameters\(\)\)\.data\.mul_",
    ),
]


NATIVE = [
    Mutant(
        "fork-wait-removed",
        drop_line(r"shared_expert_stream\.wait_stream\(current_stream\)"),
        "race-raw",
        r"self\.\w+\(",
    ),
    Mutant("join-removed", drop_line(r"current_stream\.wait_stream\(shared_expert_stream\)"), "race-raw", r"_output\b"),
    Mutant(
        "join-after-consumer",
        join_after_consumer(r"current_stream\.wait_stream\(", "shared_expert_stream is not None"),
        "race-raw",
        r"_output\b",
    ),
    Mutant("lifetime-guard-removed", drop_line(r"_ms_record_stream\(current_stream, "), "lifetime", r"."),
    Mutant("unjoined-at-return", unjoined_at_return, "unjoined", r"."),
]
NPUGRAPH_EX = [
    Mutant("fork-wait-removed", drop_line(r"^\s+fork_event\.wait\(\)"), "race-raw", r"self\.\w+\("),
    Mutant("join-removed", drop_line(r"^\s+join_event\.wait\(\)"), "race-raw", r"_output\b"),
    Mutant(
        "join-after-consumer",
        join_after_consumer(r"join_event\.wait\(", "shared_expert_stream is not None"),
        "race-raw",
        r"_output\b",
    ),
    Mutant(
        "lifetime-guard-removed", drop_line(r"_ms_record_stream\(torch\.npu\.current_stream\(\), "), "lifetime", r"."
    ),
    Mutant("unjoined-at-return", unjoined_at_return, "unjoined", r"."),
]
EVENTS = [  # moe-shared-mlp-init: fresh events per call
    Mutant("fork-wait-removed", drop_line(r"input_ready_event\.wait\("), "race-raw", r"self\.\w+\("),
    Mutant("join-removed", drop_line(r"_done_event\.wait\(current_stream\)"), "race-raw", r"hidden_states_mlp\b"),
    Mutant(
        "join-after-consumer",
        join_after_consumer(r"_done_event\.wait\(", "shared_mlp_stream is not None"),
        "race-raw",
        r"hidden_states_mlp\b",
    ),
    Mutant("lifetime-guard-removed", drop_line(r"_ms_record_stream\(current_stream, "), "lifetime", r"."),
    Mutant("unjoined-at-return", unjoined_at_return, "unjoined", r"."),
]
PHASED = [  # moe-shared-expert-phased: the join is what protects the result
    Mutant(
        "join-removed",
        drop_line(r"current_stream\.wait_stream\(shared_expert_stream\)"),
        "race-raw",
        r"shared_output\b",
    ),
    Mutant("lifetime-guard-removed", drop_line(r"_ms_record_stream\(current_stream, "), "lifetime", r"."),
    Mutant("unjoined-at-return", unjoined_at_return, "unjoined", r"."),
]
INDEXER = [  # indexer-prolog: two streams, each join protects its own result
    # the q join already covers the q quantization issued on the same stream: drop both
    Mutant(
        "q-stream-joins-removed",
        drop_lines(r"current_stream(_3)?\.wait_stream\(indexer_q_stream", 2),
        "race-raw",
        r"q_int8",
    ),
    Mutant(
        "weights-join-removed",
        drop_line(r"current_stream_2\.wait_stream\(indexer_weights_stream\)"),
        "race-raw",
        r"weights",
    ),
    Mutant(
        "weights-fork-removed", drop_line(r"indexer_weights_stream\.wait_stream\(current_stream_2\)"), "race-raw", r"."
    ),
]
OFFLOAD = [  # kvcache-offload: the join protects buffer reuse and the host copies
    Mutant("join-removed", drop_line(r"kv_copy_done_event\.wait\(current_stream\)"), "race-raw", r"."),
    Mutant("fork-removed", drop_line(r"input_ready_event\.wait\(kv_copy_stream\)"), "race-raw", r"copy_"),
]
LIMIT_CORE = [  # attn-moe-limit-core: the core limits change nothing about the sync
    Mutant(
        "fork-wait-removed",
        drop_line(r"moe_shortcut_stream\.wait_stream\(current_stream\)"),
        "race-raw",
        r"self\.\w+\(",
    ),
    Mutant(
        "join-removed",
        drop_line(r"current_stream\.wait_stream\(moe_shortcut_stream\)"),
        "race-raw",
        r"shortcut_mlp_output",
    ),
    Mutant("lifetime-guard-removed", drop_line(r"_ms_record_stream\(current_stream, "), "lifetime", r"."),
]
# The mutation operators of each case's edit (its sync, its stream names, its output): a case's
# declared mutant_modes x mutant_examples (msrewrite/cases/) are mutated with these; a case with
# none of its own gets the generic ones of its sync (GENERIC), built from its stream tag.
OPERATORS = {
    ("attn-moe-limit-core", "eager"): LIMIT_CORE,
    ("kvcache-offload", "eager"): OFFLOAD,
    ("indexer-prolog", "eager"): INDEXER,
    ("moe-shared-expert-phased", "eager"): PHASED,
    ("moe-shared-expert", "eager"): NATIVE + WINDOW,
    ("moe-shared-expert", "cuda"): NATIVE + WINDOW,
    ("moe-shared-expert", "npugraph-ex"): NPUGRAPH_EX,
    ("moe-shared-mlp-init", "eager"): EVENTS,
    ("moe-shared-mlp-init", "cuda"): EVENTS,
}


def generic_operators(case) -> list[Mutant]:
    """A wait_stream case's fork and join, found by its stream tag: dropping either is a race."""
    stream = f"{case.stream_tag}_stream"
    return [
        Mutant("fork-wait-removed", drop_line(rf"{stream}\.wait_stream\(current_stream\)"), "race-raw", r"."),
        Mutant("join-removed", drop_line(rf"current_stream\.wait_stream\({stream}\)"), "race-raw", r"."),
    ]


def mutants(cases=None) -> dict[tuple[str, str], list[Mutant]]:
    """(case, mode) -> its mutants, for every case that declares mutant modes and examples."""
    found = {}
    for case in all_cases() if cases is None else cases:
        for mode in case.mutant_modes if case.mutant_examples else ():
            found[(case.name, mode)] = OPERATORS.get((case.name, mode)) or generic_operators(case)
    return found


MUTANTS = mutants()


def run_verify(tmp_path: Path, example: str, text: str, full: bool = False, examples: Path = EXAMPLES):
    """A mutant breaks a sync: the default eval run shows it. `full`: every scenario and schedule.
    `examples`: the folder of the example models (another for a case outside this checkout)."""
    edited = tmp_path / f"{example}.py"
    edited.write_text(text)
    if full:
        return verify_files(edited, original=examples / f"{example}.py")
    return verify_files(edited, original=examples / f"{example}.py", inputs=0, train=False)


MUTATED_EXAMPLES = {case.name: case.mutant_examples for case in all_cases()}
PARAMS = [
    (case, mode, example, m) for (case, mode), ms in MUTANTS.items() for example in MUTATED_EXAMPLES[case] for m in ms
]


@pytest.mark.parametrize("case,mode,example,mutant", PARAMS, ids=[f"{p[0]}-{p[1]}-{p[2]}-{p[3].name}" for p in PARAMS])
def test_mutant_is_caught(tmp_path, case, mode, example, mutant):
    golden, _ = regen.golden_paths(case, mode, example)
    text = mutant.mutate(golden.read_text())
    assert text != golden.read_text()
    result = run_verify(tmp_path, example, text, full=mutant.full)
    kinds = {f.kind for f in result.findings}
    assert mutant.kind in kinds, (kinds, result.problems)
    lines = text.splitlines()
    pointed = [
        lines[loc[1] - 1]
        for f in result.findings
        if f.kind == mutant.kind
        for loc in (f.first, f.second)
        if loc[0].endswith(f"{example}.py") and 0 < loc[1] <= len(lines)
    ]
    assert any(re.search(mutant.line_marker, line) for line in pointed), pointed


GOLDENS = [
    (case, mode, example)
    for case, examples in regen.golden_examples().items()
    for mode in regen.golden_modes(case)
    for example in examples
    # these need a process group: tests/test_afd_gloo.py and tests/test_microbatch_gloo.py run them
    if case not in ("afd-overlap", "prefill-microbatch")
]


@pytest.mark.parametrize("case,mode,example", GOLDENS, ids=["-".join(g) for g in GOLDENS])
def test_unmutated_golden_verifies_clean(tmp_path, case, mode, example):
    golden, _ = regen.golden_paths(case, mode, example)
    result = run_verify(tmp_path, example, golden.read_text(), full=True)
    assert result.ok, result.problems
    assert not result.findings
    # the draws at batch 1 and 1 token, or (where the original rejects that size) at make()'s shape
    assert {"train", "draw 1", "draw 2"} <= {s.split(" (")[0] for s in result.scenarios}, result.scenarios
    # the side work deferred to the join (and split around main work) gives the original's outputs,
    # in every scenario (eval, train, zero tokens, random draws), guarded and phased plans included
    # (each phase deferred up to the next issue on its stream, the last one up to the join)
    assert result.schedules == ["early", "late", "interleaved"], result.schedule_note
    for schedule in ("late", "interleaved"):
        runs = [r.name for r in result.runs if r.name.endswith(f"{schedule} schedule")]
        assert len(runs) == len(result.scenarios), [r.name for r in result.runs]


def _ge_edit_with_gate(example: str) -> str:
    path = EXAMPLES / f"{example}.py"
    src = load(path)
    anchor = {"deepseek_moe": "topk_indices", "qwen_gated_moe": "selected_experts"}[example]
    plans = plans_for_case(
        path,
        src.module,
        "moe-shared-expert",
        "ge-graph",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
        (StartGate("", anchor),),
    )
    return apply_plans(src.module, plans).code


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_ge_start_gate_verifies_clean_and_its_discarded_rebind_is_caught(tmp_path, example):
    text = _ge_edit_with_gate(example)
    assert "= _ms_wait_tensor(" in text
    assert run_verify(tmp_path, example, text).ok
    discarded = re.sub(r"(\s+)(\w+) = (_ms_wait_tensor\()", r"\1\3", text, count=1)
    discarded = re.sub(r"(\w+)_side\b", r"\1", discarded)  # the side keeps reading the un-gated tensor
    result = run_verify(tmp_path, example, discarded)
    assert "ge-discarded-wait" in {f.kind for f in result.findings}, result.problems


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_ge_mixed_api_family_is_caught(tmp_path, example):
    golden, _ = regen.golden_paths("moe-shared-expert", "ge-graph", example)
    text = golden.read_text().replace(
        '            with torchair.scope.npu_stream_switch("shared_expert", 0):\n',
        "            torch.npu.current_stream().wait_stream(torch.npu.current_stream())\n"
        '            with torchair.scope.npu_stream_switch("shared_expert", 0):\n',
    )
    result = run_verify(tmp_path, example, text)
    assert "mixed-api" in {f.kind for f in result.findings}, result.problems


@pytest.mark.parametrize("mode", ["eager", "ge-graph"])
def test_guarded_late_schedule_names_the_leaking_statement(tmp_path, mode):
    """A guarded plan's side work is deferred under its guard too, into the guarded `if`: with a
    main-path write to the side input there, after the side call (the guarded example's plan forced
    onto it, as the emitter carries out a plan file), the late schedule's result differs and verify
    names that statement."""
    import dataclasses

    from msrewrite.emit.schedules import ScheduleSource

    example = EXAMPLES / "guarded_moe.py"
    src = load(example)
    (plan,) = plans_for_case(
        example, src.module, "moe-shared-expert", mode, None, FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"), None
    )
    anchor = "            shared_output = self.shared_experts(hidden_states)\n"
    leak = src.text[: src.text.index(anchor)].count("\n") + 2  # the line the write goes to
    original = tmp_path / "guarded_moe.py"
    original.write_text(src.text.replace(anchor, anchor + "            hidden_states.mul_(2)\n"))

    def shift(line: int) -> int:
        return line + 1 if line >= leak else line

    plan = plan.with_changes(
        join_line=shift(plan.join_line),
        guard_line=shift(plan.guard_line),
        side=tuple(
            dataclasses.replace(s, first_line=shift(s.first_line), last_line=shift(s.last_line)) for s in plan.side
        ),
    )
    mutated = load(original)
    edited = tmp_path / "guarded_moe_ms.py"
    edited.write_text(apply_plans(mutated.module, [plan], mutated.text).code)
    result = verify_files(
        edited, original=original, schedule_source=ScheduleSource(mutated.text, [plan]), inputs=0, train=False
    )
    assert result.schedules == ["early", "late", "interleaved"], result.schedule_note
    assert any(
        "late schedule" in p and f"main statement at line {leak}: hidden_states.mul_(2)" in p for p in result.problems
    ), result.problems


@pytest.mark.parametrize("mode", ["eager", "ge-graph"])
def test_phased_late_schedule_names_the_leaking_statement(tmp_path, mode):
    """A phased plan's phase 1 re-enters the side stream after dispatch_output and may run up to the
    join: with a main-path write to its input inside that span (after its anchor, and after the side
    call in the original, so the original is unaffected; the plan found on the unwritten file forced
    onto it), the late schedule's result differs and verify names the write. The early schedule,
    with phase 1 issued at its anchor, reads the input before the write."""
    import dataclasses

    from msrewrite.emit.schedules import ScheduleSource

    example = EXAMPLES / "deepep_moe.py"
    src = load(example)
    (plan,) = plans_for_case(
        example,
        src.module,
        "moe-shared-expert-phased",
        mode,
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )
    assert plan.phase_anchors == ("dispatch_output", "combine_input"), plan.phase_anchors
    anchor = "        dispatch_output = self.experts.dispatcher.dispatch(hidden_states, topk_idx, topk_weights)\n"
    leak = src.text[: src.text.index(anchor)].count("\n") + 2  # the line the write goes to
    original = tmp_path / "deepep_moe.py"
    original.write_text(src.text.replace(anchor, anchor + "        hidden_states.mul_(2)\n"))

    def shift(line: int) -> int:
        return line + 1 if line >= leak else line

    plan = plan.with_changes(
        join_line=shift(plan.join_line),
        side=tuple(
            dataclasses.replace(s, first_line=shift(s.first_line), last_line=shift(s.last_line)) for s in plan.side
        ),
    )
    mutated = load(original)
    edited = tmp_path / "deepep_moe_ms.py"
    edited.write_text(apply_plans(mutated.module, [plan], mutated.text).code)
    result = verify_files(
        edited, original=original, schedule_source=ScheduleSource(mutated.text, [plan]), inputs=0, train=False
    )
    assert result.schedules == ["early", "late", "interleaved"], result.schedule_note
    assert not any(p.startswith("flag on:") for p in result.problems), result.problems
    assert any(
        "late schedule" in p and f"main statement at line {leak}: hidden_states.mul_(2)" in p for p in result.problems
    ), result.problems


def test_phased_schedules_refuse_a_guarded_phased_plan():
    """Deferring a phase across its guarded `if` is not built: such a plan gets the early schedule
    only, with the reason; the unguarded phased plan is scheduled."""
    from msrewrite.emit.schedules import unsupported

    example = EXAMPLES / "deepep_moe.py"
    src = load(example)
    (plan,) = plans_for_case(
        example,
        src.module,
        "moe-shared-expert-phased",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )
    assert unsupported(plan) is None
    guarded = plan.with_changes(guard="hidden_states.numel() > 0", guard_line=plan.fork_line)
    assert "guarded phased" in unsupported(guarded)
