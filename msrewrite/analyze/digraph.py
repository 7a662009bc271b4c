"""The few directed-graph operations the analysis needs, without importing networkx.

`import networkx` costs about 0.15 s of CPU (it loads ~280 modules and scans every installed
package's entry points for backends), more than libcst takes to parse a 700-line model file;
static `suggest` must stay within 2x of that parse. `DiGraph` keeps networkx's interface and
iteration order (nodes and successors in insertion order) for the calls made here, so the
results are the same; `descendants`, `ancestors` and `transitive_reduction` follow networkx's
algorithms and also accept a networkx graph.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Any


class _Nodes:
    def __init__(self, attrs: dict) -> None:
        self._attrs = attrs

    def __iter__(self) -> Iterator:
        return iter(self._attrs)

    def __len__(self) -> int:
        return len(self._attrs)

    def __contains__(self, node: object) -> bool:
        return node in self._attrs

    def __getitem__(self, node: Hashable) -> dict:
        return self._attrs[node]

    def __call__(self) -> _Nodes:
        return self


class _Edges:
    def __init__(self, succ: dict) -> None:
        self._succ = succ

    def __iter__(self) -> Iterator[tuple]:
        return ((u, v) for u, nbrs in self._succ.items() for v in nbrs)

    def __len__(self) -> int:
        return sum(len(nbrs) for nbrs in self._succ.values())

    def __call__(self, data: bool = False) -> list[tuple]:
        if data:
            return [(u, v, d) for u, nbrs in self._succ.items() for v, d in nbrs.items()]
        return list(self)


class DiGraph:
    """Directed graph with node and edge attributes (networkx.DiGraph's interface, in part)."""

    def __init__(self, edges: Iterable[tuple] = ()) -> None:
        self._node: dict[Hashable, dict] = {}
        self._succ: dict[Hashable, dict[Hashable, dict]] = {}
        self._pred: dict[Hashable, dict[Hashable, dict]] = {}
        self.add_edges_from(edges)

    # building
    def add_node(self, node: Hashable, **attrs: Any) -> None:
        if node not in self._node:
            self._node[node] = {}
            self._succ[node] = {}
            self._pred[node] = {}
        self._node[node].update(attrs)

    def add_nodes_from(self, nodes: Iterable[Hashable]) -> None:
        for node in nodes:
            self.add_node(node)

    def add_edge(self, u: Hashable, v: Hashable, **attrs: Any) -> None:
        self.add_node(u)
        self.add_node(v)
        data = self._succ[u].get(v, {})
        data.update(attrs)
        self._succ[u][v] = data
        self._pred[v][u] = data

    def add_edges_from(self, edges: Iterable[tuple]) -> None:
        for u, v, *rest in edges:
            self.add_edge(u, v, **(rest[0] if rest else {}))

    def remove_edges_from(self, edges: Iterable[tuple]) -> None:
        for u, v, *_ in list(edges):
            if v in self._succ.get(u, {}):
                del self._succ[u][v]
                del self._pred[v][u]

    # reading
    @property
    def nodes(self) -> _Nodes:
        return _Nodes(self._node)

    @property
    def edges(self) -> _Edges:
        return _Edges(self._succ)

    def __iter__(self) -> Iterator:
        return iter(self._node)

    def __contains__(self, node: object) -> bool:
        return node in self._node

    def __len__(self) -> int:
        return len(self._node)

    def __getitem__(self, node: Hashable) -> dict:
        return self._succ[node]

    def successors(self, node: Hashable) -> Iterator:
        return iter(self._succ[node])

    def predecessors(self, node: Hashable) -> Iterator:
        return iter(self._pred[node])

    def in_degree(self, node: Hashable) -> int:
        return len(self._pred[node])

    def has_edge(self, u: Hashable, v: Hashable) -> bool:
        return v in self._succ.get(u, {})

    def get_edge_data(self, u: Hashable, v: Hashable, default: Any = None) -> Any:
        return self._succ.get(u, {}).get(v, default)


def _reach(start: Hashable, step) -> set:
    seen: set = set()
    stack = [start]
    while stack:
        for nxt in step(stack.pop()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    seen.discard(start)
    return seen


def descendants(graph, node: Hashable) -> set:
    """Nodes reachable from `node` (not `node` itself, unless on a cycle: as networkx)."""
    return _reach(node, graph.successors)


def ancestors(graph, node: Hashable) -> set:
    """Nodes from which `node` is reachable."""
    return _reach(node, graph.predecessors)


def transitive_reduction(graph) -> DiGraph:
    """The DAG with only the edges no longer path implies (networkx's algorithm and edge order);
    ValueError for a graph with a cycle."""
    if _has_cycle(graph):
        raise ValueError("transitive reduction needs a directed acyclic graph")
    reduced = DiGraph()
    reduced.add_nodes_from(graph.nodes)
    below: dict = {}
    check_count = {n: graph.in_degree(n) for n in graph}
    for u in graph:
        u_nbrs = set(graph.successors(u))
        for v in graph.successors(u):
            if v in u_nbrs:
                if v not in below:
                    below[v] = descendants(graph, v)
                u_nbrs -= below[v]
            check_count[v] -= 1
            if check_count[v] == 0:
                below.pop(v, None)
        reduced.add_edges_from((u, v) for v in u_nbrs)
    return reduced


def _has_cycle(graph) -> bool:
    indegree = {n: graph.in_degree(n) for n in graph}
    ready = [n for n, d in indegree.items() if d == 0]
    seen = 0
    while ready:
        node = ready.pop()
        seen += 1
        for nxt in graph.successors(node):
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    return seen != len(indegree)
