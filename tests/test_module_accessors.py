"""Module state reached through nn.Module's accessors, a method's result or a @property.

`self.get_buffer("bias")`, `self.parameters()`, `self.state_dict(keep_vars=True)`, `self._buffers`
and the rest hand out the module's own tensors: what they return aliases that state (the named
attribute, or all of the module's state), so a write through the result is a write of it. A method
or @property that returns a view of state aliases it too (Summary.returns_state), and one that
writes state writes that attribute of its receiver. The models are tests/adversarial's (each with
make(), run through verify by tests/test_adversarial.py); here: the analysis, fast.
"""

from __future__ import annotations

import libcst as cst
import pytest

from helpers import ROOT
from msrewrite.analyze.defuse import alias_roots, node_facts
from msrewrite.analyze.summaries import ModuleSummaries, meets
from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")
MODELS = ROOT / "tests" / "adversarial"

# model -> what apply --case moe-shared-expert's refusal says (the state, and how it is reached)
REFUSED = {
    "accessor_get_buffer": "writes module state 'self.bias' (through self.get_buffer(\"bias\")) while the side "
    "stream reads it",
    "accessor_named_buffers_ema": "writes module state 'self' (through 'b', from self.named_buffers()) while the "
    "side stream reads 'self.bias'",
    "accessor_parameters_decay": "writes module state 'self' (through 'p', from self.parameters()) while the side "
    "stream reads 'self.shared_experts'",
    "accessor_state_dict": "writes module state 'self' (through self.state_dict(keep_vars=True)) while the side "
    "stream reads 'self.bias'",
    "accessor_get_parameter": "writes module state 'self.shared_experts' (through "
    'self.get_parameter("shared_experts.0.weight")) while the side stream reads it',
    "accessor_get_submodule": "writes module state 'self.shared_experts' (through "
    'self.get_submodule("shared_experts")) while the side stream reads it',
    "accessor_modules_walk": "writes module state 'self' (through 'm', from self.modules()) while the side stream "
    "reads 'self.shared_experts'",
    "accessor_state_table": "writes module state 'self' (through self._buffers) while the side stream reads "
    "'self.bias'",
    "accessor_in_side_callee": "the side branch writes module state 'self.shared_experts', which the main path "
    "reads between the fork and the join",
    "property_view_read": "writes module state 'self.scales' while the side stream reads 'self' (the @property "
    "self.scale_view, whose getter may read any of it)",
    "method_returns_state_view": "writes module state 'self.bias' (through self.bias_head(...), which returns it) "
    "while the side stream reads it",
    "method_writes_state": "writes module state 'self.bias' (in self._update(...)) while the side stream reads it",
    # the side reads the buffer through a list taken before the fork: all of the state meets self.bias
    "accessor_bound_before_fork": "line 27 writes 'self.bias' in place while the side stream reads it (through "
    "'bufs', from self.buffers())",
    # a callee msrewrite cannot see into, handed module state the side reads: named, with the option
    "unseen_callee_on_parameters": "line 26: torch._foreach_mul_ (not visible to msrewrite) may write module state "
    "'self' (through 'p', from self.parameters()), which the side stream reads ('self.shared_experts'); msrewrite "
    "cannot see into it; pass --assume-pure torch._foreach_mul_ if it does not",
    # a module-level helper handed the block: its parameter's parameters() are all of the block's state
    "function_decays_module": "line 31 writes module state 'self' (in decay(...)) while the side stream reads "
    "'self.shared_experts'",
    # nn.Module's own methods that write all of its state
    "module_load_state_dict": "line 26 writes module state 'self' (in self.load_state_dict(...)) while the side "
    "stream reads 'self.shared_experts'",
    # an in-place tensor method on state reached through a submodule (not a callee's own choice)
    "submodule_weight_chain": "line 26 writes module state 'self.norm' while the side stream reads it",
}
# read-only accessor use, state the side never reads, a @property on the main path only: edited
EDITED = [
    "accessor_param_count",
    "accessor_buffer_read",
    "accessor_other_state",
    "property_view_main_only",
    "submodule_weight_chain_other",
    "unseen_callee_on_other_parameters",
    "module_load_state_dict_other",
]


def _case(name: str):
    path = MODELS / f"{name}.py"
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None)[-1]


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_write_of_module_state_through_an_accessor_is_refused_and_named(name):
    with pytest.raises(NothingToDo) as refused:
        _case(name)
    assert REFUSED[name] in str(refused.value), str(refused.value)


@pytest.mark.parametrize("name", EDITED)
def test_reading_through_an_accessor_or_writing_other_state_is_edited(name):
    step = _case(name)
    lines = (MODELS / f"{name}.py").read_text().splitlines()
    side = [n for n, line in enumerate(lines, 1) if line.rstrip().endswith("# side")]
    assert step.plans[0].side_lines == [[side[0], side[0]]], step.plans[0].side_lines


SOURCE = """import torch
from torch import nn


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scales", torch.ones(2, 4))

    @property
    def head(self):
        return self.scales[0]

    def view(self):
        v = self.scales[1]
        return v

    def fresh(self):
        return self.scales * 2

    def decay(self):
        for p in self.parameters():
            p.data.mul_(0.5)

    def bump(self):
        self.scales.add_(1)

    def forward(self, x):
        return self.lin(x)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def parameters(self, recurse=True):
        self.w.mul_(2)
        return iter([])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = Shared()
        self.linear = nn.Linear(4, 4)
        self.custom = Custom()
        self.register_buffer("bias", torch.zeros(4))

    def forward(self, x):
        return x
"""


@pytest.fixture(scope="module")
def summaries():
    return ModuleSummaries(cst.parse_module(SOURCE))


