"""What kind of value a name holds at the fork, for the snapshot of a side input (--protect).

A snapshot must copy exactly what the main path may write, and must not break what it cannot
copy. The kind comes from the source, never from the name: a parameter's annotation, or the last
assignment before the fork (a literal, a comparison, a torch op, a tensor method, a torch.nn layer
built in `__init__`). Four answers:

- TENSOR: `x.clone()` copies it.
- IMMUTABLE: None, a number, a string, a dtype, a device, a torch.Size: nothing can write it in
  place, so it needs no snapshot.
- UNKNOWN: anything else the source does not pin down (an unannotated parameter, a custom module's
  result, a tuple). The edit copies it with a helper that clones tensors, also inside tuples, lists
  and dicts, and runs the original single-stream code when the value turns out to be something
  else (helpers `_ms_snapshot`, `_ms_can_snapshot`).
- an object of a named class (`forward_batch: ForwardBatch`): a snapshot cannot copy its state;
  the move is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import libcst as cst

from msrewrite.analyze.torch_effects import dotted

TENSOR = "tensor"
IMMUTABLE = "immutable"
UNKNOWN = "unknown"
OBJECT_PREFIX = "object:"  # "object:ForwardBatch"

_TENSOR_TYPES = frozenset(
    f"{prefix}{leaf}"
    for prefix in ("", "torch.", "nn.", "torch.nn.")
    for leaf in ("Tensor", "FloatTensor", "HalfTensor", "BFloat16Tensor", "LongTensor", "IntTensor", "BoolTensor")
) | {"nn.Parameter", "torch.nn.Parameter", "Parameter"}
_IMMUTABLE_TYPES = frozenset(
    {"bool", "int", "float", "complex", "str", "bytes", "None", "torch.dtype", "torch.device", "torch.Size"}
)
# annotations of containers _ms_snapshot copies element by element, and of anything at all
_CONTAINER_TYPES = frozenset(
    f"{prefix}{leaf}"
    for prefix in ("", "typing.", "collections.abc.")
    for leaf in ("tuple", "Tuple", "list", "List", "dict", "Dict", "Sequence", "Mapping", "Any", "object")
)
# torch functions whose result is one tensor (not a tuple, a bool or a size)
_TORCH_TENSOR_FUNCTIONS = frozenset(
    "abs add addmm baddbmm bmm cat clamp clone cumsum div einsum empty empty_like exp full full_like "
    "gather index_select log matmul mean mm mul neg ones ones_like pow rand rand_like randint randn "
    "randn_like reciprocal relu rsqrt sigmoid softmax sqrt square stack sub sum tanh tensor where "
    "zeros zeros_like arange linspace masked_fill narrow reshape flatten squeeze unsqueeze transpose "
    "permute repeat_interleave scatter scatter_add silu gelu log_softmax argmax argmin".split()
)
_FUNCTIONAL_TENSOR_FUNCTIONS = frozenset(
    "linear relu silu gelu softmax log_softmax sigmoid tanh dropout layer_norm rms_norm normalize "
    "pad embedding one_hot softplus leaky_relu elu mish hardswish".split()
)
# tensor methods whose result is one tensor
_TENSOR_METHODS = frozenset(
    "abs add bfloat16 bmm clamp clone contiguous cpu cuda detach div double exp expand expand_as "
    "flatten float half int long masked_fill matmul mean mm mul narrow neg new_empty new_ones "
    "new_zeros permute pow relu repeat reshape reshape_as sigmoid softmax sqrt squeeze sub sum t "
    "tanh to transpose type_as unsqueeze view view_as npu".split()
)
# tensor methods and attributes whose result is immutable
_TENSOR_SCALARS = frozenset("item dim numel size element_size is_contiguous is_floating_point".split())
_TENSOR_IMMUTABLE_ATTRS = frozenset("shape dtype device ndim is_cuda requires_grad".split())
_TENSOR_ATTRS = frozenset("T mT H data".split())
# torch.nn layers whose call returns one tensor
_TENSOR_LAYERS = frozenset(
    "Linear Embedding LayerNorm RMSNorm GroupNorm BatchNorm1d BatchNorm2d Conv1d Conv2d Dropout SiLU GELU "
    "ReLU Sigmoid Tanh Softmax LogSoftmax Mish Hardswish".split()
)
_IMMUTABLE_BUILTINS = frozenset("len int float bool str isinstance issubclass hasattr callable id hash repr".split())
_MAX_DEPTH = 8


def is_object(kind: str) -> bool:
    return kind.startswith(OBJECT_PREFIX)


def annotation_kind(node: cst.BaseExpression) -> str:
    """The kind an annotation promises."""
    if isinstance(node, cst.SimpleString):  # a forward reference: "torch.Tensor"
        try:
            return annotation_kind(cst.parse_expression(node.evaluated_value))  # type: ignore[arg-type]
        except (cst.ParserSyntaxError, TypeError):
            return UNKNOWN
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.BitOr):  # X | None
        return _union(annotation_kind(node.left), annotation_kind(node.right))
    if isinstance(node, cst.Subscript):
        head = (dotted(node.value) or "").removeprefix("typing.")
        args = [
            e.slice.value
            for e in node.slice
            if isinstance(e.slice, cst.Index) and isinstance(e.slice.value, cst.BaseExpression)
        ]
        if head == "Literal":
            return IMMUTABLE
        if head in ("Optional", "Union") and args:
            kinds = [annotation_kind(a) for a in args] + ([IMMUTABLE] if head == "Optional" else [])
            kind = kinds[0]
            for other in kinds[1:]:
                kind = _union(kind, other)
            return kind
        return UNKNOWN if f"typing.{head}" in _CONTAINER_TYPES or head in _CONTAINER_TYPES else _object(head)
    name = dotted(node)
    if name is None:
        return UNKNOWN
    if name in _TENSOR_TYPES:
        return TENSOR
    if name in _IMMUTABLE_TYPES:
        return IMMUTABLE
    if name in _CONTAINER_TYPES:
        return UNKNOWN
    return _object(name)


def _object(name: str) -> str:
    return f"{OBJECT_PREFIX}{name}" if name else UNKNOWN


def _union(a: str, b: str) -> str:
    """One of two kinds: a tensor or None needs the helper; a class and anything else is refused."""
    if a == b:
        return a
    if is_object(a) or is_object(b):
        return a if is_object(a) else b
    return UNKNOWN


class ValueKinds:
    """Kinds of names before a statement of one function body (its top-level statements)."""

    def __init__(
        self,
        func: cst.FunctionDef,
        body: Sequence[cst.BaseStatement],
        layers: Mapping[str, str] | None = None,
    ) -> None:
        """`layers`: self.<attr> -> the dotted constructor `__init__` assigns it, when known."""
        self.body = list(body)
        self.layers = dict(layers or {})
        params = func.params
        self.params: dict[str, cst.Param] = {
            p.name.value: p for p in (*params.posonly_params, *params.params, *params.kwonly_params)
        }

    def of(self, name: str, before: int, depth: int = 0) -> str:
        """The kind of `name` just before body statement `before`."""
        if depth > _MAX_DEPTH:
            return UNKNOWN
        for i in range(min(before, len(self.body)) - 1, -1, -1):
            kind = self._bound_by(self.body[i], name, i, depth)
            if kind is not None:
                return kind
        param = self.params.get(name)
        if param is None or param.annotation is None:
            return UNKNOWN  # unannotated, a global, a closure variable: the source does not say
        return annotation_kind(param.annotation.annotation)

    def _bound_by(self, stmt: cst.BaseStatement, name: str, at: int, depth: int) -> str | None:
        """The kind statement `at` leaves in `name`, or None when it does not bind it."""
        if not isinstance(stmt, cst.SimpleStatementLine):
            return UNKNOWN if _binds_inside(stmt, name) else None  # bound on some paths, maybe: no claim
        kind: str | None = None
        for small in stmt.body:
            if _walrus_binds(small, name) or _imports(small, name):
                return UNKNOWN
            if isinstance(small, cst.Assign):
                targets = [t.target for t in small.targets]
                if any(isinstance(t, cst.Name) and t.value == name for t in targets):
                    kind = self.expr(small.value, at, depth)
                elif any(
                    _mentions_name(t, name) and not isinstance(t, (cst.Attribute, cst.Subscript)) for t in targets
                ):
                    kind = UNKNOWN  # unpacked from something: no claim
            elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.target.value == name:
                declared = annotation_kind(small.annotation.annotation)
                kind = declared if declared != UNKNOWN or small.value is None else self.expr(small.value, at, depth)
            elif isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name) and small.target.value == name:
                kind = _arith(self.of(name, at, depth + 1), self.expr(small.value, at, depth))
            elif isinstance(small, cst.Del) and _mentions_name(small.target, name):
                kind = UNKNOWN
        return kind

    def expr(self, node: cst.BaseExpression, at: int, depth: int = 0) -> str:
        """The kind of expression `node` evaluated before body statement `at`."""
        if depth > _MAX_DEPTH:
            return UNKNOWN
        d = depth + 1
        if isinstance(node, (cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString)):
            return IMMUTABLE
        if isinstance(node, (cst.ConcatenatedString, cst.FormattedString)):
            return IMMUTABLE
        if isinstance(node, cst.Name):
            if node.value in ("True", "False", "None"):
                return IMMUTABLE
            return self.of(node.value, at, d)
        if isinstance(node, cst.Call):
            return self._call(node, at, d)
        if isinstance(node, cst.Subscript):
            return TENSOR if self.expr(node.value, at, d) == TENSOR else UNKNOWN
        if isinstance(node, cst.Attribute):
            if self.expr(node.value, at, d) == TENSOR:
                if node.attr.value in _TENSOR_ATTRS:
                    return TENSOR
                if node.attr.value in _TENSOR_IMMUTABLE_ATTRS:
                    return IMMUTABLE
            return UNKNOWN
        return self._operation(node, at, d)

    def _operation(self, node: cst.BaseExpression, at: int, d: int) -> str:
        """Operators, comparisons and conditional expressions."""
        if isinstance(node, cst.UnaryOperation):
            return IMMUTABLE if isinstance(node.operator, cst.Not) else self.expr(node.expression, at, d)
        if isinstance(node, cst.BinaryOperation):
            return _arith(self.expr(node.left, at, d), self.expr(node.right, at, d))
        if isinstance(node, cst.Comparison):
            if all(isinstance(c.operator, (cst.Is, cst.IsNot, cst.In, cst.NotIn)) for c in node.comparisons):
                return IMMUTABLE  # always a bool
            kinds = [self.expr(node.left, at, d), *(self.expr(c.comparator, at, d) for c in node.comparisons)]
            return _arith_all(kinds)
        if isinstance(node, cst.BooleanOperation):  # one of its operands
            return _same(self.expr(node.left, at, d), self.expr(node.right, at, d))
        if isinstance(node, cst.IfExp):
            return _same(self.expr(node.body, at, d), self.expr(node.orelse, at, d))
        return UNKNOWN

    def _call(self, call: cst.Call, at: int, depth: int) -> str:
        name = dotted(call.func) or ""
        if name in _IMMUTABLE_BUILTINS:
            return IMMUTABLE
        module, _, leaf = name.rpartition(".")
        if module == "torch" and leaf in _TORCH_TENSOR_FUNCTIONS:
            return TENSOR
        if module in ("F", "torch.nn.functional", "nn.functional") and leaf in _FUNCTIONAL_TENSOR_FUNCTIONS:
            return TENSOR
        if module.startswith("self.") or module == "self":
            ctor = self.layers.get(name.removeprefix("self."), "")
            ctor_module, _, ctor_leaf = ctor.rpartition(".")
            if ctor_module in ("nn", "torch.nn") and ctor_leaf in _TENSOR_LAYERS:
                return TENSOR
            return UNKNOWN
        if isinstance(call.func, cst.Attribute) and self.expr(call.func.value, at, depth) == TENSOR:
            method = call.func.attr.value
            if method in _TENSOR_METHODS:
                return TENSOR
            if method in _TENSOR_SCALARS:
                return IMMUTABLE
        return UNKNOWN


def _arith(a: str, b: str) -> str:
    """`a <op> b`: a tensor with a tensor or a scalar is a tensor; two scalars are a scalar."""
    if a == UNKNOWN or b == UNKNOWN or is_object(a) or is_object(b):
        return UNKNOWN
    return TENSOR if TENSOR in (a, b) else IMMUTABLE


def _arith_all(kinds: list[str]) -> str:
    kind = kinds[0]
    for other in kinds[1:]:
        kind = _arith(kind, other)
    return kind


def _same(a: str, b: str) -> str:
    return a if a == b else UNKNOWN


def _mentions_name(node: cst.CSTNode, name: str) -> bool:
    found = False

    class _Find(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            nonlocal found
            found = found or n.value == name

    node.visit(_Find())
    return found


# the field of each binding form that names what it binds
_BINDING_FIELDS = {
    cst.AssignTarget: "target",
    cst.AnnAssign: "target",
    cst.AugAssign: "target",
    cst.For: "target",
    cst.AsName: "name",
    cst.NamedExpr: "target",
    cst.Del: "target",
    cst.FunctionDef: "name",
    cst.ClassDef: "name",
}


def _binds_inside(stmt: cst.CSTNode, name: str) -> bool:
    """Whether a compound statement may bind `name` anywhere inside it."""
    targets: list[cst.CSTNode] = []

    class _Find(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            field = _BINDING_FIELDS.get(type(node))
            if field is not None:
                targets.append(getattr(node, field))
            elif isinstance(node, (cst.Global, cst.Nonlocal)):
                targets.extend(item.name for item in node.names)
            elif isinstance(node, cst.ImportAlias):
                targets.append(node.asname.name if node.asname else node.name)
            # a nested def or class binds its own name here, not what its body binds
            return node is stmt or not isinstance(node, (cst.FunctionDef, cst.ClassDef))

    stmt.visit(_Find())
    return any(
        not isinstance(t, (cst.Attribute, cst.Subscript)) and _mentions_name(t, name) for t in targets if t is not None
    )


def _walrus_binds(node: cst.CSTNode, name: str) -> bool:
    found = False

    class _Find(cst.CSTVisitor):
        def visit_NamedExpr(self, n: cst.NamedExpr) -> None:
            nonlocal found
            found = found or (isinstance(n.target, cst.Name) and n.target.value == name)

    node.visit(_Find())
    return found


def _imports(node: cst.BaseSmallStatement, name: str) -> bool:
    return isinstance(node, (cst.Import, cst.ImportFrom, cst.Global, cst.Nonlocal)) and _mentions_name(node, name)
