"""Profiler ranges around an edit's side and main windows (`apply --markers`), and their removal.

A pass over the edited module, after the emitter: in the function each plan edited, the side
stream's `with <api>.stream(<side>):` block is wrapped in a range named
`msrewrite:<case>:<tag>:side`, and the main work from the fork to the join in
`msrewrite:<case>:<tag>:main`; <tag> is the plan's stream tag, or its branch for a branch of a
several-stream case (indexer-prolog's q, weights, q_quant: q_quant re-enters q's stream after
its join and is a window of its own). Each plan's side stream is the local its prelude binds
(`<side> = _ms_side_stream(...)`, `= self.<attr>` for a stream handed down by the model's
constructor, or the model's own stream), found by the comment the emitter opens every plan's
prelude with, `# msrewrite(<label>): ... runs on ...` (OverlapPlan.label). Every added line sits
inside the blocks the enable flag already guards (the fork's `if <side> is not None:` and the
join's), so with the flag off nothing runs.

What the ranges are:
  cuda   torch.profiler.record_function: kineto records the host range and, per stream, the span
         of the kernels launched inside it (`gpu_user_annotation`), which `msrewrite profile` reads.
  eager  torch_npu's mstx ranges with a stream, `torch.npu.mstx.range_start(message, stream)` /
         `range_end(id)` (torch_npu/npu/mstx.py): marked on the host and on that stream on the
         device, so the range shows in trace_view.json's Ascend Hardware process. A
         record_function range stays on the host in a torch_npu trace. Collected when the
         profiler runs with mstx enabled (experimental_config msprof_tx / mstx).
Graph modes (npugraph-ex, ge-graph), phased plans and async-comm plans are refused: a range
opened while capturing a graph is not replayed with it, and a phased side branch has no one window.

`remove` deletes exactly the added lines and helpers, so marking then removing gives back the
unmarked edit byte for byte.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from msrewrite.analyze.outline import unique_name
from msrewrite.analyze.walk import Visitor
from msrewrite.errors import BadInput
from msrewrite.plan import OverlapPlan
from msrewrite.validate import literal

START, END = "_ms_range_start", "_ms_range_end"
MARKER_MODES = ("eager", "cuda")

HELPERS = {
    "cuda": f'''\
def {START}(name, stream):
    """Open a profiler range (record_function); kineto shows it on each stream its kernels ran on."""
    profiler_range = torch.profiler.record_function(name)
    profiler_range.__enter__()
    return profiler_range


def {END}(profiler_range):
    """Close a range opened by {START}."""
    profiler_range.__exit__(None, None, None)
''',
    "eager": f'''\
def {START}(name, stream):
    """Open an mstx range on `stream`: torch_npu's profiler shows it on the host and on the device."""
    return torch.npu.mstx.range_start(name, stream)


def {END}(range_id):
    """Close a range opened by {START}."""
    torch.npu.mstx.range_end(range_id)