def _roots(summaries, cls: str, expr: str) -> set[str]:
    return alias_roots(cst.parse_expression(expr), summaries.scope_for(cls, "forward"))


@pytest.mark.parametrize(
    ("expr", "roots"),
    [
        ('self.get_buffer("bias")', {"self.bias"}),
        ('self.get_parameter("shared_experts.lin.weight")', {"self.shared_experts"}),
        ("self.get_buffer(name)", {"self"}),  # not a constant: any of it
        ('self.__getattr__("bias")', {"self.bias"}),
        ("self.parameters()", {"self"}),
        ("self.named_buffers()", {"self"}),
        ("self.modules()", {"self"}),
        ("self.children()", {"self"}),
        ("self.state_dict()", {"self"}),  # its tensors are detached views of the state
        ("self._buffers['bias']", {"self"}),
        ("self.__dict__", {"self"}),
        ("self.shared_experts.parameters()", {"self.shared_experts"}),  # a same-file submodule
        ("self.linear.named_parameters()", {"self.linear"}),  # an nn module
        ('self.shared_experts.get_buffer("scales")', {"self.shared_experts"}),
        ("self.shared_experts.head", {"self.shared_experts"}),
        ("self.shared_experts.view()", {"self.shared_experts"}),  # a method returning a view of its state
        ("getattr(self, 'bias')", {"self"}),
    ],
)
def test_an_accessor_result_aliases_the_state_it_names(summaries, expr, roots):
    assert _roots(summaries, "Block", expr) == roots


def test_a_fresh_result_and_an_overridden_accessor_are_not_state(summaries):
    assert _roots(summaries, "Block", "self.shared_experts.fresh()") == set()
    # Custom defines its own parameters(): its summary counts, not torch's accessor
    effect = summaries.scope_for("Block", "forward").effect_of(cst.parse_expression("self.custom.parameters()"))
    written = {r for w in effect.writes for r in alias_roots(w, summaries.scope_for("Block", "forward"))}
    assert written == {"self.custom"}


def test_a_summary_says_which_state_its_result_aliases_and_which_it_writes(summaries):
    node = summaries.classes["Shared"]
    methods = {s.name.value: s for s in node.body.body if isinstance(s, cst.FunctionDef)}
    assert summaries.function_summary("Shared", methods["head"]).returns_state == {"self.scales"}
    assert summaries.function_summary("Shared", methods["view"]).returns_state == {"self.scales"}
    assert summaries.function_summary("Shared", methods["fresh"]).returns_state == set()
    assert summaries.function_summary("Shared", methods["decay"]).state_writes == {"self"}
    assert summaries.function_summary("Shared", methods["bump"]).state_writes == {"self.scales"}


def test_a_write_through_an_accessor_is_a_write_of_that_state(summaries):
    scope = summaries.scope_for("Block", "forward")
    cases = {
        'self.get_buffer("bias").add_(1)': {"self.bias"},
        "self.state_dict(keep_vars=True)['bias'].add_(1)": {"self"},
        "self.shared_experts.decay()": {"self.shared_experts"},
        "self.shared_experts.view().mul_(2)": {"self.shared_experts"},
        "self.shared_experts.head.mul_(2)": {"self.shared_experts"},
    }
    for code, written in cases.items():
        assert node_facts(cst.parse_statement(code), scope).mutates == written, code
    loop = node_facts(cst.parse_statement("for p in self.parameters():\n    p.mul_(0.5)\n"), scope)
    assert loop.mutates == {"p"} and ("self", "p") in loop.links
    # reading is no write
    assert not node_facts(cst.parse_statement("n = sum(p.numel() for p in self.parameters())"), scope).mutates


def test_a_module_method_that_writes_its_state_writes_all_of_it(summaries):
    scope = summaries.scope_for("Block", "forward")
    for code, written in {
        "self.load_state_dict(sd)": {"self"},
        "self.linear.to(torch.float16)": {"self.linear"},
        "self.shared_experts.half()": {"self.shared_experts"},
        "self.apply(init)": {"self"},  # and `init` is a callee msrewrite does not follow
    }.items():
        facts = node_facts(cst.parse_statement(code), scope)
        assert facts.mutates == written, code
    assert node_facts(cst.parse_statement("self.apply(init)"), scope).unknown_callees
    # a tensor's .float() / .to() is no module write: self.bias is a buffer
    assert not node_facts(cst.parse_statement("y = self.bias.float()"), scope).mutates
    # reading the dict state_dict() returns is no write, and no unseen callee
    read = node_facts(cst.parse_statement("n = sum(v.sum() for k, v in self.state_dict().items())"), scope)
    assert not read.mutates and not read.may_write and not read.unknown_callees


def test_an_accessor_on_a_module_msrewrite_cannot_see_still_aliases_it():
    module = cst.parse_module(SOURCE.replace("self.linear = nn.Linear(4, 4)", "self.linear = make_linear(4)"))
    scope = ModuleSummaries(module).scope_for("Block", "forward")
    effect = scope.effect_of(cst.parse_expression("self.linear.parameters()"))
    assert effect.unknown  # on the trust boundary, named
    assert alias_roots(cst.parse_expression("self.linear.parameters()"), scope) == {"self.linear"}


def test_all_of_the_state_meets_each_attribute_and_attributes_do_not_meet_each_other():
    whole = frozenset({("param", "self")})
    bias, gate = frozenset({("free", "self.bias")}), frozenset({("free", "self.gate")})
    assert meets(whole, bias) and meets(bias, whole) and meets(frozenset({("free", "self")}), gate)
    assert not meets(bias, gate) and not meets(whole, frozenset({("param", "x")}))
