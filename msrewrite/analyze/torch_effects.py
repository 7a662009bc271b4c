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

from msrewrite.analyze.torch_names import F_FUNCTIONS, NN_MODULES, TENSOR_METHODS, TORCH_FUNCTIONS
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
    }
)
# torch.distributed calls that write into their first (tensor) argument.
WRITES_FIRST_ARG = frozenset(
    {
        "recv",
        "irecv",
        "all_reduce",
        "broadcast",
        "reduce",
        "all_to_all_single",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_gather",
        "all_to_all",
        "scatter",
        "gather",
        "reduce_scatter",
    }
)
COLLECTIVE_MODULES = ("dist", "torch.distributed", "distributed")
RNG_NAMES = frozenset(
    {
        "rand",
        "randn",
        "randint",
        "rand_like",
        "randn_like",
        "randint_like",
        "randperm",
        "multinomial",
        "bernoulli",
        "normal",
        "poisson",
        "dropout",
        "manual_seed",
        "random_",
        "normal_",
        "uniform_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
    }
)
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
PURE_MODULES = ("math", "operator", "itertools", "functools", "logger", "logging", "warnings", "os", "einops")

# torch's public names, from a generated table: importing torch here would cost seconds per run
_TENSOR_METHODS = TENSOR_METHODS
# A method of a string literal is str's own (like str(x), it only formats its arguments)
_STRING_LITERALS = (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)
_STR_METHODS = frozenset(name for name in dir(str) if not name.startswith("_"))
_TORCH_FUNCTIONS = TORCH_FUNCTIONS
_F_FUNCTIONS = F_FUNCTIONS
_NN_MODULES = NN_MODULES
# nn modules that may return their input itself (or write it with inplace=True).
IDENTITY_MODULES = frozenset(
    {"Identity", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "Flatten", "Unflatten"}
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


def _common_kwargs(call: cst.Call, effect: CallEffect, first: cst.BaseExpression | None) -> CallEffect:
    out = _keyword(call, "out")
    if out is not None:
        effect.writes.append(out)
        effect.returns.append(out)
    if is_true(_keyword(call, "inplace")) and first is not None:
        effect.writes.append(first)
        effect.returns.append(first)
    return effect


_TORCH_FUNCTION_MODULES = (
    "torch",
    "F",
    "torch.nn.functional",
    "nn.functional",
    "torch.special",
    "torch.linalg",
    "torch.fft",
)


def torch_call_effect(call: cst.Call) -> CallEffect | None:
    """The effect of a call when the table knows it, else None.

    Knows: torch.* / F.* / nn.functional.* functions, torch.distributed collectives, tensor
    methods on any receiver (by name), Python builtins and a few pure modules."""
    func = call.func
    args = positional(call)
    first = args[0] if args else None
    name = dotted(func)
    if name is not None:
        module, _, leaf = name.rpartition(".")
        if name.startswith("_ms_"):
            return CallEffect(stream=True)  # msrewrite's own helpers: streams, events, record_stream
        if module in COLLECTIVE_MODULES:
            return _collective_effect(leaf, args, first)
        if module in _TORCH_FUNCTION_MODULES:
            return _torch_function_effect(call, module, leaf, first)
        effect = _other_module_effect(call, module, leaf)
        if effect is not None:
            return effect
    if isinstance(func, cst.Attribute):
        return _method_effect(call, func)
    return None


def _collective_effect(leaf: str, args: list[cst.BaseExpression], first: cst.BaseExpression | None) -> CallEffect:
    """A torch.distributed call: a collective (but for rank/size queries), writing its output buffer."""
    effect = CallEffect(collective=leaf not in ("get_rank", "get_world_size", "is_initialized"))
    if leaf in WRITES_FIRST_ARG and first is not None:
        effect.writes.append(first)
        if leaf in ("all_gather", "all_to_all", "gather", "scatter") and len(args) > 1:
            effect.writes.append(args[0])
    return effect


def _torch_function_effect(
    call: cst.Call, module: str, leaf: str, first: cst.BaseExpression | None
) -> CallEffect | None:
    """A torch.* / F.* function: its effect when the table knows it (or it is in place), else None."""
    known = _TORCH_FUNCTIONS if module == "torch" else _F_FUNCTIONS if "functional" in module or module == "F" else None
    if known is not None and leaf not in known and not is_inplace_name(leaf):
        return None
    effect = CallEffect(rng=leaf in RNG_NAMES)
    if is_inplace_name(leaf) and first is not None:  # torch.relu_(x), F.relu_(x)
        effect.writes.append(first)
        effect.returns.append(first)
    elif leaf in ALIAS_FUNCTIONS and first is not None:
        effect.returns.append(first)
    return _common_kwargs(call, effect, first)


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
    if module in PURE_MODULES or module.startswith(("math.", "torch.compiler", "einops")):
        return CallEffect.pure()
    if not module and leaf in PURE_BUILTINS:
        return CallEffect.pure()
    if not module and leaf in CONTAINER_BUILTINS:
        return CallEffect(returns=list(tensor_args(call)))
    return None


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
    if method in _TENSOR_METHODS or method in ALIAS_METHODS:
        effect = CallEffect(rng=method in RNG_NAMES, stream=method in STREAM_NAMES)
        if is_inplace_name(method):
            effect.writes.append(receiver)  # x.add_(y), x.view(-1).mul_(2), x.untyped_storage().resize_(0)
            effect.returns.append(receiver)
        elif method in ALIAS_METHODS:
            effect.returns.append(receiver)
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
    effect = CallEffect(rng=leaf.startswith("Dropout"))
    # nn.ReLU(inplace=True), nn.ReLU(True), nn.Dropout(0.1, True); inplace=<a variable> may be True
    flag = _keyword(constructor, "inplace")
    literal_false = isinstance(flag, cst.Name) and flag.value == "False"
    inplace = (flag is not None and not literal_false) or any(is_true(a) for a in positional(constructor))
    if inplace:
        effect.writes.append(placeholder)
    if leaf in IDENTITY_MODULES or inplace:
        effect.returns.append(placeholder)
    return effect
