"""Schedule variants of an edit, for `verify`: the same emitted code with its side work issued later.

A device may run the side stream's work at any point between the fork and the join. The CPU
stand-ins run it at the fork ("early"). The other legal schedules are emitted here, from the plan
and the emitter's own record of where it put the side work (`PlannedEdit.side_nodes`, `.window`),
never by reading the emitted text:

  late          all side work just before the join block
  interleaved   the first half of the side statements at the fork, the rest halfway through the
                main work of the window (a single side statement: all of it halfway)
  after:K       all side work right after the K-th main statement of the window (used to name the
                statement whose effect leaked into the side work when a schedule differs)

The side inputs are captured by reference at the fork (`_ms_fork_x = x`) and swapped in around
the deferred side work, so a main-path rebinding of `x` in the window does not matter (the real
side stream reads the tensor it was handed), but an in-place write to that tensor does: exactly
the races a device can show. Flag-off code is untouched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import libcst as cst

from msrewrite.analyze.defuse import function_names, node_facts
from msrewrite.analyze.guards import block_of, follow_turns, rebuild_path
from msrewrite.emit.engine import (
    PlannedEdit, _comment, _if_block, _parse_block, _unique, apply_plans, code_of, strip_leading,
)
from msrewrite.plan import OverlapPlan

SCHEDULES = ("early", "late", "interleaved")


class NoSchedule(Exception):
    """This edit's structure has no movable side block (phases, async comm, several waits)."""


@dataclass
class ScheduleSource:
    """The last step of an edit: the text it was made on and the plans carried out on it."""

    text: str
    plans: list[OverlapPlan]
    note: str = ""  # what the variants leave out, said in verify's summary
    window_statements: list[tuple[int, str]] = field(default_factory=list)  # filled by variant()


def unsupported(plan: OverlapPlan) -> str | None:
    """Why this plan's side work cannot be moved as one block, or None."""
    if plan.phase_anchors:
        return "phased side work (its phases are already ordered after main-stream anchors)"
    if plan.sync == "async-comm":
        return "asynchronous send/recv (no side stream)"
    return None


def _flat_body(edit: PlannedEdit) -> list[cst.BaseStatement]:
    """The edited body as `edit.window` counts it: a guarded plan's `if` block spliced in place of the `if`."""
    body = list(edit.new_func.body.body)  # type: ignore[union-attr]
    if edit.guarded_block is None:
        return body
    start, _end, turns = edit.guarded_block
    block = block_of(follow_turns(body[start], turns))  # type: ignore[arg-type]
    return body[:start] + block + body[start + 1 :]


def _unflat_body(edit: PlannedEdit, flat: list[cst.BaseStatement], inserted: int, at: int) -> list[cst.BaseStatement]:
    """`flat` with the guarded block put back into its `if`; `inserted` statements were added at `at`."""
    if edit.guarded_block is None:
        return flat
    start, end, turns = edit.guarded_block
    if at < start:
        start += inserted
    if at < end:
        end += inserted
    node = edit.new_func.body.body[edit.guarded_block[0]]  # type: ignore[union-attr]
    rebuilt = rebuild_path(follow_turns(node, turns), flat[start:end])  # type: ignore[arg-type]
    return flat[:start] + [rebuilt] + flat[end:]


def _side_with(edit: PlannedEdit) -> tuple[cst.If, int, cst.With]:
    """The fork `if` in the edited body, and the `with <side stream>:` that holds the side nodes."""
    if edit.window is None or not edit.side_nodes:
        raise NoSchedule(f"{edit.plan.function}: no side block at the fork")
    body = _flat_body(edit)
    fork_if = body[edit.window[0] - 1]
    side_ids = {id(n) for n in edit.side_nodes}
    if isinstance(fork_if, cst.If):
        for k, stmt in enumerate(fork_if.body.body):  # type: ignore[union-attr]
            if isinstance(stmt, cst.With) and any(id(n) in side_ids for n in stmt.body.body):  # type: ignore[union-attr]
                return fork_if, k, stmt
    raise NoSchedule(f"{edit.plan.function}: the side block is not a `with` inside the fork")


def _split(with_stmt: cst.With, side_nodes: tuple[cst.BaseStatement, ...]):
    inner = list(with_stmt.body.body)  # type: ignore[union-attr]
    ids = {id(n) for n in side_nodes}
    at = [k for k, n in enumerate(inner) if id(n) in ids]
    return inner[: at[0]], inner[at[0] : at[-1] + 1], inner[at[-1] + 1 :]


