"""Three kinds of effect the statement facts once missed, each a way an unsound edit got through.

- Writes through `**mapping` / `*sequence` arguments (analyze/spreads.py): a container the
  function builds itself is written out at the call (`opts = {"out": x}; torch.clamp(x, **opts)`
  writes x); one that cannot be followed (a parameter, an attribute, a call's result) may write
  what it holds, and the refusal names the spread.
- Attribute rebinding (`self.last_norm = out.norm()`, `self.calls += 1`) on either stream is an
  effect on the object's state: ordered against every read of that attribute between the fork
  and the join, and the fork never moves above a main statement that reads what the side
  rebinds (host state included).
- A nested function's free variables (`def add_shared(t): return t + shared`) are read where it
  is called, and from where it is handed on.

The models with make() for each kind are in tests/adversarial (kwargs_*, side_rebinds_*,
host_counter_*, main_method_rebinds_*, closure_*), run through verify by tests/test_adversarial.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst
import pytest

from msrewrite.analyze.defuse import Scope, node_facts, statement_facts
from msrewrite.analyze.spreads import spread_expansions
from msrewrite.analyze.summaries import ModuleSummaries
from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")
ADVERSARIAL = Path(__file__).parent / "adversarial"


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _body(source: str) -> list[cst.BaseStatement]:
    func = cst.parse_module(textwrap.dedent(source)).body[0]
    assert isinstance(func, cst.FunctionDef) and isinstance(func.body, cst.IndentedBlock)
    return list(func.body.body)


def _facts(source: str) -> list:
    """Statement facts of a function's body, with a resolver (unseen calls may write)."""
    module = cst.parse_module(textwrap.dedent(source))
    func = module.body[0]
    assert isinstance(func, cst.FunctionDef) and isinstance(func.body, cst.IndentedBlock)
    from libcst.metadata import MetadataWrapper, PositionProvider

    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    scope = ModuleSummaries(module).scope_for(None, func.name.value)
    return statement_facts(list(func.body.body), positions, scope)


def _expanded(source: str) -> list[str]:
    """Each call with a spread written out, as code."""
    body = _body(source)
    found = spread_expansions(body)
    calls = [c for stmt in body for c in _calls(stmt) if id(c) in found]
    return [_code(c.with_changes(args=found[id(c)])) for c in calls]


def _calls(node: cst.CSTNode) -> list[cst.Call]:
    from msrewrite.analyze.defuse import all_calls

    return all_calls(node)


# spreads ------------------------------------------------------------------------------------------
def test_a_dict_literal_is_written_out_with_its_later_stores():
    expanded = _expanded(
        """
        def f(x, y):
            opts = {"min": -1, "out": x}
            if y is not None:
                opts["out"] = y
            return torch.clamp(x, **opts)
        """
    )
    # a literal constant stays itself; an object is passed as the container, which holds them all
    assert expanded == ["torch.clamp(x, min = -1, out = opts)"]


def test_dict_call_tuple_and_inline_literals_are_written_out():
    expanded = _expanded(
        """
        def f(x, y):
            kw = dict(inplace=True)
            args = (x, 0.5)
            a = F.relu(*args)
            b = F.dropout(*args, **kw)
            c = torch.clamp(x, **{"out": y})
            return a, b, c
        """
    )
    assert expanded == ["F.relu(args, 0.5)", "F.dropout(args, 0.5, inplace = True)", "torch.clamp(x, out = y)"]


@pytest.mark.parametrize(
    "binding",
    [
        "def f(x, opts):\n    torch.clamp(x, **opts)\n",  # a parameter
        "def f(x):\n    opts = self.options\n    torch.clamp(x, **opts)\n",  # an attribute
        "def f(x):\n    opts = make(x)\n    torch.clamp(x, **opts)\n",  # a call's result
        "def f(x):\n    opts = {}\n    opts.update(out=x)\n    torch.clamp(x, **opts)\n",  # updated
        "def f(x):\n    opts = {}\n    fill(opts)\n    torch.clamp(x, **opts)\n",  # handed on
        "def f(x):\n    opts = {}\n    other = opts\n    torch.clamp(x, **opts)\n",  # aliased
        "def f(x):\n    torch.clamp(x, **opts)\n    opts = {}\n",  # used before its binding
        "def f(x, c):\n    if c:\n        opts = {}\n    torch.clamp(x, **opts)\n",  # bound on one path only
        "def f(x):\n    opts = {}\n    opts[k] = x\n    torch.clamp(x, **opts)\n",  # a computed key
        "def f(x):\n    opts = {}\n    for opts in xs:\n        pass\n    torch.clamp(x, **opts)\n",
    ],
)
def test_a_spread_that_cannot_be_followed_is_left_in_the_call(binding):
    assert _expanded(binding) == []


