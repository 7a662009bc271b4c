"""The effect tables against torch itself (audit A): collectives' buffers by keyword, functionals'
positional `inplace`, operator and einops, calls that return (a view of) their input, decorators
and properties. Each hole gets a model the analysis must refuse (or place correctly) and its safe
twin, which is still edited (and, where it runs on a CPU, verified)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_effects import edit, model, refusal, verified, window

HEADER = "import operator\nimport einops\nimport torch.distributed as dist\n"


def with_imports(source: str) -> str:
    return HEADER + source


UNSAFE = {
    # 1. collectives written with keywords (and the forms the table lacked)
    "all_reduce_kw": "dist.all_reduce(tensor=x)",
    "broadcast_kw": "dist.broadcast(tensor=x, src=0)",
    "recv_kw": "dist.recv(tensor=x, src=1)",
    "irecv_pos": "dist.irecv(x, 1)",
    "all_gather_into_tensor_kw": "dist.all_gather_into_tensor(output_tensor=x, input_tensor=w)",
    "reduce_scatter_tensor_kw": "dist.reduce_scatter_tensor(output=x, input=w)",
    "all_to_all_single_kw": "dist.all_to_all_single(output=x, input=w)",
    "all_reduce_coalesced": "dist.all_reduce_coalesced([x])",
    "batch_isend_irecv": "dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, 1)])",
    "all_reduce_starred": "args = (x,)\n    dist.all_reduce(*args)",
    # 2. positional inplace of functionals (and a flag that may be true)
    "relu_pos": "h = F.relu(x, True)",
    "silu_pos": "h = F.silu(x, True)",
    "hardtanh_pos": "h = F.hardtanh(x, -1.0, 1.0, True)",
    "threshold_pos": "h = F.threshold(x, 0.0, 0.0, True)",
    "leaky_relu_pos": "h = F.leaky_relu(x, 0.1, True)",
    "dropout_pos": "h = F.dropout(x, 0.0, False, True)",
    "inplace_variable": "h = F.relu(x, inplace=self.training)",
    "relu__keyword": "torch.relu_(input=x)",
    # 3. operator and einops
    "operator_iadd": "operator.iadd(x, 1.0)",
    "operator_dunder_imul": "operator.__imul__(x, 2.0)",
    "operator_setitem": "operator.setitem(x, 0, 0.0)",
    "einops_rearrange_view": "y = einops.rearrange(x, 'n d -> d n')\n    y.mul_(2)",
    # 4. calls that may return their input (or a view of it)
    "as_tensor": "y = torch.as_tensor(x)\n    y.mul_(2)",
    "asarray": "y = torch.asarray(x)\n    y.mul_(2)",
    "broadcast_to_method": "y = x.broadcast_to(x.shape)\n    y.mul_(2)",
    "positive": "y = torch.positive(x)\n    y.mul_(2)",
    "as_subclass": "y = x.as_subclass(torch.Tensor)\n    y.mul_(2)",
    "unsafe_chunk": "a, b = torch.unsafe_chunk(x, 2)\n    a.mul_(2)",
    "split_with_sizes": "a, b = torch.split_with_sizes(x, [4, 4])\n    a.mul_(2)",
    "adjoint": "y = torch.adjoint(x)\n    y.mul_(2)",
    "conj_method": "y = x.conj()\n    y.mul_(2)",
    "to_dense": "y = x.to_dense()\n    y.mul_(2)",
    "sum_to_size": "y = x.sum_to_size(x.shape)\n    y.mul_(2)",
    "flatten_keyword": "y = torch.flatten(input=x)\n    y.mul_(2)",
}


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_a_write_the_tables_missed_is_refused(tmp_path, name):
    reason = refusal(tmp_path, with_imports(model(window(UNSAFE[name]))))
    assert "in place while the side stream reads it" in reason, reason


SAFE = {
    "all_reduce_kw_of_a_copy": "buf = x.clone()\n    dist.all_reduce(tensor=buf)",
    "send_kw": "dist.send(tensor=x, dst=1)",
    "relu_pos_false": "h = F.relu(x, False)",
    "hardtanh_no_flag": "h = F.hardtanh(x, -1.0, 1.0)",
    "operator_add": "h = operator.add(x, 1.0)",
    "einops_rearrange_read": "y = einops.rearrange(x, 'n d -> d n') * 2",
    "as_tensor_copy": "y = torch.as_tensor(x).clone()\n    y.mul_(2)",
    "conj_read": "y = x.conj() * 2",
}


@pytest.mark.parametrize("name", sorted(SAFE))
def test_the_safe_twin_is_still_edited(tmp_path, name):
    plan, _, _ = edit(tmp_path, with_imports(model(window(SAFE[name]))))
    assert plan.protect_inputs == ()
    assert plan.trust_boundary == (), plan.trust_boundary


VERIFIED = {
    "relu_pos_false": "h = F.relu(x, False)",
    "as_tensor_copy": "y = torch.as_tensor(x).clone()\n    y.mul_(2)",
    "sum_to_size_read": "y = x.sum_to_size(x.shape) * 2",
}


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", sorted(VERIFIED))
def test_the_safe_twin_verifies(tmp_path, name):
    verified(tmp_path, model(window(VERIFIED[name])))


def test_protect_clone_snapshots_an_input_a_keyword_collective_fills(tmp_path):
    plan, edited, _ = edit(tmp_path, with_imports(model(window("dist.all_reduce(tensor=x)"))), protect="clone")
    assert plan.protect_inputs == ("x",)


R03 = """
if self.training:
    dist.all_reduce(tensor=x)
