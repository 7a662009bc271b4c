"""Carry out one plan on its function: the fork, the join and the body around them.

For a plan the edited function reads, top to bottom:

    <prelude: the side stream, or None when the flag is off>
    if <on>:                       # fork, as early as the side inputs allow
        <wait for the current stream>
        with <side stream>:
            <side statements>
    else:
        <side statements that were already here, unchanged>
    ... main path, untouched ...
    if <off>:
        <side statements at their original place, unchanged>
    if <on>:                       # join, right before the first consumer
        <wait for the side stream; lifetime guards>
    else:
        <side statements that sat right before the join>
    <first consumer>

With the flag off every original statement runs, in its original order, on the current stream.
Where the lines go is read by emit/locate.py; what they say comes from the mode's strategy
(emit/strategies.py); the class's `__init__` lines are added by emit/constructor.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import libcst as cst

from msrewrite.analyze.defuse import function_names, node_facts, statement_facts
from msrewrite.analyze.guards import conjoin
from msrewrite.analyze.outline import (
    already_applied,
    bound_on_every_path,
    init_info,
    init_layers,
    model_stream,
    self_attrs,
)
from msrewrite.analyze.outline import unique_name as _unique
from msrewrite.analyze.value_kinds import TENSOR, ValueKinds
from msrewrite.analyze.wrappers import flattened, is_transparent, placement, rewrapped, top_level_withs
from msrewrite.emit import frameworks
from msrewrite.emit.constructor import extend_init
from msrewrite.emit.locate import Layout, layout, locate
from msrewrite.emit.strategies import STRATEGIES, Context, Emission, Names, async_comm
from msrewrite.emit.templates import (
    AsyncComm,
    NonBlocking,
    Rename,
    ReplaceCalls,
    assign,
    code_of,
    comment,
    flag_attribute,
    if_block,
    leading_lines,
    parse_block,
    returns,
    rewritten,
    strip_leading,
    with_block,
    with_leading,
)
from msrewrite.errors import BadInput, NothingToDo
from msrewrite.plan import OverlapPlan
from msrewrite.records import record
from msrewrite.validate import literal


@record
class PlannedEdit:
    """One plan carried out on its function (and `__init__`): the old and new definitions."""

    plan: OverlapPlan
    old_func: cst.FunctionDef
    new_func: cst.FunctionDef
    old_init: cst.FunctionDef | None
    new_init: cst.FunctionDef | None
    emission: Emission
    cls: cst.ClassDef | None = None
    stream_param: str = ""
    # Where the edit put things in new_func's body, for schedule variants (emit/schedules.py):
    # the side statements issued at the fork (the very nodes), and [start, end) of the main work
    # between the fork block and the join block.
    side_nodes: tuple[cst.BaseStatement, ...] = ()
    window: tuple[int, int] | None = None
    # A guarded plan: `window` counts in the body with the guarded `if`'s block spliced in place
    # of the `if`; this is [start, end) of that block there, and the turns (each step's `else:`)
    # that reach it through nested `if`s and `elif`s.
    guarded_block: tuple[int, int, tuple[bool, ...]] | None = None
    # A phased plan: for each later phase, the index (counted as `window` counts) of the `if` that
    # re-enters the side stream after its anchor, and the statements it issues there (the very nodes).
    phases: tuple[tuple[int, tuple[cst.BaseStatement, ...]], ...] = ()
    # Main calls hoisted out of the join statement (plan.main_hoists): the assignments that open the
    # flag-on branch of the join block (at `window[1]`), the very nodes; main work of the window.
    main_hoisted: tuple[cst.BaseStatement, ...] = ()
    # A top-level `with` that the edit's join went inside (analyze/wrappers.py): (its index, the
    # `with`, the statements after it, and the first statement of its block in new_func when the
    # fork went before it, else None: the block starts at the same index); new_func and the indices
    # above are those of the body with the `with`'s block in its place, and unwrapped_edit puts it back.
    wrapped: tuple[int, cst.With, tuple[cst.BaseStatement, ...], cst.BaseStatement | None] | None = None


@record
class _Edit:
    """One plan on its way into its function: where its lines go, and what they say."""

    plan: OverlapPlan
    func: cst.FunctionDef
    where: Layout
    positions: Any  # PositionProvider's ranges for the function's nodes
    em: Emission
    names: Names
    init: cst.FunctionDef | None
    taken: set[str]  # names the function binds, and those the edit chose so far
    snapshots: dict[str, str]  # --protect: input -> the copy the side stream reads
    snapshot_tensors: set[str]  # the inputs known to be tensors (`x.clone()`; the others `_ms_snapshot(x)`)
    renames: dict[str, str]  # GE start gates: gated tensor -> the name the side block reads
    what: str
    main: str
    model_stream: str  # self.<attr> already holding a side stream the edit reuses, or ""

    @property
    def label(self) -> str:
        return self.plan.label

    @property
    def prelude_at(self) -> int:
        """The prelude (stream or switch) precedes every use of it: the fork, or an earlier side
        statement whose original place now holds its off-path guard."""
        return min([self.where.fork, *self.where.whole])


def plan_edit(
    module: cst.Module,
    positions,
    plan: OverlapPlan,
    text: str | None = None,
    words: tuple[str, str] = ("the side branch", "the main path"),
) -> PlannedEdit:
    """Carry out `plan` on its function; `words`: (side work, main work) as comments name them."""
    located = locate(module, plan.function)
    func = located.func
    _check_function(module, func, plan, text)
    wrapped = _wrapping_both(func, positions, plan)
    work = flattened(func, *wrapped[:2]) if wrapped is not None else func
    where = layout(work, positions, plan)
    e = _prepare(module, work, located.cls, where, positions, plan, words)
    if plan.placement == "routed":
        _read_snapshots_on_main(e)
    phase_nodes, hoist_assigns = _side_statements(e)
    side_nodes = phase_nodes.get(0, [])
    phase_blocks, phase_issued = _phase_blocks(e, phase_nodes)
    runs = _runs(where, plan)
    fork_block, prelude = _fork_block(e, side_nodes, runs)
    join_block, join_stmt, main_assigns = _join_block(e, runs, hoist_assigns)
    with_at = wrapped[0] if wrapped is not None and wrapped[2] == "before" else None
    if with_at is not None and e.em.main_limit:
        raise BadInput(
            f"{plan.function}: the side work runs before a `with` that holds the join; a core limit around "
            "the window would cross its edge"
        )
    assembly = _Assembly(e, runs, prelude, fork_block, join_block, join_stmt, phase_blocks, phase_issued, with_at)
    built = assembly.build()
    new_func = work.with_changes(body=work.body.with_changes(body=built.body))
    new_init = extend_init(e.init, e.em.init_lines, plan, e.names.stream_attr)
    edit = PlannedEdit(
        plan,
        func,
        new_func,
        e.init,
        new_init,
        e.em,
        located.cls,
        e.names.stream_attr,
        tuple(side_nodes),
        built.window,
        built.guarded_block,
        tuple(built.phases),
        tuple(main_assigns),
    )
    if wrapped is not None:
        at, node, _how = wrapped
        assert isinstance(func.body, cst.IndentedBlock)  # top_level_withs found a `with` in it
        first = built.body[assembly.with_start] if assembly.with_start is not None else None
        edit.wrapped = (at, node, tuple(func.body.body[at + 1 :]), first)
    return edit


def _wrapping_both(func: cst.FunctionDef, positions, plan: OverlapPlan) -> tuple[int, cst.With, str] | None:
    """The top-level `with` (analyze/wrappers.py) that holds the plan's join, with how the edit
    stands to it ("inside": the fork in it too; "before": the side work and the fork before it).
    The edit then goes into it."""
    body = func.body.body  # type: ignore[union-attr]
    falls_off = plan.join_line == positions[body[-1]].end.line + 1
    side_lines = [s.first_line for s in plan.side]
    for at, node in top_level_withs(func):
        if not is_transparent(node):
            continue
        is_last = at == len(body) - 1
        join_line = None if falls_off else plan.join_line
        how = placement(node, positions[node], is_last, plan.fork_line, join_line, side_lines)
        if how == "before" and (plan.phase_anchors or plan.guard):
            continue
        if how is not None:
            return at, node, how
    return None


def unwrapped_edit(edit: PlannedEdit) -> cst.FunctionDef:
    """The edited function as it goes into the file: a looked-through `with` put back around its
    edited block (schedule variants work on the flattened body before this)."""
    if edit.wrapped is None:
        return edit.new_func
    at, node, after, first = edit.wrapped
    if first is not None:  # the fork went before the `with`: its block starts at this very node
        body = edit.new_func.body.body  # type: ignore[union-attr]
        at = next(k for k, stmt in enumerate(body) if stmt is first)
    return rewrapped(edit.new_func, at, node, list(after))


def _check_function(module: cst.Module, func: cst.FunctionDef, plan: OverlapPlan, text: str | None) -> None:
    if already_applied(func, f"msrewrite({plan.label})" if plan.case_branch else None):
        raise NothingToDo(f"{plan.function} already runs its side branch on a side stream")
    if not isinstance(func.body, cst.IndentedBlock):
        raise BadInput(f"{plan.function}: a one-line function body cannot be split")
    compiled = frameworks.fullgraph_refusal(module, plan.function, text)
    if compiled is not None:
        raise BadInput(compiled)


# What the lines say ------------------------------------------------------------------------------
def _identifier(tag: str) -> str:
    ident = re.sub(r"\W+", "_", tag).strip("_").lower()
    if not ident or ident[0].isdigit():
        ident = f"side_{ident}"
    return ident


def _names(plan: OverlapPlan, cls: cst.ClassDef | None, taken: set[str]) -> Names:
    # attributes the edit adds to the class (npugraph-ex streams/events, handed-down streams)
    needs_attrs = plan.mode == "npugraph-ex" or plan.stream_source == "constructor"
    class_attrs = self_attrs(cls) if cls is not None and needs_attrs else set()
    ident = _identifier(plan.stream_tag)
    if plan.sync == "async-comm":
        stream_local = f"overlap_{ident}"
    elif plan.mode == "ge-graph":
        stream_local = f"use_{ident}_stream"
    else:
        stream_local = f"{ident}_stream"
    return Names(
        stream=_unique(stream_local, taken),
        current=_unique("current_stream", taken),
        fork_event=_unique("fork_event", taken),
        join_event=_unique("join_event", taken),
        flag_attr=flag_attribute(plan.flag.name),
        stream_attr=_unique(f"{ident}_stream", set(class_attrs)),
        events_attr=_unique(f"{ident}_events", set(class_attrs)),
        input_ready=_unique("input_ready_event", taken),
        side_done=_unique(f"{ident}_done_event", taken),
    )


def _start_gates(plan: OverlapPlan, where: Layout, taken: set[str]):
    """(gates, renames, snapshots): GE start gates rebind the gated tensor; it is renamed inside the
    side block when the main path still reads the original name, so main work is not ordered after
    the anchor too. --protect: the side stream reads a snapshot of each input the main path
    writes before the join, taken on the main stream before the fork."""
    gates: list[tuple[str, str, str]] = []
    renames: dict[str, str] = {}
    main_reads: set[str] = set()
    for i, stmt in enumerate(where.body):
        if plan.start_gates and i >= where.fork and i not in where.whole:
            main_reads |= function_names(stmt)
    snapshots: dict[str, str] = {}
    if plan.protect_inputs and plan.start_gates:
        raise BadInput(
            f"plan for {plan.function}: a snapshot (--protect) and --start-after cannot be combined; pass --protect none"
        )
    for name in plan.protect_inputs:
        snapshots[name] = _unique(f"{name}_side", taken)
    for gate in plan.start_gates:
        side_name = gate.tensor
        if gate.tensor in main_reads:
            side_name = _unique(f"{gate.tensor}_side", taken)
            renames[gate.tensor] = side_name
        gates.append((side_name, gate.tensor, gate.anchor))
    return gates, renames, snapshots


def _prepare(module, func, cls, where: Layout, positions, plan: OverlapPlan, words: tuple[str, str]) -> _Edit:
    switch = flag_attribute(plan.flag.name) if plan.flag.kind in ("env", "sglang") else plan.flag.name
    roots = frameworks.imported_roots(module)
    framework_imports = frameworks.flag_imports(plan.flag, roots)
    phase_gate = None
    if plan.flag.gate is not None:
        phase_gate, needed = frameworks.phase_predicate(
            plan.flag.gate, func, roots, plan.function, module, Path(plan.file) if plan.file else None
        )
        framework_imports += [i for i in needed if i not in framework_imports]
    frameworks.check_own_bindings(module, framework_imports)
    init, config_param, init_sets_flag = init_info(cls, (switch,))
    taken = function_names(func) | {temp for _call, temp in where.main_hoisted}
    names = _names(plan, cls, taken)
    what, main = words
    gates, renames, snapshots = _start_gates(plan, where, taken)
    reused = model_stream(cls, init, plan)  # an attribute name read from the class's __init__
    tensors = _snapshot_tensors(func, where, init, snapshots)
    ctx = _context(
        plan, init, config_param, init_sets_flag, gates, names, what, snapshots, phase_gate, framework_imports, reused
    )
    ctx.snapshot_checked = [n for n in snapshots if n not in tensors]
    em = async_comm(ctx) if plan.sync == "async-comm" else STRATEGIES[plan.mode](ctx)
    if where.main_hoisted and em.main_limit:
        raise BadInput(
            f"plan for {plan.function}: core limits on main work hoisted out of the join statement are not supported"
        )
    if where.guarded is not None:
        if em.main_limit:
            raise BadInput(f"plan for {plan.function}: core limits on a guarded side branch are not supported")
        if any(i not in where.guarded.inside for i in where.whole):
            raise BadInput(
                f"plan for {plan.function}: a guarded side statement lies outside its `if` (line {plan.guard_line})"
            )
    if len(tensors) < len(snapshots):
        em.helpers.append("_ms_snapshot")
    return _Edit(plan, func, where, positions, em, names, init, taken, snapshots, tensors, renames, what, main, reused)


def _snapshot_tensors(func, where: Layout, init, snapshots: dict[str, str]) -> set[str]:
    """The snapshot inputs the source shows to be tensors at the fork. The others are copied by
    `_ms_snapshot`, checked first by `_ms_can_snapshot` where the prelude runs, which must see the
    value the fork copies."""
    kinds = ValueKinds(func, where.body, init_layers(init))
    tensors = {name for name in snapshots if kinds.of(name, where.fork) == TENSOR}
    prelude_at = min([where.fork, *where.whole])
    for name in snapshots:
        if name in tensors:
            continue
        if any(name in node_facts(stmt).stores for stmt in where.body[prelude_at : where.fork]):
            raise BadInput(
                f"{func.name.value}: {name} is bound between the first side statement and the fork, where "
                "the side stream is chosen: its snapshot cannot be checked there"
            )
    return tensors


def _context(
    plan: OverlapPlan,
    init,
    config_param,
    init_sets_flag,
    gates,
    names,
    what,
    snapshots,
    phase_gate,
    framework_imports,
    model_stream,
) -> Context:
    """The strategies' Context: every user value in it comes from `plan` (validated on
    construction); the others are names read from the source or made by the emitter."""
    return Context(
        case=plan.case,
        tag=plan.stream_tag,
        flag_kind=plan.flag.kind,
        flag_name=plan.flag.name,
        flag_default=plan.flag.default,
        max_tokens=plan.flag.max_tokens,
        has_init=init is not None,
        init_config_param=config_param,
        init_sets_flag=init_sets_flag,
        # routed: the snapshots are read on the current stream; the side stream reads the originals
        inputs=[n if plan.placement == "routed" else snapshots.get(n, n) for n in plan.side_inputs],
        rebound_inputs=[n for n in plan.inputs_rebound_before_join if plan.placement == "routed" or n not in snapshots],
        outputs=list(plan.side_outputs),
        maybe_unbound=list(plan.outputs_maybe_unbound),
        token_input=plan.side_inputs[0] if plan.side_inputs else None,
        gates=gates if plan.mode == "ge-graph" else [],
        names=names,
        what=what,
        stream_source=plan.stream_source,
        sync=plan.sync,
        phased=bool(plan.phase_anchors),
        core_limits=plan.core_limits,
        phase_gate=phase_gate,
        framework_imports=framework_imports,
        model_stream=model_stream,
        inline_guards=plan.inline_guard_pairs,
    )


def _side_statements(e: _Edit) -> tuple[dict[int, list[cst.BaseStatement]], list[cst.BaseStatement]]:
    """(side statements as they run on the side stream, by phase (0 = at the fork); the
    assignments of the calls hoisted out of the join statement)."""
    plan, where = e.plan, e.where
    hoist_assigns: list[cst.BaseStatement] = [assign(temp, call) for call, temp in where.hoists]
    phase_nodes: dict[int, list[cst.BaseStatement]] = {}
    for i in where.whole:
        if i in where.inner_split:
            for p, part in sorted(where.inner_split[i].items()):
                phase_nodes.setdefault(p, []).append(strip_leading(part))
        else:
            phase_nodes.setdefault(where.phase_of[i], []).append(strip_leading(where.body[i]))
    for k, stmt in enumerate(hoist_assigns, start=1):
        phase_nodes.setdefault(where.phase_of[-k], []).append(stmt)
    # a routed placement's snapshots are read by the case's own statements on the current stream
    rewrites: list[cst.CSTTransformer] = _snapshot_renames(e) if plan.placement == "shared" else []
    if plan.mode == "ge-graph":
        rewrites += [Rename(old, new) for old, new in e.renames.items()]
    if plan.non_blocking:
        rewrites.append(NonBlocking())
    if e.em.async_comm:
        made = AsyncComm(e.taken)
        rewrites.append(made)
    for rewrite in rewrites:
        phase_nodes = {p: [rewritten(n, rewrite) for n in nodes] for p, nodes in phase_nodes.items()}
    if e.em.async_comm:  # (kind, name) of the async transfers, in issue order
        recvs = [h for kind, h in made.handles if kind == "recv"]
        sends = [h for kind, h in made.handles if kind == "send"]
        e.em.join = [f"{h}.wait()" for h in recvs + sends]
    return phase_nodes, hoist_assigns


def _snapshot_renames(e: _Edit) -> list[cst.CSTTransformer]:
    return [Rename(old, new) for old, new in e.snapshots.items()]


def _read_snapshots_on_main(e: _Edit) -> None:
    """A routed placement: the side stream may write the snapshot inputs, so the case's own
    statements in the window (on the current stream) read the copies. They run on both paths: the
    flag-off path binds each copy's name to the original itself (no copy), see _fork_block."""
    where, renames = e.where, _snapshot_renames(e)
    if not renames:
        return
    for i in range(where.fork, where.join):
        if i not in where.whole:
            for rename in renames:
                where.body[i] = rewritten(where.body[i], rename)


