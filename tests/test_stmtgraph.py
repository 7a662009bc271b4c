"""One statement IR behind `apply` and `suggest` (issue 10): suggest's statement DAG is built from
the facts the branch finder reads (analyze/defuse.py), under the same summaries scope.

Before, suggest computed its own def-use facts (analyze/dataflow.py) with weaker rules: an
in-place torch function (`torch.relu_(x)`) counted as a write of `torch`, `inplace=True` and
`out=` were not writes, a write through a view bound earlier (`flat = x.view(-1); flat.mul_(2)`)
wrote `flat` only, and a collective filling its buffer (`dist.recv(buf)`) bound nothing. Each
test below fails on those facts: the DAG edge apply's analysis implies was missing. Each unsafe
model is refused by apply, naming the write; each safe twin (the write goes to a fresh copy) has
no such edge, and apply edits it and the edit verifies.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from msrewrite.analyze.defuse import statement_facts
from msrewrite.analyze.positions import positions_for
from msrewrite.analyze.stmtgraph import FunctionInfo, analyze_file, analyze_source, analyze_static, may_hold_a_branch
from msrewrite.plancheck import summaries_scope
from test_serving_rules import edits_and_verifies, model_source, refusal, write

ROOT = Path(__file__).resolve().parent.parent

# The side work reads x; the main path then writes x's object (WRITE), which moving the shared
# expert onto a side stream would race with.
UNSAFE = """
shared = self.shared_expert(x)
weights, ids = self.route(x)
{write}
routed = self.experts(x, weights, ids)
return routed + shared
"""

# The same write, to a fresh copy: nothing the side work reads.
SAFE = """
shared = self.shared_expert(x)
weights, ids = self.route(x)
g = x.clone()
{write}
routed = self.experts(g, weights, ids)
return routed + shared
"""

WRITES = {
    "inplace_function": "torch.relu_({t})",
    "inplace_keyword": "F.relu({t}, inplace=True)",
    "out_keyword": "torch.mul({t}, 2, out={t})",
    "view_bound_earlier": "flat = {t}.view(-1)\nflat.mul_(2)",
}


def _forward(path: Path) -> FunctionInfo:
    return analyze_file(path).functions["Block.forward"]


def _edge(info: FunctionInfo, reader: str, writer: str) -> dict | None:
    """The DAG edge from the statement whose source starts `reader` to the one starting `writer`."""
    index = {s.source.split("\n")[0]: s.index for s in info.statements}
    first = next(i for text, i in index.items() if text.startswith(reader))
    second = next(i for text, i in index.items() if text.startswith(writer))
    return info.graph(renaming=True).get_edge_data(first, second)


@pytest.mark.parametrize("kind", WRITES)
def test_a_main_path_write_of_a_side_input_orders_the_dag_as_apply_refuses(tmp_path, kind):
    write_x = WRITES[kind].format(t="x")
    path = write(tmp_path, f"unsafe_{kind}", model_source(UNSAFE.format(write=write_x)))
    last = write_x.split("\n")[-1]
    edge = _edge(_forward(path), "shared = self.shared_expert(x)", last)
    # the old facts had no edge here; a write after the side reads: what a snapshot lifts
    assert edge is not None and edge["kind"] == "war", edge
    assert "x" in refusal(path)  # apply: the main path writes the side input x


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("kind", WRITES)
def test_the_same_write_to_a_fresh_copy_has_no_edge_and_apply_edits_it(tmp_path, kind):
    write_g = WRITES[kind].format(t="g")
    source = model_source(SAFE.format(write=write_g))
    path = write(tmp_path, f"safe_{kind}", source)
    assert _edge(_forward(path), "shared = self.shared_expert(x)", write_g.split("\n")[-1]) is None
    edits_and_verifies(tmp_path, f"safe_{kind}", source)


def test_a_received_buffer_is_a_new_value_the_return_reads():
    """`dist.recv(ffn_out)` fills ffn_out: the return must stay after it (the old DAG let it move
    before the recv), and the send and the recv stay in order (collectives)."""
    info = analyze_file(ROOT / "examples" / "afd_attention_node.py").functions["AttentionNodeLayer.forward"]
    recv = _edge(info, "dist.recv(ffn_out", "return hidden_states + ffn_out")
    assert recv is not None and recv["kind"] == "data" and recv["name"] == "ffn_out"
    assert _edge(info, "dist.send(normed", "dist.recv(ffn_out") is not None


def test_an_unseen_callee_may_write_its_arguments():
    """PkgMoE's routed experts come from a package msrewrite cannot read: they may write x, which
    the gate read before (write after read), exactly as the branch finder assumes."""
    info = analyze_file(ROOT / "tests" / "fixtures" / "pkg_moe.py").functions["PkgMoE.forward"]
    routed = next(s for s in info.statements if s.source.startswith("routed = self.experts"))
    assert "x" in routed.mutates
    assert _edge(info, "weights = torch.softmax(self.gate(x)", "routed = self.experts") is not None


_FIELDS = (
    "index",
    "first_line",
    "last_line",
    "loads",
    "stores",
    "mutates",
    "self_calls",
    "has_call",
    "exits",
    "raises",
    "links",
    "self_stores",
    "may_write",
    "unknown_callees",
    "collective",
    "rng",
    "stream",
)


def _apply_facts(path: Path, qualname: str) -> list[tuple]:
    """The facts apply's branch finder computes for `qualname` (plancheck's scope and positions)."""
    text = path.read_text()
    module = cst.parse_module(text)
    cls, _, name = qualname.rpartition(".")
    holder = next(n for n in module.body if isinstance(n, cst.ClassDef) and n.name.value == cls)
    func = [f for f in holder.body.body if isinstance(f, cst.FunctionDef) and f.name.value == name][-1]
    scope = summaries_scope(module, qualname, (), path)
    facts = statement_facts(list(func.body.body), positions_for(module, qualname, func, text), scope)
    return [tuple(getattr(f, k) for k in _FIELDS) for f in facts]


@pytest.mark.parametrize(
    "name",
    ["examples/deepseek_moe.py", "examples/hunyuan_moe.py", "tests/fixtures/pkg_moe.py", "examples/microbatch_moe.py"],
)
def test_suggest_reads_the_facts_apply_computes(name):
    path = ROOT / name
    for analysis in (analyze_file(path), analyze_static(path)):
        forwards = [q for q in analysis.functions if q.endswith(".forward")]
        assert forwards, name
        for qualname in forwards:
            info = analysis.functions[qualname]
            mine = [tuple(getattr(s.facts, k) for k in _FIELDS) for s in info.statements]
            theirs = _apply_facts(path, qualname)
            assert len(theirs) - len(mine) in (0, 1), qualname  # a leading docstring is no statement here
            assert mine == theirs[len(theirs) - len(mine) :], qualname


def test_candidates_are_derived_under_the_scope_the_dag_came_from():
    """One scope per function: the branch finder suggest runs for a candidate resolves calls with
    the very scope (and so the same memoized facts) the statement DAG was built from."""
    from msrewrite.suggest.candidates import _scope_of

    path = ROOT / "examples" / "deepseek_moe.py"
    info = analyze_static(path).functions["DeepseekMoE.forward"]
    memo: dict = {}
    assert _scope_of(info, str(path), memo) is info.scope
    assert memo["module"] is info.syntax
    assert info.node is not None and isinstance(info.node.body, cst.IndentedBlock)
    again = statement_facts(list(info.node.body.body), info.positions, info.scope)  # as branch.py asks
    assert [f.node for f in again][-len(info.statements) :] == [s.facts.node for s in info.statements]
    assert [tuple(getattr(f, k) for k in _FIELDS) for f in again][-len(info.statements) :] == [
        tuple(getattr(s.facts, k) for k in _FIELDS) for s in info.statements
    ]


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "tests" / "fixtures").glob("*.py")),
    ids=lambda p: p.name,
)
def test_the_static_tier_leaves_out_only_forwards_without_a_branch(path):
    """analyze_static decides on torch-table facts which forwards can hold a branch (resolving calls
    costs package reads); the summaries' facts must agree wherever it left one out."""
    full, fast = analyze_file(path), analyze_static(path)
    for qualname, info in full.functions.items():
        if qualname in fast.functions:
            assert fast.functions[qualname] == info, qualname
        elif qualname.endswith(".forward") and sum(len(s.calls) for s in info.statements) >= 2:
            assert not may_hold_a_branch(info), qualname


