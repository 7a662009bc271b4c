"""What a torch call does to its tensors, read from its name and arguments (no import of the model).

Three facts matter for moving code onto another stream:
  - which tensors a call writes (in-place methods `x.add_(y)`, `torch.relu_(x)`, `inplace=True`,
    `out=`, `copy_`, storage ops, collectives that fill their argument);
  - which tensors its result may share storage with (views: `x.view(..)`, `torch.flatten(x)`,
    indexing, `detach`, and calls that may return their input itself: `x.to(dtype)`, `x.contiguous()`);
  - whether it is a known pure function (everything else in `torch`, `torch.nn.functional`, and
    the tensor methods not listed above).

Anything not in these tables is unknown: the caller decides (summaries.py looks into same-file
code; what stays unknown "may write its tensor arguments").
"""

from __future__ import annotations

from dataclasses import field

import libcst as cst

from msrewrite.analyze.torch_names import (
    ALIAS_OPS,
    DIST_SIGNATURES,
    F_FUNCTIONS,
    F_INPLACE,
    INPLACE_ARGS,
    NN_MODULES,
    RNG_F_FUNCTIONS,
    RNG_NN_MODULES,
    RNG_OPS,
    TENSOR_METHODS,
    TORCH_FUNCTIONS,
)
from msrewrite.records import record

# Tensor methods whose result may share storage with the receiver. Some only sometimes do
# (`x.to(x.dtype)`, `x.contiguous()` on a contiguous tensor, `x.reshape(..)` when it can view):
# they count, since a later write through the result would then write the receiver.
ALIAS_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "ravel",
        "unflatten",
        "expand",
        "expand_as",
        "transpose",
        "swapaxes",
        "swapdims",
        "t",
        "permute",
        "movedim",
        "moveaxis",
        "squeeze",
        "unsqueeze",
        "narrow",
        "select",
        "diagonal",
        "unfold",
        "as_strided",
        "detach",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "tensor_split",
        "hsplit",
        "vsplit",
        "dsplit",
        "to",
        "type",
        "type_as",
        "float",
        "half",
        "double",
        "bfloat16",
        "int",
        "long",
        "short",
        "bool",
        "byte",
        "char",
        "contiguous",
        "cpu",
        "cuda",
        "npu",
        "data_ptr_view",
        "align_to",
        "refine_names",
        "rename",
        "real",
        "imag",
        "values",
        "indices",
        "coalesce",
        "view_as_real",
        "view_as_complex",
        "__getitem__",
        "requires_grad_",
        "untyped_storage",
        "storage",
        # may return the receiver itself (checked on torch by tests/test_effects_tables.py; views
        # with alias annotations in their aten schema come from torch_names.ALIAS_OPS)
        "as_subclass",
        "to_dense",
        "sum_to_size",
        "conj_physical",
        "dequantize",
        "resize_as",
        "resize",
        "index",
        "unsafe_chunk",
        "unsafe_split",
        "unsafe_split_with_sizes",
        "numpy",
        "pin_memory",
    }
)
# Attributes of a tensor that are tensors sharing its storage; every other attribute read from
# a local is assumed to alias it too, except these plain metadata fields.
METADATA_ATTRS = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "is_cuda",
        "is_npu",
        "layout",
        "requires_grad",
        "is_leaf",
        "names",
        "is_contiguous",
        "itemsize",
        "nbytes",
        "is_sparse",
        "is_quantized",
        "is_meta",
    }
)
# Trailing-underscore names that do not write the tensor's data.
NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})