# Phases --------------------------------------------------------------------------------------------
def _phase_blocks(e: _Edit, phase_nodes: dict[int, list[cst.BaseStatement]]):
    """body index of each phase's anchor -> the block that re-enters the side stream after it, and
    -> the statements that block issues on the side stream (for schedule variants)."""
    plan, where = e.plan, e.where
    if not plan.phase_anchors:
        return {}, {}
    facts = statement_facts(where.body, e.positions)
    blocks: dict[int, list[cst.BaseStatement]] = {}
    issued: dict[int, tuple[cst.BaseStatement, ...]] = {}
    earlier: set[str] = set()  # names the side stream defined in earlier phases, on every path
    for node in phase_nodes.get(0, []):
        earlier |= bound_on_every_path(node)
    for p, anchor in enumerate(plan.phase_anchors, start=1):
        at = next((f.index for f in reversed(facts[: where.join]) if anchor in f.stores), None)
        if at is None:
            raise BadInput(f"stale plan for {plan.function}: phase anchor {anchor!r} is not assigned before the join")
        nodes = phase_nodes.get(p, [])
        if not nodes:
            continue
        inner = _gated_phase(e, p, anchor, nodes, earlier)
        for node in nodes:
            earlier |= bound_on_every_path(node)
        em = e.em
        # a phase re-entered before the guarded `if` runs under its condition too
        guarded = where.guarded is not None and at not in where.guarded.inside
        cond = conjoin(em.on_cond, plan.guard) if guarded else em.on_cond
        block = if_block(cond, [*parse_block(em.phase_head), *with_block(em.with_open, inner)], em.off_cond, [])
        note = f"msrewrite({plan.case}): phase {p} of {e.what} re-enters the side stream after {anchor}."
        blocks[at] = with_leading(block, [comment(note)])
        issued[at] = tuple(inner)
    return blocks, issued