def test_an_unfollowed_mapping_may_write_what_it_holds_and_says_why():
    facts = _facts(
        """
        def f(x, opts):
            torch.clamp(x, -1, 1, **opts)
            x.view(*opts)
        """
    )
    assert set(facts[0].may_write) == {"opts"}
    assert "torch.clamp(**opts) (**opts is not followed by msrewrite: it may carry out=)" in facts[0].may_write["opts"]
    assert not facts[1].may_write and not facts[1].mutates  # view writes no position a *spread could fill


def test_a_followed_spread_writes_the_tensor_it_holds():
    facts = _facts(
        """
        def f(x):
            opts = {"out": x}
            torch.clamp(x, -1, 1, **opts)
            keep = {"min": -1}
            y = torch.clamp(x, **keep)
        """
    )
    assert facts[1].mutates == {"opts"} and ("x", "opts") in facts[0].links
    assert not facts[3].mutates and not facts[3].may_write


def test_an_inplace_module_called_through_a_spread_writes_what_it_holds():
    module = cst.parse_module(
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.act = nn.ReLU(inplace=True)\n"
    )
    scope = ModuleSummaries(module).scope_for("M", "forward")
    effect = scope.effect_of(cst.parse_expression("self.act(*args)"))
    assert [_code(w) for w in effect.writes] == ["args"]


def test_the_refusal_names_the_spread(tmp_path):
    source = (ADVERSARIAL / "kwargs_out_write.py").read_text()
    source = source.replace('        opts = {"out": x}\n', "        opts = self.clamp_options(x)\n").replace(
        "    def forward(self, x):",
        '    def clamp_options(self, x):\n        return {"out": x}\n\n    def forward(self, x):',
    )
    why = _refusal(tmp_path, "kwargs_call", source)
    assert "torch.clamp(**opts) (**opts is not followed by msrewrite: it may carry out=) may write 'opts'" in why, why


# attribute rebinding ------------------------------------------------------------------------------
REBINDS = """
import torch
from torch import nn


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.stats = Stats()

    def forward(self, x):
        self.calls += 1
        self.stats.last = x.norm()
        self._remember(x)
        return self.lin(x)

    def _remember(self, x):
        self.seen = x.shape[0]


class Stats(nn.Module):
    def __init__(self):
        super().__init__()
        self.last = None
"""


def test_a_summary_lists_the_attributes_its_object_rebinds():
    summaries = ModuleSummaries(cst.parse_module(REBINDS))
    cls = summaries.classes["Shared"]
    forward = next(s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "forward")
    summary = summaries.function_summary("Shared", forward)
    # `self.calls += 1` on a Python number writes no device memory, but it is still a rebinding
    assert summary.rebinds == {"calls", "stats.last", "seen"}


def test_a_call_rebinds_on_its_receiver():
    module = cst.parse_module(
        REBINDS + "\n\nclass Block(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.shared_experts = Shared()\n"
    )
    scope = ModuleSummaries(module).scope_for("Block", "forward")
    facts = node_facts(cst.parse_statement("s = self.shared_experts(x)"), scope)
    assert facts.rebinds == {
        "self.shared_experts.calls",
        "self.shared_experts.seen",
        "self.shared_experts.stats.last",
    }


def test_direct_rebinds_and_a_method_writing_state():
    facts = node_facts(cst.parse_statement("self.a.b = 1"))
    assert facts.rebinds == {"self.a.b"}
    assert node_facts(cst.parse_statement("del self.c")).rebinds == {"self.c"}
    assert node_facts(cst.parse_statement("self.n += 1")).rebinds == {"self.n"}
    module = cst.parse_module(
        "class M(nn.Module):\n    def bump(self):\n        self.scale.mul_(2)\n\n    def forward(self, x):\n        pass\n"
    )
    scope = ModuleSummaries(module).scope_for("M", "forward")
    # a method that writes its object's state writes that state of the receiver at the call
    assert "self.scale" in node_facts(cst.parse_statement("self.bump()"), scope).mutates


def _refusal(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    src = load(path)
    with pytest.raises(NothingToDo) as refused:
        case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None)
    return str(refused.value)


def _side_lines(tmp_path: Path, name: str, source: str):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    src = load(path)
    step = case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None)[-1]
    return step.plans[0]


def test_a_side_rebinding_read_before_the_join_is_refused(tmp_path):
    why = _refusal(tmp_path, "rebind", (ADVERSARIAL / "side_rebinds_attribute.py").read_text())
    assert (
        "line 36: the side branch rebinds module state 'self.shared_experts.last_norm', which the main path reads "
        "between the fork and the join (line 37: 'self.shared_experts.last_norm')"
    ) in why, why