# torch functions whose result may share storage with their first argument.
ALIAS_FUNCTIONS = frozenset(
    {
        "flatten",
        "reshape",
        "squeeze",
        "unsqueeze",
        "transpose",
        "swapaxes",
        "swapdims",
        "t",
        "permute",
        "movedim",
        "moveaxis",
        "narrow",
        "select",
        "diagonal",
        "as_strided",
        "detach",
        "split",
        "chunk",
        "unbind",
        "tensor_split",
        "hsplit",
        "vsplit",
        "dsplit",
        "view_as_real",
        "view_as_complex",
        "unflatten",
        "ravel",
        "broadcast_to",
        "expand_copy_view",
        "dropout",
        "alpha_dropout",
        "feature_alpha_dropout",
        "feature_dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "real",
        "imag",
        "conj",
        "resolve_conj",
        "resolve_neg",
        "atleast_1d",
        "atleast_2d",
        "atleast_3d",
        "broadcast_tensors",
        "meshgrid",
        "identity",
        # may return their argument itself (tests/test_effects_tables.py probes torch for these)
        "as_tensor",
        "asarray",
        "from_dlpack",
        "from_numpy",
        "conj_physical",
        "dequantize",
        "unsafe_chunk",
        "unsafe_split",
        "unsafe_split_with_sizes",
        "split_with_sizes",
        "positive",
        "adjoint",
    }
)
# torch.distributed calls -> the parameters naming the buffers they fill (by keyword or position;
# positions from the signatures in torch_names.DIST_SIGNATURES, checked against
# torch/distributed/distributed_c10d.py by tests/test_effects_tables.py). `gather` counts its
# input too (as before: it is read on every rank, written on none, but a table entry that is too
# wide is only conservative).
DIST_WRITES: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor",),
    "all_reduce_coalesced": ("tensors",),
    "all_gather": ("tensor_list",),
    "all_gather_coalesced": ("output_tensor_lists",),
    "all_gather_into_tensor": ("output_tensor",),
    "all_gather_single": ("output_tensor",),
    "_all_gather_base": ("output_tensor",),
    "all_gather_object": ("object_list",),
    "all_to_all": ("output_tensor_list",),
    "all_to_all_single": ("output",),
    "broadcast": ("tensor",),
    "broadcast_object_list": ("object_list",),
    "gather": ("tensor", "gather_list"),
    "gather_object": ("object_gather_list",),
    "recv": ("tensor",),
    "irecv": ("tensor",),
    "recv_object_list": ("object_list",),
    "reduce": ("tensor",),
    "reduce_scatter": ("output",),
    "reduce_scatter_tensor": ("output",),
    "reduce_scatter_single": ("output",),
    "_reduce_scatter_base": ("output",),
    "scatter": ("tensor",),
    "scatter_object_list": ("scatter_object_output_list",),
    # each P2POp holds its tensor (P2POp's result aliases it): the batch fills the irecv ones
    "batch_isend_irecv": ("p2p_op_list",),
}
# torch.distributed calls with tensor parameters that only read them (P2POp: see above).
DIST_READS = frozenset({"send", "isend", "send_object_list", "gather_object", "P2POp"})
# Parameter names that may hold a tensor (or a list of them): a torch.distributed function
# with one of them is in DIST_WRITES or DIST_READS, else unknown (tests/test_effects_tables.py).
DIST_TENSOR_PARAMS = frozenset(
    {
        "tensor",
        "tensors",
        "output",
        "input",
        "tensor_list",
        "output_tensor",
        "input_tensor",
        "output_tensor_list",
        "input_tensor_list",
        "output_tensor_lists",
        "input_list",
        "gather_list",
        "scatter_list",
        "object_list",
        "obj",
        "object_gather_list",
        "scatter_object_output_list",
        "scatter_object_input_list",
        "p2p_op_list",
        "op_list",
    }
)
_DIST_PARAMS: dict[str, tuple[str, ...]] = {
    word.split(":", 1)[0]: tuple(word.split(":", 1)[1].split(",")) for word in DIST_SIGNATURES
}
COLLECTIVE_MODULES = ("dist", "torch.distributed", "distributed")
# torch.distributed._functional_collectives, by its module path and the names torch and its users
# import it as (`import torch.distributed._functional_collectives as funcol`)
FUNCOL_MODULES = (
    "torch.distributed._functional_collectives",
    "dist._functional_collectives",
    "distributed._functional_collectives",
    "_functional_collectives",
    "funcol",
    "ft_c",
)
# its functions (torch 2.13, torch/distributed/_functional_collectives.py): the functional ones
# return a new tensor (an AsyncCollectiveTensor, waited by wait_tensor or on first use) and read
# their inputs until then; the `_inplace` ones copy the result into their output (first
# parameter) before returning; isend/irecv_inplace and batch_p2p_ops_inplace read / write their
# buffer until the result is waited; wait_tensor returns its argument, waited
FUNCOL_FUNCTIONAL = frozenset(
    {
        "broadcast",
        "all_reduce",
        "all_gather_single",
        "all_gather_single_autograd",
        "reduce_scatter_single",
        "reduce_scatter_single_autograd",
        "all_gather_tensor",
        "all_gather_tensor_autograd",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_autograd",
        "all_reduce_coalesced",
        "all_gather_single_coalesced",
        "reduce_scatter_single_coalesced",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
        "all_to_all_single_autograd",
        "permute_tensor",
    }
)
FUNCOL_INPLACE = frozenset(
    {
        "all_gather_tensor_inplace",
        "reduce_scatter_tensor_inplace",
        "all_reduce_inplace",
        "all_to_all_inplace",
        "all_gather_inplace",
    }
)
FUNCOL_PURE = frozenset({"allow_inflight_collective_as_graph_input_ctx"})
# torch.distributed functions that are asynchronous whatever `async_op` says
DIST_ALWAYS_ASYNC = frozenset({"isend", "irecv", "batch_isend_irecv"})
# Random draws, from the generated table (torch_names: RNG_OPS are the aten ops torch tags
# `nondeterministic_seeded`, which name the torch functions and tensor methods that draw;
# RNG_F_FUNCTIONS and RNG_NN_MODULES the torch.nn.functional functions and nn modules that reach
# one). Calls that set or read the generator's state order against every draw too.
RNG_STATE_CALLS = frozenset({"manual_seed", "seed", "set_rng_state", "get_rng_state"})
# draws only when its `dropout_p` (keyword, or this position) may be non-zero: it defaults to 0
_DROPOUT_P_AT = {"scaled_dot_product_attention": 4}


