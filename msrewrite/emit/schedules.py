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

A phased plan issues side work at the fork and again after each phase anchor; the side stream runs
the phases in order, so each phase moves within its own span: from its issue up to the next issue
(`PlannedEdit.phases`), the last one up to the join. Late defers each phase to the end of its span,
interleaved splits each around the middle of its span, after:K clamps K into each span.

The side inputs are captured by reference at the issue (`_ms_fork_x = x`) and swapped in around
the deferred side work, so a main-path rebinding of `x` in the window does not matter (the real
side stream reads the tensor it was handed), but an in-place write to that tensor does: exactly
the races a device can show. Flag-off code is untouched.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import field
from functools import lru_cache
from pathlib import Path

import libcst as cst

from msrewrite.analyze.defuse import function_names, node_facts
from msrewrite.analyze.guards import block_of, follow_turns, rebuild_path
from msrewrite.analyze.outline import unique_name
from msrewrite.analyze.wrappers import flattened
from msrewrite.emit.engine import PlannedEdit, apply_plans
from msrewrite.emit.templates import code_of, comment, if_block, parse_block, strip_leading
from msrewrite.plan import MicrobatchPlan, OverlapPlan
from msrewrite.records import record

SCHEDULES = ("early", "late", "interleaved")


class NoSchedule(Exception):
    """This edit's structure has no movable side block (async comm, several waits)."""


@record
class ScheduleSource:
    """The last step of an edit: the text it was made on and the plans carried out on it."""

    text: str
    plans: list[OverlapPlan]
    note: str = ""  # what the variants leave out, said in verify's summary
    window_statements: list[tuple[int, str]] = field(default_factory=list)  # filled by variant()
    # apply --markers on an edit of several steps: the earlier steps' plans, whose windows carry
    # profiler ranges too (text is the last step's input without them)
    marked: tuple[OverlapPlan, ...] = ()
    # the case's own pass over apply_plans' output (EditStep.finish): phased edits call the
    # shared expert again on the flag-off path
    finish: Callable[[str], str] | None = None


def unsupported(plan: OverlapPlan) -> str | None:
    """Why this plan's side work cannot be moved, or None."""
    if plan.sync == "async-comm":
        return "asynchronous send/recv (no side stream)"
    if plan.phase_anchors and plan.guard:
        return "guarded phased side work (deferring a phase across its guarded `if` is not built)"
    return None


def _flat_body(edit: PlannedEdit) -> list[cst.BaseStatement]:
    """The edited body as `edit.window` counts it: a guarded plan's `if` block spliced in place of the `if`."""
    suite = edit.new_func.body
    assert isinstance(suite, cst.IndentedBlock)  # plan_edit refuses a one-line body
    body: list[cst.BaseStatement] = list(suite.body)
    if edit.guarded_block is None:
        return body
    start, _end, turns = edit.guarded_block
    block = block_of(follow_turns(body[start], turns))  # type: ignore[arg-type]
    return body[:start] + block + body[start + 1 :]


def _unflat_body(
    edit: PlannedEdit, flat: list[cst.BaseStatement], insertions: list[tuple[int, int]]
) -> list[cst.BaseStatement]:
    """`flat` with the guarded block put back into its `if`; each (at, count) of `insertions` added
    `count` statements at `at` of the flat body as `edit.window` counts it."""
    if edit.guarded_block is None:
        return flat
    start, end, turns = edit.guarded_block
    new_start = start + sum(count for at, count in insertions if at < start)
    new_end = end + sum(count for at, count in insertions if at < end)
    node = edit.new_func.body.body[start]  # type: ignore[union-attr]
    rebuilt = rebuild_path(follow_turns(node, turns), flat[new_start:new_end])  # type: ignore[arg-type]
    return flat[:new_start] + [rebuilt] + flat[new_end:]


@record
class _Issue:
    """One place the edit issues side work: the `if` at flat index `at` (the fork, or a phase's
    re-entry after its anchor), and the statements it runs on the side stream there."""

    at: int
    nodes: tuple[cst.BaseStatement, ...]
    lo: int = 0  # the side work may run from here (flat index: before the statement there) ...
    hi: int = 0  # ... up to here: the next issue on the same stream, or the join