def test_the_read_counts_through_a_local_bound_to_the_module(tmp_path):
    source = (ADVERSARIAL / "side_rebinds_attribute.py").read_text()
    source = source.replace(
        "    def forward(self, x):\n        s = self.shared_experts(x)  # side\n",
        "    def forward(self, x):\n        shared = self.shared_experts\n        s = self.shared_experts(x)  # side\n",
    ).replace("self.gate(x) * self.shared_experts.last_norm", "self.gate(x) * shared.last_norm")
    why = _refusal(tmp_path, "rebind_alias", source)
    assert "the side branch rebinds module state 'self.shared_experts.last_norm'" in why, why


def test_another_attribute_of_the_same_module_may_be_read(tmp_path):
    source = (ADVERSARIAL / "side_rebinds_attribute.py").read_text()
    source = source.replace(
        "self.gate(x) * self.shared_experts.last_norm", "self.gate(x) * self.shared_experts.up.bias"
    )
    assert _side_lines(tmp_path, "other_attr", source).side_lines == [[36, 36]]


def test_the_fork_stays_below_a_read_of_host_state_the_side_rebinds(tmp_path):
    plan = _side_lines(tmp_path, "counter", (ADVERSARIAL / "host_counter_read_then_routed.py").read_text())
    assert plan.fork_line == 38 and plan.side_lines == [[38, 38]]  # not above line 37, which reads the count


def test_nothing_to_overlap_says_the_fork_waits_for_the_read(tmp_path):
    why = _refusal(tmp_path, "counter_refused", (ADVERSARIAL / "host_counter_read_before_call.py").read_text())
    assert "the fork waits for line 40, which uses module state the side work changes" in why, why


def test_a_main_method_rebinding_what_the_side_reads_is_refused(tmp_path):
    why = _refusal(tmp_path, "main_rebinds", (ADVERSARIAL / "main_method_rebinds_side_state.py").read_text())
    assert (
        "line 40 writes module state 'self.shared_experts' (in self._rescale_shared(...)) while the side stream "
        "reads it"
    ) in why, why


# closures -----------------------------------------------------------------------------------------
def test_a_nested_function_reads_its_free_variables_where_it_is_called():
    facts = _facts(
        """
        def f(x, shared):
            def add_shared(t):
                y = t * 2
                return y + shared
            add = lambda t: t - shared
            out = add_shared(x)
            out = add(out)
            return out
        """
    )
    assert "shared" not in facts[0].loads  # the def itself reads nothing
    assert "shared" in facts[1].loads  # a lambda: at the def too
    assert "shared" in facts[2].loads and "y" not in facts[2].loads and "t" not in facts[2].loads
    assert "shared" in facts[3].loads


def test_a_nested_function_handed_on_is_read_from_there_on():
    facts = _facts(
        """
        def f(x, shared):
            def add_shared(t):
                return t + shared
            fn = add_shared
            y = x * 2
            return fn(y)
        """
    )
    assert "shared" not in facts[0].loads
    assert all("shared" in f.loads for f in facts[1:])


def test_the_join_lands_before_the_nested_functions_call(tmp_path):
    plan = _side_lines(tmp_path, "closure", (ADVERSARIAL / "closure_reads_side_output.py").read_text())
    assert plan.join_line == 32  # `out = add_shared(routed)`, not the first direct use of `shared`


def test_scope_spreads_are_read_once_per_function():
    scope = Scope()
    first = _body("def f(x):\n    opts = {'out': x}\n    torch.clamp(x, **opts)\n")
    scope.note_body(first)
    seen = scope.spreads
    scope.note_body(_body("def g(x):\n    pass\n"))
    assert scope.spreads is seen and len(seen) == 1


CLOSURE_IN_SIDE_IF = """import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(4, 4)
        self.gate = nn.Linear(4, 4)
        self.experts = nn.Linear(4, 4)

    def forward(self, x):
        def scaled(t):
            return t * g

        g = self.gate(x)
        if self.shared_experts is not None:
            s = self.shared_experts(scaled(x))
        h = self.experts(x)
        return h + s
"""


def test_a_side_if_calling_a_nested_function_forks_after_what_it_reads(tmp_path):
    plan = _side_lines(tmp_path, "side_if", CLOSURE_IN_SIDE_IF)
    assert plan.fork_line == 17 and "g" in plan.side_inputs  # after `g = self.gate(x)`, which scaled() reads


def test_a_side_call_is_not_hoisted_above_a_read_in_its_own_statement(tmp_path):
    source = (ADVERSARIAL / "host_counter_read_then_routed.py").read_text()
    source = source.replace(
        "        h = self.gate(x) * (self.shared_experts.calls + 1)\n"
        "        s = self.shared_experts(x)  # side\n"
        "        h = self.experts(h)\n"
        "        return h + s  # join\n",
        "        h = self.experts(self.gate(x))\n        return h * (self.shared_experts.calls + 1) + self.shared_experts(x)\n",
    )
    why = _refusal(tmp_path, "hoist_read", source)
    assert "hoisting the side call out of line 38 would change their order" in why, why
    assert "the side branch rebinds module state 'self.shared_experts.calls'" in why, why