def reschedule(edit: PlannedEdit, schedule: str) -> cst.FunctionDef:
    """The edited function with its side work issued under `schedule`."""
    if schedule == "early":
        return edit.new_func
    why = unsupported(edit.plan)
    if why:
        raise NoSchedule(f"{edit.plan.function}: {why}")
    fork_if, with_at, with_stmt = _side_with(edit)
    head, side, tail = _split(with_stmt, edit.side_nodes)
    start, end = edit.window  # type: ignore[misc]
    main_count = end - start
    if schedule == "late":
        early_part, later_part, after = [], side, main_count
    elif schedule == "interleaved":
        k = len(side) // 2
        early_part, later_part, after = side[:k], side[k:], (main_count + 1) // 2
    elif schedule.startswith("after:"):
        early_part, later_part, after = [], side, int(schedule.split(":", 1)[1])
        if not 0 <= after <= main_count:
            raise NoSchedule(f"{schedule}: the window has {main_count} main statement(s)")
    else:
        raise ValueError(f"unknown schedule {schedule!r}")

    taken = function_names(edit.new_func)
    inputs = [name for name in edit.plan.side_inputs if name in _locals(edit.old_func) and name != "self"]
    captured = {name: _unique(f"_ms_fork_{name}", taken) for name in inputs}
    saved = {name: _unique(f"_ms_main_{name}", taken | set(captured.values())) for name in inputs}
    outputs = set(edit.plan.side_outputs)

    def with_body(nodes: list[cst.BaseStatement]) -> cst.With:
        return with_stmt.with_changes(body=with_stmt.body.with_changes(body=nodes))

    fork_body = list(fork_if.body.body)  # type: ignore[union-attr]
    at_fork: list[cst.BaseStatement] = _parse_block([f"{c} = {name}" for name, c in captured.items()])
    if early_part:
        at_fork.append(with_body([*head, *early_part]))
    fork_body[with_at : with_at + 1] = at_fork
    new_fork_if = fork_if.with_changes(body=fork_if.body.with_changes(body=fork_body))

    # The deferred side work reads the tensors it was handed at the fork: its reads of the inputs are
    # renamed to the captures (a main-path rebinding or `del` of the name does not matter). An input
    # the side work itself rebinds is swapped in and out instead.
    stored = set().union(*(node_facts(n).stores for n in later_part)) if later_part else set()
    renamed = {n: captured[n] for n in inputs if n not in stored}
    swapped = [n for n in inputs if n in stored]
    later_part = [n.visit(_RenameLoads(renamed)) for n in later_part] if renamed else list(later_part)
    head_part = [n.visit(_RenameLoads(renamed)) for n in head] if renamed else list(head)
    swap_in = [f"{saved[n]} = {n}" for n in swapped] + [f"{n} = {captured[n]}" for n in swapped]
    swap_out = [f"{n} = {saved[n]}" for n in swapped if n not in outputs]
    moved = [
        *_parse_block(swap_in),
        with_body([*([] if early_part else head_part), *later_part, *tail]),
        *_parse_block(swap_out),
    ]
    at = start + after
    # A guarded plan's deferred work runs under its guard, as its fork did: inside the guarded
    # `if` the condition already holds; before it, it is tested with the stream.
    inside = edit.guarded_block is not None and edit.guarded_block[0] <= at < edit.guarded_block[1]
    cond = code_of(fork_if.test) if edit.guarded_block is not None and not inside else edit.emission.on_cond
    block = _if_block(cond, moved, None, [])
    note = f"msrewrite verify: {schedule} schedule, side work deferred to here"
    block = [block[0].with_changes(leading_lines=(_comment(note),)), *block[1:]]
    body = _flat_body(edit)
    body[start - 1] = new_fork_if
    body[at:at] = block
    body = _unflat_body(edit, body, len(block), at)
    return edit.new_func.with_changes(body=edit.new_func.body.with_changes(body=body))


def variant(source: ScheduleSource, schedule: str) -> str:
    """The edited file's text under `schedule` (NoSchedule when the edit has no movable block)."""
    for plan in source.plans:
        why = unsupported(plan)
        if why:
            raise NoSchedule(why)
    text, window = _variant(source.text, tuple(source.plans), schedule)
    source.window_statements = list(window)
    return text


