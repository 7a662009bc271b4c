"""A strict checker for the Mermaid subset the report writes.

Grammar (one statement per line, indentation free):
    flowchart LR                          (first line, exactly)
    subgraph ID[Label] | subgraph ID      (balanced by `end`, may nest)
    end
    ID["label"]                           (node; label without quotes, brackets or pipes)
    ID --> ID | ID -.-> ID                (edges between declared nodes, optional |label|)
IDs are [A-Za-z_][A-Za-z0-9_]*; every node is declared once; edges name declared nodes.

Gantt subset (`msrewrite profile`):
    gantt                                 (first line, exactly)
    title TEXT | dateFormat x | axisFormat %L
    section LABEL
    LABEL :[crit, ]ID, START, END         (integers, START <= END, IDs unique, a section first)
Labels hold no `:`, `#` or `;`.
"""

from __future__ import annotations

import re

_ID = r"[A-Za-z_][A-Za-z0-9_]*"
_LABEL = r'[^"\[\]|]*'
NODE = re.compile(rf'^({_ID})\["({_LABEL})"\]$')
EDGE = re.compile(rf"^({_ID}) (-->|-\.->)(?:\|([^|\"\[\]]*)\|)? ({_ID})$")
SUBGRAPH = re.compile(rf"^subgraph ({_ID})(?:\[({_LABEL})\])?$")
RESERVED = {"end", "subgraph", "flowchart", "graph", "style", "class", "click"}


GANTT_TASK = re.compile(rf"^([^:#;]+?) :(?:crit, )?({_ID}), (\d+), (\d+)$")
GANTT_HEAD = re.compile(r"^(title [^:#;]+|dateFormat x|axisFormat %L)$")
GANTT_SECTION = re.compile(r"^section [^:#;]+$")


def check(text: str) -> list[str]:
    """Problems in one Mermaid block (without the ``` fences); empty when it is valid."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines and lines[0] == "gantt":
        return _check_gantt(lines)
    problems: list[str] = []
    if not lines or lines[0] != "flowchart LR":
        return ["the first line must be 'flowchart LR'"]
    nodes: set[str] = set()
    groups: set[str] = set()
    edges: list[tuple[int, str, str]] = []
    depth = 0
    for number, line in enumerate(lines[1:], 2):
        if line == "end":
            depth -= 1
            if depth < 0:
                problems.append(f"line {number}: 'end' without 'subgraph'")
                depth = 0
            continue
        if m := SUBGRAPH.match(line):
            if m.group(1) in nodes | groups or m.group(1) in RESERVED:
                problems.append(f"line {number}: subgraph id {m.group(1)} reused")
            groups.add(m.group(1))
            depth += 1
            continue
        if m := NODE.match(line):
            if m.group(1) in nodes | groups or m.group(1) in RESERVED:
                problems.append(f"line {number}: node {m.group(1)} declared twice or reserved")
            nodes.add(m.group(1))
            continue
        if m := EDGE.match(line):
            edges.append((number, m.group(1), m.group(4)))
            continue
        problems.append(f"line {number}: not a node, edge, subgraph or end: {line!r}")
    if depth != 0:
        problems.append(f"{depth} subgraph(s) not closed with 'end'")
    for number, a, b in edges:
        for name in (a, b):
            if name not in nodes:
                problems.append(f"line {number}: edge names undeclared node {name}")
    return problems


def _check_gantt(lines: list[str]) -> list[str]:
    problems: list[str] = []
    ids: set[str] = set()
    in_section = False
    for number, line in enumerate(lines[1:], 2):
        if GANTT_HEAD.match(line) and not in_section:
            continue
        if GANTT_SECTION.match(line):
            in_section = True
            continue
        m = GANTT_TASK.match(line)
        if m is None:
            problems.append(f"line {number}: not a title, dateFormat, axisFormat, section or task: {line!r}")
            continue
        if not in_section:
            problems.append(f"line {number}: task before any section")
        if m.group(2) in ids:
            problems.append(f"line {number}: task id {m.group(2)} reused")
        ids.add(m.group(2))
        if int(m.group(3)) > int(m.group(4)):
            problems.append(f"line {number}: task ends before it starts")
    if not any(line.startswith("dateFormat") for line in lines):
        problems.append("no dateFormat line")
    return problems


def blocks(markdown: str) -> list[str]:
    """The bodies of every ```mermaid block in a markdown text."""
    return re.findall(r"```mermaid\n(.*?)```", markdown, flags=re.S)


def node_id(text: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_]", "_", text)
    return clean if re.match(r"[A-Za-z_]", clean) else f"n_{clean}"


def label(text: str) -> str:
    return re.sub(r'["\[\]|]', "'", text).replace("\n", " ")[:80]
