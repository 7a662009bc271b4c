"""Interprocedural summaries: what a same-file function, method or nn.Module does to its arguments.

For each function (and each module class, through its `forward`) a summary says which parameters
it writes (through aliases too), which parameters its result may alias, which callees it could not
see into, and whether it holds collectives, RNG or stream code. Calls are resolved without
importing anything:
  - `self.sub(...)` -> the class assigned to `self.sub` in `__init__` (its `forward`), also
    `nn.*` modules (`nn.ReLU(inplace=True)` writes its input, `nn.Linear` does not), activation
    tables (`ACT2FN[...]`) and torch functions stored on self (`self.act = F.silu`);
  - `self.helper(...)` -> the method; `helper(...)` -> the module-level function;
  - `expert(...)` for `for expert in self.experts` -> the ModuleList's element class;
  - a class or function imported from a sibling module, or from any package whose source
    analyze/packages.py finds on `--source-path` or `sys.path` (read, never imported), also
    through `__init__.py` re-exports, relative imports and bases (`class X(FusedMoE)`).
A package's function counts only as far as its summary proves: one that calls anything
msrewrite cannot see into (`self.quant_method.apply(...)`, a Triton kernel, a custom op) may
write every tensor argument. Reading is bounded (import depth, bytes read per analysis).
Anything else (a callable passed in, dynamic dispatch) is unknown: it "may write its tensor
arguments", and the summary names it so a refusal can say what msrewrite could not see.
`assume_pure` holds names a reviewer vouched for (`--assume-pure NAME`): a class, function or
`self.` attribute name.
"""

from __future__ import annotations

import builtins
import dataclasses
import re
from dataclasses import field
from pathlib import Path

import libcst as cst

from msrewrite.analyze import catalogue, declared, dispatch, fused_dispatch, packages
from msrewrite.analyze.definitions import last_def
from msrewrite.analyze.defuse import (
    Scope,
    StatementFacts,
    alias_roots,
    dotted_name,
    expression_loads,
    extend_pending,
    node_facts,
    parameter_names,
)
from msrewrite.analyze.platforms import other_platform_blocks, platform_tests
from msrewrite.analyze.reach import UNSEEN_STORE, attribute_stores, instance_targets, local_import, returned_values
from msrewrite.analyze.torch_effects import (
    MODULE_PLACEHOLDER,
    ORDERING_METHODS,
    TENSOR_METHODS,
    CallEffect,
    is_inplace_name,
    is_ordering_call,
    is_stream_object,
    nn_module_effect,
    positional,
    torch_call_effect,
)
from msrewrite.analyze.walk import Visitor
from msrewrite.records import record

# Activation lookups that hand out stateless, functional activations.
ACTIVATION_TABLES = frozenset({"ACT2FN", "ACT2CLS"})
ACTIVATION_FACTORIES = frozenset({"get_activation", "get_act_fn"})
# nn.Module methods that hand out the module's own state (tensors, submodules): what they return
# aliases it. One by name (`get_buffer("bias")`) is that attribute (its first dotted part);
# otherwise, and for the iterators, all of the module's state (its submodules' too). A write
# through the result is a write of that state.
NAMED_STATE_ACCESSORS = frozenset({"get_buffer", "get_parameter", "get_submodule", "__getattr__"})
STATE_ACCESSORS = NAMED_STATE_ACCESSORS | frozenset(
    {
        "buffers",
        "parameters",
        "named_buffers",
        "named_parameters",
        "modules",
        "named_modules",
        "children",
        "named_children",
        "state_dict",
    }
)
# nn.Module methods that write the module's state (all of it, its submodules' too) and return the
# module: `self.load_state_dict(sd)` copies into every tensor, `.to()` / `.half()` swap their data.
# Those a tensor does not have too are known by name even on a module msrewrite cannot see.
MODULE_ONLY_STATE_WRITERS = frozenset(
    {
        "load_state_dict",
        "zero_grad",
        "apply",
        "_apply",
        "to_empty",
        "share_memory",
        "register_buffer",
        "register_parameter",
        "register_module",
        "add_module",
        "set_submodule",
    }
)
STATE_WRITERS = MODULE_ONLY_STATE_WRITERS | frozenset(
    {"to", "half", "float", "double", "bfloat16", "cuda", "cpu", "npu", "xpu", "type", "requires_grad_"}
)


@record
class Summary:
    """Effects of calling one function with arguments bound to `params`."""

    params: list[str]
    writes: set[str] = field(default_factory=set)  # parameters written in place
    # parameter -> every unseen callee that may write it (sorted, no repeats; at most MAX_WRITERS)
    may_write: dict[str, list[str]] = field(default_factory=dict)
    returns: set[str] = field(default_factory=set)  # parameters the result may alias
    # (p, q): after the call the object parameter p names holds parameter q (`buf[0] = x`,
    # `buf.append(x)`, `obj.a = x`); p is "self" for the object's own attributes (`self.last = x`)
    holds: set[tuple[str, str]] = field(default_factory=set)
    # parameters an asynchronous collective it starts and never waits still writes / reads when
    # it returns (`return dist.all_reduce(x, async_op=True)`): the caller's wait of the result ends it
    pending_writes: set[str] = field(default_factory=set)
    pending_reads: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)  # callees not seen into
    # callees whose tensor effects are declared but whose other work is not seen (CallEffect.unseen_work)
    unseen_work: set[str] = field(default_factory=set)
    # state beyond the arguments written in place: "self.<attr>" (an attribute of the object),
    # "self" (any of its state: through `self.parameters()`, say) and module-level names; a
    # caller counts them as writes of that attribute of the receiver, and of those names
    state_writes: set[str] = field(default_factory=set)
    # attributes of the object it rebinds, as paths below it (`self.calls += 1`: "calls";
    # `self.sub.last = y`: "sub.last"), a Python number included: a caller that reads one
    # must not see the call move across that read
    rebinds: set[str] = field(default_factory=set)
    # the object's own state the result may alias, as "self.<attr>" or "self" (all of it):
    # `return self.scales[0]`, a @property returning a view of state, `return self.get_buffer("b")`
    returns_state: set[str] = field(default_factory=set)
    collective: bool = False
    rng: bool = False
    stream: bool = False
    barrier: bool = False  # orders streams or events (an event wait, a synchronize): see CallEffect
    vararg: str | None = None
    kwarg: str | None = None


_SELF = cst.Name("self")

# Bounds on reading other modules' source for one analysis: import hops from the user's file,
# and bytes read (a lookup past either stays an unknown callee).
MAX_IMPORT_DEPTH = 6
MAX_BYTES_READ = 3_000_000
# Unseen callees kept per parameter of a summary: any one of them makes the parameter "may be
# written" (soundness needs only that); the list is for naming them all in one refusal. Past
# this many a summary keeps the first (sorted) ones, and a refusal names those (far more than
# it lists: analyze/branch.py's MAX_VOUCHED; SGLang xllm's MoE forward has 184 for its input).
MAX_WRITERS = 1024


@record
class _Reading:
    """Modules read for one analysis (shared by every ModuleSummaries it loads)."""

    loaded: dict[Path, ModuleSummaries | None] = field(default_factory=dict)
    bytes_read: int = 0
    # (namespace, op, the file asking) -> (its declaration, "") or (None, why none is trusted)
    ops: dict[tuple, tuple] = field(default_factory=dict)
    # the mode the edit is for: code under another platform's test (`if _is_npu:` for a CUDA edit)
    # never runs there and is not read (analyze/platforms.py); None reads every branch
    mode: str | None = None
    skipped_tests: set[str] = field(default_factory=set)  # the platform tests whose code was left out
    root: ModuleSummaries | None = None  # the file analysed (analyze/dispatch.py searches its classes too)
    checked_trees: set[Path] = field(default_factory=set)  # package trees dispatch.refresh looked at