def draws(leaf: str, functional: bool, call: cst.Call | None = None) -> bool:
    """Whether `torch.<leaf>(..)` / `x.<leaf>(..)` (functional: `F.<leaf>(..)`) draws random numbers."""
    found = leaf in RNG_F_FUNCTIONS if functional else leaf in RNG_OPS or leaf in RNG_STATE_CALLS
    if found and call is not None and leaf in _DROPOUT_P_AT:
        p = _keyword(call, "dropout_p")
        args = positional(call)
        if p is None and len(args) > _DROPOUT_P_AT[leaf] and not _starred_before(call, _DROPOUT_P_AT[leaf]):
            p = args[_DROPOUT_P_AT[leaf]]
        if p is None:  # the default, 0, unless *args / **kwargs may pass it
            return any(a.star for a in call.args)
        return not (isinstance(p, (cst.Integer, cst.Float)) and float(p.value) == 0)
    return found


STREAM_NAMES = frozenset(
    {
        "stream",
        "Stream",
        "wait_stream",
        "current_stream",
        "record_stream",
        "Event",
        "synchronize",
        "npu_stream_switch",
        "npu_wait_tensor",
        "set_stream",
    }
)
# Methods that order streams and events (`ev.wait()`, `stream.synchronize()`,
# `stream.wait_event(ev)`, `ev.record()`): stream ordering only on a stream or event object. On any
# other receiver (a same-file `self.tracker.wait(x)`, an object from an unknown factory) the name
# says nothing: the call is resolved like any other, and where msrewrite cannot see into it, it is
# an unknown callee that is also taken as a barrier (summaries.py).
ORDERING_METHODS = frozenset({"wait", "synchronize", "wait_event", "wait_stream", "record", "record_event"})
# device-module functions that order the host or the current stream against other work
BARRIER_FUNCTIONS = frozenset({"synchronize", "set_stream", "npu_wait_tensor", "wait_tensor"})
# constructors and getters of stream and event objects, under a device module
_STREAM_OBJECT_LEAVES = frozenset(
    {"current_stream", "default_stream", "Stream", "Event", "ExternalStream", "stream_from_id"}
)
_DEVICE_MODULES = ("torch.cuda", "torch.npu", "torch_npu.npu", "torch.accelerator", "torch")
# Builtins that build a container holding their arguments (the result aliases them) or do not
# touch tensors at all.
CONTAINER_BUILTINS = frozenset(
    {
        "list",
        "tuple",
        "zip",
        "enumerate",
        "reversed",
        "sorted",
        "iter",
        "next",
        "dict",
        "set",
        "frozenset",
        "map",
        "filter",
        "getattr",
        "max",
        "min",
        "sum",
    }
)
PURE_BUILTINS = frozenset(
    {
        "len",
        "range",
        "int",
        "float",
        "bool",
        "str",
        "isinstance",
        "issubclass",
        "hasattr",
        "print",
        "repr",
        "abs",
        "round",
        "any",
        "all",
        "type",
        "id",
        "hash",
        "callable",
        "divmod",
        "pow",
        "format",
        "super",
        "ValueError",
        "RuntimeError",
        "TypeError",
        "NotImplementedError",
        "AssertionError",
        "KeyError",
        "IndexError",
        "Exception",
    }
)
PURE_MODULES = ("math", "logger", "logging", "warnings", "os")
# os functions that are not pure: they read into buffers they are given (a tensor's memory through
# the buffer protocol) or call a function they are given (os.walk's onerror)
OS_NOT_PURE = frozenset({"readv", "preadv", "readinto", "walk", "fwalk"})
# Modules whose calls build iterators, partials or reductions over their arguments: the result
# may hold (alias) any argument; they write nothing themselves (a function handed to them is
# followed where it is passed: defuse's _functions_passed).
ALIASING_MODULES = ("itertools", "functools")
# operator: in place on their first argument (a tensor's `+=`), reads that alias it, pure ones;
# any other operator function is unknown (operator.call runs its argument).
OPERATOR_INPLACE = frozenset(
    {
        "iadd",
        "iand",
        "iconcat",
        "ifloordiv",
        "ilshift",
        "imatmul",
        "imod",
        "imul",
        "ior",
        "ipow",
        "irshift",
        "isub",
        "itruediv",
        "ixor",
        "setitem",
        "delitem",
    }
)
OPERATOR_ALIAS = frozenset({"getitem", "pos", "concat"})
OPERATOR_PURE = frozenset(
    {
        "abs",
        "add",
        "and_",
        "attrgetter",
        "contains",
        "countOf",
        "eq",
        "floordiv",
        "ge",
        "gt",
        "index",
        "indexOf",
        "inv",
        "invert",
        "is_",
        "is_not",
        "itemgetter",
        "le",
        "length_hint",
        "lshift",
        "lt",
        "matmul",
        "methodcaller",
        "mod",
        "mul",
        "ne",
        "neg",
        "not_",
        "or_",
        "pow",
        "rshift",
        "sub",
        "truediv",
        "truth",
        "xor",
    }
)
# einops: rearrange / reduce / repeat / pack / unpack may return a view of (or the very) input;
# parse_shape reads shapes only; anything else is unknown.
EINOPS_ALIAS = frozenset({"rearrange", "reduce", "repeat", "pack", "unpack", "einsum", "asnumpy"})
EINOPS_PURE = frozenset({"parse_shape"})