@lru_cache(maxsize=64)
def _variant(text: str, plans: tuple[OverlapPlan, ...], schedule: str) -> tuple[str, tuple[tuple[int, str], ...]]:
    from msrewrite.load import parse_source

    module = parse_source(Path(plans[0].file or "<edit>"), text)
    windows: list[list[tuple[int, str]]] = []

    def move(edit: PlannedEdit) -> cst.FunctionDef:
        windows.append(_window_lines(edit, module, text))
        return reschedule(edit, schedule)

    new = apply_plans(module, list(plans), text, reschedule=move).code
    return new, tuple(windows[0] if windows else ())


def _window_lines(edit: PlannedEdit, module: cst.Module, text: str) -> list[tuple[int, str]]:
    """(line in the unedited text, first line of code) of each main statement in the window."""
    from msrewrite.analyze.positions import positions_for

    if edit.window is None:
        return []
    positions = positions_for(module, edit.plan.function, edit.old_func, text)
    old = list(edit.old_func.body.body)  # type: ignore[union-attr]
    found = []
    for stmt in _flat_body(edit)[edit.window[0] : edit.window[1]]:
        same = next((s for s in _old_flat(edit, old) if s is stmt or s.deep_equals(stmt)), None)
        line = positions[same].start.line if same is not None and same in positions else 0
        found.append((line, _first_line(stmt)))
    return found


def _old_flat(edit: PlannedEdit, old: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """The unedited body's statements, with those of a guarded `if`'s blocks (where its window may lie)."""
    if edit.guarded_block is None:
        return old
    nested = [
        stmt
        for node in old if isinstance(node, cst.If)
        for block in (node.body, getattr(node.orelse, "body", None)) if isinstance(block, cst.IndentedBlock)
        for stmt in block.body
    ]
    return old + nested


def window_size(source: ScheduleSource) -> int:
    """How many main statements the (first) plan's window holds in the edited function."""
    variant(source, "early")
    return len(source.window_statements)


class _RenameLoads(cst.CSTTransformer):
    """Rename variables, never attribute names, keyword names or parameters."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        return updated.with_changes(keyword=original.keyword)

    def leave_Param(self, original: cst.Param, updated: cst.Param) -> cst.Param:
        return updated.with_changes(name=original.name)

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        new = self.names.get(updated.value)
        return updated.with_changes(value=new) if new else updated


def _locals(func: cst.FunctionDef) -> set[str]:
    """Parameters and names bound in the function: only these can be captured and swapped (a global
    assigned inside the function would become a local everywhere in it)."""
    params = func.params
    names = {p.name.value for p in [*params.posonly_params, *params.params, *params.kwonly_params]}
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            names.add(star.name.value)
    return names | node_facts(func.body).stores


def _first_line(stmt: cst.BaseStatement) -> str:
    text = code_of(strip_leading(stmt)).strip().splitlines()
    return text[0] if text else ""


_MARKER = re.compile(r"#\s*msrewrite\(([\w-]+)(?::[^)]*)?\)")


def derive_source(text: str, original: Path | None, mode: str, flag) -> tuple[ScheduleSource | None, str]:
    """The plans behind an edited file, found again by re-running its case on the original with the
    options the edit shows (mode, flag); (None, why) when they do not reproduce the edit exactly."""
    if original is None:
        return None, "no --original to find the plan again (pass --plan PLANS.json)"
    from msrewrite.errors import BadInput
    from msrewrite.load import read_source

    try:
        original_text = read_source(original, python=False)
    except (OSError, UnicodeDecodeError, BadInput):
        return None, f"cannot read {original}"
    found, why = _derive(text, str(original), original_text, mode, flag)
    if found is None:
        return None, why
    return ScheduleSource(found[0], list(found[1]), found[2]), ""


@lru_cache(maxsize=32)
def _derive(text: str, original_name: str, original_text: str, mode: str, flag):
    from msrewrite.commands.apply import case_steps
    from msrewrite.errors import MsrewriteError
    from msrewrite.load import parse_source

    original = Path(original_name)
    cases = {m.group(1) for m in _MARKER.finditer(text)}
    if len(cases) != 1:
        return None, "no single msrewrite case marker in the edited file (pass --plan PLANS.json)"
    case = cases.pop()
    try:
        steps = case_steps(original, original_text, parse_source(original, original_text), case, mode, None, flag, None)
    except MsrewriteError as exc:
        return None, f"apply --case {case} does not reproduce the edit ({exc})"
    last = steps[-1]
    if last.new != text:
        return None, f"the edit is not what apply --case {case} makes with default options (pass --plan PLANS.json)"
    if not last.plans:
        return None, f"{case} is a model-level edit with no side block to move"
    note = "later schedules move the last side stream's work only" if len(steps) > 1 and steps[0].plans else ""
    return (last.old, tuple(last.plans), note), ""
