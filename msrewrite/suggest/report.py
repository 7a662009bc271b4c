"""The analysis report: every section of the multi-stream report template (seed-cases.md §3).

Sections that need hardware (implementation, debugging, acceptance, profiles) are kept and say
N/A. Modules are the statements of the function holding the best candidate (a hoisted side
call is its own module); operators come from the trace when there is one.
"""

from __future__ import annotations

import re
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msrewrite.analyze.stmtgraph import FunctionInfo, ModuleInfo
from msrewrite.records import record
from msrewrite.suggest import graph as g
from msrewrite.suggest.candidates import Candidate
from msrewrite.suggest.mermaid import label, node_id
from msrewrite.suggest.profiles import DeviceProfile

if TYPE_CHECKING:
    from msrewrite.suggest.trace import Trace

MAX_OPS = 40  # per module in §8; the rest is summarized


@record
class FileAnalysis:
    file: Path
    module: ModuleInfo | None
    candidates: list[Candidate]
    tiers: dict[str, str]  # tier -> "ok" / why not
    device: DeviceProfile
    phase: str
    target: str | None = None
    trace: Trace | None = None
    scopes: dict[str, g.Scope] = field(default_factory=dict)
    fx: dict[str, Any] = field(default_factory=dict)  # function -> fxgraph.FxResult
    # branches the finder refused: {"function", "side", "tier", "reason"} (apply --plan would refuse them too)
    refused: list[dict] = field(default_factory=list)
    # `msrewrite profile --json` output for this model (suggest --profile): fills §11.5
    profile: dict | None = None
    # the prefill-microbatch fork of a model with a layer loop (suggest/microbatch.py), with its plan
    microbatch: list = field(default_factory=list)

    @property
    def tier(self) -> str:
        return "trace" if self.tiers.get("trace") == "ok" else "static"


@record
class ModuleNode:
    id: str
    name: str
    stmt: int
    lines: str
    side: bool
    inputs: list[str]
    outputs: list[str]
    side_effect: str
    ops: list = field(default_factory=list)


def report_name(file: Path, phase: str) -> str:
    stem = re.sub(r"^modeling_", "", file.stem)
    return f"{stem.replace('_', '-').lower()}-{phase}.md"