RAISES = """
import torch
from torch import nn


class Block(nn.Module):
    def forward(self, x):
        y = self.f(x)
        if x.shape[0] == 0:
            raise ValueError("empty batch")
        z = self.g(x)
        return y + z
"""


def test_a_raise_is_an_exit_kept_before_the_return():
    """`raise` leaves the function as `return` does: the old facts did not count it, so the check
    could float past the return."""
    info = analyze_source(RAISES).functions["Block.forward"]
    check = next(s for s in info.statements if s.source.startswith("if x.shape[0] == 0"))
    assert check.exits
    assert _edge(info, "if x.shape[0] == 0", "return y + z") == {"kind": "state", "name": "self"}


def test_stream_work_stays_in_order():
    """The hand-written overlap's stream calls (a wait, the stream context, the join's wait) keep
    their order in the DAG; the old facts saw no effect in them."""
    info = analyze_file(ROOT / "tests" / "fixtures" / "handwritten_moe.py").functions["HandWrittenMoE.forward"]
    assert _edge(info, "side = torch.npu.Stream()", "main = torch.npu.current_stream()") is not None
    assert _edge(info, "side.wait_stream(main)", "with torch.npu.stream(side)") is not None
    assert _edge(info, "if JOIN:", "return routed + shared") is not None