def _gated_phase(e: _Edit, p: int, anchor: str, nodes: list[cst.BaseStatement], earlier: set[str]):
    """A phase's statements, after the mode's start gate (GE) when it has one."""
    if not e.em.phase_gate:
        return list(nodes)
    # the gated tensor must be bound wherever the phase runs: one an earlier phase bound on
    # every path (not inside a side `if`), else a side input (bound before the fork)
    loads = [n for node in nodes for n in sorted(node_facts(node).loads)]
    inputs = [n for n in loads if n in e.plan.side_inputs]
    tensor = next((n for n in loads if n in earlier), inputs[0] if inputs else None)
    if tensor is None:
        return list(nodes)
    side_name = tensor if tensor in earlier else _unique(f"{tensor}_phase{p}", e.taken)
    inner = [node.visit(Rename(tensor, side_name)) for node in nodes] if side_name != tensor else list(nodes)
    gate = e.em.phase_gate.format(side=side_name, tensor=tensor, anchor=anchor)
    return [*parse_block([gate]), *inner]


# The fork -------------------------------------------------------------------------------------------
@record
class _Runs:
    """Runs of side statements left at their original place (they form the off path); the ones
    that sit at the fork and right before the join go into those blocks' `else:`."""

    runs: list[list[int]]
    fork_run: list[int] | None
    join_run: list[int] | None
    join_guard: str  # a join after a guarded `if` runs under its condition too