class ModuleSummaries:
    """Summaries of one parsed file, computed on demand and cached."""

    def __init__(
        self,
        module: cst.Module,
        assume_pure: tuple[str, ...] = (),
        path: Path | None = None,
        _reading: _Reading | None = None,
        _depth: int = 0,
        _package: bool = False,
        mode: str | None = None,
        text: str | None = None,
    ) -> None:
        """`text`: the file's source when the caller has it (else rendered from `module` when needed)."""
        self.assume_pure = set(assume_pure)
        self.assumed: set[str] = set()  # names the reviewer vouched for that were used
        self.path = path
        self.classes: dict[str, cst.ClassDef] = {}
        self.functions: dict[str, cst.FunctionDef] = {}
        self.imports: dict[str, tuple[int, str, str]] = {}  # local name -> (dots, module, name)
        self.module_imports: dict[str, str] = {}  # `import a.b as m`: m -> a.b; `import a.b`: a -> a
        self.depth = _depth  # import hops from the user's file
        self.package = _package  # read from an installed package: its callees count only if proven
        self.patched: dict[str, str] = {}  # free function -> the class it is assigned to (Cls.forward = fn)
        # (class, attribute) -> each module-level `Cls.attr = value`: the function's name, or None
        # for any other value (a lambda, a call): what a call of that method may run instead
        self.patches: dict[tuple[str, str], list[str | None]] = {}
        self._class_bases: dict[str, list[str]] | None = None  # class -> its bases (read modules: the index's)
        self.star_imports: list[tuple[int, str]] = []  # `from <dots><module> import *`, in order
        self._tree = module
        self._containers: frozenset[str] | None = None  # see container_globals
        # `op = torch.library.custom_op("ns::op", mutates_args=...)(impl)` at module level: op ->
        # impl's def with that registration as its decorator (function_summary reads it so)
        self.registered_ops: dict[str, cst.FunctionDef] = {}
        self._reading = _reading if _reading is not None else _Reading(mode=mode, root=self)
        self._platform_names: dict[str, str] | None = None
        self._text: str | None = text  # see _code
        for stmt in _top_level(module.body):
            if isinstance(stmt, cst.ClassDef):
                self.classes[stmt.name.value] = stmt
            elif isinstance(stmt, cst.FunctionDef):
                self.functions[stmt.name.value] = stmt
            elif isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    self._note_top_level(small)
        self._cache: dict[tuple[str, str, int], Summary] = {}
        # (id of a function, its flag literals) -> the function without the branches they rule out
        self._specialized: dict[tuple, cst.FunctionDef] = {}
        self._flag_params: dict[int, frozenset[str]] = {}  # id of a function -> flag_params
        self._bound: frozenset[str] | None = None  # bound_names(), once per file
        self._method_reads: dict[tuple[str, str], frozenset[str] | None] = {}
        self._class_hooks: dict[str, dict[str, list[str]]] = {}
        self._attrs: dict[str, dict[str, list[cst.BaseExpression]]] = {}
        self._stored_in: dict[int, cst.FunctionDef] = {}  # id of a value in _attrs -> the method storing it
        self._fills: dict[int, dict[str, list[cst.BaseExpression]]] = {}  # id of a method -> its container fills
        self.reach_cache: dict = {}  # analyze/reach.py's answers about this file's functions

    def _note_top_level(self, small: cst.BaseSmallStatement) -> None:
        """Records what a top-level small statement binds: imports, star imports, `Cls.forward = fn`."""
        if isinstance(small, cst.ImportFrom):
            source = dotted_name(small.module) if small.module is not None else ""
            if isinstance(small.names, cst.ImportStar):
                self.star_imports.append((len(small.relative), source or ""))
                return
            for alias in small.names:
                bound = alias.asname.name if alias.asname else alias.name
                local = bound.value if isinstance(bound, cst.Name) else dotted_name(bound) or ""  # always a Name here
                self.imports[local] = (len(small.relative), source or "", dotted_name(alias.name) or "")
        elif isinstance(small, cst.Import):
            for alias in small.names:
                full = dotted_name(alias.name) or ""
                if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                    self.module_imports[alias.asname.name.value] = full
                elif full:
                    head = full.split(".")[0]
                    self.module_imports[head] = head
        elif isinstance(small, cst.Assign):
            self._note_registered_op(small)
            for target in small.targets:
                name = dotted_name(target.target) or ""
                if name.count(".") != 1:
                    continue
                owner, attr = name.split(".")
                value = small.value.value if isinstance(small.value, cst.Name) else None
                self.patches.setdefault((owner, attr), []).append(value)
                if value is not None:
                    self.patched[value] = owner

    def container_globals(self) -> frozenset[str]:
        """Module-level names that only ever hold a dict/list/set/tuple built by a literal
        (packages.container_globals), from an `ast` pass over this file made when first asked."""
        if self._containers is None:
            self._containers = packages.text_facts(self._code())[0]
        return self._containers

    def _code(self) -> str:
        """The user's file as text (rendered once from its tree)."""
        if self._text is None:
            self._text = self._tree.code
        return self._text

    def _note_registered_op(self, small: cst.Assign) -> None:
        """`op = torch.library.custom_op("ns::op", mutates_args=...)(impl)` (or SGLang's
        `register_custom_op(...)(impl)`): `op` is impl with that registration as its decorator."""
        registering = small.value
        if not (
            len(small.targets) == 1
            and isinstance(small.targets[0].target, cst.Name)
            and isinstance(registering, cst.Call)
            and isinstance(registering.func, cst.Call)
            and (dotted_name(registering.func.func) or "").split(".")[-1] in ("custom_op", "register_custom_op")
            and len(registering.args) == 1
        ):
            return
        impl = registering.args[0].value
        if isinstance(impl, cst.Name) and impl.value in self.functions:
            decorator = cst.Decorator(decorator=registering.func)
            self.registered_ops[small.targets[0].target.value] = self.functions[impl.value].with_changes(
                decorators=[decorator]
            )

    # classes ----------------------------------------------------------------------------
    def find_class(self, name: str) -> tuple[ModuleSummaries, str] | None:
        """A class defined in this file, or imported from a sibling module or an installed
        package whose source msrewrite can read (never imported)."""
        return self._find_def(name, "classes")

    def find_function(self, name: str) -> tuple[ModuleSummaries, str] | None:
        """A free function defined in this file or imported (as `find_class`)."""
        return self._find_def(name, "functions")

    def _find_def(self, name: str, kind: str, seen: frozenset = frozenset()) -> tuple[ModuleSummaries, str] | None:
        if name in getattr(self, kind):
            return self, name
        if self.path is None or (id(self), name) in seen:
            return None
        seen = seen | {(id(self), name)}
        head, _, rest = name.partition(".")
        if rest:  # m.Name / a.b.Name through `import a.b as m` / `from a import b`
            if head in self.module_imports:
                module, _, leaf = f"{self.module_imports[head]}.{rest}".rpartition(".")
                other = self._module(0, module)
            elif head in self.imports and "." not in rest:
                dots, source, original = self.imports[head]
                other, leaf = self._module(dots, f"{source}.{original}" if source else original), rest
            else:
                return None
            return other._find_def(leaf, kind, seen) if other is not None else None
        if name not in self.imports:
            # `from pkg.common import *` (SGLang's sglang/srt/utils/__init__.py): a public name
            # the starred module defines or imports itself
            if name.startswith("_"):
                return None
            for dots, source in self.star_imports:
                other = self._module(dots, source)
                found = other._find_def(name, kind, seen) if other is not None else None
                if found is not None:
                    return found
            return None
        dots, source, original = self.imports[name]
        other = self._module(dots, source)
        return other._find_def(original, kind, seen) if other is not None else None

    def _module(self, dots: int, source: str) -> ModuleSummaries | None:
        """The module `from <dots><source> import ...` names: a sibling of this file, or a module
        of an installed package (analyze/packages.py). Read lazily, within the reading bounds."""
        if self.path is None or self.depth >= MAX_IMPORT_DEPTH:
            return None
        found = self._sibling(dots, source)
        if found is not None or dots:
            return found
        file = packages.module_file(source, near=self.path)
        return self._read(file, package=True) if file is not None else None

    def _sibling(self, dots: int, source: str) -> ModuleSummaries | None:
        """The parsed sibling module: `from .x import A`, `from x import A` next to this file (never imported)."""
        base = self.path.parent  # type: ignore[union-attr]
        for _ in range(max(dots - 1, 0)):
            base = base.parent
        if not source:  # `from . import x`: the package's own `__init__.py`
            candidates = [base / "__init__.py"]
        else:
            rel = Path(*source.split("."))
            candidates = [base / rel.with_suffix(".py"), base / rel / "__init__.py"]
        for candidate in candidates:
            if candidate.is_file():
                return self._read(candidate, package=self.package)
        return None

    def _read(self, file: Path, package: bool) -> ModuleSummaries | None:
        file = file.resolve()
        loaded = self._reading.loaded
        if file in loaded:
            return loaded[file]
        loaded[file] = None  # a cycle sees nothing
        try:
            size = file.stat().st_size
        except OSError:
            return None
        if self._reading.bytes_read + size > MAX_BYTES_READ:
            return None
        self._reading.bytes_read += size
        index = packages.index_file(file)
        if index is None:
            return None
        other = ModuleSummaries(
            cst.Module(body=[]), tuple(self.assume_pure), file, self._reading, self.depth + 1, package
        )
        other.classes = _LazyDefinitions(index, index.classes, "class")
        other.functions = _LazyDefinitions(index, index.functions, "def")
        other.imports, other.module_imports, other.patched = (
            dict(index.imports),
            dict(index.module_imports),
            dict(index.patched),
        )
        other.star_imports = list(index.star_imports)
        other._containers = index.containers
        other.patches = {k: list(v) for k, v in index.patches.items()}
        other._class_bases = {k: list(v) for k, v in index.bases.items()}
        other._platform_names = index.platform_names
        other.assumed = self.assumed  # names vouched for anywhere count as used
        loaded[file] = other
        return other

    # virtual dispatch --------------------------------------------------------------------
    def _all_bases(self) -> dict[str, list[str]]:
        """Every class of this module -> its bases (dotted), without parsing a read module's classes."""
        if self._class_bases is None:
            self._class_bases = {name: self._bases(name) for name in list(self.classes)}
        return self._class_bases

    def subclasses(self, cls: str) -> list[str]:
        """The classes of this module that derive from `cls` (directly or through each other), in order."""
        bases = self._all_bases()
        found: list[str] = []
        todo = [cls]
        while todo:
            parent = todo.pop(0)
            for name, parents in bases.items():
                if name not in found and name != cls and any(b.split(".")[-1] == parent for b in parents):
                    found.append(name)
                    todo.append(name)
        return found

    def _ancestors(self, cls: str) -> list[str]:
        """`cls` and its bases defined in this module."""
        out: list[str] = []
        todo = [cls]
        while todo:
            name = todo.pop(0)
            if name in out:
                continue
            out.append(name)
            todo += [b.split(".")[-1] for b in self._all_bases().get(name, [])]
        return out

    def _dispatch_effects(
        self, call: cst.Call, cls: str, name: str, label: str, subclasses: bool, receiver: cst.BaseExpression = _SELF
    ) -> list[CallEffect]:
        """What else `<cls instance>.name(...)` may run: the overrides of `name` in the subclasses of
        `cls` this module defines (with `subclasses`: the object may be of any of them) and every
        module-level `Cls.name = f` on `cls`, its bases or those subclasses. `receiver`: the
        object, as the caller names it."""
        effects: list[CallEffect] = []
        classes = self._ancestors(cls) + (self.subclasses(cls) if subclasses else [])
        if subclasses:
            for sub in self.subclasses(cls):
                node = self.classes.get(sub)
                if node is None or not isinstance(node.body, cst.IndentedBlock):
                    continue
                stmt = last_def(node.body.body, name)
                if stmt is not None:
                    summary = self.function_summary(sub, stmt)
                    effects.append(
                        _apply(summary, call, f"{label} ({sub}.{name}, an override)", self.package, receiver)
                    )
        for owner in classes:
            for value in self.patches.get((owner, name), []):
                where = f"{label} ({owner}.{name} = {value or '...'} at module level"
                if value is not None and value in self.functions:
                    summary = self.function_summary(owner, self.functions[value])
                    effects.append(_apply(summary, call, where + ")", self.package, receiver))
                else:
                    effects.append(_unknown(call, f"{where}, not visible to msrewrite)"))
        return effects

    def _hooks(self, cls: str, attr: str) -> list[str]:
        """`self.<attr>.register_forward_hook(...)` / `register_forward_pre_hook(...)` /
        `register_module_forward_hook` in a method of `cls` (or its bases and subclasses here):
        hooks run inside every call of that submodule."""
        return [
            hook
            for owner in [*self._ancestors(cls), *self.subclasses(cls)]
            for hook in self._hooks_in(owner).get(attr, [])
        ]

    def _hooks_in(self, owner: str) -> dict[str, list[str]]:
        """attr -> the hooks class `owner` registers on `self.<attr>`, in source order (each class
        read once: every call on a submodule asks)."""
        if owner in self._class_hooks:
            return self._class_hooks[owner]
        found: dict[str, list[str]] = {}

        class _Hooks(Visitor):
            def visit_Call(self, call: cst.Call) -> None:
                func = call.func
                if (
                    isinstance(func, cst.Attribute)
                    and func.attr.value.startswith("register_")
                    and "hook" in func.attr.value
                ):
                    target = dotted_name(func.value) or ""
                    head, _, attr = target.partition(".")
                    if head == "self" and attr:
                        found.setdefault(attr, []).append(f"{owner}: {target}.{func.attr.value}")

        node = self.classes.get(owner)
        if node is not None:
            node.visit(_Hooks())
        self._class_hooks[owner] = found
        return found

    def _bases(self, cls: str) -> list[str]:
        node = self.classes.get(cls)
        if node is None:
            return []
        return [b for b in (dotted_name(arg.value) or "" for arg in node.bases) if b]

    def _method(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> tuple[str, cst.FunctionDef] | None:
        node = self.classes.get(cls)
        if node is None or cls in seen:
            return None
        kept = last_def(node.body.body, name)  # a second `def name` replaces the first
        if kept is not None:
            return cls, kept
        for base in self._bases(cls):
            found = self._method(base, name, seen | {cls})
            if found:
                return found
        return None

    def _inherited(
        self, cls: str, name: str, seen: frozenset = frozenset()
    ) -> tuple[ModuleSummaries, str, cst.FunctionDef] | None:
        """Method `name` of `cls` (or a base), also from a base class imported from another
        module: (the module that defines it, its class there, the method)."""
        mine = (id(self), cls)  # a base may have the subclass's name in another module
        if mine in seen or cls not in self.classes:
            return None
        found = self._method(cls, name)
        if found is not None:
            return self, found[0], found[1]
        for base in self._bases(cls):
            if base in self.classes:
                hit = self._inherited(base, name, seen | {mine})
            else:
                where = self.find_class(base)
                hit = where[0]._inherited(where[1], name, seen | {mine}) if where is not None else None
            if hit is not None:
                return hit
        return None

    def replacing_new(self, cls: str) -> str | None:
        """`Base.__new__` when the `__new__` that `Cls(...)` runs (its own or a base's) may
        return an instance of another class: vLLM's `CustomOp.__new__` builds the class an
        out-of-tree platform registered under the op's name (vllm-ascend's NPU layers), so the
        object is not what `cls`'s source says. None when there is no `__new__` or every return
        is `super().__new__(cls)` / `object.__new__(cls)` of its own first parameter."""
        found = self._inherited(cls, "__new__")
        if found is None:
            return None
        _, owner_cls, method = found
        params = method.params.params
        first = params[0].name.value if params else None
        values = returned_values(method)
        for value in values if values is not None else [None]:
            if not (
                isinstance(value, cst.Call)
                and isinstance(value.func, cst.Attribute)
                and value.func.attr.value == "__new__"
                and (
                    dotted_name(value.func.value) == "object"
                    or (isinstance(value.func.value, cst.Call) and dotted_name(value.func.value.func) == "super")
                )
                and value.args
                and isinstance(value.args[0].value, cst.Name)
                and value.args[0].value.value == first
            ):
                return f"{owner_cls}.__new__"
        return None

    def _overridden(self, cls: str, owner: ModuleSummaries, base: str) -> str | None:
        """A `self.<name>` the base class (in another module) uses that `cls` reassigns or
        redefines: the base's method, summarized in its own module, would not see the subclass's."""
        mine = set(self.attribute_values(cls))
        chain = [cls]
        while chain:
            node = self.classes.get(chain.pop())
            if node is None:
                continue
            mine |= {s.name.value for s in node.body.body if isinstance(s, cst.FunctionDef)} - {"__init__"}
            chain += [b for b in self._bases(node.name.value) if b in self.classes]
        used: set[str] = set()

        class _SelfAttrs(Visitor):
            def visit_Attribute(self, node: cst.Attribute) -> None:
                if isinstance(node.value, cst.Name) and node.value.value == "self":
                    used.add(node.attr.value)

        owner.classes[base].visit(_SelfAttrs())
        clash = sorted(mine & used)
        return clash[0] if clash else None

    def _inherited_effect(self, call: cst.Call, cls: str, name: str, label: str) -> CallEffect | None:
        """The effect of calling inherited method `name` on a `cls` instance, when a base in
        another module defines it; None when no base does."""
        hit = self._inherited(cls, name)
        if hit is None or hit[0] is self:
            return None
        owner, base, method = hit
        if name == "forward":  # a base that runs one of the op's own methods, picked per platform
            fused = fused_dispatch.dispatch_call(self, call, cls, (owner, base), label, _union, _unknown)
            if fused is not None:
                return fused
        clash = self._overridden(cls, owner, base)
        receiver = call.func if name == "forward" or not isinstance(call.func, cst.Attribute) else call.func.value
        if clash is not None:
            if not self._portable(method, owner):
                return _unknown(
                    call, f"{label} ({base}.{name} uses self.{clash}, which {cls} overrides; not visible to msrewrite)"
                )
            # read again as a method of `cls`: its `self.<name>`s are what `cls` makes of them
            summary = self.function_summary(cls, method)
            return _apply(summary, call, f"{label} ({base}.{name}, on {cls})", owner.package or self.package, receiver)
        return _apply(owner.function_summary(base, method), call, f"{label} ({base}.{name})", owner.package, receiver)

    def _portable(self, method: cst.FunctionDef, home: ModuleSummaries) -> bool:
        """Whether `method`, written in module `home`, means the same read in this module: each
        module-level name it uses is the same import in both (`torch`), and it uses no `super()`
        or `__class__` (they name its own class)."""
        if opaque_decorator(method) is not None:
            return False
        local = {
            p.name.value for p in (*method.params.posonly_params, *method.params.params, *method.params.kwonly_params)
        }
        local |= {p.name.value for p in (method.params.star_arg, method.params.star_kwarg) if isinstance(p, cst.Param)}
        local |= _rebound_names(method)
        for name in _loaded_names(method.body) - local - {"self"}:
            if name in ("super", "__class__") or any(name in m.functions or name in m.classes for m in (home, self)):
                return False
            if name in BUILTIN_NAMES and not any(name in m.imports or name in m.module_imports for m in (home, self)):
                continue
            mine, theirs = self.module_imports.get(name), home.module_imports.get(name)
            if mine is not None and mine == theirs:
                continue
            mine_from, theirs_from = self.imports.get(name), home.imports.get(name)
            if mine_from is None or mine_from != theirs_from or mine_from[0] != 0:
                return False
        return True

    def _external_bases(self, cls: str) -> list[str]:
        """Bases that are neither same-file classes nor torch's nn.Module (they may define methods)."""
        out = []
        for base in self._bases(cls):
            if base in self.classes:
                out += self._external_bases(base)
            elif base not in ("nn.Module", "torch.nn.Module", "Module", "object"):
                out.append(base)
        return out

    def is_module_class(self, cls: str, seen: frozenset[str] = frozenset()) -> bool:
        """Whether `cls` is an nn.Module, its bases followed through the classes msrewrite reads:
        then `self.parameters()` and the other state accessors are torch's own (no class of the
        chain defines them; resolve checks that first)."""
        if cls in seen:
            return False
        for base in self._bases(cls):
            if base.startswith(("nn.", "torch.nn.")):
                return True
            if base == "Module" and self.imports.get("Module", (0, "", ""))[1].startswith("torch"):
                return True
            if base in self.classes and self.is_module_class(base, seen | {cls}):
                return True
        return False

    def attribute_values(self, cls: str) -> dict[str, list[cst.BaseExpression]]:
        """What `self.<attr>` may hold: every value a method of the class or of a same-file base
        puts there (`__init__`'s first, in source order). Not only `__init__`'s: a module set to
        None there and bound in `setup()` is called as whatever `setup()` binds. A store whose
        value cannot be told apart (`self.a, self.b = pair()`, `for self.x in ...`,
        `setattr(self, name, v)`) records a stand-in that resolves to nothing seen into."""
        if cls in self._attrs:
            return self._attrs[cls]
        values: dict[str, list[cst.BaseExpression]] = {}
        for base in self._bases(cls):
            if base in self.classes and base != cls:
                for k, v in self.attribute_values(base).items():
                    values.setdefault(k, []).extend(v)
        node = self.classes.get(cls)
        methods = [m for m in node.body.body if isinstance(m, cst.FunctionDef)] if node is not None else []
        init = last_def(node.body.body, "__init__") if node is not None else None
        methods.sort(key=lambda m: m is not init)  # stable: __init__ first, the rest in source order
        for method in methods:
            for name, value in attribute_stores(method):
                values.setdefault(name, []).append(value)
                self._stored_in[id(value)] = method
        if "*" in values:  # setattr(self, <computed name>, v): any attribute may hold v
            anywhere = values.pop("*")
            for name in values:
                values[name] = values[name] + anywhere
        self._attrs[cls] = values
        return values

    def element_values(self, cls: str, attr: str) -> list[cst.BaseExpression]:
        """What the methods of `cls` (and its same-file bases) put into the container
        `self.<attr>` after building it: `self.routers["a"] = X(...)` gives X(...); a call that
        fills it some other way (`self.routers.update(extra)`, `.add_module(k, m)`, `.append(m)`)
        gives that call, which resolves to nothing msrewrite can see into."""
        found: list[cst.BaseExpression] = []
        for klass in [cls, *(b for b in self._bases(cls) if b in self.classes and b != cls)]:
            node = self.classes.get(klass)
            methods = [m for m in node.body.body if isinstance(m, cst.FunctionDef)] if node is not None else []
            for method in methods:
                found += _container_fills(method, self._fills).get(f"self.{attr}", [])
        return found

    # queries for the other analyses (analyze/effects.py) -----------------------------------
    def method_of(self, cls: str, name: str) -> tuple[str, cst.FunctionDef] | None:
        """Method `name` of class `cls` or of a same-file base: (the class defining it, its def)."""
        return self._method(cls, name)

    def attribute_class(self, cls: str, attr: str) -> tuple[ModuleSummaries, str] | None:
        """The one class (this file or a sibling) whose instance `self.<attr>` holds, from `__init__`
        (`self.cache = OffloadCache(...)`, also through `self.a = self.b`); None when it is not
        assigned there, comes from elsewhere (an argument) or may be of several classes."""
        values = self.attribute_values(cls).get(attr)
        found: dict[tuple[int, str], tuple[ModuleSummaries, str]] = {}
        for value in self._through_self_aliases(cls, values or []):
            hit = self.find_class(dotted_name(value.func) or "") if isinstance(value, cst.Call) else None
            if hit is None or hit[0].replacing_new(hit[1]) is not None:
                return None
            found[(id(hit[0]), hit[1])] = hit
        return next(iter(found.values())) if len(found) == 1 else None

    # summaries ---------------------------------------------------------------------------
    def function_summary(self, cls: str | None, func: cst.FunctionDef) -> Summary:
        """Summary of `func` called on an instance of `cls` (None: a free function). Behind a
        decorator msrewrite does not see through, the wrapper runs instead of the body
        (`@_double_input` may write the argument first): what the body does (its collectives,
        RNG, stream work, writes) still counts, and the wrapper may write every argument."""
        key = (cls or "", func.name.value, id(func))
        if key in self._cache:
            return self._cache[key]
        declaration = self._decorator_declaration(func) if cls is None else None
        if declaration is not None:
            self._cache[key] = self._declared_summary(func, declaration)
            return self._cache[key]
        summary = self._body_summary(cls, func)
        opaque = opaque_decorator(func)
        if opaque is not None and not self._vouched(opaque):
            why = f"{func.name.value} (a decorator, @{opaque}, wraps it: not visible to msrewrite)"
            every = [*summary.params, *(n for n in (summary.vararg, summary.kwarg) if n)]
            summary = dataclasses.replace(
                summary,
                may_write={p: _merged(summary.may_write.get(p, []), [why]) for p in every},
                returns=set(every),
                holds=_all_pairs(every),
                unknown=summary.unknown | {why},
            )
            self._cache[key] = summary
        return summary

    # declared effects (analyze/declared.py) ----------------------------------------------
    def qualified(self, name: str) -> str:
        """`name` as this file's absolute imports spell it in full (`library.custom_op` after
        `from torch import library`: "torch.library.custom_op"); "" when its head is not imported so."""
        head, _, rest = name.partition(".")
        if head in self.module_imports:
            base = self.module_imports[head]
        elif head in self.imports and self.imports[head][0] == 0:
            _dots, source, original = self.imports[head]
            base = f"{source}.{original}" if source else original
        else:
            return ""
        return f"{base}.{rest}" if rest else base

    def helper_library(self, name: str) -> str | None:
        """The library a framework registration helper (declared.FRAMEWORK_HELPERS), called as
        `name` in this file, registers into; None when `name` resolves to none of them."""
        found = self.find_function(name) if name else None
        if found is None or found[0].path is None:
            return None
        entry = declared.FRAMEWORK_HELPERS.get(found[1])
        path = found[0].path.as_posix()
        for suffix in entry[0] if entry is not None else ():
            if path.endswith("/" + suffix):
                return entry[1] or suffix.split("/")[0]  # type: ignore[index]
        return None

    def call_summary(self, func: cst.FunctionDef, call: cst.Call) -> Summary:
        """The summary of free function `func` for this call: where the call fixes a flag
        parameter to a literal (`fused_experts(x, w, inplace=False)`, or its literal default), the
        body's `if inplace:` branches that cannot run are left out (a keyword convention read
        from the body: what the flag selects is what the call does)."""
        if id(func) not in self._flag_params:  # once per function: every call of it asks
            self._flag_params[id(func)] = flag_params(func)
        wanted = self._flag_params[id(func)]
        flags = flag_literals(func, call, wanted) if wanted else {}
        if not flags:
            return self.function_summary(None, func)
        key = (id(func), tuple(sorted(flags.items())))
        if key not in self._specialized:
            body = func.body.visit(_FlagBranches(flags))
            self._specialized[key] = func.with_changes(body=body) if isinstance(body, cst.BaseSuite) else func
        return self.function_summary(None, self._specialized[key])

    def _decorator_declaration(self, func: cst.FunctionDef) -> declared.Declaration | None:
        """What a registering decorator of `func` declares (`@torch.library.custom_op(...,
        mutates_args=...)`, SGLang's `@register_custom_op(...)`), when every other decorator is
        transparent; None when it has no such decorator."""
        for d in func.decorators:
            call = d.decorator if isinstance(d.decorator, cst.Call) else None
            name = dotted_name(call.func if call is not None else d.decorator) or ""
            keywords = {a.keyword.value: a.value for a in (call.args if call else ()) if a.keyword is not None}
            if call is not None and self.qualified(name) in declared.TORCH_CUSTOM_OP:
                first = positional(call)
                label = f"@{name}({_short(first[0]) if first else ''})"
                schema = keywords.get("schema")
                if isinstance(schema, cst.SimpleString) and isinstance(schema.evaluated_value, str):
                    decl = declared.from_schema(label, f"op{schema.evaluated_value}")[1]
                elif schema is not None:
                    decl = declared.Declaration(label=label, why="its schema is not a literal")
                elif "mutates_args" not in keywords:
                    decl = declared.Declaration(label=label, why="mutates_args is not given")
                else:
                    names, why = declared.literal_names(keywords["mutates_args"])
                    decl = declared.from_mutates(label, func, names, why, helper=False)
            elif (
                name.split(".")[-1] == "register_custom_op"
                and not (call is not None and positional(call))
                and self.helper_library(name) is not None
            ):
                names, why = declared.literal_names(keywords.get("mutates_args"))
                decl = declared.from_mutates(f"@{name}", func, names, why, helper=True)
            else:
                continue
            # another decorator msrewrite does not see through may wrap the op: the call runs that
            if any(opaque_decorator(func.with_changes(decorators=[o])) for o in func.decorators if o is not d):
                return None
            return decl
        return None

    def _declared_summary(self, func: cst.FunctionDef, decl: declared.Declaration) -> Summary:
        """The summary of a free function registered as an op: it writes what its declaration
        says (and what its body is seen to write); the result is new, or may alias what it
        writes (decl.returns). Its body's collectives, RNG and stream work count, and the callees
        in it not seen into are its `unseen_work`."""
        params, vararg, kwarg = _signature(None, func)
        every = [*params, *(n for n in (vararg, kwarg) if n)]
        if not decl.why and not decl.writes <= set(every):
            decl.why = "its schema names parameters the function does not have"
        if decl.why:
            why = f"{func.name.value} ({decl.label}: {decl.why}; not visible to msrewrite)"
            return Summary(
                params=params,
                vararg=vararg,
                kwarg=kwarg,
                may_write={p: [why] for p in every},
                returns=set(every),
                holds=_all_pairs(every),
                unknown={why},
            )
        body = self._body_summary(None, func)
        label = f"{func.name.value} ({decl.label}, declared)"
        return Summary(
            params=params,
            vararg=vararg,
            kwarg=kwarg,
            writes=set(decl.writes) | body.writes,
            returns=set(decl.returns),
            state_writes=set(body.state_writes),
            collective=body.collective,
            rng=body.rng,
            stream=body.stream,
            barrier=body.barrier,
            unseen_work={f"{label} -> {u}" for u in body.unknown | body.unseen_work},
        )

    def _declared_call(self, call: cst.Call) -> CallEffect | None:
        """`torch.ops.ns.op(...)` (also through `from torch import ops`), or a name bound at module
        level to `custom_op(...)(impl)`: the op's declared effect; None for any other call."""
        func = call.func
        if isinstance(func, cst.Name) and func.value in self.registered_ops:
            return _apply(self.function_summary(None, self.registered_ops[func.value]), call, func.value)
        qualified = self.qualified(dotted_name(func) or "")
        return self._torch_op(call, qualified) if qualified.startswith("torch.ops.") else None

    def _torch_op(self, call: cst.Call, named: str) -> CallEffect:
        """`torch.ops.ns.op(...)` / `torch.ops.ns.op.default(...)`: what the op's registration
        declares (declared.py), found in this file and in the tree of the package named `ns`;
        an op registered nowhere msrewrite looked, or in two places that disagree, stays unknown."""
        parts = named.split(".")[2:]
        if len(parts) == 3 and parts[2] == "default":
            parts = parts[:2]
        if self._vouched(named, parts[-1] if parts else named):
            return _vouched_effect(call)
        if len(parts) != 2:
            return _unknown(call, f"{named} (not visible to msrewrite: an overload msrewrite does not read)")
        decl, why = self._op_declaration(*parts)
        if decl is None and why.startswith("no registration of "):
            # registered in C++ (torch_npu, sgl-kernel, vLLM's _C): what the catalogue says
            head = (dotted_name(call.func) or "").split(".")[0]
            found = None if head in self.bound_names() else _catalogued(call, named, f"torch.ops.{parts[0]}.{parts[1]}")
            if found is not None:
                return found
        if decl is None:
            return _unknown(call, f"{named} (not visible to msrewrite: {why})")
        summary = Summary(
            params=[*decl.params, *decl.kwonly],
            writes=set(decl.writes),
            returns=set(decl.returns),
            collective=decl.collective,
            rng=decl.rng,
            stream=decl.stream,
            barrier=decl.barrier,
            unseen_work={f"{named} ({decl.label}, declared) -> {u}" for u in sorted(decl.unseen_work)},
        )
        return _apply(summary, call, named)

    def bound_names(self) -> frozenset[str]:
        """Names the file binds anywhere other than by an import (an assignment, a parameter, a
        loop or `with` target, a def): such a name may not be the module it imports, so a
        catalogue answer for `name.f(...)` is not taken (the call stays unknown)."""
        if self._bound is None:
            if self._tree.body or self.path is None:
                self._bound = frozenset(_bound_besides_imports(self._tree))
            else:  # a package's module, read as an index: what the index counted
                index = packages.index_file(self.path)
                self._bound = index.bound_besides_imports if index is not None else _EVERY_NAME
        return self._bound

    def _op_declaration(self, ns: str, op: str) -> tuple[declared.Declaration | None, str]:
        """(the one declaration of op `ns::op`, "") or (None, why there is none to trust).
        Searched: this file, and the tree of the package named `ns` (the folder of that name
        above this file, else the one the package roots give): where a framework registers its
        own ops (`torch.ops.vllm.*` in vllm/, `torch.ops.sglang.*` in sglang/). Every
        registration found there must agree; one in a library msrewrite cannot name, or through
        a helper it does not know, may be this op too and keeps it unknown."""
        key = (ns, op, self.path)
        cache = self._reading.ops
        if key in cache:
            return cache[key]
        roots: list[Path] = [self.path.resolve()] if self.path is not None else []
        enclosing = packages.enclosing_root(self.path, ns)
        if enclosing is not None:
            roots.append(enclosing / ns)
        else:
            init = packages.module_file(ns, near=self.path) if self.path is not None else None
            if init is not None and init.name == "__init__.py":
                roots.append(init.parent)
        sites: dict[tuple[Path, int], declared.Site] = {}
        for root in roots:
            found, incomplete = declared.registrations(root, op)
            if incomplete:
                cache[key] = (None, f"the search for its registration stopped: {incomplete}")
                return cache[key]
            for site in found:
                if site.namespace in (ns, "", "?"):
                    sites.setdefault((site.file, site.line), site)
        decls = [d for d in (self._site_declaration(s, ns) for s in sites.values()) if d is not None]
        searched = " and ".join(str(r) for r in roots) or "no file"
        if not decls:
            cache[key] = (None, f"no registration of {ns}::{op} found in {searched}")
        elif any(d.why for d in decls):
            bad = next(d for d in decls if d.why)
            cache[key] = (None, f"{bad.label} at {bad.where}: {bad.why}")
        elif len({d.key() for d in decls}) > 1:
            wheres = ", ".join(d.where for d in decls)
            cache[key] = (None, f"{ns}::{op} is registered with different declarations ({wheres})")
        else:
            one = decls[0]
            for other in decls[1:]:
                one.collective |= other.collective
                one.rng |= other.rng
                one.stream |= other.stream
                one.barrier |= other.barrier
                one.unseen_work |= other.unseen_work
            cache[key] = (one, "")
        return cache[key]

    def _site_declaration(self, site: declared.Site, ns: str) -> declared.Declaration | None:
        """What one registration found by the search declares (`why` set when it cannot be
        read exactly); None when it registers into another library than `ns`."""
        mine = self.path is not None and site.file == self.path.resolve()
        module = self if mine else self._read(site.file, package=True)
        named = f"{site.namespace}::{site.op}" if site.namespace not in ("", "?") else site.op
        label = f"{site.helper}({named})"
        if module is None:
            decl = declared.Declaration(label=label, why="its registering file is past the reading bounds")
        elif site.kind in ("schema", "library"):
            decl = _schema_site(module, site, label)
        else:
            found = module.find_function(site.op_func) if site.op_func else None
            func = found[0].functions[found[1]] if found is not None else None
            if site.kind == "custom_op":
                decl = _custom_op_site(module, site, label, func)
            else:
                library = module.helper_library(site.helper)
                if library is not None and site.namespace == "?" and library != ns:
                    return None
                decl = _helper_site(site, label, func, library)
            if func is not None and found is not None and not decl.why:
                # what the implementing function does besides its declared writes
                body = found[0].function_summary(None, func)
                decl.collective, decl.rng, decl.stream, decl.barrier = (
                    body.collective,
                    body.rng,
                    body.stream,
                    body.barrier,
                )
                decl.unseen_work = {f"{func.name.value} -> {u}" for u in body.unknown} | body.unseen_work
        decl.where = f"{site.file.name}:{site.line}"
        return decl

    def _other_platform_blocks(self, func: cst.FunctionDef) -> frozenset[int]:
        """Ids of `func`'s blocks that never run on the platform of the edit's mode (none when the
        analysis is not for one mode)."""
        mode = self._reading.mode
        if mode is None:
            return frozenset()
        if self._platform_names is None:  # the user's file (a read module has its index's)
            self._platform_names = packages.module_platform_names(self._code())
        blocks = other_platform_blocks(func, mode, self._platform_names)
        if blocks:
            self._reading.skipped_tests |= platform_tests(func, blocks)
        return frozenset(id(block) for block in blocks)

    def skipped_platform_code(self) -> list[str]:
        """For the trust boundary: where code under another platform's test was not read."""
        return sorted(self._reading.skipped_tests)

    def _body_summary(self, cls: str | None, func: cst.FunctionDef) -> Summary:
        """Summary of `func`'s own body (function_summary without its decorators)."""
        # keyed by the class `self` is (an inherited forward sees the subclass's submodules)
        key = (cls or "", func.name.value, id(func))
        if key in self._cache:
            return self._cache[key]
        params, vararg, kwarg = _signature(cls, func)
        summary = Summary(params=params, vararg=vararg, kwarg=kwarg)
        # A recursive call sees an unknown callee until the summary is done.
        self._cache[key] = Summary(
            params=params,
            vararg=vararg,
            kwarg=kwarg,
            may_write={p: [f"{func.name.value} (recursive)"] for p in params},
            unknown={f"{func.name.value} (recursive)"},
        )
        body = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else [func.body]
        scope = self.scope_for(cls)
        scope.local_names = function_locals(func)
        scope.note_body([s for s in body if isinstance(s, cst.BaseStatement)])
        skip = self._other_platform_blocks(func)
        facts = [node_facts(stmt, scope, skip=skip) for stmt in body]
        for index, item in enumerate(facts):
            item.index = index
        open_ops = extend_pending(facts)
        not_tensors = frozenset((*self.module_imports, *self.imports, *self.classes, *self.functions))
        summary.state_writes = _state_writes(facts, func, self._scalar_attrs(cls), not_tensors)
        summary.rebinds = _rebinds(facts, func) if cls is not None else set()
        if self.package and any(f.unknown_callees for f in facts):
            # a package's function with an unseen call may write every argument (_apply, strict);
            # every unseen call of it is named, so that one refusal lists all a reviewer must vouch for
            unseen = sorted(set().union(*(f.unknown_callees for f in facts)))
            every = [*params, *(n for n in (vararg, kwarg) if n)]
            summary.may_write = {p: unseen[:MAX_WRITERS] for p in every}
            summary.returns = set(every)
            summary.holds = _all_pairs(every)
            summary.unknown = set(unseen)
            _note_kinds(summary, facts)  # the collectives, RNG and stream work it was seen to do still count
            self._cache[key] = summary
            return summary
        _param_effects(summary, facts, [*params, *(n for n in (vararg, kwarg) if n)], scope)
        if open_ops:
            storage = Storage(facts, [*params, *(n for n in (vararg, kwarg) if n)])
            for op in open_ops:
                for names, into in ((op.writes, summary.pending_writes), (op.reads, summary.pending_reads)):
                    for name in names:
                        into |= {t[1] for i in range(len(facts) + 1) for t in storage.held(name, i) if t[0] == "param"}
        for f in facts:
            summary.unknown |= f.unknown_callees
        _note_kinds(summary, facts)
        self._cache[key] = summary
        return summary

    def _scalar_attrs(self, cls: str | None) -> frozenset[str]:
        """Attributes `__init__` sets only to number, string, bool or None literals."""
        if cls is None:
            return frozenset()
        literal = (cst.Integer, cst.Float, cst.SimpleString)
        return frozenset(
            name
            for name, values in self.attribute_values(cls).items()
            if values
            and all(
                isinstance(v, literal) or (isinstance(v, cst.Name) and v.value in ("None", "True", "False"))
                for v in values
            )
        )

    def scope_for(self, cls: str | None, function: str | None = None) -> Scope:
        """A scope whose resolver looks calls up in this file, from inside class `cls` (or a free
        function; one assigned as `Cls.forward = function` sees `self` as that class)."""
        owner: tuple[ModuleSummaries, str] | None = (self, cls) if cls is not None else None
        if owner is None and function in self.patched:
            owner = self.find_class(self.patched[function])
        values = owner[0].attribute_values(owner[1]) if owner is not None else {}
        attrs = frozenset(values) if owner is not None else None
        own = frozenset(
            name
            for name, found in values.items()
            if found and all(isinstance(v, cst.Call) and (dotted_name(v.func) or "").startswith("_ms_") for v in found)
        )
        node = None
        if function is not None:
            found = self._method(cls, function) if cls is not None else None
            node = found[1] if found is not None else (self.functions.get(function) if cls is None else None)
        return Scope(
            resolver=lambda call, scope: self.resolve(call, scope, owner),
            receivers=object_parameters(node) if node is not None else {},
            local_names=function_locals(node) if node is not None else frozenset(),
            state_attrs=attrs,
            own_stream_attrs=own,
            module_names=frozenset((*self.module_imports, *self.classes, *self.functions)),
            properties=owner[0].properties(owner[1]) if owner is not None else frozenset(),
            method_reads=(lambda name: owner[0].method_state_reads(owner[1], name)) if owner is not None else None,
        )

    def method_state_reads(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> frozenset[str] | None:
        """The `self.<chain>`s `self.<name>(...)` may read, from the bodies of its definition in
        `cls` (or a same-file base), of every same-file subclass's override, and of the same-file
        methods they call; None when a definition is not in this file, `self` is handed on or used
        bare, or a @property is read: then it may read any of the object's state."""
        key = (cls, name)
        cache = self._method_reads
        if key in cache:
            return cache[key]
        if name in seen:
            return frozenset()  # a recursive call adds nothing the outer one does not read
        found = self._method(cls, name)
        if found is None:
            cache[key] = None
            return None
        defs = [found[1]]
        for sub in self.subclasses(cls):
            node = self.classes.get(sub)
            override = (
                last_def(node.body.body, name)
                if node is not None and isinstance(node.body, cst.IndentedBlock)
                else None
            )
            if override is not None:
                defs.append(override)
        reads: set[str] = set()
        for func in defs:
            body = _self_chains(func)
            if body is None:
                cache[key] = None
                return None
            chains, calls = body
            if any(chain.split(".")[1] in self.properties(cls) for chain in chains):
                cache[key] = None
                return None
            reads |= chains
            for callee in calls - set(self.attribute_values(cls)):  # submodules: their chain is read
                inner = self.method_state_reads(cls, callee, seen | {name})
                if inner is None:
                    cache[key] = None
                    return None
                reads |= inner
        cache[key] = frozenset(reads)
        return cache[key]

    def properties(self, cls: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
        """Names class `cls` and its same-file bases define as a @property (or cached_property)."""
        node = self.classes.get(cls)
        if node is None or cls in seen:
            return frozenset()
        found = {
            stmt.name.value
            for stmt in node.body.body
            if isinstance(stmt, cst.FunctionDef) and _decorator_names(stmt) & PROPERTY_DECORATORS
        }
        for base in self._bases(cls):
            if base in self.classes:
                found |= self.properties(base, seen | {cls})
        return frozenset(found)

    # resolution ----------------------------------------------------------------------------
    def _vouched(self, *names: str) -> bool:
        hit = [n for n in names if n and n in self.assume_pure]
        self.assumed.update(hit)
        return bool(hit)

    def resolve(self, call: cst.Call, scope: Scope, owner: tuple[ModuleSummaries, str] | None) -> CallEffect:
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in _MAPPING_READS and _accessor_call(func.value, scope):
            return CallEffect(returns=[func.value])  # self.state_dict().items(): the dict's own views
        cls = owner[1] if owner is not None and owner[0] is self else None
        # self.helper(...) / self.sub(...) / self.experts[i](...)
        path = _self_path(func)
        if path is None and isinstance(func, cst.Name) and func.value in scope.modules:
            path = scope.modules[func.value][len("self.") :]
        if path is not None and owner is not None:
            return owner[0]._resolve_self(call, owner[1], path)
        # a local or parameter of that name first, then an op the file declares
        known = self._local_call(call, scope) or self._declared_call(call)
        if known is not None:
            return known
        if isinstance(func, cst.Name):
            own = self._resolve_own_name(call, func.value)
            if own is not None:
                return own
        named = dotted_name(func)
        if named and named.split(".")[0] in (*self.imports, *self.module_imports) and named not in scope.modules:
            imported = self._resolve_imported(call, named)
            if imported is not None:
                return imported
            # a native function (no Python source found) or a standard-library one, by the name
            # the file's imports give it: what the catalogue says
            qualified = self.qualified(named) if named.split(".")[0] not in self.bound_names() else ""
            found = _catalogued(call, named, qualified) if qualified else None
            if found is not None:
                return found
        on_attribute = self._resolve_attribute(call, func, scope, cls) if isinstance(func, cst.Attribute) else None
        if on_attribute is not None:
            return on_attribute
        callee = dotted_name(func) or _short(func)
        if self._vouched(callee, callee.split(".")[-1]):
            return _vouched_effect(call)
        return _unknown(call, f"{callee} (not visible to msrewrite)")

    def _resolve_attribute(
        self, call: cst.Call, func: cst.Attribute, scope: Scope, cls: str | None
    ) -> CallEffect | None:
        """`super().m(...)`, a read of a container global (`CONFIGS.get(key)`), or `Cls.m(...)`
        for a class-level method; None for any other call."""
        if isinstance(func.value, cst.Call):
            if dotted_name(func.value.func) == "super":
                return self._resolve_super(call, func.attr.value, cls) if cls is not None else None
            # get_backend().is_fast(): by the classes get_backend declares it returns (a name
            # the reviewer vouched for, as written or by its method, stays theirs)
            if self._vouched(_short(func), func.attr.value):
                return _vouched_effect(call)
            return dispatch.call_on_returned(self, call, _short(func.value), _union, _unknown)
        if not isinstance(func.value, cst.Name):
            return None
        if func.attr.value in _CONTAINER_READS and func.value.value in self.container_globals():
            return CallEffect(returns=[func.value])  # CONFIGS.get(key): a stored value, nothing written
        if func.value.value in scope.local_names:
            return None
        return self._class_level_call(call, func.value, func.attr.value)

    def _class_level_call(self, call: cst.Call, receiver: cst.Name, method: str) -> CallEffect | None:
        """`Cls.method(...)` for a @classmethod or @staticmethod of a class msrewrite reads (this
        file's, or imported; `_DpGatheredBufferWrapper.is_dp_max_padding()`): its body, read as a
        free function; a classmethod's `cls` is the class object, so what the body does to `cls`
        (`cls.flag = v`, `cls.other()`) is done to that object. None for any other call (an
        instance method called on the class, a method patched in this file, a class not read)."""
        if receiver.value in self.imports and receiver.value in self.bound_names():
            return None  # bound here too: it may not be the class imported
        found = self.find_class(receiver.value)
        if found is None or (found[1], method) in found[0].patches:
            return None
        hit = found[0]._inherited(found[1], method)
        if hit is None:
            return None
        owner, cls, func = hit
        kinds = _decorator_names(func) & {"classmethod", "staticmethod"}
        if len(kinds) != 1 or opaque_decorator(func) is not None:
            return None
        label = f"{receiver.value}.{method}"
        if self._vouched(label, method):
            return _vouched_effect(call)
        if kinds == {"classmethod"}:  # the class object is the first argument
            call = call.with_changes(args=[cst.Arg(receiver), *call.args])
        elif func.params.params and func.params.params[0].name.value in ("self", "cls"):
            return None  # read as a method elsewhere (_signature): not taken here
        return _apply(owner.function_summary(None, func), call, f"{label} ({cls})", strict=owner.package)

    def _local_call(self, call: cst.Call, scope: Scope) -> CallEffect | None:
        """A call of a parameter or local of the function (`def forward(self, x, scale=None):
        scale(x)`): whatever the caller passed, never the module's function or import of the same
        name; None for any other call."""
        named = dotted_name(call.func) or ""
        head = named.split(".")[0]
        if not head or head == "self" or head not in scope.local_names:
            return None
        if self._vouched(named, named.split(".")[-1]):
            return _vouched_effect(call)
        module_level = (*self.functions, *self.classes, *self.imports, *self.module_imports, *self.registered_ops)
        if head in module_level:  # say why the module's own `head` was not read
            return _unknown(call, f"{named} (a local or parameter `{head}` of the function: not visible to msrewrite)")
        return _unknown(call, f"{named} (not visible to msrewrite)")

    def _resolve_own_name(self, call: cst.Call, name: str) -> CallEffect | None:
        """`name(...)` for a function this file defines, or a class it can find; None otherwise."""
        if name in self.functions:
            if self._vouched(name):
                return _vouched_effect(call)
            return _apply(self.call_summary(self.functions[name], call), call, name, strict=self.package)
        if self.find_class(name) is not None:
            return CallEffect()  # constructing a module does not touch tensors
        return None

    def _resolve_imported(self, call: cst.Call, named: str) -> CallEffect | None:
        """An imported function or class, read from its module's source (never imported); None
        when neither is found there."""
        if self._vouched(named, named.split(".")[-1]):
            return _vouched_effect(call)
        found = self.find_function(named)
        if found is not None:
            owner_module, fname = found
            return _apply(
                owner_module.call_summary(owner_module.functions[fname], call),
                call,
                named,
                strict=owner_module.package,
            )
        found_cls = self.find_class(named)
        if found_cls is not None:
            return found_cls[0]._construct(call, found_cls[1], named)
        return None

    def _resolve_super(self, call: cst.Call, attr: str, cls: str) -> CallEffect | None:
        """`super().<attr>(...)` inside class `cls`: the first base that defines it; None when
        no base msrewrite can read does."""
        for base in self._bases(cls):
            found = self._method(base, attr)
            if found is not None:
                return _apply(self.function_summary(cls, found[1]), call, f"super().{attr}", receiver=_SELF)
            if base not in self.classes and (where := self.find_class(base)) is not None:
                hit = where[0]._inherited(where[1], attr)
                if hit is not None:
                    label = f"super().{attr}"
                    clash = self._overridden(cls, hit[0], hit[1])
                    if clash is not None:
                        return _unknown(
                            call,
                            f"{label} ({hit[1]}.{attr} uses self.{clash}, which {cls} overrides; not visible to msrewrite)",
                        )
                    return _apply(
                        hit[0].function_summary(hit[1], hit[2]), call, f"{label} ({hit[1]})", hit[0].package, _SELF
                    )
        return None

    def _construct(self, call: cst.Call, cls: str, label: str) -> CallEffect:
        """`Cls(args)` for an imported class: what its `__init__` does to the arguments (a
        dataclass or NamedTuple has none of its own); the object may hold them."""
        args = [a.value for a in call.args]
        init = self._inherited(cls, "__init__")
        if init is None:
            if self._external_bases(cls) and not _is_record(self.classes[cls]):
                return _unknown(call, f"{label} ({self._external_bases(cls)[0]}.__init__, not visible to msrewrite)")
            return CallEffect(returns=args)
        owner, base, method = init
        effect = _apply(owner.function_summary(base, method), call, f"{label}.__init__", strict=owner.package)
        effect.returns = args
        return effect

    def _resolve_self(self, call: cst.Call, cls: str, path: str) -> CallEffect:
        head, _, rest = path.partition(".")
        element = head.endswith("[]")
        head = head.removesuffix("[]")
        label = f"self.{path.replace('[]', '')}"
        # the object the method runs on, as the caller names it (`self`, `self.shared_experts`
        # for a method reached through a submodule of a class msrewrite reads)
        receiver = call.func.value if isinstance(call.func, cst.Attribute) and not rest else _SELF
        if not element:
            method = self._method(cls, head)
            if method is not None and not rest:
                if self._vouched(head, f"self.{head}"):
                    return _vouched_effect(call)
                own = _apply(self.function_summary(cls, method[1]), call, f"self.{head}", self.package, receiver)
                # `self` may be of a subclass that overrides the method, or the method patched
                return _union(
                    [own, *self._dispatch_effects(call, cls, head, f"self.{head}", subclasses=True, receiver=receiver)]
                )
            if (
                method is None
                and not rest
                and head in STATE_ACCESSORS | STATE_WRITERS
                and not self.attribute_values(cls).get(head)
                and self.is_module_class(cls)
            ):
                return state_accessor_effect(call, receiver)
        if self._vouched(head, label):
            return _vouched_effect(call)
        values = list(self.attribute_values(cls).get(head) or [])
        for sub in self.subclasses(cls):  # a subclass's __init__ may put another module there
            values += [v for v in self.attribute_values(sub).get(head, []) if not any(v is w for w in values)]
        inherited_stores = self._external_stores(cls, head)  # what a base in another module puts there
        hooks = self._hooks(cls, head) if (values or inherited_stores) and not rest else []
        hooks += [h for m, base, _ in inherited_stores if not rest for h in m._hooks(base, head)]
        if hooks:
            return _unknown(call, f"{label} (a hook runs in its call, {hooks[0]}; not visible to msrewrite)")
        if inherited_stores:
            effects = [self._inherited_store_call(call, cls, head, label, element, rest, *s) for s in inherited_stores]
            if values:
                effects.append(self._resolve_stored(call, cls, head, label, element, rest, values))
            return _union(effects)
        if not values and not element and not rest:
            inherited = self._inherited_effect(call, cls, head, label)
            if inherited is not None:
                return inherited
        if not values:
            extra = self._external_bases(cls)
            where = f"{extra[0]}" if extra else "not assigned in __init__"
            return _unknown(call, f"{label} ({where}, not visible to msrewrite)")
        return self._resolve_stored(call, cls, head, label, element, rest, values)

    def _resolve_stored(
        self,
        call: cst.Call,
        cls: str,
        head: str,
        label: str,
        element: bool,
        rest: str,
        values: list[cst.BaseExpression],
    ) -> CallEffect:
        """Calling what `self.<head>` holds, when the methods of `cls` (and its same-file bases and
        subclasses) store `values` there."""
        added = self.element_values(cls, head)  # `self.layers.append(X())`, `self.routers[k] = X()`
        effects = []
        for value in self._through_self_aliases(cls, values):
            effect = self._module_value(call, value, label, element, rest, added, cls, head)
            if effect is not None:
                effects.append(effect)
        if not effects and rest:
            # `self.input_ready = None` in __init__, `self.input_ready.wait()` in forward: None has
            # no methods, so the object is set elsewhere (by a caller, at run time)
            return _unknown(call, f"{label} (None in __init__, set elsewhere; not visible to msrewrite)")
        return _union(effects) if effects else CallEffect()

    def _external_stores(
        self, cls: str, attr: str, seen: frozenset = frozenset()
    ) -> list[tuple[ModuleSummaries, str, list[cst.BaseExpression]]]:
        """(module, base, values) for each base of `cls` in another module (through same-file
        bases, and those bases' own) whose methods store `self.<attr>`: `Base.__init__` sets it
        before the subclass's `__init__` may set it again on some path only, so a call of it may
        run either."""
        out: list[tuple[ModuleSummaries, str, list[cst.BaseExpression]]] = []
        for base in self._bases(cls):
            key = (id(self), base)
            if key in seen:
                continue
            if base in self.classes:
                out += self._external_stores(base, attr, seen | {key})
                continue
            where = self.find_class(base)
            if where is None or (id(where[0]), where[1]) in seen:
                continue  # not read (nn.Module, or past the bounds): as before, what it stores is not known
            module, name = where
            stored = module.attribute_values(name).get(attr)
            if stored:
                out.append((module, name, list(stored)))
            out += module._external_stores(name, attr, seen | {key, (id(module), name)})
        return out

    def _inherited_store_call(
        self,
        call: cst.Call,
        cls: str,
        head: str,
        label: str,
        element: bool,
        rest: str,
        module: ModuleSummaries,
        base: str,
        values: list[cst.BaseExpression],
    ) -> CallEffect:
        """Calling `self.<head>` of a `cls` instance as base `base` (of `module`) stores it. A value
        naming `self.<name>` that `cls` redefines is not what the base's own context would resolve."""
        effects: list[CallEffect] = []
        left: list[cst.BaseExpression] = []
        for value in values:  # a bound method of the object: looked up on `cls`, not on `base`
            found = self._dispatched(call, value, cls) if not element and not rest else None
            if found is not None:
                effects.append(found)
            else:
                left.append(value)
        if not left:
            return _union(effects)
        values = left
        mine = self._own_names(cls, module, base)
        for value in values:
            used = {n.attr.value for n in _self_attributes(value)}
            clash = sorted(used & mine)
            if clash:
                why = f"set by {base} from {_short(value)}, which uses self.{clash[0]}, which {cls} overrides"
                return _unknown(call, f"{label} ({why}; not visible to msrewrite)")
        stored = module._resolve_stored(call, base, head, f"{label} (as {base} sets it)", element, rest, values)
        return _union([*effects, stored])

    def _method_on(self, cls: str, name: str) -> tuple[ModuleSummaries, str, cst.FunctionDef] | None:
        """Method `name` as an instance of `cls` finds it: this file's classes first, then bases
        in other modules (the module and class that define it, the def)."""
        found = self._method(cls, name)
        return (self, found[0], found[1]) if found is not None else self._inherited(cls, name)

    def _dispatched(self, call: cst.Call, value: cst.BaseExpression, cls: str) -> CallEffect | None:
        """Calling `value` stored as a bound method of a `cls` instance: `self.forward_cuda`, or
        `self.dispatch_forward()` whose every return is one (SGLang's CustomOp picks
        `self._forward_method` per platform in its `__init__`). Each is looked up on `cls` (a
        subclass's override is what runs) and the call is the union of calling them. None for any
        other value, or when a method named there is not one `cls` has."""
        if isinstance(value, cst.Attribute) and _is_name(value.value, "self"):
            targets = [value.attr.value]
        elif (
            isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and _is_name(value.func.value, "self")
        ):
            found = self._method_on(cls, value.func.attr.value)
            returned = returned_values(found[2]) if found is not None and not found[2].decorators else None
            if not returned or not all(
                isinstance(r, cst.Attribute) and _is_name(r.value, "self") or _is_name(r, "None") for r in returned
            ):
                return None
            targets = [r.attr.value for r in returned if isinstance(r, cst.Attribute)]
        else:
            return None
        if not targets or any(self._method_on(cls, t) is None for t in targets):
            return None
        return _union(
            [
                self._resolve_self(call.with_changes(func=cst.Attribute(value=_SELF, attr=cst.Name(t))), cls, t)
                for t in targets
            ]
        )

    def _own_names(self, cls: str, module: ModuleSummaries, base: str, seen: frozenset = frozenset()) -> set[str]:
        """The methods and attributes `cls` and its bases below `base` (of `module`) define, in
        this module and the modules of bases in between: what `self.<name>` in `base` may mean
        instead of what `base`'s own context says."""
        key = (id(self), cls)
        if key in seen or (self is module and cls == base) or cls not in self.classes:
            return set()
        node = self.classes[cls]
        mine = set(self.attribute_values(cls))
        mine |= {s.name.value for s in node.body.body if isinstance(s, cst.FunctionDef)} - {"__init__"}
        for parent in self._bases(cls):
            where = (self, parent) if parent in self.classes else self.find_class(parent)
            if where is not None:
                mine |= where[0]._own_names(where[1], module, base, seen | {key})
        return mine

    def _through_self_aliases(self, cls: str, values: list[cst.BaseExpression]) -> list[cst.BaseExpression]:
        """`self.shared_mlp = self.shared_experts`: what the other attribute holds, followed until
        a value that is not another plain `self.<attr>` (an alias cycle is left as it is: unknown)."""
        attrs = self.attribute_values(cls)
        out: list[cst.BaseExpression] = []
        seen: set[str] = set()
        todo = list(values)
        while todo:
            value = todo.pop(0)
            name = dotted_name(value) if isinstance(value, cst.Attribute) else None
            if name and name.startswith("self.") and name.count(".") == 1 and attrs.get(name[5:]):
                if name not in seen:
                    seen.add(name)
                    todo.extend(attrs[name[5:]])
                continue
            out.append(value)
        return out

    def _module_value(
        self,
        call: cst.Call,
        value: cst.BaseExpression,
        label: str,
        element: bool,
        rest: str,
        added: list[cst.BaseExpression] | None = None,
        cls: str | None = None,
        attr: str | None = None,
    ) -> CallEffect | None:
        """Calling what `self.<attr>` holds when a method of `cls` sets it to `value` (with
        `element`, an element of it: `self.routers[k](x)`, where `added` are the values put into
        it later)."""
        if isinstance(value, cst.Name) and value.value == "None":
            return None
        if isinstance(value, cst.IfExp):
            home = self._stored_in.get(id(value))
            if home is not None:  # each branch is stored by the same method
                self._stored_in.setdefault(id(value.body), home)
                self._stored_in.setdefault(id(value.orelse), home)
            parts = [
                self._module_value(call, v, label, element, rest, None, cls, attr) for v in (value.body, value.orelse)
            ]
            return _union([p for p in parts if p is not None])
        if isinstance(value, cst.Subscript) and dotted_name(value.value) in ACTIVATION_TABLES:
            return CallEffect()  # ACT2FN["silu"]: a functional activation
        if not rest and not element and cls is not None:
            bound = self._bound_callable(call, value, cls, label)
            if bound is not None:
                return bound
        if isinstance(value, (cst.Attribute, cst.Name)) and not rest and not element:
            # self.act = F.silu / torch.relu: call it as the torch function
            known = torch_call_effect(call.with_changes(func=value))
            if known is not None:
                return known
            qualified = self.qualified(dotted_name(value) or "")
            if qualified.startswith("torch.ops."):  # self.op = torch.ops._C.silu_and_mul: that op
                return self._torch_op(call.with_changes(func=value), qualified)
        if rest in _CONTAINER_READS and not element and _container_display(value):
            return CallEffect(returns=[call.func.value])  # type: ignore[attr-defined]  # self.cache.get(k)
        if isinstance(value, cst.Call) and dotted_name(value.func) == UNSEEN_STORE:
            where = _short(value.args[0].value) if value.args else "a store"
            return _unknown(call, f"{label} (set through `{where}`, not visible to msrewrite)")
        if isinstance(value, cst.Call):
            if is_stream_object(value) and not element and rest in ORDERING_METHODS:
                return CallEffect(stream=True, barrier=True)  # self.comm_stream = torch.npu.Stream()
            return self._constructed_value(call, value, label, element, rest, added or [], cls, attr)
        declared_base = self._declared_base_call(call, value, label, element, rest, cls, attr)
        if declared_base is not None:
            return declared_base
        return _unknown(call, f"{label} (set from {_short(value)}, not visible to msrewrite)")

    def _declared_base_call(
        self,
        call: cst.Call,
        value: cst.BaseExpression,
        label: str,
        element: bool,
        rest: str,
        cls: str | None,
        attr: str | None,
    ) -> CallEffect | None:
        """Calling `self.<attr>` holding `value` of a class no source names, when its base is
        declared (an annotation): the union over the base's subclasses (analyze/dispatch.py)."""
        if element or cls is None or attr is None:
            return None
        home = self._stored_in.get(id(value))
        return dispatch.call_through_base(self, call, value, label, rest, cls, attr, home, _union, _unknown)

    def _locally_imported_class(self, name: str, home: cst.FunctionDef | None) -> tuple[ModuleSummaries, str] | None:
        """A class `home` imports inside its body (`from ..unquant import UnquantizedLinearMethod`
        in `__init__`, kept out of the module's import time), when that import is the only way
        `home` binds the name."""
        if home is None or "." in name or not name:
            return None
        imported = local_import(home, name)
        if imported is None:
            return None
        dots, source, original = imported
        other = self._module(dots, source)
        return other._find_def(original, "classes") if other is not None else None

    def _bound_callable(self, call: cst.Call, value: cst.BaseExpression, cls: str, label: str) -> CallEffect | None:
        """Calling `self.<attr>` bound to a method of the class (`self.down_proj_forward =
        self.forward_a8w8`) or to `functools.partial` of one or of a function msrewrite reads,
        whose bound arguments are constants or `self.<chain>`s (anything else may be a local of
        the binding method, which the call site cannot name). None: not such a value."""
        dispatched = self._dispatched(call, value, cls)
        if dispatched is not None:
            return dispatched
        args: list[cst.Arg] = []
        if isinstance(value, cst.Call) and self._is_partial(value.func):
            if not value.args or value.args[0].star or value.args[0].keyword is not None:
                return None
            bound = list(value.args[1:])
            if not all(_constant_or_self(a.value) and not a.star for a in bound):
                return _unknown(
                    call, f"{label} (set from {_short(value)}, which binds values msrewrite cannot name here)"
                )
            args, value = bound, value.args[0].value
        target = _self_path(value)
        if target is not None and "." not in target and not target.endswith("[]"):
            if self._method(cls, target) is None:
                return None
        elif not (isinstance(value, cst.Name) and value.value in self.functions) and not args:
            return None
        given = {a.keyword.value for a in call.args if a.keyword is not None}
        merged = [a for a in args if a.keyword is None] + [a for a in call.args if a.keyword is None]
        merged += [a for a in args if a.keyword is not None and a.keyword.value not in given]
        merged += [a for a in call.args if a.keyword is not None]
        through = call.with_changes(func=value, args=merged)
        if target is not None:
            return self._resolve_self(through, cls, target)
        return self.resolve(through, Scope(), (self, cls))

    def _is_partial(self, func: cst.BaseExpression) -> bool:
        named = dotted_name(func)
        if named == "partial":
            return self.imports.get("partial") == (0, "functools", "partial")
        return named is not None and named.endswith(".partial") and self.module_imports.get(named[:-8]) == "functools"

    def _constructed_value(
        self,
        call: cst.Call,
        value: cst.Call,
        label: str,
        element: bool,
        rest: str,
        added: list[cst.BaseExpression] | None = None,
        cls: str | None = None,
        attr: str | None = None,
    ) -> CallEffect:
        """Calling (or indexing, or a method of) `self.<attr>` set from a constructor call `value`;
        an element of a ModuleList / ModuleDict / Sequential is any of its items (those it is built
        from and the `added` ones): the union of what calling each does."""
        ctor = dotted_name(value.func) or ""
        leaf = ctor.split(".")[-1]
        if leaf in ACTIVATION_FACTORIES and leaf not in self.functions:
            return CallEffect()  # transformers' get_activation("silu"): an ACT2FN entry
        nn_module = ctor.rpartition(".")[0] in ("nn", "torch.nn") and not _makes_tensor(ctor)
        if rest in STATE_ACCESSORS | STATE_WRITERS and not element and nn_module:
            return state_accessor_effect(call, call.func.value)  # type: ignore[attr-defined]
        if leaf in ("ModuleList", "Sequential", "ModuleDict") and ctor.split(".")[0] in ("nn", "torch"):
            items = _container_items(value) + (added or [])
            if leaf == "Sequential" and not element and not rest:
                parts = [self._module_value(call, v, label, False, "") for v in items]
                return _union([p for p in parts if p is not None] or [CallEffect()])  # a None entry runs nothing
            if element and items:
                parts = [self._module_value(call, v, label, False, rest) for v in items]
                return _union([p for p in parts if p is not None])
            return _unknown(call, f"{label} ({leaf} of unseen modules, not visible to msrewrite)")
        if element:
            return _unknown(call, f"{label} (indexed {leaf}, not visible to msrewrite)")
        if rest and "." not in rest and _makes_tensor(ctor):
            # self.weight.float(), self.bias.squeeze(0): a tensor method on module state, looked up
            # on a stand-in receiver (the table knows tensor methods by name, not `self.` chains),
            # whose writes and aliases are then the state's own
            state = cst.Name(_STATE_RECEIVER)
            known = torch_call_effect(call.with_changes(func=cst.Attribute(value=state, attr=cst.Name(rest))))
            if known is not None:
                receiver = call.func.value if isinstance(call.func, cst.Attribute) else call.func
                known.writes = [receiver if _is_name(w, _STATE_RECEIVER) else w for w in known.writes]
                known.returns = [receiver if _is_name(r, _STATE_RECEIVER) else r for r in known.returns]
                return known
        if self._vouched(leaf, ctor):
            return _vouched_effect(call)
        nn_effect = nn_module_effect(value)
        if nn_effect is not None and not rest:
            return _apply_template(nn_effect, call)
        found = self.find_class(ctor) or self._locally_imported_class(ctor, self._stored_in.get(id(value)))
        if found is not None:
            return self._instance_call(call, found, label, ctor, rest)
        # a factory (`build_fused_moe(...)`), a class-valued local (`moe_cls(...)`) or helper
        # (`get_moe_impl_class(cfg)(...)`): calling any instance it can give
        targets = instance_targets(self, value, self._stored_in.get(id(value)))
        if targets:
            made = _short(value.func)
            return _union(
                [
                    where._instance_call(call, (where, name), label, f"{name} from {made}", rest)
                    for where, name in targets
                ]
            )
        declared_base = self._declared_base_call(call, value, label, element, rest, cls, attr)
        if declared_base is not None:
            return declared_base
        return _unknown(call, f"{label} ({ctor or _short(value.func)}, not visible to msrewrite)")

    def _instance_call(
        self, call: cst.Call, found: tuple[ModuleSummaries, str], label: str, ctor: str, rest: str
    ) -> CallEffect:
        """Calling an instance of a class msrewrite can read (`found`): its forward, or the
        method `rest` names on it."""
        owner, name = found
        swapped = owner.replacing_new(name)
        if swapped is not None:
            return _unknown(
                call, f"{label} ({ctor}: {swapped} may build an instance of another class; not visible to msrewrite)"
            )
        if rest:  # self.experts.dispatcher.dispatch(...): follow into the submodule's class
            return owner._resolve_self(call, name, rest)
        forward = owner._method(name, "forward")
        if forward is None:
            inherited = owner._inherited_effect(call, name, "forward", f"{label} ({ctor})")
            if inherited is not None:
                return inherited
            base = (owner._external_bases(name) or ["no forward"])[0]
            return _unknown(call, f"{label} ({ctor} from {base}, not visible to msrewrite)")
        own = _apply(owner.function_summary(name, forward[1]), call, f"{label} ({ctor})", owner.package, call.func)
        patched = owner._dispatch_effects(call, name, "forward", f"{label} ({ctor})", subclasses=False)
        return _union([own, *patched]) if patched else own


def _custom_op_site(
    module: ModuleSummaries, site: declared.Site, label: str, func: cst.FunctionDef | None
) -> declared.Declaration:
    """`@torch.library.custom_op("ns::op", mutates_args=...)` / `custom_op(...)(fn)` found by the search."""
    if module.qualified(site.helper) not in declared.TORCH_CUSTOM_OP:
        return declared.Declaration(label=label, why=f"{site.helper} is not torch.library.custom_op")
    if site.schema:
        return declared.from_schema(label, f"op{site.schema}")[1]
    if func is None:
        return declared.Declaration(label=label, why=f"its function {site.op_func or '?'} is not found")
    if not site.mutates_given:
        return declared.Declaration(label=label, why="mutates_args is not given")
    names, why = declared.ast_names(site.mutates, True)
    return declared.from_mutates(label, func, names, why, helper=False)


def _helper_site(
    site: declared.Site, label: str, func: cst.FunctionDef | None, library: str | None
) -> declared.Declaration:
    """A framework helper's registration (declared.FRAMEWORK_HELPERS) found by the search."""
    if library is None:
        return declared.Declaration(label=label, why=f"{site.helper} is no registration helper msrewrite knows")
    if site.namespace == "":
        return declared.Declaration(label=label, why="it registers into a library passed as target_lib")
    if func is None:
        return declared.Declaration(label=label, why=f"its function {site.op_func or '?'} is not found")
    names, why = declared.ast_names(site.mutates, site.mutates_given)
    return declared.from_mutates(label, func, names, why, helper=True)


def _schema_site(module: ModuleSummaries, site: declared.Site, label: str) -> declared.Declaration:
    """`torch.library.define("ns::op", "(...) -> ...")` or `<Library>.define("op(...) -> ...")`."""
    ctor = module.qualified(site.helper)
    if site.kind == "schema" and ctor not in declared.TORCH_DEFINE:
        return declared.Declaration(label=label, why=f"{site.helper} is not torch.library.define")
    if site.kind == "library" and ctor not in declared.TORCH_LIBRARY:
        return declared.Declaration(label=label, why="its library is not a torch.library.Library msrewrite can name")
    name, decl = declared.from_schema(label, site.schema)
    if not decl.why and name != site.op:
        decl.why = f"it defines the overload {name}, not the op itself"
    decl.unseen_work = {"its implementation, registered apart from the schema (not read)"}
    return decl


def flag_params(func: cst.FunctionDef) -> frozenset[str]:
    """Parameters of `func` its body tests (`if inplace:`) and never rebinds."""
    params = {p.name.value for p in (*func.params.posonly_params, *func.params.params, *func.params.kwonly_params)}
    tested = params & _tested_names(func)
    return frozenset(tested - _rebound_names(func)) if tested else frozenset()


def flag_literals(func: cst.FunctionDef, call: cst.Call, wanted: frozenset[str]) -> dict[str, bool]:
    """Of the parameters `wanted` (flag_params), those the call fixes to a literal truth value
    (`True`, `False`, `None`, an integer), passed or by their default. None when the call
    spreads `*args` / `**kwargs` (any of them may be set there)."""
    if any(a.star for a in call.args):
        return {}
    params = [*func.params.posonly_params, *func.params.params]
    named = {p.name.value: p for p in (*params, *func.params.kwonly_params)}
    values: dict[str, cst.BaseExpression | None] = {p: named[p].default for p in named}
    for param, given in zip(params, positional(call), strict=False):  # extra ones go to *args
        values[param.name.value] = given
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in values:
            values[arg.keyword.value] = arg.value
    flags: dict[str, bool] = {}
    for name, value in values.items():
        truth = _literal_truth(value) if name in wanted else None
        if truth is not None:
            flags[name] = truth
    return flags


def _literal_truth(node: cst.BaseExpression | None) -> bool | None:
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return node.value == "True"
    if isinstance(node, cst.Integer):
        return int(node.value, 0) != 0
    return None


def _tested_names(func: cst.FunctionDef) -> set[str]:
    """Names that are (part of) an `if` test in the body."""
    found: set[str] = set()

    class _Tests(Visitor):
        def visit_If(self, node: cst.If) -> None:
            found.update(n.value for n in _names_in(node.test))

    func.body.visit(_Tests())
    return found


def _names_in(node: cst.CSTNode) -> list[cst.Name]:
    out: list[cst.Name] = []

    class _Names(Visitor):
        def visit_Name(self, n: cst.Name) -> None:
            out.append(n)

    node.visit(_Names())
    return out


def _rebound_names(func: cst.FunctionDef) -> set[str]:
    """Names the body binds anywhere (assignment, loop, `with ... as`, walrus, `del`, an inner
    def, `global`/`nonlocal`): a flag bound there may not hold the call's value at its test."""
    found: set[str] = set()

    class _Binds(Visitor):
        def _targets(self, node: cst.CSTNode | None) -> None:
            if node is not None:
                found.update(n.value for n in _names_in(node))

        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            self._targets(node.target)

        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            self._targets(node.target)

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            self._targets(node.target)

        def visit_For(self, node: cst.For) -> None:
            self._targets(node.target)

        def visit_CompFor(self, node: cst.CompFor) -> None:
            self._targets(node.target)

        def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
            self._targets(node.target)

        def visit_AsName(self, node: cst.AsName) -> None:
            self._targets(node.name)

        def visit_Del(self, node: cst.Del) -> None:
            self._targets(node.target)

        def visit_Global(self, node: cst.Global) -> None:
            found.update(n.name.value for n in node.names)

        def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
            found.update(n.name.value for n in node.names)

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            found.add(node.name.value)

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            found.add(node.name.value)

    func.body.visit(_Binds())
    return found


class _EveryName(frozenset):
    """Holds every name (a file that does not parse may bind any)."""

    def __contains__(self, _name: object) -> bool:
        return True


_EVERY_NAME = _EveryName()


# names an annotation may use for a tensor parameter (`x: torch.Tensor`, `Optional[Tensor]`,
# `Tensor | None`): any other name in it (a class, int, Any, list) makes the parameter an object
_TENSOR_ANNOTATION_NAMES = frozenset({"torch", "Tensor", "None", "Optional", "Union", "typing"})


def object_parameters(func: cst.FunctionDef) -> dict[str, cst.BaseExpression]:
    """Parameters annotated with something other than a tensor (`acc: Acc`, `meta: Metadata`),
    each with its annotation: a method called on one is that object's method (Scope.receivers),
    never a tensor method by name. An unannotated parameter is read as a tensor."""
    found: dict[str, cst.BaseExpression] = {}
    params = func.params
    for param in (*params.posonly_params, *params.params, *params.kwonly_params):
        annotation = param.annotation.annotation if param.annotation is not None else None
        if annotation is None or param.name.value == "self":
            continue
        if isinstance(annotation, (cst.SimpleString, cst.ConcatenatedString)):
            text = annotation.evaluated_value if isinstance(annotation, cst.SimpleString) else None
            names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)) if isinstance(text, str) else {"?"}
        else:
            names = expression_loads(annotation) | {n.attr.value for n in _attributes(annotation)}
        if names - _TENSOR_ANNOTATION_NAMES:
            found[param.name.value] = annotation
    return found


def _attributes(node: cst.CSTNode) -> list[cst.Attribute]:
    found: list[cst.Attribute] = []

    class _Collect(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> None:
            found.append(node)

    node.visit(_Collect())
    return found


def function_locals(func: cst.FunctionDef) -> frozenset[str]:
    """Every name `func` binds, its parameters and its body at any depth (nested functions too:
    a name bound there is taken as local everywhere, which only makes more calls unknown), less
    its own name (a recursive call is of the module's function)."""
    binds = _NameBinds()
    func.params.visit(binds)
    func.body.visit(binds)
    return frozenset(binds.found)


def _bound_besides_imports(module: cst.Module) -> set[str]:
    """Every name `module` binds at any depth other than by an import statement."""
    binds = _NameBinds()
    module.visit(binds)
    return binds.found


class _NameBinds(Visitor):
    """The names a tree binds (see _bound_besides_imports), in `found`."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def _targets(self, node: cst.CSTNode | None) -> None:
        if node is not None:
            self.found.update(n.value for n in _names_in(node))

    def visit_Import(self, _node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, _node: cst.ImportFrom) -> bool:
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._targets(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._targets(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._targets(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._targets(node.target)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self._targets(node.target)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._targets(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:  # `with ... as n`, `except E as n`
        self._targets(node.name)

    def visit_Param(self, node: cst.Param) -> None:
        self.found.add(node.name.value)

    def visit_MatchAs(self, node: cst.MatchAs) -> None:
        if node.name is not None:
            self.found.add(node.name.value)

    def visit_MatchStar(self, node: cst.MatchStar) -> None:
        if node.name is not None:
            self.found.add(node.name.value)

    def visit_MatchMapping(self, node: cst.MatchMapping) -> None:
        if node.rest is not None:
            self.found.add(node.rest.value)

    def visit_Global(self, node: cst.Global) -> None:
        self.found.update(n.name.value for n in node.names)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.found.add(node.name.value)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.found.add(node.name.value)


def _test_truth(test: cst.BaseExpression, flags: dict[str, bool]) -> bool | None:
    """The value of an `if` test the flags decide: `flag`, `not flag`, and `a and b` / `a or b`
    whose left side decides it (`inplace and not disabled()` with inplace False); else None."""
    if isinstance(test, cst.Name) and test.value in flags:
        return flags[test.value]
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = _test_truth(test.expression, flags)
        return None if inner is None else not inner
    if isinstance(test, cst.BooleanOperation):
        left = _test_truth(test.left, flags)
        if isinstance(test.operator, cst.And) and left is False:
            return False
        if isinstance(test.operator, cst.Or) and left is True:
            return True
    return None


class _FlagBranches(cst.CSTTransformer):
    """A function body with the `if` statements its flags decide replaced by the branch that
    runs (an `elif` chain is left whole: only a decided `if` with a plain `else` or none goes)."""

    def __init__(self, flags: dict[str, bool]) -> None:
        super().__init__()
        self.flags = flags
        self.elifs: set[int] = set()

    def visit_If(self, node: cst.If) -> None:
        if isinstance(node.orelse, cst.If):
            self.elifs.add(id(node.orelse))

    def visit_FunctionDef(self, _node: cst.FunctionDef) -> bool:
        return False  # a nested function's parameters may shadow the flags

    def visit_Lambda(self, _node: cst.Lambda) -> bool:
        return False

    def visit_ClassDef(self, _node: cst.ClassDef) -> bool:
        return False

    def leave_If(self, original: cst.If, updated: cst.If):  # type: ignore[override]
        truth = _test_truth(updated.test, self.flags)
        if truth is None or id(original) in self.elifs or isinstance(updated.orelse, cst.If):
            return updated
        if truth:
            branch = updated.body
        elif updated.orelse is not None:
            branch = updated.orelse.body
        else:
            return cst.FlattenSentinel([cst.SimpleStatementLine([cst.Pass()])])
        if isinstance(branch, cst.SimpleStatementSuite):  # `if flag: x.add_(1)` on one line
            return cst.FlattenSentinel([cst.SimpleStatementLine(list(branch.body))])
        return cst.FlattenSentinel(list(branch.body))


# Decorators that leave what the function does to its arguments as its body says (they change
# grad mode, compilation, binding or documentation only); any other one wraps the body in code
# msrewrite does not follow. Matched on the decorator's last dotted name (`torch.no_grad()`).
TRANSPARENT_DECORATORS = frozenset(
    {
        "staticmethod",
        "classmethod",
        "property",
        "cached_property",
        "abstractmethod",
        "no_grad",
        "inference_mode",
        "enable_grad",
        "compile",  # torch.compile: the same code, compiled
        "disable",  # torch.compiler.disable / torch._dynamo.disable
        "ignore",  # torch.jit.ignore / unused / export
        "unused",
        "export",
        "overload",
        "override",
        "final",
    }
)
PROPERTY_DECORATORS = frozenset({"property", "cached_property"})


def _decorator_names(func: cst.FunctionDef) -> set[str]:
    return {
        (dotted_name(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator) or "?").split(".")[-1]
        for d in func.decorators
    }


def opaque_decorator(func: cst.FunctionDef) -> str | None:
    """The first decorator of `func` msrewrite does not see through (`@_double_input`,
    `@lru_cache`, a `@x.setter`), as written; None when every one is transparent."""
    for d in func.decorators:
        target = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
        name = dotted_name(target)
        if name is None or name.split(".")[-1] not in TRANSPARENT_DECORATORS:
            return name or _short(target)
    return None


def _note_kinds(summary: Summary, facts: list[StatementFacts]) -> None:
    """Whether the function holds collectives, RNG or stream work, from the statements it was seen to run."""
    for f in facts:
        summary.collective |= f.collective
        summary.rng |= f.rng
        summary.stream |= f.stream
        summary.barrier |= f.barrier
        summary.unseen_work |= f.unseen_work


def _signature(cls: str | None, func: cst.FunctionDef) -> tuple[list[str], str | None, str | None]:
    """(named parameters, without `self`/`cls` for a method; *args name; **kwargs name)."""
    params = [p.name.value for p in (*func.params.posonly_params, *func.params.params)]
    if cls is not None and params and params[0] in ("self", "cls"):
        params = params[1:]
    params += [p.name.value for p in func.params.kwonly_params]
    vararg = func.params.star_arg.name.value if isinstance(func.params.star_arg, cst.Param) else None
    kwarg = func.params.star_kwarg.name.value if func.params.star_kwarg is not None else None
    return params, vararg, kwarg


def _state_writes(
    facts: list[StatementFacts], func: cst.FunctionDef, scalars: frozenset[str], modules: frozenset[str]
) -> set[str]:
    """What `func` writes in place beyond its arguments: "self.<attr>" for its object's attributes
    (`self.last.copy_(y)`, through a local alias too), "self" for any of them (through
    `self.parameters()`, a classmethod's `cls`) and module-level names (`_BUF.mul_(2)`).
    `self.calls += 1` on an attribute `__init__` sets only to literals (`scalars`) rebinds a
    Python number on the host: no device memory is written.
    Through a local alias only what the alias was bound from counts: an attribute of `self`
    (`buf = self.last`), or a module-level name this module neither imports nor defines as a
    class or function (`modules`): a local an unseen call may have returned "its receiver"
    (`np.arange(n)`, `MMEncoderAttention.build(x)`, `self.helper()`) or a dict filled with
    results is not that module, class or object. A direct write (`self.x.mul_(2)`, an imported
    `BUF.mul_(2)`) always counts; a classmethod's own state only through `cls.<attr>` itself."""
    named, star = parameter_names(func.params)
    own = set(named) | star
    self_name = next(iter(p.name.value for p in (*func.params.posonly_params, *func.params.params)), None)
    local = (own - {self_name}) | {name for f in facts for name in f.stores}
    storage = Storage(facts, sorted(local))
    found: set[str] = set()

    def note(name: str, through_alias: bool) -> None:
        root = name.split(".")[0]
        if through_alias and (root in modules or root == self_name == "cls" or name == self_name != "self"):
            return
        if root == self_name == "self":
            found.add(".".join(name.split(".")[:2]))  # "self.last", or "self" through self.parameters()
        elif root == self_name == "cls":
            found.add("self")
        elif root not in local and root != self_name and root not in BUILTIN_NAMES:
            found.add(root)

    for f in facts:
        for name in f.mutates:
            if name.count(".") == 1 and name.split(".")[0] == self_name and name.split(".")[1] in scalars:
                continue
            note(name, False)
            for kind, *rest in storage.write_reach(f, name, f.index):
                if kind == "free":
                    note(rest[-1], True)
    return found


def _rebinds(facts: list[StatementFacts], func: cst.FunctionDef) -> set[str]:
    """The attributes of its object a method rebinds (`self.a = v`, `self.calls += 1`, or in a
    callee it runs on `self` or on one of its attributes), as paths below the object."""
    first = next(iter(p.name.value for p in (*func.params.posonly_params, *func.params.params)), None)
    prefix = f"{first}."
    return {path.removeprefix(prefix) for f in facts for path in f.rebinds if first and path.startswith(prefix)}


def _all_pairs(names: list[str]) -> set[tuple[str, str]]:
    """Every parameter may hold every other (a callee msrewrite cannot see into may store them)."""
    return {(p, q) for p in names for q in names if p != q}


def _param_effects(summary: Summary, facts: list[StatementFacts], names: list[str], scope: Scope) -> None:
    """Fills in which parameters (`names`) the body writes, may write, may return, which come to
    hold which (`buf[0] = x`: a caller's later write through its `buf` reaches its `x`), and the
    object's own state the result may alias."""
    returns: dict[int, set[str]] = {}  # statement -> names its return values may alias

    class _Returns(Visitor):
        def __init__(self, at: int) -> None:
            self.at = at

        def visit_Return(self, node: cst.Return) -> None:
            if node.value is not None:
                returns.setdefault(self.at, set()).update(alias_roots(node.value, scope))

        def visit_FunctionDef(self, _node: cst.FunctionDef) -> bool:
            return False

    for item in facts:
        item.node.visit(_Returns(item.index))
    storage = Storage(facts, names)
    for name in names:
        mine = frozenset({("param", name)})
        for f in facts:
            if storage.written(f, f.index, mine):
                summary.writes.add(name)
            hit = storage.maybe_written(f, f.index, mine)
            if hit:
                writers = unseen_writers(f, hit, scope)
                summary.may_write[name] = _merged(summary.may_write.get(name, []), writers)
            if returns.get(f.index) and any(storage._around(r, f.index) & mine for r in returns[f.index]):
                summary.returns.add(name)
    summary.returns_state = _returned_state(returns, storage)
    params = frozenset(names)
    for f in facts:
        for source, target in f.stored:  # a store into an object, not a rebinding
            held = {t[1] for t in storage._around(source, f.index) if t[0] == "param" and t[1] in params}
            if target.startswith("self."):
                holders = {"self"}
            else:
                holders = {t[1] for t in storage._around(target, f.index) if t[0] == "param" and t[1] in params}
            summary.holds |= {(p, q) for p in holders for q in held if p != q}


def _returned_state(returns: dict[int, set[str]], storage: Storage) -> set[str]:
    """The object's state ("self.<attr>", or "self" for all of it) the names returned at each
    statement may hold: `return self.scales[0]`, `v = self.get_buffer("b"); return v`."""
    found: set[str] = set()
    for at, roots in returns.items():
        for root in roots:
            for kind, *rest in storage._around(root, at):
                if kind == "free" and _is_state(rest[-1]):
                    found.add(".".join(rest[-1].split(".")[:2]))
    return found


def unseen_writers(f: StatementFacts, names: list[str], scope: Scope) -> list[str]:
    """Every unseen callee in statement `f` that may write one of `names` (names `f.may_write`
    holds), sorted, no repeats. `f.may_write` keeps one callee per name; the calls are looked at
    again here so that a refusal can name all of them at once."""
    wanted = set(names)
    found = {f.may_write[n] for n in names if n in f.may_write}

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            if isinstance(call.func, cst.Name) and call.func.value in scope.closures:
                found.update(why for n, why in scope.closures[call.func.value].may_write.items() if n in wanted)
            for written, why in scope.effect_of(call).may_writes:
                if alias_roots(written, scope) & wanted:
                    found.add(why)

        def visit_FunctionDef(self, _node: cst.FunctionDef) -> bool:
            return False

        def visit_Lambda(self, _node: cst.Lambda) -> bool:
            return False

    f.node.visit(_Calls())
    return sorted(found)


def _merged(old: list[str], new: list[str]) -> list[str]:
    """Two sorted lists of unseen callees as one (sorted, no repeats, at most MAX_WRITERS)."""
    return sorted(set(old) | set(new))[:MAX_WRITERS]


class _LazyDefinitions(dict):
    """A read module's classes or functions: the names from its `ast` index, each parsed with
    libcst on first use. One that does not parse on its own stands in as something msrewrite
    cannot see into (a class with an unseen base, a function calling an unseen callee)."""

    def __init__(self, index: packages.SourceIndex, names: set[str], kind: str) -> None:
        super().__init__()
        self._index, self._names, self._kind = index, names, kind

    def __contains__(self, name: object) -> bool:
        return name in self._names

    # every name the index has, parsed or not: `*module.classes` lists the names a module binds
    # (what is not a tensor there), not only those some summary has parsed so far
    def __iter__(self):
        return iter(sorted(self._names))

    def keys(self):  # type: ignore[override]
        return sorted(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(name)
        if not dict.__contains__(self, name):
            node = self._index.definition(name)
            wanted = cst.ClassDef if self._kind == "class" else cst.FunctionDef
            if not isinstance(node, wanted):
                stub = (
                    f"class {name}(_unreadable_source):\n    pass\n"
                    if self._kind == "class"
                    else f"def {name}(*args, **kwargs):\n    return _unreadable_source(*args, **kwargs)\n"
                )
                node = cst.parse_module(stub).body[0]
            dict.__setitem__(self, name, node)
        return dict.__getitem__(self, name)

    def get(self, name, default=None):
        return self[name] if name in self._names else default


class Storage:
    """Which storage each name may hold before each top-level statement, in program order.

    A storage token stands for one tensor object: a parameter's, or one a statement made fresh.
    A binding from an alias (`h = x.view(-1)`, `lst[0] = x`, `self.last = x`) hands on the source's
    tokens, so a later write through `h` is a write of x's object, while `x = x + 1` (fresh) leaves
    the old object behind: a write to the new x does not touch what was read before.
    """

    def __init__(self, facts: list[StatementFacts], params: list[str] | set[str]) -> None:
        state: dict[str, frozenset] = {p: frozenset({("param", p)}) for p in params}
        self.states: list[dict[str, frozenset]] = []
        for f in facts:
            self.states.append(state)
            whole = isinstance(f.node, cst.SimpleStatementLine)  # a compound statement binds on some paths only
            targets = {t for _, t in f.links}
            bound = f.stores | targets
            new = dict(state)
            for name in bound:
                kept = state.get(name, frozenset()) if not whole or name not in f.stores else frozenset()
                fresh = (
                    frozenset({("fresh", f.index, name)}) if name in f.stores and name not in targets else frozenset()
                )
                new[name] = kept | fresh
            changed = True
            while changed:  # links made in one statement can chain (a = x; b = a)
                changed = False
                for source, target in f.links:
                    tokens = state.get(source, frozenset({("free", source)}))
                    if source in bound and source != target:
                        tokens |= new.get(source, frozenset())
                    if not tokens <= new[target]:
                        new[target] = new[target] | tokens
                        changed = True
            state = new
        self.states.append(state)

    def held(self, name: str, at: int) -> frozenset:
        """The storage `name` may hold just before statement `at`."""
        return self.states[min(at, len(self.states) - 1)].get(name, frozenset({("free", name)}))

    def _around(self, name: str, at: int) -> frozenset:
        return self.held(name, at) | self.held(name, at + 1)

    def write_reach(self, f: StatementFacts, name: str, at: int) -> frozenset:
        """The storage an in-place write of `name` in statement `f` (at body index `at`) may reach:
        what it holds around the statement, except that `h *= self.scale` writes h's object
        before h holds anything the right side gives it (`lst += [x]` extends lst, never writes
        x). That holds only where the statement names `name` just once: a later write in the
        same statement (`h += [x]; h[0].mul_(2)`) reaches x."""
        late = {s for s, t in f.late_links if t == name}
        if late and _mentions(f.node, name) == 1:
            return self.held(name, at)
        return self._around(name, at)

    def written(self, f: StatementFacts, at: int, tokens: frozenset | set) -> list[str]:
        """Names whose in-place writes in statement `f` (at body index `at`) reach `tokens`."""
        return sorted(n for n in f.mutates if meets(self.write_reach(f, n, at), tokens))

    def maybe_written(self, f: StatementFacts, at: int, tokens: frozenset | set) -> list[str]:
        """Names an unseen callee in `f` may write whose storage reaches `tokens`."""
        return sorted(n for n in f.may_write if meets(self._around(n, at), tokens))


# all of the module's state (`self.parameters()`, `self._buffers`): `self` where it is a
# parameter of the function analysed (a method), or a name it does not bind
ALL_STATE_TOKENS = frozenset({("free", "self"), ("param", "self")})


def _mentions(node: cst.CSTNode, name: str) -> int:
    """How often `node` names the variable `name` (`Name` nodes, not attribute fields)."""
    count = 0

    class _Names(Visitor):
        def visit_Name(self, n: cst.Name) -> None:
            nonlocal count
            count += n.value == name

        def visit_Attribute(self, n: cst.Attribute) -> bool:
            n.value.visit(self)  # `obj.name` is a field, not the variable
            return False

    node.visit(_Names())
    return count


def meets(a: frozenset | set, b: frozenset | set) -> bool:
    """Whether two sets of storage tokens may share an object: a token in common, or all of the
    module's state (`for p in self.parameters()`) against one of its attributes (`self.bias`)."""
    if a & b:
        return True

    def attribute(tokens: frozenset | set) -> bool:
        return any(t[0] == "free" and t[-1].startswith("self.") for t in tokens)

    return bool(ALL_STATE_TOKENS & a and attribute(b)) or bool(ALL_STATE_TOKENS & b and attribute(a))


def _makes_tensor(ctor: str) -> bool:
    """`nn.Parameter(...)`, `torch.zeros(...)`: module state that is a tensor, not a submodule."""
    module, _, leaf = ctor.rpartition(".")
    return leaf in ("Parameter", "Buffer") or (module == "torch" and leaf[:1].islower())


def _is_record(node: cst.ClassDef) -> bool:
    """A `@dataclass` or a NamedTuple: its constructor only stores its arguments."""
    decorators = {
        (dotted_name(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator) or "").split(".")[-1]
        for d in node.decorators
    }
    bases = {(dotted_name(b.value) or "").split(".")[-1] for b in node.bases}
    return "dataclass" in decorators or bool(bases & {"NamedTuple", "TypedDict"})


# `None`, `True`, `print`: a callee writing its argument may be handed one; never a tensor
BUILTIN_NAMES = frozenset(dir(builtins))

# a name no table knows as a module (`torch`, `dist`) or as msrewrite's own `_ms_` helpers
_STATE_RECEIVER = "module_state_tensor"


def _constant_or_self(node: cst.BaseExpression) -> bool:
    """A literal (`True`, `3`, `"x"`, `None`) or a `self.<chain>`: the same value wherever named."""
    if isinstance(node, (cst.Integer, cst.Float, cst.SimpleString)):
        return True
    if isinstance(node, cst.Name):
        return node.value in ("True", "False", "None")
    named = dotted_name(node)
    return named is not None and named.startswith("self.")


def _is_name(node: cst.BaseExpression, name: str) -> bool:
    return isinstance(node, cst.Name) and node.value == name


# Nodes that can hold statements: an assignment is found by descending through these only, never
# into an expression (which holds none), so a long `__init__` is not walked node by node.
_STATEMENT_HOLDERS = (
    cst.BaseCompoundStatement,
    cst.BaseSuite,
    cst.SimpleStatementLine,
    cst.Else,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.Finally,
    cst.MatchCase,
)


def _assignments(func: cst.FunctionDef) -> list[cst.Assign | cst.AnnAssign]:
    """`Assign` and `AnnAssign` statements of `func`, in source order, at any block depth (nested
    classes included, nested functions not)."""
    found: list[cst.Assign | cst.AnnAssign] = []
    todo: list[cst.CSTNode] = [func.body]
    while todo:
        node = todo.pop()
        if isinstance(node, (cst.Assign, cst.AnnAssign)):
            found.append(node)
        elif isinstance(node, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            todo.extend(reversed(node.body))
        elif isinstance(node, _STATEMENT_HOLDERS) and not isinstance(node, cst.FunctionDef):
            todo.extend(
                reversed([c for c in node.children if isinstance(c, (*_STATEMENT_HOLDERS, cst.BaseSmallStatement))])
            )
    return found


def _top_level(body) -> list[cst.CSTNode]:
    """Module statements, also inside top-level `if`/`try` (optional imports, guarded classes)."""
    out: list[cst.CSTNode] = []
    for stmt in body:
        if isinstance(stmt, (cst.If, cst.Try)) and isinstance(stmt.body, cst.IndentedBlock):
            out += _top_level(stmt.body.body)
            orelse = getattr(stmt, "orelse", None)
            if orelse is not None and isinstance(getattr(orelse, "body", None), cst.IndentedBlock):
                out += _top_level(orelse.body.body)
        else:
            out.append(stmt)
    return out


def _self_path(func: cst.BaseExpression) -> str | None:
    """'experts' for self.experts(...), 'experts[]' for self.experts[i](...), 'mlp.act' for self.mlp.act(...)."""
    parts: list[str] = []
    node = func
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        if isinstance(node, cst.Attribute):
            parts.append(node.attr.value)
        elif parts:
            return None  # self.a[i].b: not followed
        else:
            parts.append("[]")
        node = node.value
    if not (isinstance(node, cst.Name) and node.value == "self") or not parts or parts[-1] == "[]":
        return None
    parts.reverse()
    text = ".".join(parts).replace(".[]", "[]")
    return text


def _short(node: cst.CSTNode) -> str:
    """The node's code on one line (a call written over several lines too), at most 40 characters."""
    text = " ".join(cst.Module(body=[]).code_for_node(node).split())
    return text if len(text) <= 40 else text[:37] + "..."


def _container_items(value: cst.Call) -> list[cst.BaseExpression]:
    """The modules `nn.ModuleList([...])` / `nn.Sequential(a, b)` / `nn.ModuleDict({k: m})` is
    built from; an argument that is none of these literals is itself an item (a name, a call:
    resolved as a module, so what cannot be seen into stays unknown). A `**other` entry of a dict
    literal is kept as `other`."""
    items: list[cst.BaseExpression] = []
    for arg in value.args:
        node = arg.value
        if isinstance(node, (cst.List, cst.Tuple, cst.Dict)):
            items += [el.value for el in node.elements]
        elif isinstance(node, (cst.ListComp, cst.GeneratorExp)):
            items.append(node.elt)
        elif isinstance(node, cst.DictComp):
            items.append(node.value)
        elif isinstance(node, cst.Call) and dotted_name(node.func) in (
            "dict",
            "collections.OrderedDict",
            "OrderedDict",
        ):
            items += _container_items(node)  # dict(a=X(), b=Y()), OrderedDict([("a", X())]): its values
        else:
            items.append(node)
    return items


# methods of a ModuleList / ModuleDict / Sequential that put modules into it -> the position of the
# module they put (`append(m)`, `insert(i, m)`, `add_module(name, m)`), or -1: the modules of a
# list or dict literal (`extend([a, b])`, `update({"k": m})`)
_CONTAINER_FILLS = {
    "append": 0,
    "insert": 1,
    "add_module": 1,
    "register_module": 1,
    "setdefault": 1,
    "extend": -1,
    "update": -1,
}


def _filled(call: cst.Call, method: str) -> list[cst.BaseExpression]:
    """The modules `holder.<method>(...)` puts into the container; the call itself when they are
    not plain arguments (`update(**kw)`, `extend(other)`): what resolves to nothing seen into."""
    args = call.args
    if any(a.star or a.keyword is not None for a in args):
        return [call]
    at = _CONTAINER_FILLS[method]
    if at >= 0:
        return [args[at].value] if at < len(args) else [call]
    if len(args) == 1 and isinstance(args[0].value, (cst.List, cst.Tuple, cst.Dict)):
        return _container_items(call)
    return [call]


def _container_fills(func: cst.FunctionDef, cache: dict) -> dict[str, list[cst.BaseExpression]]:
    """What `func` puts into each container it fills, by the container's dotted name
    (`self.routers`): the value of each `holder[key] = value`, and each call that fills it
    otherwise (`holder.update(...)`). One pass over the body, kept per function: a class's
    containers are asked about one by one, and walking every method each time dominated
    the run on large serving files (`cache`: the caller's, by id of the function)."""
    cached = cache.get(id(func))
    if cached is not None:
        return cached
    found: dict[str, list[cst.BaseExpression]] = {}

    class _Fills(Visitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            for target in node.targets:
                if isinstance(target.target, cst.Subscript):
                    holder = dotted_name(target.target.value)
                    if holder:
                        found.setdefault(holder, []).append(node.value)

        def visit_Call(self, node: cst.Call) -> None:
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value in _CONTAINER_FILLS:
                holder = dotted_name(func.value)
                if holder:
                    found.setdefault(holder, []).extend(_filled(node, func.attr.value))

    func.body.visit(_Fills())
    cache[id(func)] = found
    return found


def _bind_args(summary: Summary, call: cst.Call) -> dict[str, list[cst.BaseExpression]]:
    """Parameter name -> the argument expressions bound to it (`*args` at the call site: to all)."""
    bound: dict[str, list[cst.BaseExpression]] = {}
    spread = [a.value for a in call.args if a.star]
    pos = positional(call)
    for i, expr in enumerate(pos):
        if i < len(summary.params):
            bound.setdefault(summary.params[i], []).append(expr)
        elif summary.vararg:
            bound.setdefault(summary.vararg, []).append(expr)
    for arg in call.args:
        if arg.keyword is not None:
            name = arg.keyword.value
            target = name if name in summary.params else summary.kwarg
            if target:
                bound.setdefault(target, []).append(arg.value)
    for name in [*summary.params, *(n for n in (summary.vararg, summary.kwarg) if n)]:
        bound.setdefault(name, []).extend(spread)
    return bound


def _apply(
    summary: Summary, call: cst.Call, label: str, strict: bool = False, receiver: cst.BaseExpression | None = None
) -> CallEffect:
    """The effect of `call` from the callee's summary. `strict` (a package's code): a callee that
    calls anything msrewrite cannot see into may write every argument, not only those the
    unseen call is handed (module state, globals, a dispatch table could reach them).
    `receiver`: the object a method or forward runs on, written when the callee writes `self`'s
    state; module-level names the callee writes are written here by name."""
    bound = _bind_args(summary, call)
    effect = CallEffect(
        unknown=sorted(summary.unknown),
        unseen_work=sorted(summary.unseen_work),
        collective=summary.collective,
        rng=summary.rng,
        stream=summary.stream,
        barrier=summary.barrier,
    )
    for name in summary.writes:
        effect.writes += bound.get(name, [])
    _state_effects(summary, receiver, effect)
    effect.rebinds = _rebound_on(summary.rebinds, receiver)
    may_write = dict(summary.may_write)
    if strict and summary.unknown:
        unseen = sorted(summary.unknown)[:MAX_WRITERS]
        for name in bound:
            if name not in summary.writes:
                may_write.setdefault(name, unseen)
    for name, whys in may_write.items():
        for why in whys:  # one entry per unseen callee: unseen_writers names them all
            # `why` may name this very call already (a recursive call's placeholder); `fused_moe`
            # calling `fused_moe_kernel[grid]` is another callee
            named = why == label or why.startswith((f"{label} (", f"{label} -> "))
            chain = why if named else f"{label} -> {why}"
            effect.may_writes += [(expr, chain) for expr in bound.get(name, [])]
    for name in summary.returns:
        effect.returns += bound.get(name, [])
    holds = set(summary.holds)
    if strict and summary.unknown:
        holds |= _all_pairs(list(bound))
    for name in sorted(summary.pending_writes):
        effect.pending_writes += bound.get(name, [])
    for name in sorted(summary.pending_reads):
        effect.pending_reads += bound.get(name, [])
    for holder, held in sorted(holds):
        containers = [receiver] if holder == "self" and receiver is not None else bound.get(holder, [])
        effect.stores += [(c, v) for c in containers for v in bound.get(held, []) if c is not v]
    return effect


def _state_effects(summary: Summary, receiver: cst.BaseExpression | None, effect: CallEffect) -> None:
    """The state beyond the arguments a call writes and returns, from the callee's summary: the
    module-level names by name, the object's own attributes on `receiver`."""
    for name in sorted(summary.state_writes):
        if not _is_state(name):
            effect.writes.append(cst.Name(name))
        elif receiver is not None:
            effect.writes.append(_state_of(receiver, name))
    if receiver is not None:
        effect.returns += [_state_of(receiver, path) for path in sorted(summary.returns_state)]


# methods of the dict state_dict() returns that only read it
_MAPPING_READS = frozenset({"items", "keys", "values", "get"})
# methods of a builtin dict / list / set / tuple that only read it
_CONTAINER_READS = frozenset(
    {"get", "keys", "values", "items", "copy", "count", "index", "__contains__", "__getitem__", "__len__"}
)


def _container_display(value: cst.BaseExpression) -> bool:
    """`{...}`, `[...]`, `(...)`, a comprehension of them, or a bare `dict()` / `list()` / `set()` /
    `tuple()`: a builtin container."""
    if isinstance(value, (cst.Dict, cst.List, cst.Set, cst.Tuple, cst.DictComp, cst.ListComp, cst.SetComp)):
        return True
    return (
        isinstance(value, cst.Call)
        and isinstance(value.func, cst.Name)
        and value.func.value in ("dict", "list", "set", "tuple")
        and not value.args
    )


def _accessor_call(node: cst.BaseExpression, scope: Scope) -> bool:
    """`self.state_dict()`, `self.sub.named_parameters()`: a state accessor msrewrite resolved as one."""
    if not (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute)):
        return False
    return node.func.attr.value in STATE_ACCESSORS and not scope.effect_of(node).unknown


def _is_state(path: str) -> bool:
    return path == "self" or path.startswith("self.")


def _state_of(receiver: cst.BaseExpression, path: str) -> cst.BaseExpression:
    """The callee's `self.<attr>` (or all of `self`) as the caller names it: `receiver.<attr>`."""
    attr = path.partition(".")[2]
    return cst.Attribute(value=receiver, attr=cst.Name(attr)) if attr else receiver


def state_accessor_effect(call: cst.Call, receiver: cst.BaseExpression) -> CallEffect:
    """`<module>.parameters()`, `.get_buffer("bias")`, `.state_dict()` on an nn.Module: nothing
    written; the result aliases the state it hands out (STATE_ACCESSORS). `.load_state_dict(sd)`,
    `.to(...)`, `.apply(fn)`: a write of all of its state (STATE_WRITERS); `apply` runs `fn`, which
    msrewrite does not follow, on every submodule."""
    leaf = call.func.attr.value  # type: ignore[attr-defined]
    args = positional(call)
    if leaf in STATE_WRITERS:
        if leaf in ("apply", "_apply"):
            callee = dotted_name(call.func) or _short(call.func)
            return _unknown(call, f"{callee} (runs its argument on every submodule; not visible to msrewrite)")
        return CallEffect(writes=[receiver], returns=[receiver])
    if leaf in NAMED_STATE_ACCESSORS:
        keyword = next(
            (a.value for a in call.args if a.keyword is not None and a.keyword.value in ("target", "name")), None
        )
        target = args[0] if args else keyword
        named = target.evaluated_value if isinstance(target, cst.SimpleString) else None
        first = named.split(".")[0] if isinstance(named, str) else ""
        if first.isidentifier():
            return CallEffect(returns=[cst.Attribute(value=receiver, attr=cst.Name(first))])
    effect = CallEffect(returns=[receiver])
    if leaf == "state_dict":  # state_dict(destination=d) fills d with the state
        keyword = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "destination"), None)
        destination = args[0] if args else keyword
        if destination is not None:
            effect.stores.append((destination, receiver))
            effect.returns.append(destination)
    return effect


def _catalogued(call: cst.Call, named: str, qualified: str) -> CallEffect | None:
    """`call` of `qualified`, a native op or standard-library function msrewrite's catalogue
    knows (analyze/catalogue.py): its effect, the union over the entry's version ranges (which
    one runs is not known here); None when the catalogue has no entry. A native op's kernel is
    not read: the call counts as unseen work, which names the catalogue in the trust boundary."""
    entries = catalogue.lookup(qualified)
    effects = []
    for entry in entries:
        decl = entry.declaration()
        if decl.why:
            why = f"its catalogue entry ({entry.package} {entry.version}) does not read: {decl.why}"
            return _unknown(call, f"{named} (not visible to msrewrite: {why})")
        effects.append(_apply(_catalogue_summary(entry, decl, named), call, named))
    return _union(effects) if effects else None


def _catalogue_summary(entry: catalogue.Entry, decl: declared.Declaration, named: str) -> Summary:
    """The summary a catalogue entry gives: a schema's arguments bind by position or keyword
    (as `_torch_op` binds a declared op's); a Python function's keyword-only parameters bind only
    by keyword (through its `**` parameter, or a stand-in for them when it has none)."""
    star, double = entry.variadic()
    keywords = double or ("**" if decl.kwonly and not entry.schema else None)
    params = [*decl.params, *decl.kwonly] if entry.schema else list(decl.params)
    through = lambda names: {n if n in params or n == star else keywords or n for n in names}  # noqa: E731
    label = f"{named} (effects from msrewrite's catalogue: {entry.package} {entry.version}; its kernel is not read)"
    return Summary(
        params=params,
        vararg=star,
        kwarg=keywords,
        writes=through(decl.writes),
        returns=through(decl.returns),
        collective=entry.collective,
        unseen_work=set() if entry.package == "python" else {label},
    )


def _apply_template(template: CallEffect, call: cst.Call) -> CallEffect:
    args = positional(call)
    first = args[0] if args and not (call.args and call.args[0].star) else None
    # `self.act(*args)`, `self.act(**kw)`: the input is somewhere in what the spreads hold
    inputs = [first] if first is not None else [a.value for a in call.args if a.star]
    pick = lambda exprs: [i for e in exprs if not _is_name(e, MODULE_PLACEHOLDER) for i in inputs]  # noqa: E731 - the placeholder is the input
    module = [call.func for e in template.writes if _is_name(e, MODULE_PLACEHOLDER)]  # its running statistics
    return CallEffect(writes=pick(template.writes) + module, returns=pick(template.returns), rng=template.rng)


def _unknown(call: cst.Call, why: str) -> CallEffect:
    args = [a.value for a in call.args]
    receiver: list[cst.BaseExpression] = []
    held: list[cst.BaseExpression] = []  # what the result aliases beyond the arguments
    written: list[cst.BaseExpression] = []
    if isinstance(call.func, cst.Attribute):
        method = call.func.attr.value
        if _self_path(call.func) is None:
            receiver = [call.func.value]  # obj.method(x) may write obj too
        elif method in STATE_ACCESSORS:
            held = [call.func.value]  # self.sub.parameters() of a module not seen: its state all the same
        elif method in MODULE_ONLY_STATE_WRITERS:
            written = held = [call.func.value]  # self.sub.load_state_dict(sd): all of its state
        elif method in TENSOR_METHODS and is_inplace_name(method) and not _is_name(call.func.value, "self"):
            # self.norm.weight.data.mul_(0.5), self.sub.head.add_(1): an in-place tensor method on
            # state reached through a submodule writes that state, whatever the chain holds
            written = held = [call.func.value]
    elif not isinstance(call.func, cst.Name):
        # a computed callee (`getattr(x, "mul_")(2)`, `table[k](x)`) may be bound to any object its
        # expression names
        receiver = [cst.Name(n) for n in sorted(expression_loads(call.func)) if n != "self"]
    # `ev.wait()`, `self.prefetcher.wait()`: a wait, synchronize or record msrewrite cannot see into
    # may order streams (an event from elsewhere), so nothing after it moves above it
    ordering = is_ordering_call(call)
    return CallEffect(
        writes=written,
        returns=args + receiver + held,
        may_writes=[(e, why) for e in args + receiver],
        # `lst.append(x)`, `helper(lst, x)`: any of them may now hold any other
        stores=[(c, v) for c in args + receiver for v in args if c is not v],
        unknown=[why],
        stream=ordering,
        barrier=ordering,
    )


def _vouched_effect(call: cst.Call) -> CallEffect:
    """A callee the reviewer vouched for: writes nothing; its result may still alias its arguments.
    Vouching is for tensor writes only: a wait or synchronize it makes still orders streams."""
    ordering = is_ordering_call(call)
    return CallEffect(returns=[a.value for a in call.args], stream=ordering, barrier=ordering)


def _rebound_on(rebinds: set[str], receiver: cst.BaseExpression | None) -> list[str]:
    """The attributes a callee rebinds on its object, as paths on the call's receiver."""
    if not rebinds or receiver is None:
        return []
    owner = _attribute_path(receiver)
    return [f"{owner}.{path}" for path in sorted(rebinds)]


def _attribute_path(node: cst.BaseExpression) -> str:
    """'self.experts' for self.experts[i] (indices dropped): the object a rebinding is on; only
    the root name (`self`: all of it) when a call's result is in the chain."""
    parts: list[str] = []
    called = False
    while isinstance(node, (cst.Attribute, cst.Subscript, cst.Call)):
        if isinstance(node, cst.Call):
            called = True
            node = node.func
            continue
        if isinstance(node, cst.Attribute):
            parts.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return "self"  # an object msrewrite cannot name: take it as the module's whole state
    return node.value if called else ".".join([node.value, *reversed(parts)])


def _union(effects: list[CallEffect]) -> CallEffect:
    out = CallEffect()
    for e in effects:
        out.rebinds += [r for r in e.rebinds if r not in out.rebinds]
        out.writes += e.writes
        out.returns += e.returns
        out.may_writes += e.may_writes
        out.stores += e.stores
        out.unknown += [u for u in e.unknown if u not in out.unknown]
        out.unseen_work += [u for u in e.unseen_work if u not in out.unseen_work]
        out.collective |= e.collective
        out.rng |= e.rng
        out.stream |= e.stream
        out.barrier |= e.barrier
    return out


bind_args = _bind_args  # for analyses that rebase a callee's effects onto a call site (analyze/effects.py)


def self_chain(node: cst.Attribute) -> str | None:
    """`self.shared_experts.calls` for an attribute chain on `self` with no subscript in it; None
    for one on another object, or with a subscript (its inner `self.<attr>` is a chain of its own)."""
    root: cst.BaseExpression = node
    while isinstance(root, (cst.Attribute, cst.Subscript)):
        root = root.value
    if not (isinstance(root, cst.Name) and root.value == "self"):
        return None
    return dotted_name(node)


def _self_chains(func: cst.FunctionDef) -> tuple[set[str], set[str]] | None:
    """(every `self.<chain>` a method's body names, the `self.<method>(...)` calls among them), or
    None when `self` is used bare (handed on, returned, stored, `getattr(self, ...)`): what is read
    through it is not tracked."""
    chains: set[str] = set()
    calls: set[str] = set()
    bare = False

    class _Chains(Visitor):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            chain = self_chain(node)
            if chain is None:
                return True  # not on `self`, or self.experts[i].w: the inner self.experts is found below
            chains.add(chain)
            return False

        def visit_Call(self, call: cst.Call) -> None:
            func = call.func
            if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
                calls.add(func.attr.value)
            named = dotted_name(func) or ""
            if named.startswith("self.") and named.count(".") > 1:
                chains.add(named.rpartition(".")[0])  # self.shared_experts.reset(): its object's state

        def visit_Name(self, node: cst.Name) -> None:
            nonlocal bare
            if node.value == "self":
                bare = True  # reached only where `self` is not the base of an attribute

        def visit_Param(self, node: cst.Param) -> bool:
            if node.default is not None:  # `def inner(y=self.scale)` reads it
                node.default.visit(self)
            return False  # the parameter's own name is no use of `self`

    func.body.visit(_Chains())
    return None if bare else (chains, calls)


def _self_attributes(node: cst.CSTNode) -> list[cst.Attribute]:
    """Every `self.<name>` in `node`."""
    found: list[cst.Attribute] = []

    class _Attrs(Visitor):
        def visit_Attribute(self, n: cst.Attribute) -> None:
            if isinstance(n.value, cst.Name) and n.value.value == "self":
                found.append(n)

    node.visit(_Attrs())
    return found


def _loaded_names(node: cst.CSTNode) -> set[str]:
    """The variable names `node` mentions (not attribute fields, not keyword names)."""
    found: set[str] = set()

    class _Names(Visitor):
        def visit_Name(self, n: cst.Name) -> None:
            found.add(n.value)

        def visit_Attribute(self, n: cst.Attribute) -> bool:
            n.value.visit(self)
            return False

        def visit_Arg(self, n: cst.Arg) -> bool:
            n.value.visit(self)
            return False

    node.visit(_Names())
    return found