# torch's public names, from a generated table: importing torch here would cost seconds per run
_TENSOR_METHODS = TENSOR_METHODS
# A method of a string literal is str's own (like str(x), it only formats its arguments)
_STRING_LITERALS = (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)
_STR_METHODS = frozenset(name for name in dir(str) if not name.startswith("_"))
_TORCH_FUNCTIONS = TORCH_FUNCTIONS
_F_FUNCTIONS = F_FUNCTIONS
_NN_MODULES = NN_MODULES
# nn modules that may return their input itself (or write it with inplace=True): the dropouts
# do in eval.
IDENTITY_MODULES = frozenset(
    {
        "Identity",
        "Dropout",
        "Dropout1d",
        "Dropout2d",
        "Dropout3d",
        "AlphaDropout",
        "FeatureAlphaDropout",
        "Flatten",
        "Unflatten",
    }
)
CONTAINER_MODULES = frozenset({"ModuleList", "ModuleDict", "Sequential", "ParameterList", "ParameterDict"})


def is_inplace_name(name: str) -> bool:
    """torch's convention: add_, copy_, mul_ ... write their receiver (not dunder, private or `_`)."""
    return name.endswith("_") and not name.startswith("_") and name not in NOT_WRITES


@record
class CallEffect:
    """What one call does: expressions it writes, expressions its result may alias, expressions a
    callee msrewrite cannot see into may write (with that callee's description), and the callees
    it could not see into (its trust boundary)."""

    writes: list[cst.BaseExpression] = field(default_factory=list)
    returns: list[cst.BaseExpression] = field(default_factory=list)
    may_writes: list[tuple[cst.BaseExpression, str]] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    # callees whose tensor effects are declared (a custom op's registration: analyze/declared.py)
    # but whose other work is not seen: they may run a collective, draw random numbers or order
    # streams, which the checks of that work count as they count `unknown` callees
    unseen_work: list[str] = field(default_factory=list)
    # (container, value): after the call the object `container` names holds `value` (`put(buf, x)`
    # doing `buf[0] = x`, `setattr(obj, "a", x)`): a later write through the container writes value
    stores: list[tuple[cst.BaseExpression, cst.BaseExpression]] = field(default_factory=list)
    # an asynchronous collective (`async_op=True`, isend/irecv, batch_isend_irecv, a functional
    # collective's AsyncCollectiveTensor): buffers it keeps writing / reading after the call, until
    # its result (the work handle, the tensor) is waited; analyze/defuse.py extends them to that wait
    pending_writes: list[cst.BaseExpression] = field(default_factory=list)
    pending_reads: list[cst.BaseExpression] = field(default_factory=list)
    # the result is waited on first use (an AsyncCollectiveTensor), not only by `.wait()`
    waits_on_use: bool = False
    # attributes the call rebinds, as dotted paths on its receiver (`self.shared_experts.calls`)
    rebinds: list[str] = field(default_factory=list)
    collective: bool = False
    rng: bool = False
    stream: bool = False
    # stream ordering (an event or stream wait, a synchronize, an event record): work after it in
    # the original order must not be started before it (the fork is never hoisted above it)
    barrier: bool = False

    @staticmethod
    def pure() -> CallEffect:
        return CallEffect()