def _runs(where: Layout, plan: OverlapPlan) -> _Runs:
    runs: list[list[int]] = []
    for i in sorted(where.whole):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    # a guarded plan's fork sits before the `if`; the side statements stay in it
    fork_run = next((r for r in runs if r[0] == where.fork), None) if where.guarded is None else None
    join_run = next((r for r in runs if r[-1] == where.join - 1 and r is not fork_run), None)
    join_guard = ""
    if where.guarded is not None and where.join not in where.guarded.inside:
        join_run = None
        join_guard = plan.guard
    return _Runs(runs, fork_run, join_run, join_guard)


def _off_nodes(body: list[cst.BaseStatement], run: list[int] | None) -> list[cst.BaseStatement]:
    if not run:
        return []
    nodes = [body[i] for i in run]
    return [strip_leading(nodes[0]), *nodes[1:]]


def _prelude(e: _Edit) -> list[cst.BaseStatement]:
    plan, em = e.plan, e.em
    if em.async_comm:
        opening = f"msrewrite({e.label}): {e.what} start as soon as their tensors exist, overlapping {e.main}."
    elif e.model_stream:
        opening = (
            f"msrewrite({e.label}): {e.what} runs on the model's own side stream self.{e.model_stream} during {e.main}."
        )
    else:
        opening = f"msrewrite({e.label}): {e.what} runs on side stream {literal(plan.stream_tag)} during {e.main}."
    notes = [comment(opening)]
    if plan.guard:
        notes.append(comment(f"Only when {plan.guard}, as in the `if` below; nothing in between can change that."))
    return with_leading(parse_block(em.prelude), notes)