''',
}


def marker_name(plan: OverlapPlan, role: str) -> str:
    return f"msrewrite:{plan.case}:{plan.region_tag}:{role}"


def check(plan: OverlapPlan) -> None:
    if plan.mode not in MARKER_MODES:
        raise BadInput(
            f"--markers: {plan.mode} mode is not supported (eager and cuda only: a range opened "
            "while a graph is captured is not replayed with it)"
        )
    if plan.phase_anchors or plan.sync == "async-comm":
        raise BadInput(
            f"--markers: {plan.function}: a {'phased' if plan.phase_anchors else 'async-comm'} "
            "plan has no single side window to mark"
        )


def _is_stream_with(stmt: cst.CSTNode, api: str) -> str | None:
    """The side stream's local name if `stmt` is `with torch.<api>.stream(NAME):`."""
    if not isinstance(stmt, cst.With) or len(stmt.items) != 1:
        return None
    call = stmt.items[0].item
    if isinstance(call, cst.Call) and m.matches(
        call,
        m.Call(
            func=m.Attribute(value=m.Attribute(value=m.Name("torch"), attr=m.Name(api)), attr=m.Name("stream")),
            args=[m.Arg(value=m.Name())],
        ),
    ):
        stream = call.args[0].value
        return stream.value if isinstance(stream, cst.Name) else None
    return None


def _tests_stream(node: cst.If, stream: str) -> bool:
    """`if STREAM is not None...:` (the emitted fork and join conditions start so)."""
    test = node.test
    while isinstance(test, cst.BooleanOperation):
        test = test.left
    return m.matches(
        test,
        m.Comparison(
            left=m.Name(stream), comparisons=[m.ComparisonTarget(operator=m.IsNot(), comparator=m.Name("None"))]
        ),
    )


def _line(code: str) -> cst.SimpleStatementLine:
    return cst.ensure_type(cst.parse_statement(code + "\n"), cst.SimpleStatementLine)


class _Mark(cst.CSTTransformer):
    """Adds the four range lines to the edited functions."""

    def __init__(self, plans_by_function: dict[str, list[OverlapPlan]], api: str, taken: set[str]) -> None:
        self.plans = plans_by_function
        self.api = api
        self.path: list[str] = []
        self.taken = taken

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.path.append(node.name.value)

    def leave_ClassDef(self, _original, updated):
        self.path.pop()
        return updated

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.path.append(node.name.value)

    def leave_FunctionDef(self, _original, updated):
        qualname = ".".join(self.path)
        self.path.pop()
        plans = self.plans.get(qualname)
        if not plans:
            return updated
        for plan in plans:
            stream = _plan_stream(updated, plan)
            if stream is None:
                raise BadInput(f"--markers: {qualname}: no side stream for {plan.label!r} in the edit")
            updated = self._mark(updated, plan, stream, qualname)
        return updated

    def _mark(self, func: cst.FunctionDef, plan: OverlapPlan, stream: str, qualname: str) -> cst.FunctionDef:
        side_id, main_id = unique_name("side_range", self.taken), unique_name("main_range", self.taken)
        state = {"fork": False, "join": False}
        api = self.api
        current = f"torch.{api}.current_stream()"  # the main stream at the fork, whatever the edit named it

        class Blocks(cst.CSTTransformer):
            def leave_If(self, original, updated):
                if not _tests_stream(original, stream):
                    return updated
                body = list(updated.body.body)
                at = next((k for k, s in enumerate(body) if _is_stream_with(s, api) == stream), None)
                if at is not None and not state["fork"]:
                    block = body[at]
                    inner = [
                        _line(f"{side_id} = {START}({literal(marker_name(plan, 'side'))}, {stream})"),
                        *block.body.body,
                        _line(f"{END}({side_id})"),
                    ]
                    body[at] = block.with_changes(body=block.body.with_changes(body=inner))
                    body.insert(at + 1, _line(f"{main_id} = {START}({literal(marker_name(plan, 'main'))}, {current})"))
                    state["fork"] = True
                    return updated.with_changes(body=updated.body.with_changes(body=body))
                if state["fork"] and not state["join"] and _joins(body, stream):
                    # main calls hoisted out of the join statement open the block: they are main work
                    body.insert(_hoisted_main(body, plan), _line(f"{END}({main_id})"))
                    state["join"] = True
                    return updated.with_changes(body=updated.body.with_changes(body=body))
                return updated

        new = func.visit(Blocks())
        if not (state["fork"] and state["join"]):
            raise BadInput(
                f"--markers: {qualname}: could not find the fork and join of side stream {plan.stream_tag!r}"
            )
        return cst.ensure_type(new, cst.FunctionDef)


def _hoisted_main(body: list[cst.BaseStatement], plan: OverlapPlan) -> int:
    """How many statements at the top of the join block assign the plan's main hoists' temporaries."""
    temps = [h.hoist or "" for h in plan.main_hoists]  # OverlapPlan gives every main hoist its temporary
    count = 0
    for stmt, temp in zip(body, temps, strict=False):  # the block holds more than the hoists
        if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(temp))])])):
            break
        count += 1
    return count


def _joins(body: list[cst.BaseStatement], stream: str) -> bool:
    """The join block: it waits for the side stream (`cur.wait_stream(side)` or an event the side recorded)."""
    code = "".join(cst.Module(body=[]).code_for_node(stmt) for stmt in body)
    return f".wait_stream({stream})" in code or f".record({stream})" in code


def _plan_stream(func: cst.FunctionDef, plan: OverlapPlan) -> str | None:
    """The local that holds `plan`'s side stream: the name the statement after the plan's opening
    comment (`# msrewrite(<label>): ... runs on ...`) binds."""
    opening = f"# msrewrite({plan.label}): "
    found: list[str] = []

    class Find(Visitor):
        def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
            if found or len(node.body) != 1 or not isinstance(node.body[0], cst.Assign):
                return
            if not any(
                line.comment is not None
                and line.comment.value.startswith(opening)
                and " runs on " in line.comment.value
                for line in node.leading_lines
            ):
                return
            targets = node.body[0].targets
            if len(targets) == 1 and isinstance(targets[0].target, cst.Name):
                found.append(targets[0].target.value)

    func.visit(Find())
    return found[0] if found else None


def add(text: str, plans: list[OverlapPlan]) -> str:
    """The edited module `text` with ranges around each plan's windows, and the two helpers."""
    if not plans:
        return text
    for plan in plans:
        check(plan)
    mode = plans[0].mode
    module = cst.parse_module(text)
    if any(isinstance(s, cst.FunctionDef) and s.name.value == START for s in module.body):
        raise BadInput("--markers: the file already has profiler ranges (apply --no-markers removes them)")
    by_function: dict[str, list[OverlapPlan]] = {}
    for plan in plans:
        by_function.setdefault(plan.function, []).append(plan)
    taken = {n.value for n in m.findall(module, m.Name()) if isinstance(n, cst.Name)}
    marked = module.visit(_Mark(by_function, "cuda" if mode == "cuda" else "npu", taken))
    helpers = list(cst.parse_module(HELPERS[mode].replace("\n", module.default_newline)).body)
    body = list(marked.body)
    last = max(k for k, s in enumerate(body) if isinstance(s, cst.FunctionDef) and s.name.value.startswith("_ms_"))
    two_blank = [cst.EmptyLine(), cst.EmptyLine()]
    helpers = [h.with_changes(leading_lines=two_blank) for h in helpers]
    body[last + 1 : last + 1] = helpers
    return marked.with_changes(body=body).code


def remove(text: str) -> str:
    """`text` without the ranges and helpers `add` wrote; the same text when it has none."""
    module = cst.parse_module(text)

    def is_range_line(stmt: cst.CSTNode) -> bool:
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            return False
        small = stmt.body[0]
        call = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
        return isinstance(call, cst.Call) and m.matches(call.func, m.Name(START) | m.Name(END))

    class Strip(cst.CSTTransformer):
        def leave_IndentedBlock(self, _original, updated):
            body = [s for s in updated.body if not is_range_line(s)]
            return updated.with_changes(body=body) if len(body) != len(updated.body) else updated

    body = [
        s for s in module.visit(Strip()).body if not (isinstance(s, cst.FunctionDef) and s.name.value in (START, END))
    ]
    return module.with_changes(body=body).code