def dotted(node: cst.BaseExpression) -> str | None:
    """'self.shared_expert.down_proj' for an attribute chain of names, else None."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name):
        parts.append(node.value)
        return ".".join(reversed(parts))
    return None


def _keyword(call: cst.Call, name: str) -> cst.BaseExpression | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg.value
    return None


def is_true(node: cst.BaseExpression | None) -> bool:
    return isinstance(node, cst.Name) and node.value == "True"


def positional(call: cst.Call) -> list[cst.BaseExpression]:
    return [a.value for a in call.args if a.keyword is None and not a.star]


def tensor_args(call: cst.Call) -> list[cst.BaseExpression]:
    """Every argument expression (positional, keyword, starred): what an unknown callee may write."""
    return [a.value for a in call.args]


def maybe_true(node: cst.BaseExpression | None) -> bool:
    """A flag argument that may be true: anything passed but the literals False, None and 0."""
    if node is None:
        return False
    if isinstance(node, cst.Name) and node.value in ("False", "None"):
        return False
    return not (isinstance(node, cst.Integer) and node.value == "0")


def _common_kwargs(
    call: cst.Call, effect: CallEffect, first: cst.BaseExpression | None, inplace_at: int | None = None
) -> CallEffect:
    """`out=` and `inplace=` (also `inplace` passed by position `inplace_at`, F.relu(x, True); a
    variable flag may be true)."""
    out = _keyword(call, "out")
    if out is not None:
        effect.writes.append(out)
        effect.returns.append(out)
    flag = _keyword(call, "inplace")
    args = positional(call)
    if flag is None and inplace_at is not None and len(args) > inplace_at and not _starred_before(call, inplace_at):
        flag = args[inplace_at]
    elif flag is None and inplace_at is not None and any(a.star for a in call.args):
        flag = cst.Name("True")  # F.relu(*args): the flag may be among them
    if maybe_true(flag) and first is not None:
        effect.writes.append(first)
        effect.returns.append(first)
    return effect


def _starred_before(call: cst.Call, index: int) -> bool:
    """Whether a `*args` comes before positional argument `index` (its position is then unknown)."""
    seen = 0
    for arg in call.args:
        if arg.keyword is not None:
            continue
        if arg.star:
            return True
        if seen == index:
            return False
        seen += 1
    return False


def first_argument(call: cst.Call, *names: str) -> cst.BaseExpression | None:
    """The first positional argument, or the keyword one of `names` (`torch.relu_(input=x)`)."""
    args = positional(call)
    if args and not _starred_before(call, 0):
        return args[0]
    for name in names:
        found = _keyword(call, name)
        if found is not None:
            return found
    return None


# inplace's position in torch.nn.functional's signatures (generated: torch_names.F_INPLACE)
F_INPLACE_AT: dict[str, int] = {w.split(":")[0]: int(w.split(":")[1]) for w in F_INPLACE}
# positional tensor arguments ops without the trailing `_` write (torch_names.INPLACE_ARGS)
_INPLACE_AT: dict[str, tuple[int, ...]] = {}
for _word in sorted(INPLACE_ARGS):
    _op, _at = _word.split(":")
    _INPLACE_AT[_op] = (*_INPLACE_AT.get(_op, ()), int(_at))


def method_may_alias(name: str) -> bool:
    """Whether `x.<name>(...)` may return (a view of) x: the hand table, or an aten schema whose
    result is an alias of self."""
    return name in ALIAS_METHODS or name in ALIAS_OPS


def function_may_alias(name: str) -> bool:
    """Whether `torch.<name>(x, ...)` / `F.<name>(x, ...)` may return (a view of) its first argument."""
    return name in ALIAS_FUNCTIONS or name in ALIAS_OPS


_TORCH_FUNCTION_MODULES = (
    "torch",
    "F",
    "torch.nn.functional",
    "nn.functional",
    "torch.special",
    "torch.linalg",
    "torch.fft",
)


def torch_call_effect(
    call: cst.Call, local_names: frozenset[str] = frozenset(), module_names: frozenset[str] = frozenset()
) -> CallEffect | None:
    """The effect of a call when the table knows it, else None.

    Knows: torch.* / F.* / nn.functional.* functions, torch.distributed collectives, tensor
    methods on any receiver (by name), Python builtins and a few pure modules. A call whose head
    is one of the function's `local_names` (a parameter `torch`, a local `F`) is of that local:
    no module's or builtin's entry answers for it. A method of one of the file's `module_names`
    (an imported module, a class, a function: `ops.add(out, x)`) is not a tensor method: the
    caller's resolver reads it."""
    func = call.func
    args = positional(call)
    first = args[0] if args else None
    name = dotted(func)
    if name is not None and name.split(".")[0] in local_names:
        name = None
    if name is not None:
        module, _, leaf = name.rpartition(".")
        if name.startswith("_ms_"):
            return CallEffect(stream=True)  # msrewrite's own helpers: streams, events, record_stream
        if module in COLLECTIVE_MODULES:
            return _async(call, leaf, _collective_effect(call, name, leaf))
        if module in FUNCOL_MODULES:
            return _funcol_effect(call, name, leaf)
        if module in _TORCH_FUNCTION_MODULES:
            effect = _torch_function_effect(call, module, leaf, first)
            functional = module == "F" or "functional" in module
            positions = is_inplace_name(leaf) or leaf in _INPLACE_AT or (functional and leaf in F_INPLACE_AT)
            return spread_may_writes(call, effect, name, positions) if effect is not None else None
        effect = _other_module_effect(call, module, leaf)
        if effect is not None:
            return effect
    if isinstance(func, cst.Attribute) and _type_of_first_argument(call, local_names):
        # type(x).mul_(x, 2): the unbound method, called on its first argument
        bound = call.with_changes(func=func.with_changes(value=call.args[0].value), args=call.args[1:])
        return torch_call_effect(bound, local_names, module_names)
    if isinstance(func, cst.Attribute):
        root = dotted(func.value)
        if root is not None and root.split(".")[0] in module_names and root.split(".")[0] not in local_names:
            return None  # `ops.add(out, x)`: a module's function, not Tensor.add
        effect = _method_effect(call, func)
        if effect is not None and func.attr.value not in ORDERING_METHODS:
            positions = any(at > 0 for at in _INPLACE_AT.get(func.attr.value, ()))
            effect = spread_may_writes(call, effect, f"{dotted(func.value) or '<tensor>'}.{func.attr.value}", positions)
        return effect
    return None


def _type_of_first_argument(call: cst.Call, local_names: frozenset[str]) -> bool:
    """`type(x).method(x, ...)`: the receiver is the class of the call's first argument."""
    receiver = cst.ensure_type(call.func, cst.Attribute).value
    if not (isinstance(receiver, cst.Call) and dotted(receiver.func) == "type" and "type" not in local_names):
        return False
    if len(receiver.args) != 1 or receiver.args[0].star or not call.args or call.args[0].star or call.args[0].keyword:
        return False
    return receiver.args[0].value.deep_equals(call.args[0].value)


