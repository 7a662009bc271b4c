"""An op whose `forward` picks one of its own methods per platform (issue 26, item 2).

SGLang's `BaseFusedOp` (sglang/kernels/fused_op.py) is the base of its layers' ops (`SiluAndMul`,
`TopK`, ...): its `forward` runs `self._forward_method`, resolved on the first call to one of the
op's `forward_<name>` methods (a kernel backend `forward_aot` / `forward_triton` / ..., forced
or auto-selected; the platform's `forward_cuda` / `forward_hip` / `forward_npu` / ...; or
`forward_native`), or pinned by the subclass's `__init__` (`self._forward_method =
self.forward_native`), or switched by `enter_torch_compile` to what `_torch_compile_forward`
returns. Its selection code (platform detection behind `lru_cache`, the trace, the debug
decorator) is not something msrewrite reads to the end, so the base is read through a model of
it, kept here as data: a call of `forward` on an instance of a subclass is the union of calling,
on that subclass, every method the model says the dispatch can pick:
  - every `forward_<name>` method a class between the subclass and the base defines (the base's
    own defaults raise NotImplementedError, except `forward_torch_compile`, which runs
    `forward_native`);
  - `forward_native`;
  - every `self.<method>` the subclass's classes store in the dispatch attribute (the pins);
  - every `self.<method>` an override of `_torch_compile_forward` returns.
A pin or a compile hook returning anything else, an override of the per-call gate
(`backend_eligible`, called with the op's arguments), a dispatched name bound in a class body
other than by a top-level `def`, or a base msrewrite cannot read, keeps the call unknown.
What the model takes on trust, read by hand in the modelled source: the selection code and the
debug decorator (`debug_kernel_api`: it logs and dumps the arguments, reading them) write no
tensor; the selection code is not read by msrewrite, so the call's note is unseen work (the RNG
and collective checks count it, as they count a catalogue entry's kernel).

For an edit in one mode, the platform methods the base picks only on another platform's key
(`forward_npu` for a CUDA edit; the base's own table says which method each key picks: the
model copies it) are left out, as analyze/platforms.py leaves out a branch under another
platform's test; `forward_hip` stays for a CUDA edit (ROCm runs the torch.cuda API).

The model holds only for the base's source it was read from: each entry names its files and
their sha256. A base whose files differ (another SGLang release) is not read through the model:
the call stays unknown and says why.

Trust boundary: on an out-of-tree platform (a plugin), the base runs a forward the plugin
registered (`BaseFusedOp.register_oot_forward`) or `forward_<its key>`; no in-tree code of SGLang
0.5.23 registers one (checked by hand: `register_oot_forward` is called only in the docs and in
multimodal_gen's tests, of another class). The union assumes no such plugin is active, and says
so in the call's trust boundary (`unseen_work`), with the methods it took.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import libcst as cst

from msrewrite.analyze import dispatch
from msrewrite.analyze.defuse import dotted_name
from msrewrite.analyze.platforms import helper_platform, platform_of
from msrewrite.analyze.reach import returned_values
from msrewrite.analyze.torch_effects import CallEffect
from msrewrite.analyze.walk import Visitor, walk
from msrewrite.records import record

if TYPE_CHECKING:
    from collections.abc import Callable

    from msrewrite.analyze.summaries import ModuleSummaries


@record
class Dispatcher:
    """A base class whose `method` runs one of the instance's own methods, chosen per platform."""

    file: str  # the base's file, relative to the folder its top package is in
    base: str  # the class
    method: str  # the method that dispatches
    # file (relative as `file`) -> sha256 of its bytes: the source the model was read from
    sources: dict[str, str]
    provenance: str  # package and version
    prefix: str = "forward_"  # the methods it may pick: every one of this name prefix
    native: str = "forward_native"  # always a candidate (the fallback)
    attribute: str = "_forward_method"  # where a subclass may pin the choice
    compile_hook: str = "_torch_compile_forward"  # returns the method under torch.compile (or None)
    gate: str = "backend_eligible"  # a per-call gate called with the op's arguments: not modelled
    # platform key -> the methods that key picks (the base's own table, copied)
    platform_methods: dict[str, tuple[str, ...]] | None = None
    registry: str = "_oot_forward_registry"  # where plugins put forwards msrewrite cannot see


DISPATCHERS: list[Dispatcher] = [
    Dispatcher(
        file="sglang/kernels/fused_op.py",
        base="BaseFusedOp",
        method="forward",
        sources={
            "sglang/kernels/fused_op.py": "2042fb5fb0fca33a93dd32fd05c8adc658bf44323840bd0391ef177e161163a9",
            "sglang/kernels/kernel_api_logging.py": "d3cfbaa939422f47b84b96a8878a98b178a7182a79656440c08938804517c4f7",
        },
        provenance="sglang 0.5.23",
        # fused_op.py's _PLATFORM_METHODS
        platform_methods={
            "cuda": ("forward_cuda",),
            "hip": ("forward_hip", "forward_cuda"),
            "musa": ("forward_musa",),
            "npu": ("forward_npu",),
            "xpu": ("forward_xpu",),
            "cpu": ("forward_cpu",),
        },
    ),
]

