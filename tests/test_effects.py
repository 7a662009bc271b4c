"""Effects, aliases and summaries (issue 10, items 2, 3 and 7): one small runnable model per shape.

Each model is an MoE block whose `forward` varies; `make()` builds it with inputs. Unsafe shapes
(a write msrewrite must see, through a view, an alias, a callee) are refused with a reason; where a
snapshot makes them safe, `--protect clone` edits them and `verify` proves the edit (original =
flag off = flag on, sanitizer clean). Safe counterparts are edited and verified the same way.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

TEMPLATE = '''\
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class ReluFirstMLP(nn.Module):
    """Activates its input first."""

    def __init__(self, d):
        super().__init__()
        self.act = nn.ReLU()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        x = self.act(x)
        return self.proj(x)


class InplaceReluFirstMLP(nn.Module):
    """The same with an in-place ReLU: it writes the caller's tensor. Not a subclass of
    ReluFirstMLP: a subclass here putting another module in `self.act` would make every
    ReluFirstMLP's `self.act` call take its effects too (the analysis does not yet use that
    `ReluFirstMLP(d)` is built by name, so of that exact class)."""

    def __init__(self, d):
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        x = self.act(x)
        return self.proj(x)


class PairMLP(MLP):
    """Returns (output, auxiliary): a tuple-returning shared expert."""

    def forward(self, x):
        out = self.down(self.act(self.up(x)))
        return out, out.sum(dim=-1)


class Router(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.proj = nn.Linear(d, n, bias=False)

    def forward(self, x):
        return torch.softmax(self.proj(x), dim=-1)


class ClampRouter(Router):
    def forward(self, x):
        x.clamp_(-0.5, 0.5)  # writes the caller's hidden states
        return torch.softmax(self.proj(x), dim=-1)


class Experts(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.experts = nn.ModuleList(MLP(d) for _ in range(n))

    def forward(self, x, weights):
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            out = out + expert(x) * weights[:, i : i + 1]
        return out


class IndexedExperts(Experts):
    def forward(self, x, weights):
        out = torch.zeros_like(x)
        for i in range(len(self.experts)):
            expert = self.experts[i]
            out = out + expert(x) * weights[:, i : i + 1]
        return out


def _fused_class(inplace):
    # built at run time: msrewrite cannot read its source (like a kernel library's FusedMoE)
    class FusedMoE(Experts):
        def forward(self, x, weights):
            out = super().forward(x, weights)
            if inplace:
                x.copy_(out)  # SGLang's fused_moe(..., inplace=True)
                return x
            return out

    return FusedMoE


FusedMoE = _fused_class(FUSED_INPLACE)


@torch.compile(disable=True)
def scale_(t):
    t.mul_(2)
    return t


class Block(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.gate = ROUTER(d, n)
        self.experts = EXPERTS(d, n)
        self.shared_experts = SHARED
        self.identity = nn.Identity()

    def forward(self, x):
BODY

def make():
    torch.manual_seed(0)
    return Block().eval(), (torch.randn(8, 16),)
'''


def model(body: str, router="Router", experts="Experts", shared="MLP(d)", fused_inplace=False) -> str:
    return (
        TEMPLATE.replace("BODY", textwrap.indent(textwrap.dedent(body).strip("\n"), " " * 8))
        .replace("ROUTER", router)
        .replace("EXPERTS", experts)
        .replace("SHARED", shared)
        .replace("FUSED_INPLACE", str(fused_inplace))
    )


def edit(tmp_path: Path, source: str, **options):
    """(plan, edited path, original path), or raises NothingToDo with the refusal."""
    original = tmp_path / "block.py"
    original.write_text(source)
    src = load(original)
    steps = case_steps(
        original,
        src.text,
        src.module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
        **options,
    )
    edited = tmp_path / "block_ms.py"
    edited.write_text(steps[-1].new)
    return steps[-1].plans[0], edited, original


def refusal(tmp_path: Path, source: str, **options) -> str:
    with pytest.raises(NothingToDo) as err:
        edit(tmp_path, source, **options)
    return str(err.value)


def verified(tmp_path: Path, source: str, **options):
    plan, edited, original = edit(tmp_path, source, **options)
    result = verify_files(edited, original=original)
    assert result.ok, result.problems
    assert any(s != "main" for s in result.runs[-1].streams), result.runs[-1].streams
    return plan, edited.read_text()


def window(write: str) -> str:
    """The side reads x first, then the main path runs `write` and the routed experts."""
    return f"""
    s = self.shared_experts(x)
    w = self.gate(x)
    {write}
    y = self.experts(x, w)
    return y + s
    """


# --- writes the table must see -------------------------------------------------------------

UNSAFE_WRITES = {
    "torch_relu_": "torch.relu_(x)",
    "F_relu_inplace": "h = F.relu(x, inplace=True)",
    "out_kwarg": "torch.mul(x, 2, out=x)",
    "view_then_inplace": "x.view(-1).mul_(2)",
    "setitem_through_view": "x.view(-1)[:32] = 0",
    "copy_": "x.copy_(x * 2)",
    "data_assign": "x.data = x * 2",
    "flatten_alias": "flat = torch.flatten(x); flat.mul_(2)",
    "annotated_alias": "h: torch.Tensor = x; h.add_(1)",
    "walrus_alias": "n = (h := x).shape[0]; h.add_(1)",
    "list_element_alias": "buf = [x]; buf[0].mul_(2)",
    "starred_alias": "first, *rest = w, x; rest[0].mul_(2)",
    "identity_module_alias": "h = self.identity(x); h.mul_(2)",
    "self_attribute_alias": "self.last = x; self.last.mul_(2)",
    "closure": "def scale():\n        x.mul_(2)\n    scale()",
    "compiled_helper": "scale_(x)",
    "del_item": "del x[0:2]",
}


@pytest.mark.parametrize("name", sorted(UNSAFE_WRITES))
def test_main_path_write_of_a_side_input_is_refused(tmp_path, name):
    reason = refusal(tmp_path, model(window(UNSAFE_WRITES[name])))
    assert "in place while the side stream reads it" in reason, reason
    assert "--protect clone" in reason


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize(
    "name", ["torch_relu_", "view_then_inplace", "setitem_through_view", "self_attribute_alias", "closure", "out_kwarg"]
)
def test_protect_clone_snapshots_the_input_and_verifies(tmp_path, name):
    plan, text = verified(tmp_path, model(window(UNSAFE_WRITES[name])), protect="clone")
    assert plan.protect_inputs == ("x",)
    assert "x_side = _ms_snapshot(x)" in text  # x is not annotated: copied if it is a tensor
    assert "self.shared_experts(x_side)" in text


SAFE_WRITES = {
    "functional_relu": "x = torch.relu(x)",
    "F_relu": "h = F.relu(x) + 1",
    "out_into_fresh_buffer": "buf = torch.empty_like(x); torch.mul(x, 2, out=buf)",
    "write_to_a_copy": "h = x.clone(); h.view(-1)[:32] = 0",
    "metadata_only": "n = x.shape[0]; x2 = x.float().sum()",
    "rebound_then_written": "x = x * 2\n    x.mul_(2)",  # the write hits the new object, not the one the side read
}


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", sorted(SAFE_WRITES))
def test_functional_counterparts_are_edited_and_verify(tmp_path, name):
    plan, text = verified(tmp_path, model(window(SAFE_WRITES[name])))
    assert plan.protect_inputs == () and plan.trust_boundary == ()


# --- summaries: submodules, helpers, unknown callees -------------------------------------


@pytest.mark.slow  # starts a process or runs verify
def test_inplace_relu_in_the_shared_expert_is_refused_and_plain_relu_is_edited(tmp_path):
    body = window("pass")
    reason = refusal(tmp_path, model(body, shared="InplaceReluFirstMLP(d)"))
    assert "the side branch writes its input 'x' in place" in reason
    verified(tmp_path, model(body, shared="ReluFirstMLP(d)"))


@pytest.mark.slow  # runs the model through verify
def test_router_that_clamps_its_input_is_refused_or_protected(tmp_path):
    body = window("pass")
    reason = refusal(tmp_path, model(body, router="ClampRouter"))
    assert "writes 'x' in place" in reason
    plan, _ = verified(tmp_path, model(body, router="ClampRouter"), protect="clone")
    assert plan.protect_inputs == ("x",)


@pytest.mark.slow  # runs the model through verify
def test_a_write_before_the_side_read_moves_the_fork_after_it(tmp_path):
    body = """
    w = self.gate(x)
    x.mul_(2)
    y = self.experts(x, w)
    return y + self.shared_experts(x)
    """
    plan, text = verified(tmp_path, model(body))
    assert plan.fork_line == plan.join_line - 1  # it reads the doubled x: overlaps the experts only
    assert text.index("x.mul_(2)") < text.index("shared_expert_stream.wait_stream")


SGLANG_SHAPE = """
shared = self.shared_experts(x)
w = self.gate(x)
y = self.experts(x, w)
return y + shared
"""


def test_unknown_fused_experts_are_named_and_refused(tmp_path):
    reason = refusal(tmp_path, model(SGLANG_SHAPE, experts="FusedMoE", fused_inplace=True))
    assert "self.experts (FusedMoE, not visible to msrewrite) may write 'x'" in reason, reason
    assert "--protect clone or --assume-pure FusedMoE" in reason


@pytest.mark.slow  # runs the model through verify
def test_protect_clone_makes_the_in_place_fused_experts_safe(tmp_path):
    plan, text = verified(tmp_path, model(SGLANG_SHAPE, experts="FusedMoE", fused_inplace=True), protect="clone")
    assert plan.protect_inputs == ("x",)
    assert any("FusedMoE" in t for t in plan.trust_boundary), plan.trust_boundary


@pytest.mark.slow  # runs the model through verify
def test_assume_pure_vouches_for_a_callee(tmp_path):
    plan, _ = verified(
        tmp_path, model(SGLANG_SHAPE, experts="FusedMoE", fused_inplace=False), assume_pure=("FusedMoE",)
    )
    assert plan.assume_pure == ("FusedMoE",) and plan.protect_inputs == ()


@pytest.mark.slow  # runs the model through verify
def test_experts_picked_by_index_are_followed(tmp_path):
    plan, _ = verified(tmp_path, model(SGLANG_SHAPE, experts="IndexedExperts"))
    assert plan.trust_boundary == ()


@pytest.mark.slow  # runs the model through verify
def test_a_helper_method_is_followed(tmp_path):
    source = model("""
    s = self.shared_experts(x)
    y = self._route(x)
    return y + s
    """).replace(
        "\n\ndef make():",
        """
    def _route(self, x):
        x.mul_(0.5)
        return self.experts(x, self.gate(x))