def _issues(edit: PlannedEdit) -> list[_Issue]:
    if edit.window is None or not edit.side_nodes:
        raise NoSchedule(f"{edit.plan.function}: no side block at the fork")
    start, end = edit.window
    issues = [
        _Issue(start - 1, edit.side_nodes),
        *(_Issue(at, nodes) for at, nodes in sorted(edit.phases, key=lambda p: p[0])),
    ]
    for k, issue in enumerate(issues):
        issue.lo = issue.at + 1
        issue.hi = issues[k + 1].at if k + 1 < len(issues) else end
    return issues


def _side_with(edit: PlannedEdit, body: list[cst.BaseStatement], issue: _Issue) -> tuple[cst.If, int, cst.With]:
    """The issuing `if` in the edited body, and the `with <side stream>:` that holds its side nodes."""
    issue_if = body[issue.at]
    side_ids = {id(n) for n in issue.nodes}
    if isinstance(issue_if, cst.If):
        for k, stmt in enumerate(issue_if.body.body):  # type: ignore[union-attr]
            if isinstance(stmt, cst.With) and any(id(n) in side_ids for n in stmt.body.body):  # type: ignore[union-attr]
                return issue_if, k, stmt
    raise NoSchedule(f"{edit.plan.function}: the side block is not a `with` inside its `if`")


def _split(with_stmt: cst.With, side_nodes: tuple[cst.BaseStatement, ...]):
    inner = list(with_stmt.body.body)  # type: ignore[union-attr]
    ids = {id(n) for n in side_nodes}
    at = [k for k, n in enumerate(inner) if id(n) in ids]
    return inner[: at[0]], inner[at[0] : at[-1] + 1], inner[at[-1] + 1 :]


def _main_positions(edit: PlannedEdit, issues: list[_Issue]) -> list[int]:
    """Flat indices of the window's main statements (the phases' re-entry blocks are not main work)."""
    start, end = edit.window  # type: ignore[misc]
    issuing = {issue.at for issue in issues}
    return [i for i in range(start, end) if i not in issuing]


def _split_main_hoists(edit: PlannedEdit) -> PlannedEdit:
    """`edit` with the main calls it hoisted out of the join statement (they open the flag-on branch
    of the join block) each moved into an `if` of its own right before that block, under the
    block's own condition: the same code run in the same order, where each counts as one main
    statement of the window, so the side work can be deferred after them (late), between them
    (interleaved, after:K)."""
    if not edit.main_hoisted or edit.window is None:
        return edit
    start, end = edit.window
    flat = _flat_body(edit)
    join_if = flat[end] if end < len(flat) else None
    n = len(edit.main_hoisted)
    inner = (
        list(join_if.body.body) if isinstance(join_if, cst.If) and isinstance(join_if.body, cst.IndentedBlock) else []
    )
    if [id(node) for node in inner[:n]] != [id(node) for node in edit.main_hoisted]:
        raise NoSchedule(
            f"{edit.plan.function}: the join block does not open with the main calls hoisted out of the join"
        )
    assert isinstance(join_if, cst.If)
    alone = [
        join_if.with_changes(body=join_if.body.with_changes(body=[node]), orelse=None, leading_lines=())
        for node in edit.main_hoisted
    ]
    alone[0] = alone[0].with_changes(leading_lines=join_if.leading_lines)
    rest = join_if.with_changes(body=join_if.body.with_changes(body=inner[n:]), leading_lines=())
    flat = [*flat[:end], *alone, rest, *flat[end + 1 :]]
    body = _unflat_body(edit, flat, [(end, n)])
    guarded = edit.guarded_block
    if guarded is not None and end < guarded[1]:
        guarded = (guarded[0], guarded[1] + n, guarded[2])
    new_func = edit.new_func.with_changes(body=edit.new_func.body.with_changes(body=body))
    return dataclasses.replace(
        edit, new_func=new_func, window=(start, end + n), guarded_block=guarded, main_hoisted=tuple(alone)
    )


