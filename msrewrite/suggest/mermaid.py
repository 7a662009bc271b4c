"""A strict checker for the Mermaid subset the report writes.

Grammar (one statement per line, indentation free):
    flowchart LR                          (first line, exactly)
    subgraph ID[Label] | subgraph ID      (balanced by `end`, may nest)
    end
    ID["label"]                           (node; label without quotes, brackets or pipes)
    ID --> ID | ID -.-> ID                (edges between declared nodes, optional |label|)
IDs are [A-Za-z_][A-Za-z0-9_]*; every node is declared once; edges name declared nodes.
"""

from __future__ import annotations

import re

_ID = r"[A-Za-z_][A-Za-z0-9_]*"
_LABEL = r'[^"\[\]|]*'
NODE = re.compile(rf'^({_ID})\["({_LABEL})"\]$')
EDGE = re.compile(rf"^({_ID}) (-->|-\.->)(?:\|([^|\"\[\]]*)\|)? ({_ID})$")
SUBGRAPH = re.compile(rf"^subgraph ({_ID})(?:\[({_LABEL})\])?$")
RESERVED = {"end", "subgraph", "flowchart", "graph", "style", "class", "click"}


def check(text: str) -> list[str]:
    """Problems in one Mermaid block (without the ``` fences); empty when it is valid."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
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


def blocks(markdown: str) -> list[str]:
    """The bodies of every ```mermaid block in a markdown text."""
    return re.findall(r"```mermaid\n(.*?)```", markdown, flags=re.S)


def node_id(text: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_]", "_", text)
    return clean if re.match(r"[A-Za-z_]", clean) else f"n_{clean}"


def label(text: str) -> str:
    return re.sub(r'["\[\]|]', "'", text).replace("\n", " ")[:80]