_digests: dict[tuple[Path, int, int], str] = {}


def _digest(file: Path) -> str | None:
    """sha256 of `file`'s bytes (kept per size and mtime); None when it cannot be read."""
    try:
        stat = file.stat()
        key = (file, stat.st_size, stat.st_mtime_ns)
        if key not in _digests:
            import hashlib  # only when an SGLang fused op is met (start-up: tests/test_startup_budget.py)

            _digests[key] = hashlib.sha256(file.read_bytes()).hexdigest()
        return _digests[key]
    except OSError:
        return None


def dispatcher_of(module: ModuleSummaries, base: str) -> tuple[Dispatcher | None, str]:
    """(the model of class `base` of `module`, "") when one holds for its source; (None, why not)
    when a model names this class but its files differ; (None, "") when none names it."""
    if module.path is None:
        return None, ""
    path = module.path.resolve().as_posix()
    for entry in DISPATCHERS:
        if entry.base != base or not path.endswith("/" + entry.file):
            continue
        root = Path(path[: -len(entry.file)])
        for name, digest in entry.sources.items():
            if _digest(root / name) != digest:
                return None, (
                    f"its {entry.base}.{entry.method} dispatches per platform; msrewrite's model of it was read "
                    f"from {entry.provenance}, and {name} differs from that source"
                )
        return entry, ""
    return None, ""


# bases that define no method the dispatch looks up (by name, or as the file's imports spell them)
_INERT_BASES = frozenset({"object", "ABC", "abc.ABC", "Generic", "typing.Generic"})
_INERT_QUALIFIED = frozenset({"abc.ABC", "typing.Generic", "torch.nn.Module", "torch.nn.modules.module.Module"})


def _chain(
    module: ModuleSummaries, cls: str, stop: tuple[ModuleSummaries, str]
) -> tuple[list[tuple[ModuleSummaries, str]], str]:
    """(`cls` and its bases, through the modules they are defined in, down to the class `stop`
    (not included): the classes whose definitions the dispatch looks up before the base's, "");
    or ([], the first base msrewrite cannot read, which may define any of them)."""
    out: list[tuple[ModuleSummaries, str]] = []
    todo = [(module, cls)]
    while todo:
        where, name = todo.pop(0)
        if (where is stop[0] and name == stop[1]) or any(w is where and n == name for w, n in out):
            continue
        out.append((where, name))
        for arg in where.classes[name].bases:
            value = arg.value.value if isinstance(arg.value, cst.Subscript) else arg.value
            base = dotted_name(value) or ""
            if base in _INERT_BASES and base not in where.classes or where.qualified(base) in _INERT_QUALIFIED:
                continue
            found = (where, base) if base in where.classes else where.find_class(base) if base else None
            if found is None:
                return [], base or " ".join(cst.Module([]).code_for_node(arg.value).split())
            todo.append(found)
    return out, ""


def _self_methods(value: cst.BaseExpression) -> list[str] | None:
    """The methods `value` may be: `self.<name>` -> [name], `a if c else b` -> both's, `None` ->
    []; None for anything else."""
    if isinstance(value, cst.Name) and value.value == "None":
        return []
    if isinstance(value, cst.Attribute) and isinstance(value.value, cst.Name) and value.value.value == "self":
        return [value.attr.value]
    if isinstance(value, cst.IfExp):
        body, orelse = _self_methods(value.body), _self_methods(value.orelse)
        return body + orelse if body is not None and orelse is not None else None
    return None