def spread_may_writes(call: cst.Call, effect: CallEffect, label: str, positions: bool) -> CallEffect:
    """A table entry matches arguments by keyword and position: a `**mapping` may carry `out=`,
    `inplace=` or a tensor the op writes, and a `*sequence` may hold a position the op writes
    (`positions`: the op has one). What such a spread holds (one analyze/spreads.py could not
    write out: a parameter, an attribute, a call's result) may be written."""
    for arg in call.args:
        if arg.star == "**" or (arg.star == "*" and positions):
            code = " ".join(cst.Module(body=[]).code_for_node(arg.value).split())
            code = code if len(code) <= 30 else code[:27] + "..."
            # no name --assume-pure takes: vouching for the op would not say what the spread holds
            why = f"{label}({arg.star}{code}) ({arg.star}{code} is not followed by msrewrite: it may carry out=)"
            effect.may_writes.append((arg.value, why))
    return effect


def _collective_effect(call: cst.Call, name: str, leaf: str) -> CallEffect:
    """A torch.distributed call: a collective (but for rank/size queries), writing the buffers
    DIST_WRITES names, passed by keyword or by position; one msrewrite has no entry for that
    takes a tensor may write every argument (named as unknown)."""
    effect = CallEffect(collective=leaf not in ("get_rank", "get_world_size", "is_initialized"))
    params = _DIST_PARAMS.get(leaf)
    if leaf in DIST_WRITES and params is not None:
        if any(a.star for a in call.args):  # dist.all_reduce(*args, **kwargs): any argument may be the buffer
            effect.writes += tensor_args(call)
            return effect
        args = positional(call)
        for param in DIST_WRITES[leaf]:
            value = _keyword(call, param)
            if value is None and param in params and params.index(param) < len(args):
                value = args[params.index(param)]
            if value is not None:
                effect.writes.append(value)
        return effect
    if leaf == "P2POp":
        effect.returns += tensor_args(call)  # batch_isend_irecv fills the irecv ones
        return effect
    if leaf in DIST_READS or (params is not None and not DIST_TENSOR_PARAMS & set(params)):
        return effect
    if not call.args:
        return effect  # dist.get_backend(), dist.new_group(): no tensor to touch
    why = f"{name} (not in msrewrite's torch.distributed table)"
    args = tensor_args(call)
    effect.may_writes = [(a, why) for a in args]
    effect.returns = list(args)
    effect.unknown = [why]
    return all_pairs_stored(effect, list(args))


def _async(call: cst.Call, leaf: str, effect: CallEffect) -> CallEffect:
    """`dist.all_reduce(x, async_op=True)`, `dist.isend(x, 1)`: the buffers it writes (reads, for a
    send) stay in use until its work is waited."""
    if leaf in DIST_ALWAYS_ASYNC or maybe_true(_keyword(call, "async_op")):
        effect.pending_writes = list(effect.writes)
        if leaf in DIST_READS or leaf == "batch_isend_irecv":  # its isend ops read theirs
            effect.pending_reads = [a for a in tensor_args(call) if a not in effect.writes] or list(effect.writes)
        if not effect.writes and not effect.pending_reads:
            effect.pending_reads = list(tensor_args(call))
    return effect


def _funcol_effect(call: cst.Call, name: str, leaf: str) -> CallEffect:
    """A torch.distributed._functional_collectives call (see FUNCOL_FUNCTIONAL); any other is
    unknown, named."""
    args = tensor_args(call)
    first = positional(call)[0] if positional(call) else first_argument(call, "self", "tensor", "input", "output")
    if leaf == "wait_tensor":
        return CallEffect(returns=list(args), collective=True, stream=True, barrier=True)
    if leaf in FUNCOL_FUNCTIONAL:
        return CallEffect(pending_reads=list(args), waits_on_use=True, collective=True)
    if leaf in FUNCOL_INPLACE:
        out = positional(call)[0] if positional(call) else None
        out = out if out is not None else first_argument(call, "output_tensor", "output", "tensor", "tensor_list")
        writes = [out] if out is not None else list(args)
        return CallEffect(writes=writes, returns=list(writes), collective=True)
    if leaf == "isend_inplace" and first is not None:
        return CallEffect(returns=[first], pending_reads=[first], waits_on_use=True, collective=True)
    if leaf in ("irecv_inplace", "batch_p2p_ops_inplace"):
        buffers = [first] if leaf == "irecv_inplace" and first is not None else list(args)
        return CallEffect(
            writes=buffers,
            returns=buffers,
            pending_writes=buffers,
            pending_reads=buffers,
            waits_on_use=True,
            collective=True,
        )
    if leaf in FUNCOL_PURE:
        return CallEffect.pure()
    return _unknown_module_call(call, name)