s = self.shared_experts(x)
w = self.gate(x)
y = self.experts(x, w)
return y + s
"""


@pytest.mark.parametrize("write", ["dist.all_reduce(tensor=x)", "dist.all_reduce(x)", "dist.recv(tensor=x, src=0)"])
def test_the_fork_goes_after_a_keyword_collective_that_fills_the_side_input(tmp_path, write):
    _, edited, _ = edit(tmp_path, with_imports(model(R03.replace("dist.all_reduce(tensor=x)", write))))
    text = edited.read_text()
    assert text.index(write) < text.index(".wait_stream("), text


@pytest.mark.slow  # runs the model through verify
def test_the_fork_after_a_keyword_collective_verifies(tmp_path):
    # single process: the collective is behind `self.training`, off in make()'s eval model
    verified(tmp_path, "import torch.distributed as dist\n" + model(R03))


# 5. decorators and properties -------------------------------------------------------------------

HELPERS = """
import functools


def _double_input(fn):
    @functools.wraps(fn)
    def wrapper(self, h):
        h.mul_(2.0)
        return fn(self, h)

    return wrapper


class Scaled(Block):
    @DECORATOR
    def routed(self, h):
        w = self.gate(h)
        return self.experts(h, w)

    @property
    def scale(self):
        PROPERTY_BODY
        return 1.0

    def forward(self, x):
        s = self.shared_experts(x)
        y = ROUTED * READ
        return y + s


def make():
    torch.manual_seed(0)
    return Scaled().eval(), (torch.randn(8, 16),)
"""


def helpers_model(decorator="torch.no_grad()", body="pass", routed="self.routed(x)", read="self.scale") -> str:
    extra = (
        HELPERS.replace("DECORATOR", decorator)
        .replace("PROPERTY_BODY", body)
        .replace("ROUTED", routed)
        .replace("READ", read)
    )
    return model("return x") + extra  # Block.forward calls no shared expert: Scaled.forward is the target


def test_a_decorator_that_wraps_a_helper_is_named_and_refused(tmp_path):
    reason = refusal(tmp_path, helpers_model(decorator="_double_input"))
    assert "@_double_input" in reason and "may write 'x' which the side stream reads" in reason, reason
    assert "--assume-pure routed" in reason


def test_a_property_that_writes_the_shared_experts_weight_is_refused(tmp_path):
    reason = refusal(tmp_path, helpers_model(body="self.shared_experts.up.weight.mul_(1.5)"))
    assert "self.scale (a @property" in reason and "self.shared_experts" in reason, reason


def test_a_property_that_writes_the_input_is_refused(tmp_path):
    source = helpers_model(body="self.last.mul_(2)", read="self.scale").replace(
        "s = self.shared_experts(x)", "self.last = x\n        s = self.shared_experts(x)"
    )
    assert "self.scale" in refusal(tmp_path, source)


@pytest.mark.slow  # runs the model through verify
def test_transparent_decorators_and_a_pure_property_are_edited_and_verify(tmp_path):
    plan, _ = verified(tmp_path, helpers_model())
    assert plan.trust_boundary == ()


# the tables against torch -----------------------------------------------------------------------

PROBE = r"""
import inspect, json, warnings
import torch
import torch.functional
import torch.nn.functional as F
import torch.distributed as dist
warnings.filterwarnings("ignore")


def shares(res, base):
    ptr, size = base.untyped_storage().data_ptr(), base.untyped_storage().nbytes()
    todo = [res]
    while todo:
        r = todo.pop()
        if isinstance(r, (list, tuple)):
            todo.extend(r)
            continue
        try:
            if isinstance(r, torch.Tensor) and r.layout == torch.strided and r.untyped_storage().data_ptr() == ptr:
                return True
            if hasattr(r, "__array_interface__") and ptr <= r.__array_interface__["data"][0] < ptr + size:
                return True
            if isinstance(r, (torch.UntypedStorage, torch.TypedStorage)) and r.data_ptr() == ptr:
                return True
        except Exception:
            pass
    return False