def reschedule(edit: PlannedEdit, schedule: str) -> cst.FunctionDef:
    """The edited function with its side work issued under `schedule`. A phased plan's phases each
    move within their own span: from their issue (the fork, or the re-entry after their anchor) up to
    the next issue on the same stream (the stream runs them in order), the last one up to the join."""
    if schedule == "early":
        return edit.new_func
    why = unsupported(edit.plan)
    if why:
        raise NoSchedule(f"{edit.plan.function}: {why}")
    edit = _split_main_hoists(edit)
    issues = _issues(edit)
    body = _flat_body(edit)
    mains = _main_positions(edit, issues)
    if schedule.startswith("after:"):
        after = int(schedule.split(":", 1)[1])
        if not 0 <= after <= len(mains):
            raise NoSchedule(f"{schedule}: the window has {len(mains)} main statement(s)")
    elif schedule not in ("late", "interleaved"):
        raise ValueError(f"unknown schedule {schedule!r}")

    taken = set(function_names(edit.new_func))
    old_locals = _locals(edit.old_func)
    insertions: list[tuple[int, list[cst.BaseStatement]]] = []
    replaced: dict[int, cst.If] = {}
    for k, issue in enumerate(issues):
        issue_if, with_at, with_stmt = _side_with(edit, body, issue)
        head, side, tail = _split(with_stmt, issue.nodes)
        span = [i for i in mains if issue.lo <= i < issue.hi]  # the main statements it may run after
        if schedule == "late":
            early_part, later_part, at = [], side, issue.hi
        elif schedule == "interleaved":
            half = len(side) // 2
            early_part, later_part = side[:half], side[half:]
            after_span = (len(span) + 1) // 2
            at = span[after_span - 1] + 1 if after_span else issue.lo
        else:
            point = mains[after - 1] + 1 if after else edit.window[0]  # type: ignore[index]
            early_part, later_part, at = [], side, min(max(point, issue.lo), issue.hi)
        if not later_part:
            continue
        later = [n for issue2 in issues[k + 1 :] for n in issue2.nodes]
        inputs = _inputs(edit, issue, k, old_locals)
        outputs = set(edit.plan.side_outputs) | (set().union(*(node_facts(n).loads for n in later)) if later else set())
        at_issue, moved = _defer(with_stmt, head, early_part, later_part, tail, inputs, outputs, taken)
        issue_body = list(issue_if.body.body)  # type: ignore[union-attr]
        issue_body[with_at : with_at + 1] = at_issue
        replaced[issue.at] = issue_if.with_changes(body=issue_if.body.with_changes(body=issue_body))
        # A guarded plan's deferred work runs under its guard, as its fork did: inside the guarded
        # `if` the condition already holds; before it, it is tested with the stream.
        inside = edit.guarded_block is not None and edit.guarded_block[0] <= at < edit.guarded_block[1]
        cond = code_of(issue_if.test) if edit.guarded_block is not None and not inside else edit.emission.on_cond
        block = if_block(cond, moved, None, [])
        where = "" if len(issues) == 1 else " (issued at the fork)" if k == 0 else f" (phase {k})"
        note = f"msrewrite verify: {schedule} schedule, side work{where} deferred to here"
        insertions.append((at, [block[0].with_changes(leading_lines=(comment(note),)), *block[1:]]))
    for at, new_if in replaced.items():
        body[at] = new_if
    for at, block in sorted(insertions, key=lambda item: item[0], reverse=True):
        body[at:at] = block
    body = _unflat_body(edit, body, [(at, len(block)) for at, block in insertions])
    return edit.new_func.with_changes(body=edit.new_func.body.with_changes(body=body))