def write_report(analysis: FileAnalysis, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / report_name(analysis.file, analysis.phase)
    path.write_text(render(analysis), encoding="utf-8")
    return path


# Module level -------------------------------------------------------------------------------------
def _modules(
    analysis: FileAnalysis, info: FunctionInfo, best: Candidate | None
) -> tuple[list[ModuleNode], list[tuple]]:
    plan = best.plan if best else None
    side_lines = {s.first_line for s in plan.side if s.hoist is None} if plan else set()
    hoists = [s for s in plan.side if s.hoist] if plan else []
    scope = analysis.scopes.get(info.qualname)
    ops_by_stmt: dict[int, list] = {}
    if scope:
        for op in scope.ops:
            ops_by_stmt.setdefault(scope.stmt_of[op.index], []).append(op)
    nodes: list[ModuleNode] = []
    by_stmt: dict[int, ModuleNode] = {}
    hoist_node: ModuleNode | None = None
    for s in info.statements:
        name = s.calls[0].callee if s.calls else (("merge_" + "_".join(sorted(s.defs))) if s.defs else "output")
        if s.first_line == (plan.join_line if plan else None) and hoists:
            name = "merge_" + "_".join(sorted(s.defs) or ["output"])
        node = ModuleNode(
            id=node_id(f"m{s.first_line}_{name}"),
            name=name,
            stmt=s.index,
            lines=s.label,
            side=s.first_line in side_lines,
            inputs=sorted(s.uses - {"self"}),
            outputs=sorted(s.defs),
            side_effect=_side_effect(s),
            ops=ops_by_stmt.get(s.index, []),
        )
        if plan is not None and hoists and s.first_line == plan.join_line:  # hoists come from the plan
            call = next(c for c in s.calls if c.source == hoists[0].source)
            hoist_node = ModuleNode(
                id=node_id(f"m{call.first_line}_{call.attr}_side"),
                name=call.callee,
                stmt=s.index,
                lines=f"L{call.first_line}",
                side=True,
                inputs=sorted(call.uses),
                outputs=[hoists[0].hoist or ""],  # hoists are the side entries with a hoist
                side_effect="none",
            )
            sub_ops = (
                [
                    op
                    for op in node.ops
                    if g.submodule_of_ops(scope, frozenset([op.index]), {op.index: op})
                    == {call.callee.replace("[", ".").rstrip("]")}
                ]
                if scope
                else []
            )
            hoist_node.ops = sub_ops
            node.ops = [op for op in node.ops if op not in sub_ops]
            nodes.append(hoist_node)
        nodes.append(node)
        by_stmt[s.index] = node
    edges: list[tuple] = []  # (from, to, type, reason)
    dag = info.graph(renaming=True)
    for u, v, data in dag.edges(data=True):
        a, b = by_stmt[u], by_stmt[v]
        if hoist_node is not None and b.stmt == hoist_node.stmt and data["name"] in hoist_node.inputs:
            b = hoist_node
        edges.append((a, b, data["kind"], f"{data['name']} ({data['kind']})"))
    if hoist_node is not None:
        edges.append((hoist_node, by_stmt[hoist_node.stmt], "data", f"{hoist_node.outputs[0]} (hoisted result)"))
    if plan:
        side = [n for n in nodes if n.side]
        fork_pred = [n for n in nodes if not n.side and _first_line(n) < plan.fork_line]
        join_node = next(n for n in nodes if not n.side and _first_line(n) == plan.join_line)
        if side:
            if fork_pred:
                edges.append((fork_pred[-1], side[0], "event", "fork: side stream waits for the main stream"))
            edges.append((side[-1], join_node, "event", "join: main stream waits for the side stream"))
    return nodes, edges


def _first_line(node: ModuleNode) -> int:
    match = re.match(r"L(\d+)", node.lines)
    assert match is not None, node.lines  # lines are always written as L<first>[-L<last>]
    return int(match.group(1))


def _side_effect(s) -> str:
    parts = []
    if s.writes_self:
        parts.append("writes self state")
    if s.mutates:
        parts.append("in-place: " + ", ".join(sorted(s.mutates)))
    if s.exits:
        parts.append("returns")
    return "; ".join(parts) or "none"


def _resource(node: ModuleNode, device: DeviceProfile) -> str:
    if not node.ops:
        return "N/A (no traced ops)"
    from msrewrite.suggest.cost import kind_of, op_time

    kinds: dict[str, int] = {}
    for op in node.ops:
        kinds[kind_of(op)] = kinds.get(kind_of(op), 0) + 1
    heavy = max(kinds, key=kinds.__getitem__)
    us = sum(op_time(op, device) for op in node.ops) * 1e6
    return f"{heavy}-heavy, {len(node.ops)} ops, ~{us:.2f} µs model (tiny shapes)"


def _mermaid(nodes: list[ModuleNode], edges: list[tuple]) -> str:
    lines = ["flowchart LR", "    subgraph Main[Main Path]"]
    lines += [f'        {n.id}["{label(n.name + " " + n.lines)}"]' for n in nodes if not n.side]
    lines += ["    end", "    subgraph Side[Side Path]"]
    lines += [f'        {n.id}["{label(n.name + " " + n.lines)}"]' for n in nodes if n.side]
    lines += ["    end"]
    seen = set()
    for a, b, kind, _ in edges:
        arrow = "-.->" if kind == "event" else "-->"
        key = (a.id, b.id, arrow)
        if key not in seen and a.id != b.id:
            seen.add(key)
            lines.append(f"    {a.id} {arrow} {b.id}")
    return "\n".join(lines)


# Rendering ----------------------------------------------------------------------------------------
def render(analysis: FileAnalysis) -> str:
    best = analysis.candidates[0] if analysis.candidates else None
    assert best is None or analysis.module is not None  # candidates come from the module's analysis
    info = analysis.module.functions.get(best.plan.function) if best and analysis.module else None
    title = report_name(analysis.file, analysis.phase)[:-3]
    out: list[str] = [f"# {title} 多流优化报告", ""]
    out += _section1(analysis, best)
    out += _section2(best)
    nodes, edges = _modules(analysis, info, best) if info else ([], [])
    out += ["## 3. 整网模块清单", ""]
    out += [
        "| module_id | module_name | module_type | inputs | outputs | side_effect | resource_hint |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in nodes:
        kind = "Side Path" if n.side else "Main Path"
        out.append(
            f"| {n.id} | {n.name} ({n.lines}) | {kind} | {', '.join(n.inputs) or '-'} | {', '.join(n.outputs) or '-'} | {n.side_effect} | {_resource(n, analysis.device)} |"
        )
    if not nodes:
        out.append("| N/A | no candidate function | - | - | - | - | - |")
    out += ["", "## 4. 整网模块依赖清单", "", "| from | to | dependency_type | reason |", "|---|---|---|---|"]
    for a, b, kind, reason in edges:
        out.append(f"| {a.id} | {b.id} | {kind} | {reason} |")
    out.append("| - | - | collective_order | no collective ops in this function |")
    fx = analysis.fx.get(info.qualname) if info else None
    if fx is not None and fx.ok:
        for u, v, data in fx.dag.edges(data=True):
            via = f" via {', '.join(data['via'][:6])}" if data["via"] else ""
            out.append(f"| fx_{u} | fx_{v} | {data['kind']} | torch.fx module graph{via} |")
    out += [
        "",
        "## 5. 整网模块 DAG",
        "",
        "```mermaid",
        _mermaid(nodes, edges) if nodes else _empty_mermaid(),
        "```",
        "",
    ]
    if fx is not None and info is not None:  # fx is only looked up for an info
        out += _fx_section(fx, info, best)
    out += _section6(analysis, nodes, best)
    out += _section7(analysis, best)
    out += _section8(analysis, nodes)
    out += _sections9to12(analysis, best)
    return "\n".join(out) + "\n"


def _fx_section(fx, info: FunctionInfo, best: Candidate | None) -> list[str]:
    """The torch.fx module DAG of the function (direct submodules as nodes), or why there is none."""
    out = ["### 5.1 torch.fx 模块级 DAG", ""]
    if not fx.ok:
        return out + [f"- fx tier failed: {fx.reason}", ""]
    out.append(f"- {fx.summary()}; edges: data (tensor), item (element of a tuple output), shape (sizes only)")
    side_nodes: set[str] = set()
    if best is not None:
        from msrewrite.suggest.fxgraph import module_node_for_callee

        out.append(f"- cross-check of the top candidate: {best.fx_check or 'N/A'}")
        callees = [c.callee for i in best.choice.statements for c in info.statements[i].calls]
        if best.choice.hoist:
            callees.append(best.choice.hoist[1].callee)
        side_nodes = {n for c in callees for n in module_node_for_callee(fx.dag, c)}

    def declare(n: str) -> str:
        d = fx.dag.nodes[n]
        where = f" L{d['line']}" if d.get("line") else ""
        return f'        fx_{node_id(n)}["{label(d["kind"] + " " + str(d["target"]) + where)}"]'

    lines = ["flowchart LR", "    subgraph FxMain[Main Path]"]
    lines += [declare(n) for n in fx.dag.nodes if n not in side_nodes]
    lines += ["    end", "    subgraph FxSide[Side Path]"]
    lines += [declare(n) for n in sorted(side_nodes)]
    lines.append("    end")
    for u, v, data in fx.dag.edges(data=True):
        arrow = "-->" if data["kind"] == "data" else "-.->"
        lines.append(f"    fx_{node_id(u)} {arrow}|{data['kind']}| fx_{node_id(v)}")
    return out + ["", "```mermaid", "\n".join(lines), "```", ""]


def _empty_mermaid() -> str:
    return 'flowchart LR\n    subgraph Main[Main Path]\n        none["no candidate"]\n    end'


def _section1(analysis: FileAnalysis, best: Candidate | None) -> list[str]:
    return [
        "## 1. 分析范围",
        "",
        f"- 模型/网络: `{analysis.file.name}`",
        f"- 阶段: {analysis.phase}",
        f"- 分析对象: `{best.plan.function if best else 'N/A'}` (target `{analysis.target or 'auto'}`)",
        f"- 代码入口: `{analysis.file}`",
        "- 当前执行模式: eager (analysis on CPU; no NPU run)",
        f"- 说明: tiers {', '.join(f'{k}={v}' for k, v in analysis.tiers.items())}; cost model device `{analysis.device.name}`",
        "",
    ]


def _fmt_us(seconds: float | None) -> str:
    return "N/A" if seconds is None else f"{seconds * 1e6:.2f} µs"


def _section2(best: Candidate | None) -> list[str]:
    if not best:
        return [
            "## 2. 目标优化点",
            "",
            "- 希望获得的 overlap: none found",
            "- 预期并行对象: N/A",
            "- 预期收益: N/A",
            "- 本轮不处理的范围: N/A",
            "",
        ]
    side = "; ".join(s.source for s in best.plan.side)
    bound = f", critical-path bound ×{best.cost.bound:.3f}" if best.cost else ""
    return [
        "## 2. 目标优化点",
        "",
        f"- 希望获得的 overlap: `{side}` on a side stream beside the main path of `{best.plan.function}`",
        f"- 预期并行对象: case `{best.case}`, fork line {best.plan.fork_line}, join line {best.plan.join_line}",
        f"- 最少同步点 (one side stream): {_syncs(best)}",
        f"- torch.fx 交叉验证: {best.fx_check or 'N/A (no fx graph of this function)'}",
        f"- 预期收益: {_fmt_us(best.estimated_saving)} per call ({best.cost_shapes}{bound})",
        "- 本轮不处理的范围: communication overlap, core limiting, graph-mode tuning (need hardware)",
        "",
    ]


def _syncs(c: Candidate) -> str:
    if not c.syncs:
        return "N/A"
    s = c.syncs
    return (
        f"{c.min_syncs} ({s['fork']} fork + {s['join']} join; {s['fork_edges']} main->side and "
        f"{s['join_edges']} side->main edges after transitive reduction)"
    )


def _section6(analysis: FileAnalysis, nodes: list[ModuleNode], best: Candidate | None) -> list[str]:
    main = [n for n in nodes if not n.side]
    side = [n for n in nodes if n.side]
    window = [n for n in main if best and best.plan.fork_line <= _first_line(n) < best.plan.join_line]
    pending = [c for c in analysis.candidates[1:] if c.case == "generic" or (c.cost and c.cost.too_small)]
    out = ["## 6. 模块级并行性结论", "", "### 6.1 主串行链", ""]
    out.append(" -> ".join(n.name for n in main) or "N/A")
    out += ["", "### 6.2 可并行模块组", ""]
    if side:
        out.append(f"- 组 A (Main Path): {' -> '.join(n.name for n in window) or 'N/A'}")
        out.append(f"- 组 B (Side Path): {' -> '.join(n.name for n in side)}")
    else:
        out.append("- N/A")
    out += ["", "### 6.3 待验证模块组", ""]
    out += [
        f"- {c.plan.function} {c.plan.side_lines} ({c.case}, {_fmt_us(c.estimated_saving)}, {c.min_syncs} syncs{', too small' if c.cost and c.cost.too_small else ''})"
        for c in pending[:8]
    ] or ["- none"]
    if analysis.refused:  # independent in the graph, but the branch finder (and apply --plan) refuses the move
        out += ["", f"Refused by the branch finder ({len(analysis.refused)}; `apply --plan` would refuse them too):"]
        out += [f"- {r['function']} {', '.join(r['side'])}: {r['reason']}" for r in analysis.refused[:8]]
    out += ["", "### 6.4 建议流分组", ""]
    out.append(f"- Stream0 / Main Path: {', '.join(n.name for n in main) or 'N/A'}")
    out.append(f"- Stream1 / Side Path: {', '.join(n.name for n in side) or 'N/A'}")
    out.append("- Stream2 / Comm Path: N/A (no collectives traced)")
    return out + [""]


def _section7(analysis: FileAnalysis, best: Candidate | None) -> list[str]:
    return [
        "## 7. 模块拆解结论",
        "",
        "- 必须串行: statements linked by data or state edges in §4",
        f"- 可以并行: {best.plan.summary if best else 'N/A'}",
        f"- 待验证: {max(0, len(analysis.candidates) - 1)} further candidate(s), see §6.3",
        f"- 推荐优先实现的多流切入点: `{best.command}`" if best else "- 推荐优先实现的多流切入点: N/A",
        "",
    ]


def _section8(analysis: FileAnalysis, nodes: list[ModuleNode]) -> list[str]:
    out = ["## 8. 每个模块的算子级拆解", ""]
    if any(node.ops for node in nodes):
        from msrewrite.suggest.cost import kind_of, op_time

    if not nodes:
        return out + ["N/A", ""]
    for number, node in enumerate(nodes, 1):
        ops = node.ops[:MAX_OPS]
        out += [f"### 8.{number} {node.name} ({node.lines})", "", "#### 算子清单", ""]
        if not ops:
            out += ["N/A (static tier or no tensor ops)", "", "#### 算子依赖清单", "", "N/A", "", "#### 算子 DAG", ""]
            out += [
                "```mermaid",
                f'flowchart LR\n    subgraph {node.id}_ops[{label(node.name)}]\n        {node.id}_stmt["{label(node.lines)}"]\n    end',
                "```",
                "",
            ]
        else:
            ids = {op.index for op in ops}
            out += [
                "| op_id | op_name | op_type | inputs | outputs | side_effect | resource_hint |",
                "|---|---|---|---|---|---|---|",
            ]
            for op in ops:
                shapes_in = ", ".join("x".join(map(str, t.shape)) for t in op.inputs[:3]) or "-"
                shapes_out = ", ".join("x".join(map(str, t.shape)) for t in op.outputs[:2]) or "-"
                effect = "in-place write" if op.writes else ("host sync" if op.is_sync else "none")
                out.append(
                    f"| op{op.index} | {op.name} | {kind_of(op)} | {shapes_in} | {shapes_out} | {effect} | {op_time(op, analysis.device) * 1e9:.0f} ns |"
                )
            if len(node.ops) > MAX_OPS:
                out.append(f"| ... | {len(node.ops) - MAX_OPS} more ops | | | | | |")
            out += ["", "#### 算子依赖清单", "", "| from | to | dependency_type | reason |", "|---|---|---|---|"]
            op_edges = [(d, op.index) for op in ops for d in sorted(op.deps) if d in ids]
            for d, o in op_edges:
                out.append(f"| op{d} | op{o} | data | storage def-use |")
            out += [
                "",
                "#### 算子 DAG",
                "",
                "```mermaid",
                "flowchart LR",
                f"    subgraph {node.id}_ops[{label(node.name)}]",
            ]
            out += [f'        {node.id}_op{op.index}["{label(op.name)}"]' for op in ops]
            out += ["    end"] + [f"    {node.id}_op{d} --> {node.id}_op{o}" for d, o in op_edges] + ["```", ""]
        roots = [op for op in ops if not (op.deps & {o.index for o in ops})]
        out += [
            "#### 算子并行性结论",
            "",
            "##### 模块内主串行链",
            "",
            " -> ".join(f"op{o.index}" for o in ops[:12]) or "N/A",
        ]
        out += [
            "",
            "##### 模块内可并行算子组",
            "",
            f"- {len(roots)} independent entry op(s): {', '.join(f'op{o.index}' for o in roots[:8]) or 'N/A'}",
        ]
        out += ["", "##### 模块内待验证算子组", "", "- N/A (needs kernel_details.csv from a profile)"]
        out += [
            "",
            "##### 模块内建议流分组",
            "",
            f"- {'Stream1 / Side Path' if node.side else 'Stream0 / Main Path'}: all ops of this module",
        ]
        out += [
            "",
            "#### 模块内结论",
            "",
            "- 必须串行: ops chained by storage def-use above",
            "- 可以并行: see entry ops",
            "- 待验证: resource overlap (needs hardware)",
            f"- 可能的流切换点·同步点: {'fork before / join after this module' if node.side else 'none inside'}",
            "",
        ]
    return out


def _profile_acceptance(analysis: FileAnalysis) -> list[str]:
    """§11.5: suggest's estimate against what `msrewrite profile` measured, per marked region."""
    out = ["### 11.5 Profile acceptance", ""]
    data = analysis.profile
    if not data:
        return out + [
            "N/A (apply --markers, profile the model on the device, then `msrewrite profile TRACE "
            "--baseline OFF_TRACE --json > profile.json` and `suggest --report DIR --profile profile.json`)",
            "",
        ]
    estimates = {(c.plan.case, c.plan.region_tag): c.estimated_saving for c in analysis.candidates}
    out += [
        f"trace: `{data.get('trace')}` ({data.get('format')}, {data.get('steps')} steps)",
        "",
        "| region | estimate µs | measured overlap µs | measured / estimate | exposed µs/step | tail µs/step | occurrences |",
        "|---|---|---|---|---|---|---|",
    ]
    for region in data.get("regions", []):
        estimate = region.get("estimated_saving_per_occurrence_us")
        saving = estimates.get((region.get("case"), region.get("tag")))
        if estimate is None and saving is not None:
            estimate = saving * 1e6
        measured = region.get("measured_overlap_per_occurrence_us")
        steps = region.get("steps") or [{}]
        exposed = sum(s.get("exposed_us", 0) for s in steps) / len(steps)
        tail = sum(s.get("tail_us", 0) for s in steps) / len(steps)
        ratio = f"{measured / estimate:.2f}x" if estimate and measured is not None else "N/A"
        shown = f"{estimate:.1f}" if estimate is not None else "N/A"
        out.append(
            f"| {region.get('region')} | {shown} | {measured} | {ratio} | {exposed:.1f} | {tail:.1f} | "
            f"{region.get('occurrences')} |"
        )
    if not data.get("regions"):
        out.append("| N/A | no marked region in the trace (apply --markers) | - | - | - | - | - |")
    saving = data.get("saving_per_step_us")
    out += ["", f"- 步时间收益 (vs baseline): {'N/A (no --baseline)' if saving is None else f'{saving} µs per step'}"]
    grown = data.get("contention") or []
    out.append(
        f"- 资源竞争 (busy time grew > {data.get('contention_threshold', 0.1):.0%}): "
        + (", ".join(f"{g['operator'][:40]} +{g['growth']:.0%}" for g in grown[:5]) or "none")
    )
    return out + [""]


def _sections9to12(analysis: FileAnalysis, best: Candidate | None) -> list[str]:
    na = "N/A (analysis only; needs an NPU run)"
    return [
        "## 9. 实施记录",
        "",
        "### 9.1 方案选择",
        "",
        f"- 主 API 路径: `{best.command}`" if best else f"- 主 API 路径: {na}",
        "- enable 开关: env:ENABLE_MOE_SHARED_EXPERT_STREAM (msrewrite apply default)",
        "- 保留的回退路径: flag off runs the original statement order",
        "- 关键同步设计: side waits main at the fork; main waits side at the join",
        "- 是否引入控核/stream limit/prefetch: no",
        "",
        "### 9.2 关键改动",
        "",
        "| 状态 | 内容 | 文件 |",
        "|---|---|---|",
        f"| planned | {best.plan.summary} | {analysis.file.name} |" if best else f"| N/A | {na} | - |",
        "",
        "### 9.3 当前实现结论",
        "",
        f"- 已实现的 overlap: {na}",
        "- 未覆盖并行点: see §6.3",
        "- 主要风险: resource contention between the two streams; sync cost on tiny shapes",
        "",
        "## 10. 调试记录",
        "",
        f"### 10.1 依赖/同步\n\n{na}",
        "",
        f"### 10.2 精度/功能\n\n{na}",
        "",
        f"### 10.3 性能无收益\n\n{na}",
        "",
        f"### 10.4 图模式/runtime 限制\n\n{na}",
        "",
        f"### 10.5 当前调试结论\n\n{na}",
        "",
        "## 11. 验收结果",
        "",
        "### 11.1 功能\n\n- 是否通过: N/A (run `msrewrite verify` after apply)",
        "",
        f"### 11.2 同步\n\n{na}",
        "",
        f"### 11.3 性能\n\n- 优化前: {na}\n- 优化后: {na}\n- 结论: {na}",
        "",
        f"### 11.4 Profile\n\n{'see §11.5' if analysis.profile else na}",
        "",
        *_profile_acceptance(analysis),
        "## 12. 最终结论",
        "",
        f"- 最适合多流的位置: {best.plan.function} lines {best.plan.side_lines}"
        if best
        else "- 最适合多流的位置: none found",
        f"- 模块级主结论: {best.plan.summary}" if best else "- 模块级主结论: N/A",
        "- 算子级主结论: see §8",
        f"- 是否建议保留: {'yes, pending measurement' if best and best.estimated_saving and best.estimated_saving > 0 else 'measure first'}",
        "- 后续建议: apply, verify on CPU, then profile on the NPU",
    ]