def _fork_block(e: _Edit, side_nodes: list[cst.BaseStatement], runs: _Runs):
    """(the fork block, the prelude): the prelude opens the fork block when it goes at the fork."""
    plan, em, where = e.plan, e.em, e.where
    if em.side_head or em.side_tail:
        inner = [*parse_block(em.side_head), *side_nodes, *parse_block(em.side_tail)]
    else:
        inner = side_nodes
    clones = parse_block(
        [
            f"{new} = {old}.clone()" if old in e.snapshot_tensors else f"{new} = _ms_snapshot({old})"
            for old, new in e.snapshots.items()
        ]
    )
    off_nodes = _off_nodes(where.body, runs.fork_run)
    if clones and plan.placement == "routed":
        note = (
            f"msrewrite({e.label}): {e.what} on the side stream may write {', '.join(e.snapshots)} before the "
            f"join: {e.main} reads a copy."
        )
        clones = with_leading(clones, [comment(note)])
        # with the flag off the same statements read the originals, under the copies' names
        aliases = parse_block([f"{new} = {old}" for old, new in e.snapshots.items()])
        off_nodes = [*aliases, *off_nodes]
    elif clones:
        note = (
            f"msrewrite({e.label}): the main path may write {', '.join(e.snapshots)} before the join: "
            "the side stream reads a copy."
        )
        clones = with_leading(clones, [comment(note)])
    on_branch = [*clones, *parse_block(em.on_head), *with_block(em.with_open, inner)]
    prelude = _prelude(e)
    fork_cond = conjoin(em.on_cond, plan.guard) if plan.guard else em.on_cond
    fork_block = if_block(fork_cond, on_branch, em.off_cond, off_nodes)
    if e.prelude_at == where.fork:
        fork_block = prelude + fork_block
    if runs.fork_run:
        fork_block = with_leading(fork_block, list(leading_lines(where.body[where.fork])))
    return fork_block, prelude