def _inputs(edit: PlannedEdit, issue: _Issue, k: int, old_locals: set[str]) -> list[str]:
    """The names the issue's side work reads as it finds them at its issue: the plan's side inputs at
    the fork; at a phase's re-entry, every local it reads before storing it (its anchor, main values,
    what earlier phases stored on the side stream)."""
    names = list(edit.plan.side_inputs)
    if k:
        names, stored = [], set[str]()
        for node in issue.nodes:
            names += [n for n in _read_first(node, stored) if n not in names]
    return [name for name in names if name in old_locals and name != "self"]


def _read_first(node: cst.BaseStatement, stored: set[str]) -> list[str]:
    """Names `node` reads before it stores them (`stored`: what the issue stored before it, updated
    in place). Inside an `if` (a phase's part of a side `if`), statement by statement: a name its
    block stored first is no input; one stored only inside a nested `if` may not be."""
    if not isinstance(node, cst.If) or not isinstance(node.body, cst.IndentedBlock) or node.orelse is not None:
        facts = node_facts(node)
        found = sorted(facts.loads - stored)
        stored |= facts.stores
        return found
    found = sorted(node_facts(node.test).loads - stored)
    inner = set(stored)
    for stmt in node.body.body:
        found += [n for n in _read_first(stmt, inner) if n not in found]
    stored |= node_facts(node).stores  # after the `if`, as a whole statement (it may not have run)
    return found


def _defer(with_stmt, head, early_part, later_part, tail, inputs, outputs, taken):
    """(statements left at the issue: the captures and the side work that stays there, the deferred
    statements). The side inputs are captured by reference at the issue; the deferred side work reads
    the captures (a main-path rebinding or `del` of the name does not matter). An input the side work
    itself rebinds is swapped in and out instead."""
    captured = {name: unique_name(f"_ms_fork_{name}", taken) for name in inputs}  # unique_name takes the name
    saved = {name: unique_name(f"_ms_main_{name}", taken) for name in inputs}

    def with_body(nodes: list[cst.BaseStatement]) -> cst.With:
        return with_stmt.with_changes(body=with_stmt.body.with_changes(body=nodes))

    at_issue: list[cst.BaseStatement] = parse_block([f"{c} = {name}" for name, c in captured.items()])
    if early_part:
        at_issue.append(with_body([*head, *early_part]))
    stored = set().union(*(node_facts(n).stores for n in later_part)) if later_part else set()
    renamed = {n: captured[n] for n in inputs if n not in stored}
    swapped = [n for n in inputs if n in stored]
    later_part = [n.visit(_RenameLoads(renamed)) for n in later_part] if renamed else list(later_part)
    head_part = [n.visit(_RenameLoads(renamed)) for n in head] if renamed else list(head)
    swap_in = [f"{saved[n]} = {n}" for n in swapped] + [f"{n} = {captured[n]}" for n in swapped]
    swap_out = [f"{n} = {saved[n]}" for n in swapped if n not in outputs]
    moved = [
        *parse_block(swap_in),
        with_body([*([] if early_part else head_part), *later_part, *tail]),
        *parse_block(swap_out),
    ]
    return at_issue, moved


def variant(source: ScheduleSource, schedule: str) -> str:
    """The edited file's text under `schedule` (NoSchedule when the edit has no movable block)."""
    if any(isinstance(plan, MicrobatchPlan) for plan in source.plans):
        if schedule != "early":  # early is the edit itself: verify checks the plans reproduce it
            raise NoSchedule(
                "prefill-microbatch is a model-level fork: each stage waits on the event of the "
                "stage before it, with no side block to move"
            )
        module = _parsed(Path(source.plans[0].file or "<edit>"), source.text)
        source.window_statements = []
        return apply_plans(module, list(source.plans), source.text).code
    for plan in source.plans:
        why = unsupported(plan)
        if why:
            raise NoSchedule(why)
    text, window = _variant(source.text, tuple(source.plans), schedule, tuple(source.marked))
    source.window_statements = list(window)
    return source.finish(text) if source.finish is not None else text


_recent_parses: list[tuple[str, cst.Module]] = []