def _torch_function_effect(
    call: cst.Call, module: str, leaf: str, first: cst.BaseExpression | None
) -> CallEffect | None:
    """A torch.* / F.* function: its effect when the table knows it (or it is in place), else None."""
    known = _TORCH_FUNCTIONS if module == "torch" else _F_FUNCTIONS if "functional" in module or module == "F" else None
    if known is not None and leaf not in known and not is_inplace_name(leaf):
        return None
    functional = module == "F" or "functional" in module
    effect = CallEffect(rng=draws(leaf, functional, call))
    first = first_argument(call, "input", "self")
    if is_inplace_name(leaf) and first is not None:  # torch.relu_(x), F.relu_(x)
        effect.writes.append(first)
        effect.returns.append(first)
    elif function_may_alias(leaf) and first is not None:
        effect.returns.append(first)
        if not positional(call):  # torch.flatten(input=x, start_dim=1): any keyword may be the input
            effect.returns += [a.value for a in call.args if a.keyword is not None and a.value is not first]
    args = positional(call)
    for at in _INPLACE_AT.get(leaf, ()):
        if at < len(args):
            effect.writes.append(args[at])
    return _common_kwargs(call, effect, first, F_INPLACE_AT.get(leaf) if functional else None)


def is_stream_object(node: cst.BaseExpression) -> bool:
    """`torch.npu.current_stream()`, `torch.cuda.Event()`, `torch.npu.Stream(...)`: an expression
    that is a stream or event object by its syntax alone."""
    if not isinstance(node, cst.Call):
        return False
    module, _, leaf = (dotted(node.func) or "").rpartition(".")
    return module in _DEVICE_MODULES and leaf in _STREAM_OBJECT_LEAVES


def is_ordering_call(call: cst.Call) -> bool:
    """`<receiver>.wait()` and the other ORDERING_METHODS, whatever the receiver."""
    return isinstance(call.func, cst.Attribute) and call.func.attr.value in ORDERING_METHODS


def _other_module_effect(call: cst.Call, module: str, leaf: str) -> CallEffect | None:
    """Device stream modules, pure modules and builtins; None when the name is none of those."""
    if module in ("torch.cuda", "torch.npu", "torch_npu.npu", "torchair.scope", "torchair.ops", "torch.accelerator"):
        return CallEffect(stream=True, barrier=leaf in BARRIER_FUNCTIONS)
    if (module in PURE_MODULES or module.startswith(("math.", "torch.compiler"))) and not (
        module == "os" and leaf in OS_NOT_PURE
    ):
        return CallEffect.pure()
    if module in ALIASING_MODULES:
        return CallEffect(returns=list(tensor_args(call)))
    if module == "operator":
        return _operator_effect(call, name=f"{module}.{leaf}", leaf=leaf.strip("_") if leaf.startswith("__") else leaf)
    if module == "einops" or module.startswith("einops."):
        return _einops_effect(call, f"{module}.{leaf}", leaf)
    if not module and leaf in PURE_BUILTINS:
        return CallEffect.pure()
    if not module and leaf in CONTAINER_BUILTINS:
        return CallEffect(returns=list(tensor_args(call)))
    if (not module and leaf == "setattr") or (module == "object" and leaf == "__setattr__"):
        return _setattr_effect(call)
    return None


def _setattr_effect(call: cst.Call) -> CallEffect:
    """`setattr(obj, "a", x)`: `obj.a = x` (obj now holds x); with a computed name, obj holds x
    all the same. Anything else (`setattr(*args)`) may store every argument in every other."""
    args = positional(call)
    if len(args) != 3 or any(a.star or a.keyword is not None for a in call.args):
        return all_pairs_stored(CallEffect(writes=list(tensor_args(call))), tensor_args(call))
    obj, attr, value = args
    named = attr.evaluated_value if isinstance(attr, cst.SimpleString) else None
    if isinstance(named, str) and named.isidentifier():
        target: cst.BaseExpression = cst.Attribute(value=obj, attr=cst.Name(named))
    else:
        target = obj
    return CallEffect(writes=[obj], stores=[(target, value)])


def all_pairs_stored(effect: CallEffect, exprs: list[cst.BaseExpression]) -> CallEffect:
    """A call msrewrite cannot see into may store any argument (or its receiver) in any other
    (`helper(lst, x)` appending x to lst): every ordered pair of `exprs` is a store."""
    effect.stores += [(c, v) for c in exprs for v in exprs if c is not v]
    return effect


def _operator_effect(call: cst.Call, name: str, leaf: str) -> CallEffect:
    """operator.iadd(x, y) writes x (a tensor's `+=`), operator.setitem(c, k, v) writes c and makes
    it hold v (counted as a write of v too: the container's later writes reach it), getitem/pos
    may alias; the pure comparisons and arithmetic touch nothing; anything else is unknown."""
    args = tensor_args(call)
    first = first_argument(call, "a")
    if leaf in OPERATOR_INPLACE:
        writes = [first] if first is not None else list(args)
        if leaf == "setitem":
            writes = list(args)
        return CallEffect(writes=writes, returns=list(writes))
    if leaf in OPERATOR_ALIAS:
        return CallEffect(returns=list(args))
    if leaf in OPERATOR_PURE:
        return CallEffect.pure()
    return _unknown_module_call(call, name)