# The join -------------------------------------------------------------------------------------------
def _join_block(e: _Edit, runs: _Runs, hoist_assigns: list[cst.BaseStatement]):
    """(the join block, the join statement after it or None, the main hoists' assignments)."""
    em, where = e.em, e.where
    body, join = where.body, where.join
    join_on = parse_block(em.join) if em.join else []
    join_cond = conjoin(em.on_cond, runs.join_guard) if runs.join_guard else em.on_cond
    join_stmt = body[join] if join < len(body) else cst.SimpleStatementLine(body=[cst.Pass()])
    main_assigns: list[cst.BaseStatement] = [assign(temp, call) for call, temp in where.main_hoisted]
    if e.plan.placement == "routed":  # the case's own calls, on the current stream: they read the copies
        for rename in _snapshot_renames(e):
            main_assigns = [rewritten(node, rename) for node in main_assigns]
    if (
        where.hoists or where.main_hoisted
    ):  # every hoisted call in one pass (a deep_replace rebuilds the tree, losing the others)
        temps = {id(call): temp for call, temp in [*where.hoists, *where.also_hoisted, *where.main_hoisted]}
        join_stmt = rewritten(join_stmt, ReplaceCalls(temps))
    if where.main_hoisted:
        block = _join_with_main_hoists(e, runs, join_cond, join_on, join_stmt, main_assigns)
        return block, None, main_assigns
    join_off = _off_nodes(body, runs.join_run) + hoist_assigns  # the off path computes what the join reads, as before
    if not (join_on or join_off):
        return [], join_stmt, main_assigns
    join_block = if_block(join_cond, join_on, em.off_cond, join_off)
    if runs.join_run:
        lead = list(leading_lines(body[runs.join_run[0]]))
    elif all(line.comment is None for line in leading_lines(join_stmt)):
        lead = list(leading_lines(join_stmt))
        join_stmt = strip_leading(join_stmt)
    else:
        lead = []
    return with_leading(join_block, lead + [comment(_join_note(e, join_on, join_stmt))]), join_stmt, main_assigns