def patterns():
    x = torch.randn(4, 4)
    return [(), (x,), ((4, 4),), (0,), (2,), (0, 1), (torch.float32,), (torch.Tensor,), ("cpu",), ([2, 2],),
            ((4, 4), (4, 1)), (False,), (0.0, False)]


SKIP = ("_", "set_", "fbgemm_", "miopen_", "cudnn_", "mkldnn_", "quantized_", "import_", "parse_")
DENY = {"manual_seed", "seed", "use_deterministic_algorithms", "init_num_threads", "from_file", "save", "load",
        "fork", "wait", "merge_type_from_type_comment", "unify_type_list", "backward", "register_hook",
        "register_post_accumulate_grad_hook", "pin_memory", "is_pinned", "cuda", "xpu", "ipu", "mtia", "npu",
        "compile", "vmap", "cond", "while_loop", "export", "prepare_multiprocessing_environment", "retain_grad",
        "record_stream", "module_load", "apply_", "map_", "map2_"}


def aliasing(names, call):
    found = set()
    for n in names:
        if n.startswith(SKIP) or n in DENY or (n.endswith("_") and n != "requires_grad_"):
            continue
        for args in patterns():
            x = torch.randn(4, 4)
            try:
                r = call(n, x, args)
            except Exception:
                continue
            if shares(r, x):
                found.add(n)
                break
    return found


def method_names():
    for n in dir(torch.Tensor):
        attr = inspect.getattr_static(torch.Tensor, n, None)
        if not (isinstance(attr, property) or type(attr).__name__ in ("getset_descriptor", "member_descriptor")):
            yield n


def function_names(module, kinds):
    for n in dir(module):
        f = getattr(module, n)
        if type(f).__name__ == "builtin_function_or_method" or (inspect.isfunction(f) and f.__module__ in kinds):
            yield n


def dist_signatures():
    out = {}
    for n in dir(dist):
        f = getattr(dist, n)
        if inspect.isfunction(f) or inspect.isclass(f):
            try:
                out[n] = list(inspect.signature(f).parameters)
            except (TypeError, ValueError):
                pass
    return out


print(json.dumps({
    "methods": sorted(aliasing(list(method_names()), lambda n, x, a: getattr(x, n)(*a))),
    "functions": sorted(aliasing(list(function_names(torch, ("torch.functional", "torch._tensor", "torch"))),
                                 lambda n, x, a: getattr(torch, n)(x, *a))),
    "F": sorted(aliasing(list(function_names(F, ("torch.nn.functional",))), lambda n, x, a: getattr(F, n)(x, *a))),
    "F_inplace": {n: list(inspect.signature(getattr(F, n)).parameters).index("inplace") for n in dir(F)
                  if not n.startswith("_") and inspect.isfunction(getattr(F, n)) and "inplace" in inspect.signature(getattr(F, n)).parameters},
    "dist": dist_signatures(),
}))
"""


@pytest.fixture(scope="module")
def probed():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.slow  # starts a process that runs every torch function once
def test_every_call_torch_shows_returning_its_input_is_an_alias_in_the_tables(probed):
    from msrewrite.analyze.torch_effects import F_INPLACE_AT, function_may_alias, method_may_alias

    assert [n for n in probed["methods"] if not method_may_alias(n)] == []
    assert [n for n in probed["functions"] if not function_may_alias(n)] == []
    # F.relu(x, 2) runs in place (a true flag): those count through their inplace position
    assert [n for n in probed["F"] if not function_may_alias(n) and n not in F_INPLACE_AT] == []


@pytest.mark.slow  # starts a process
def test_inplace_positions_are_torch_signatures(probed):
    from msrewrite.analyze.torch_effects import F_INPLACE_AT

    assert F_INPLACE_AT == probed["F_inplace"]


@pytest.mark.slow  # starts a process
def test_every_distributed_function_with_a_tensor_is_in_the_collective_table(probed):
    from msrewrite.analyze.torch_effects import _DIST_PARAMS, DIST_READS, DIST_TENSOR_PARAMS, DIST_WRITES

    for name, params in probed["dist"].items():
        if params and not name.startswith("_"):
            assert _DIST_PARAMS.get(name) == tuple(params), name
        if DIST_TENSOR_PARAMS & set(params):
            assert name in DIST_WRITES or name in DIST_READS, f"torch.distributed.{name}{params}: add it to the table"
    for name, written in DIST_WRITES.items():
        assert set(written) <= set(_DIST_PARAMS[name]), name
    # every parameter that may hold a tensor is one DIST_TENSOR_PARAMS names
    tensorish = {p for params in probed["dist"].values() for p in params if "tensor" in p or p.endswith("_list")}
    assert tensorish <= DIST_TENSOR_PARAMS | {"ranks_per_subgroup_list"}, tensorish - DIST_TENSOR_PARAMS