def _einops_effect(call: cst.Call, name: str, leaf: str) -> CallEffect:
    """einops.rearrange(x, ...) and its kin may return a view of x (or x itself): the result
    aliases every argument; nothing is written. Any other einops call is unknown."""
    if leaf in EINOPS_ALIAS:
        return CallEffect(returns=list(tensor_args(call)))
    if leaf in EINOPS_PURE:
        return CallEffect.pure()
    return _unknown_module_call(call, name)


def _unknown_module_call(call: cst.Call, name: str) -> CallEffect:
    """A call of a module function msrewrite has no effect for: it may write (and return) every argument."""
    why = f"{name} (not visible to msrewrite)"
    args = tensor_args(call)
    effect = CallEffect(returns=list(args), may_writes=[(a, why) for a in args], unknown=[why])
    return all_pairs_stored(effect, list(args))


def _method_effect(call: cst.Call, func: cst.Attribute) -> CallEffect | None:
    """A method call `receiver.method(...)`: stream order, a known tensor method, else None."""
    method = func.attr.value
    receiver = func.value
    if method in ORDERING_METHODS:
        if is_stream_object(receiver):  # torch.npu.current_stream().wait_event(ev): no tensor data written
            return CallEffect(stream=True, barrier=True)
        return None  # a stream, an event or anything else: the receiver decides (summaries.py)
    if method == "record_stream":
        return CallEffect(stream=True)  # x.record_stream(s): the caching allocator's bookkeeping
    if isinstance(receiver, _STRING_LITERALS) and method in _STR_METHODS:
        return CallEffect.pure()  # "-".join(names), "{}:{}".format(a, b): a new string, nothing written
    owner = dotted(receiver) or ""
    if owner.startswith("self.") and owner.count(".") == 1 and is_inplace_name(method) and method in _TENSOR_METHODS:
        return CallEffect(writes=[receiver], returns=[receiver])  # self.cache.copy_(x): module state
    if owner.split(".")[0] in ("torch", "F", "nn", "dist", "torch_npu", "torchair", "self"):
        return None  # a namespace or a submodule, not a tensor: torch.ops.x.y(...), self.experts.forward(...)
    if method in _TENSOR_METHODS or method_may_alias(method):
        effect = CallEffect(rng=draws(method, False), stream=method in STREAM_NAMES)
        if is_inplace_name(method):
            effect.writes.append(receiver)  # x.add_(y), x.view(-1).mul_(2), x.untyped_storage().resize_(0)
            effect.returns.append(receiver)
        elif method_may_alias(method):
            effect.returns.append(receiver)
        args = positional(call)
        for at in _INPLACE_AT.get(method, ()):  # schema position 0 is the receiver
            target = receiver if at == 0 else args[at - 1] if at - 1 < len(args) else None
            if target is not None and method not in ("record_stream", "retain_grad"):
                effect.writes.append(target)
        if method == "wait_stream" or method == "record_stream":
            effect.stream = True
        return _common_kwargs(call, effect, None)
    return None


def nn_module_effect(constructor: cst.Call) -> CallEffect | None:
    """The effect of calling `nn.X(...)` instances on their input (argument 0 of the call), as a
    template: writes/returns hold the placeholder `cst.Name("__input__")`."""
    name = dotted(constructor.func) or ""
    module, _, leaf = name.rpartition(".")
    if module not in ("nn", "torch.nn") or leaf not in _NN_MODULES or leaf in CONTAINER_MODULES:
        return None
    placeholder = cst.Name("__input__")
    effect = CallEffect(rng=leaf in RNG_NN_MODULES)
    # nn.ReLU(inplace=True), nn.ReLU(True), nn.Dropout(0.1, True); inplace=<a variable> may be True
    flag = _keyword(constructor, "inplace")
    literal_false = isinstance(flag, cst.Name) and flag.value == "False"
    inplace = (flag is not None and not literal_false) or any(is_true(a) for a in positional(constructor))
    if inplace:
        effect.writes.append(placeholder)
    if leaf in IDENTITY_MODULES or inplace:
        effect.returns.append(placeholder)
    if _tracks_running_stats(constructor, leaf):
        # in training each call updates running_mean / running_var / num_batches_tracked: the
        # module's own state, which another call of the same module on the other stream also writes
        effect.writes.append(cst.Name(MODULE_PLACEHOLDER))
    return effect


MODULE_PLACEHOLDER = "__module__"  # in an nn_module_effect template: the called module itself
_RUNNING_STATS = frozenset(
    {
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "SyncBatchNorm",
        "LazyBatchNorm1d",
        "LazyBatchNorm2d",
        "LazyBatchNorm3d",
    }
)
_OPTIONAL_RUNNING_STATS = frozenset(
    {
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "LazyInstanceNorm1d",
        "LazyInstanceNorm2d",
        "LazyInstanceNorm3d",
    }
)


def _tracks_running_stats(constructor: cst.Call, leaf: str) -> bool:
    """BatchNorm tracks running statistics unless `track_running_stats=False`; InstanceNorm only
    with `track_running_stats=` anything but a literal False."""
    flag = _keyword(constructor, "track_running_stats")
    literal_false = isinstance(flag, cst.Name) and flag.value == "False"
    if leaf in _RUNNING_STATS:
        return not literal_false
    return leaf in _OPTIONAL_RUNNING_STATS and flag is not None and not literal_false