def _join_note(e: _Edit, join_on: list[cst.BaseStatement], join_stmt: cst.BaseStatement) -> str:
    plan = e.plan
    if join_on and plan.side_outputs and not e.em.async_comm:
        return f"msrewrite({e.label}): join the side stream before the first use of {', '.join(plan.side_outputs)}."
    if join_on and e.em.async_comm:
        return f"msrewrite({e.label}): wait for the transfers before their first use."
    if join_on:
        where = "before returning" if e.where.join == len(e.where.body) or returns(join_stmt) else "here"
        return f"msrewrite({e.label}): {e.what} must finish before its buffers are reused: join {where}."
    return f"msrewrite({e.label}): with the flag off {e.what} runs here, as before."


def _join_with_main_hoists(e: _Edit, runs: _Runs, join_cond: str, join_on, join_stmt, main_assigns):
    """The main calls run first on the flag-on path only, into their temporaries, overlapping the
    side work; the join statement then reads them. The flag-off path keeps the statements as they
    were, in their order (the side statements right before the join included)."""
    body, join = e.where.body, e.where.join
    original = body[join]
    off = _off_nodes(body, runs.join_run)
    off.append(original if off else strip_leading(original))
    block = if_block(join_cond, [*main_assigns, *join_on, strip_leading(join_stmt)], e.em.off_cond, off)
    lead = list(leading_lines(body[runs.join_run[0]])) if runs.join_run else list(leading_lines(body[join]))
    main_names = ", ".join(dict.fromkeys(code_of(call.func) for call, _temp in e.where.main_hoisted))
    notes = [
        f"msrewrite({e.label}): with the flag on, {main_names} runs here, during {e.what}"
        + (", then" if join_on else ".")
    ]
    if join_on:
        notes.append(f"the side stream is joined before the first use of {', '.join(e.plan.side_outputs)}.")
    return with_leading(block, lead + [comment(n) for n in notes])


# The body around them ---------------------------------------------------------------------------------
def _wrap(with_line: str, nodes: list[cst.BaseStatement], label: str) -> list[cst.BaseStatement]:
    """`with <limit>:` around the main work of the overlap window (its own AI-core budget)."""
    if not nodes:
        return nodes
    lead = list(leading_lines(nodes[0]))
    inner = [strip_leading(nodes[0]), *nodes[1:]]
    block = with_block(with_line, inner)
    note = f"msrewrite({label}): the main branch gets its own core budget while the side stream runs."
    return with_leading(block, lead + [comment(note)])