def _parsed(path: Path, text: str) -> cst.Module:
    """The parsed text: one parse for finding the plans again and every schedule's variant, which
    all start from the same unedited text (libcst trees are immutable, so they can share it)."""
    from msrewrite.load import parse_source

    for seen, module in _recent_parses:
        if seen == text:
            return module
    module = parse_source(path, text)
    _recent_parses[:] = [(text, module), *_recent_parses[:1]]
    return module


@lru_cache(maxsize=64)
def _variant(
    text: str, plans: tuple[OverlapPlan, ...], schedule: str, marked: tuple[OverlapPlan, ...] = ()
) -> tuple[str, tuple[tuple[int, str], ...]]:
    module = _parsed(Path(plans[0].file or "<edit>"), text)
    windows: list[list[tuple[int, str]]] = []

    def move(edit: PlannedEdit) -> cst.FunctionDef:
        windows.append(_window_lines(edit, module, text))
        return reschedule(edit, schedule)

    if not marked:
        new = apply_plans(module, list(plans), text, reschedule=move).code
        return new, tuple(windows[0] if windows else ())
    from msrewrite.emit import markers  # every window's ranges, as apply wrote them

    bare = [p.with_changes(markers=False) for p in plans]
    new = apply_plans(module, bare, text, reschedule=move).code
    return markers.add(new, [*marked, *(p for p in plans if p.markers)]), tuple(windows[0] if windows else ())


def _window_lines(edit: PlannedEdit, module: cst.Module, text: str) -> list[tuple[int, str]]:
    """(line in the unedited text, first line of code) of each main statement in the window."""
    from msrewrite.analyze.positions import positions_for

    if edit.window is None:
        return []
    positions = positions_for(module, edit.plan.function, edit.old_func, text)
    old_func = flattened(edit.old_func, *edit.wrapped[:2]) if edit.wrapped is not None else edit.old_func
    old_suite = old_func.body
    assert isinstance(old_suite, cst.IndentedBlock)  # plan_edit refuses a one-line body
    old = list(old_suite.body)
    found = []
    edit = _split_main_hoists(edit)
    hoisted = {id(node): hoist for node, hoist in zip(edit.main_hoisted, edit.plan.main_hoists, strict=True)}
    flat = _flat_body(edit)
    issues = _issues(edit) if edit.side_nodes else []
    for stmt in (flat[i] for i in _main_positions(edit, issues)):
        if id(stmt) in hoisted:  # a main call hoisted out of the join statement: named as written there
            hoist = hoisted[id(stmt)]
            found.append((hoist.first_line, " ".join(hoist.source.split()) + " (in the join statement)"))
            continue
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
        for node in old
        if isinstance(node, cst.If)
        for block in (node.body, getattr(node.orelse, "body", None))
        if isinstance(block, cst.IndentedBlock)
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

    def leave_Name(self, _original: cst.Name, updated: cst.Name) -> cst.Name:
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
    return ScheduleSource(found[0], list(found[1]), found[2], finish=found[3]), ""


@lru_cache(maxsize=32)
def _derive(text: str, original_name: str, original_text: str, mode: str, flag):
    from msrewrite.cases import require_case
    from msrewrite.cases._base import Options
    from msrewrite.errors import MsrewriteError

    original = Path(original_name)
    cases = {m.group(1) for m in _MARKER.finditer(text)}
    if len(cases) != 1:
        return None, "no single msrewrite case marker in the edited file (pass --plan PLANS.json)"
    case = cases.pop()
    try:
        module = _parsed(original, original_text)
        # apply's defaults: --protect auto snapshots what the main path may write
        options = Options(mode=mode, flag=flag, protect="auto")
        steps = require_case(case).steps(original, original_text, module, options, None)
    except MsrewriteError as exc:
        return None, f"apply --case {case} does not reproduce the edit ({exc})"
    last = steps[-1]
    if last.new != text:
        return None, f"the edit is not what apply --case {case} makes with default options (pass --plan PLANS.json)"
    note = "later schedules move the last side stream's work only" if len(steps) > 1 and steps[0].plans else ""
    return (last.old, tuple(last.plans), note, last.finish), ""