def make():""",
    )
    assert "line" in refusal(tmp_path, source) and "in place" in refusal(tmp_path, source)
    verified(tmp_path, source.replace("x.mul_(0.5)", "x = x * 0.5"))


# --- item 7: hoisting keeps the original order ------------------------------------------------


def test_walrus_inside_the_hoisted_call_is_refused(tmp_path):
    body = """
    w = self.gate(x)
    y = self.experts(x, w)
    y = y + self.shared_experts(h := x * 2) + h
    return y
    """
    assert ":=" in refusal(tmp_path, model(body))


def test_join_statement_that_writes_the_side_input_first_is_refused(tmp_path):
    body = """
    w = self.gate(x)
    y = self.experts(x, w)
    y = y + x.mul_(2) + self.shared_experts(x)
    return y
    """
    assert "before the side call in the same statement reads it" in refusal(tmp_path, model(body))


@pytest.mark.slow  # runs the model through verify
def test_join_statement_writing_after_the_call_is_edited(tmp_path):
    body = """
    w = self.gate(x)
    y = self.experts(x, w)
    y.add_(self.shared_experts(x))
    return y
    """
    verified(tmp_path, model(body))


@pytest.mark.slow  # runs the model through verify
def test_tuple_returning_hoisted_call_gets_its_outputs_guarded(tmp_path):
    body = """
    w = self.gate(x)
    y = self.experts(x, w)
    return y + self.shared_experts(x)[0]
    """
    _, text = verified(tmp_path, model(body, shared="PairMLP(d)"))
    assert "_ms_record_stream(current_stream, shared_experts_output)" in text
    assert "elif isinstance(value, (tuple, list))" in text  # the guard reaches into tuples


@pytest.mark.slow  # runs the model through verify
def test_del_is_a_rebinding(tmp_path):
    body = """
    s = self.shared_experts(x)
    w = self.gate(x)
    y = self.experts(x, w)
    del x
    return y + s
    """
    plan, text = verified(tmp_path, model(body))
    assert plan.inputs_rebound_before_join == ("x",)
    assert "_ms_record_stream(shared_expert_stream, x)" in text


def test_raise_between_fork_and_join_is_an_exit(tmp_path):
    body = """
    s = self.shared_experts(x)
    w = self.gate(x)
    if not torch.isfinite(w).all():
        raise ValueError("router produced non-finite weights")
    y = self.experts(x, w)
    return y + s
    """
    assert "can raise before the join" in refusal(tmp_path, model(body))


def test_assert_between_fork_and_join_is_an_exit(tmp_path):
    """An `assert` is a raise when its test fails: the function would leave with the side stream
    unjoined and its inputs still in use there."""
    body = """
    s = self.shared_experts(x)
    w = self.gate(x)
    assert torch.isfinite(w).all(), "router produced non-finite weights"
    y = self.experts(x, w)
    return y + s
    """
    assert "line 123 can raise before the join" in refusal(tmp_path, model(body))


@pytest.mark.slow  # runs the model through verify
def test_assert_before_the_fork_stays_and_the_edit_verifies(tmp_path):
    body = """
    assert x.shape[-1] == 16, "hidden size"
    s = self.shared_experts(x)
    w = self.gate(x)
    y = self.experts(x, w)
    return y + s
    """
    plan, text = verified(tmp_path, model(body))
    assert plan.side_lines == [[122, 122]]
    assert '        assert x.shape[-1] == 16, "hidden size"\n' in text


# Functions written or computed inside forward: a nested def's writes to its parameters reach
# the arguments it is called with, a function handed to a call (`map(lambda t: t.mul_(2), xs)`)
# may be called on any other argument, and a computed callee (`getattr(x, "mul_")`) may be bound
# to any object its expression names.
CALLED_WRITES = {
    "nested-def-writes-its-parameter": (
        """
    s = self.shared_experts(x)
    def scale(t):
        t.mul_(2.0)
    scale(x)
    w = self.gate(x)
    y = self.experts(x, w)
    return y + s
    """,
        "line 124 writes 'x' in place while the side stream reads it",
    ),
    "lambda-handed-to-map": (
        """
    s = self.shared_experts(x)
    list(map(lambda t: t.mul_(2.0), [x]))
    w = self.gate(x)
    y = self.experts(x, w)
    return y + s
    """,
        "line 122 writes 'x' in place while the side stream reads it",
    ),
    "computed-callee": (
        """
    s = self.shared_experts(x)
    getattr(x, "mul_")(2.0)
    w = self.gate(x)
    y = self.experts(x, w)
    return y + s
    """,
        """line 122: getattr(x, "mul_") (not visible to msrewrite) may write 'x' which the side stream reads""",
    ),
}
CALLED_PURE = {
    "nested-def-reads-its-parameter": """
    s = self.shared_experts(x)
    def scale(t):
        return t * 2.0
    w = self.gate(scale(x))
    y = self.experts(x, w)
    return y + s
    """,
    "pure-lambda-handed-to-map": """
    s = self.shared_experts(x)
    w = sum(map(lambda t: t * 0.5, [self.gate(x), self.gate(x)]))
    y = self.experts(x, w)
    return y + s
    """,
}


@pytest.mark.parametrize("name", list(CALLED_WRITES))
def test_writes_by_functions_made_in_forward_are_seen(tmp_path, name):
    body, reason = CALLED_WRITES[name]
    assert reason in refusal(tmp_path, model(body))


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", list(CALLED_PURE))
def test_functions_made_in_forward_that_write_nothing_are_edited_and_verify(tmp_path, name):
    plan, _ = verified(tmp_path, model(CALLED_PURE[name]))
    assert plan.side_lines == [[121, 121]]


def test_every_edit_prints_its_trust_boundary(tmp_path):
    from helpers import run_main

    (tmp_path / "block.py").write_text(model(SGLANG_SHAPE, experts="FusedMoE", fused_inplace=True))
    result = run_main("apply", "--case", "moe-shared-expert", str(tmp_path / "block.py"), "--protect", "clone")
    assert result.returncode == 0, result.stderr
    assert "trust boundary (callees not seen into): self.experts (FusedMoE, not visible to msrewrite)" in result.stderr
    assert "it costs one copy of x per call" in result.stderr and "paid only while the flag is on" in result.stderr
    plain = run_main("apply", "--case", "moe-shared-expert", str(tmp_path / "block.py"), "--assume-pure", "FusedMoE")
    assert plain.returncode == 0 and "vouched for with --assume-pure: FusedMoE" in plain.stderr


def test_plan_carries_protect_and_assume_pure(tmp_path):
    from msrewrite.plan import OverlapPlan

    plan, _, _ = edit(tmp_path, model(SGLANG_SHAPE, experts="FusedMoE", fused_inplace=True), protect="clone")
    again = OverlapPlan.from_json(plan.to_json())
    assert again.protect_inputs == ("x",) and again.trust_boundary == plan.trust_boundary


def test_apply_plan_respects_protect(tmp_path):
    """The snapshot travels in the plan: apply --plan emits it, and --protect auto (the default) or clone
    adds it to a plan without; --protect none refuses. x is not annotated: the copy is `_ms_snapshot(x)`."""
    from helpers import run_main

    plan, _, original = edit(tmp_path, model(SGLANG_SHAPE, experts="FusedMoE", fused_inplace=True), protect="clone")
    with_snapshot = tmp_path / "with.json"
    with_snapshot.write_text(plan.to_json())
    result = run_main("apply", "--plan", str(with_snapshot), str(original))
    assert result.returncode == 0, result.stderr
    assert "+            x_side = _ms_snapshot(x)" in result.stdout
    without = tmp_path / "without.json"
    without.write_text(plan.with_changes(protect_inputs=()).to_json())
    refused = run_main("apply", "--plan", str(without), str(original), "--protect", "none")  # FusedMoE may write x
    assert refused.returncode == 1 and "--assume-pure FusedMoE" in refused.stderr and not refused.stdout
    for given in ((), ("--protect", "auto"), ("--protect", "clone")):
        added = run_main("apply", "--plan", str(without), str(original), *given)
        assert added.returncode == 0 and "x_side = _ms_snapshot(x)" in added.stdout, (given, added.stderr)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--protect", "copy"), "--protect must be one of auto, none, clone"),
        (("--assume-pure", "not a name"), "--assume-pure needs a class, function or attribute name"),
    ],
)
def test_bad_effect_options_are_one_line_errors(tmp_path, args, message):
    from helpers import run_main

    path = tmp_path / "block.py"
    path.write_text(model(SGLANG_SHAPE))
    result = run_main("apply", "--case", "moe-shared-expert", str(path), *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"msrewrite: error: {result.stderr.split('error: ', 1)[1].strip()}"]
    assert message in result.stderr


@pytest.mark.parametrize("write, edited", [("x.mul_(0.5)", False), ("x = x * 0.5", True)])
def test_a_sibling_module_is_read_not_imported(tmp_path, write, edited):
    """`from experts import RoutedExperts` next to the file: its source is read, so its writes are seen."""
    (tmp_path / "experts.py").write_text(
        textwrap.dedent(f"""
        from torch import nn

        class RoutedExperts(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.proj = nn.Linear(d, d)

            def forward(self, x):
                {write}
                return self.proj(x)
        """)
    )
    source = model(SGLANG_SHAPE.replace("self.experts(x, w)", "self.experts(x) * w.sum()"), experts="RoutedExperts")
    source = source.replace("from torch import nn\n", "from torch import nn\n\nfrom experts import RoutedExperts\n", 1)
    source = source.replace("RoutedExperts(d, n)", "RoutedExperts(d)")
    if edited:
        plan, _, _ = edit(tmp_path, source)
        assert plan.trust_boundary == ()
    else:
        assert "writes 'x' in place" in refusal(tmp_path, source)


@pytest.mark.slow  # starts a process
def test_torch_name_table_matches_the_installed_torch():
    """The analysis reads torch's names from a generated table (no torch import at start-up)."""
    import subprocess
    import sys

    from msrewrite.analyze import gen_torch_names

    # a fresh process: other tests import torch submodules, which adds names to dir(torch)
    fresh = subprocess.run(
        [
            sys.executable,
            "-c",
            "from msrewrite.analyze.gen_torch_names import current, render; print(render(current()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    table = Path(gen_torch_names.__file__).with_name("torch_names.py").read_text(encoding="utf-8")
    assert fresh.rstrip("\n") == table.rstrip("\n"), "run python -m msrewrite.analyze.gen_torch_names"


@pytest.mark.slow  # starts a process
def test_random_draw_table_agrees_with_a_trace_of_torch():
    """The generated draw table (RNG_F_FUNCTIONS, RNG_NN_MODULES, read from torch's source by
    gen_torch_names) against what torch does: each sampled F function and nn module, run in
    training mode under a dispatch mode, reaches an op tagged nondeterministic_seeded exactly
    when the table says it draws."""
    import subprocess
    import sys

    script = r"""
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from msrewrite.analyze.torch_names import RNG_F_FUNCTIONS, RNG_NN_MODULES, RNG_OPS

class Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.drew = False
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            assert func._opname in RNG_OPS, func  # the op table itself
            self.drew = True
        return func(*args, **(kwargs or {}))

def drew(run):
    with Seen() as seen:
        run()
    return seen.drew

x = torch.randn(2, 4, 8)
img = torch.randn(1, 2, 8, 8)
q = torch.randn(1, 2, 4, 8)
weight = torch.randn(8, 8)
functions = {
    "dropout": lambda: F.dropout(x, 0.5, True),
    "dropout1d": lambda: F.dropout1d(x, 0.5, True),
    "dropout2d": lambda: F.dropout2d(img, 0.5, True),
    "dropout3d": lambda: F.dropout3d(img.unsqueeze(0), 0.5, True),
    "alpha_dropout": lambda: F.alpha_dropout(x, 0.5, True),
    "feature_alpha_dropout": lambda: F.feature_alpha_dropout(x, 0.5, True),
    "rrelu": lambda: F.rrelu(x, training=True),
    "rrelu_": lambda: F.rrelu_(x.clone(), training=True),
    "gumbel_softmax": lambda: F.gumbel_softmax(x),
    "fractional_max_pool2d": lambda: F.fractional_max_pool2d(img, 2, output_size=4),
    "scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
    "relu": lambda: F.relu(x),
    "gelu": lambda: F.gelu(x),
    "silu": lambda: F.silu(x),
    "softmax": lambda: F.softmax(x, -1),
    "layer_norm": lambda: F.layer_norm(x, (8,)),
    "leaky_relu": lambda: F.leaky_relu(x),
    "linear": lambda: F.linear(x, weight),
    "max_pool2d": lambda: F.max_pool2d(img, 2),
}
modules = {
    "Dropout": (nn.Dropout, x), "Dropout1d": (nn.Dropout1d, x), "AlphaDropout": (nn.AlphaDropout, x),
    "FeatureAlphaDropout": (nn.FeatureAlphaDropout, x), "RReLU": (nn.RReLU, x),
    "MultiheadAttention": (lambda: nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True), None),
    "ReLU": (nn.ReLU, x), "GELU": (nn.GELU, x), "SiLU": (nn.SiLU, x), "Linear": (lambda: nn.Linear(8, 8), x),
    "LayerNorm": (lambda: nn.LayerNorm(8), x), "Embedding": (lambda: nn.Embedding(4, 8), torch.tensor([1, 2])),
}
wrong = []
for name, run in functions.items():
    if drew(run) != (name in RNG_F_FUNCTIONS):
        wrong.append(f"F.{name}")
for name, (make, arg) in modules.items():
    module = make().train()
    run = (lambda m=module: m(x, x, x)) if arg is None else (lambda m=module, a=arg: m(a))
    if drew(run) != (name in RNG_NN_MODULES):
        wrong.append(f"nn.{name}")
print(" ".join(wrong))
"""
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "", f"the table disagrees with torch on: {found.stdout.strip()}"