@record
class _Built:
    body: list[cst.BaseStatement]
    window: tuple[int, int] | None
    guarded_block: tuple[int, int, tuple[bool, ...]] | None
    phases: list[tuple[int, tuple[cst.BaseStatement, ...]]]


class _Assembly:
    """The new function body: the original statements with the fork, join, off-path and phase
    blocks in their places, and where each of them went."""

    def __init__(
        self, e: _Edit, runs: _Runs, prelude, fork_block, join_block, join_stmt, phase_blocks, phase_issued, with_at
    ):
        self.e, self.runs, self.prelude, self.fork_block = e, runs, prelude, fork_block
        # the index of a `with`'s first statement (the fork before it), and where it went in `new`
        self.with_at: int | None = with_at
        self.with_start: int | None = None
        self.join_block, self.join_stmt = join_block, join_stmt
        self.phase_blocks, self.phase_issued = phase_blocks, phase_issued
        self.body = list(e.where.body)  # a statement the prelude goes before loses its leading lines here
        self.new: list[cst.BaseStatement] = []
        self.window_start: int | None = None  # where the main work between fork and join begins in `new`
        self.window_end: int | None = None
        self.block_start: int | None = None  # where the guarded `if`'s block lies in `new`
        self.block_end: int | None = None
        self.phases: list[tuple[int, tuple[cst.BaseStatement, ...]]] = []
        self.in_fork_or_join = set(runs.fork_run or []) | set(runs.join_run or [])

    def build(self) -> _Built:
        where = self.e.where
        guarded = where.guarded
        for i, stmt in enumerate(self.body):
            if guarded is not None and i == guarded.index + len(guarded.block):
                self.block_end = len(self.new)
            if i == where.join:
                self._wrap_window()
            if i == self.with_at:
                self.with_start = len(self.new)
            self._statement(i, stmt)
        block_end = len(self.new) if self.block_end is None else self.block_end
        if where.join == len(self.body):
            self._wrap_window()
            self.window_end = len(self.new)
            self.new += self.join_block
        guarded_block = None
        if guarded is not None:  # the block goes back into its `if` (window and side nodes count without it)
            start = self.block_start
            assert start is not None  # the loop passed the `if`
            self.new[start:block_end] = [guarded.rebuild(self.new[start:block_end])]
            guarded_block = (start, block_end, tuple(in_orelse for _node, in_orelse in guarded.path))
        window = None
        if self.window_start is not None and self.window_end is not None:
            window = (self.window_start, self.window_end)
        return _Built(self.new, window, guarded_block, self.phases)

    def _wrap_window(self) -> None:
        limit = self.e.em.main_limit
        if self.window_start is not None and limit:
            self.new[self.window_start :] = _wrap(limit, self.new[self.window_start :], self.e.label)

    def _statement(self, i: int, stmt: cst.BaseStatement) -> None:
        e, where = self.e, self.e.where
        if i == e.prelude_at and e.prelude_at != where.fork:
            self.new += with_leading(self.prelude, list(leading_lines(stmt)))
            stmt = strip_leading(stmt)
            self.body[i] = stmt
        if i == where.fork:
            self.new += self.fork_block
            self.window_start = len(self.new)
        if where.guarded is not None and i == where.guarded.index:
            self.block_start = len(self.new)
        if i in where.whole:
            self._off_path(i)
        elif i == where.join:
            self.window_end = len(self.new)
            self.new += self.join_block
            if self.join_stmt is not None:
                self.new.append(self.join_stmt)
        else:
            self.new.append(stmt)
            if i in self.phase_blocks:
                self.phases.append((len(self.new), self.phase_issued[i]))
                self.new += self.phase_blocks[i]

    def _off_path(self, i: int) -> None:
        """A side statement left at its place runs there under `if <off>:` (the first of its run)."""
        if i in self.in_fork_or_join:
            return
        run = next(r for r in self.runs.runs if i in r)
        if i == run[0]:
            off_cond = self.e.em.off_cond
            guard = if_block(off_cond, [], off_cond, _off_nodes(self.body, run))
            self.new += with_leading(guard, list(leading_lines(self.body[i])))