class _ClassBindings(Visitor):
    """The names a class body binds (not inside its methods or nested classes), and the defs that
    are not top-level statements of the body."""

    def __init__(self, node: cst.ClassDef) -> None:
        super().__init__()
        self.node = node
        body = node.body.body if isinstance(node.body, cst.IndentedBlock) else ()
        self.top = {id(s) for s in body if isinstance(s, cst.FunctionDef)}
        self.other: list[str] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        if node is not self.node:
            self.other.append(node.name.value)
        return node is self.node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        if id(node) not in self.top:
            self.other.append(node.name.value)
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.other += _bound_names(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self.other += _bound_names(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.other += _bound_names(node.target)

    def visit_For(self, node: cst.For) -> None:
        self.other += _bound_names(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        self.other += _bound_names(node.name)

    def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
        if node.asname is None:
            self.other.append((dotted_name(node.name) or "").split(".")[0])

    def visit_ImportStar(self, _node: cst.ImportStar) -> None:
        self.other.append("*")


def _bound_names(target: cst.BaseExpression) -> list[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for element in target.elements for n in _bound_names(element.value)]
    if isinstance(target, cst.StarredElement):
        return _bound_names(target.value)
    return []


def _other_bindings(node: cst.ClassDef, entry: Dispatcher) -> str:
    """The first name the dispatch may look up (`forward`, a `forward_<name>`, the pin attribute,
    the hooks) that class `node`'s body binds other than by a `def` at its top level (`forward_cuda
    = _impl`, a def under an `if`, `from x import *`): msrewrite reads methods by their defs. ""
    when there is none."""
    wanted = {entry.method, entry.native, entry.attribute, entry.compile_hook, entry.gate, "*"}
    bindings = _ClassBindings(node)
    walk(node, bindings)
    return next((n for n in bindings.other if n.startswith(entry.prefix) or n in wanted), "")


def candidates(
    entry: Dispatcher, module: ModuleSummaries, cls: str, stop: tuple[ModuleSummaries, str]
) -> tuple[list[str], str]:
    """(the methods the dispatch may pick on a `cls` instance, in a fixed order, "") or ([], why
    they cannot be told)."""
    names: list[str] = [entry.native]
    chain, unread = _chain(module, cls, stop)
    if unread:
        return [], f"{cls} derives from {unread}, which msrewrite does not read"
    for where, name in chain:
        node = where.classes[name]
        other = _other_bindings(node, entry)
        if other:
            return [], f"{name} binds {other} other than by a def in its body"
        defined = [s.name.value for s in node.body.body if isinstance(s, cst.FunctionDef)]
        if entry.gate in defined:
            return [], f"{name} overrides {entry.gate}, a per-call gate msrewrite's model does not read"
        names += [d for d in defined if d.startswith(entry.prefix)]
        for value in where.attribute_values(name).get(entry.attribute, []):
            pinned = _self_methods(value)
            if pinned is None:
                short = " ".join(cst.Module([]).code_for_node(value).split())
                return [], f"{name} stores {short} in self.{entry.attribute}"
            names += pinned
        if entry.compile_hook in defined:
            hook = next(
                s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == entry.compile_hook
            )
            returned = returned_values(hook) if not hook.decorators else None
            for value in returned if returned is not None else [cst.Name("?")]:
                picked = _self_methods(value)
                if picked is None:
                    return [], f"{name}.{entry.compile_hook} returns something other than a method of the op"
                names += picked
    seen: list[str] = []
    for name in names:
        if name not in seen:
            seen.append(name)
    return seen, ""


def other_platform_methods(entry: Dispatcher, mode: str | None) -> set[str]:
    """The methods the base picks only on platform keys of another device family than `mode`'s."""
    if mode is None or not entry.platform_methods:
        return set()
    ours = platform_of(mode)
    mine: set[str] = set()
    theirs: set[str] = set()
    for key, methods in entry.platform_methods.items():
        family = helper_platform(f"is_{key}")
        (mine if family == ours or family is None else theirs).update(methods)
    return theirs - mine


def dispatch_call(
    module: ModuleSummaries,
    call: cst.Call,
    cls: str,
    base: tuple[ModuleSummaries, str],
    label: str,
    union: Callable[[list[CallEffect]], CallEffect],
    unknown: Callable[[cst.Call, str], CallEffect],
) -> CallEffect | None:
    """The effect of calling a `cls` instance (of `module`) whose `forward` is the dispatching
    method of `base`: the union over the methods the dispatch may pick. None when no model names
    `base` (the caller reads the call as before)."""
    entry, why = dispatcher_of(*base)
    if entry is None:
        return unknown(call, f"{label} ({why}; not visible to msrewrite)") if why else None
    names, why = candidates(entry, module, cls, base)
    if why:
        return unknown(
            call, f"{label} ({entry.base}.{entry.method} dispatches per platform: {why}; not visible to msrewrite)"
        )
    left_out = other_platform_methods(entry, module._reading.mode)
    taken = [n for n in names if n not in left_out]
    effects = []
    for name in taken:
        through = call.with_changes(func=cst.Attribute(value=call.func, attr=cst.Name(name)))
        effect = module._resolve_self(through, cls, name)
        dispatch._relabel(effect, f"self.{name}", f"{label} -> {name}")
        effects.append(effect)
    skipped = [n for n in names if n in left_out]
    note = (
        f"{label} ({entry.base}.{entry.method}, read by msrewrite's model of its dispatch ({entry.provenance}): "
        f"the union of {cls}.{', '.join(taken)}"
        + (f"; left out, picked on another platform only: {', '.join(skipped)}" if skipped else "")
        + f"; assumed: no out-of-tree platform plugin registers a forward for {cls} ({entry.base}.{entry.registry})"
        " or picks another platform's method)"
    )
    effects.append(CallEffect(unseen_work=[note]))
    return union(effects)
