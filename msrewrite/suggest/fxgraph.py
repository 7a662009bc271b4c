"""The torch.fx tier: a module-level graph of one forward, its direct submodules as leaves.

Two tracers, tried in order, and the record says which one worked or why neither did:

- `leaf`: a plain `torch.fx.Tracer` whose leaves are the module's direct submodules (children
  of a ModuleList/ModuleDict child count as direct: `self.self_attn[1]`). Non-tensor inputs
  (None, flags) are concrete. It fails on `x.view(*orig_shape)` (a Proxy cannot be iterated),
  which DeepSeek, GLM and LongCat MoE blocks do.
- `meta-leaf`: the same leaves on `torch.fx.experimental.meta_tracer.MetaTracer`, so every proxy
  carries a meta tensor and `orig_shape` is a real `torch.Size`. A leaf's output meta comes from
  a shape oracle (the outputs one real eager run gave, moved to `meta`) instead of running the
  leaf on meta tensors, which leaves junk nodes and cannot run data-dependent expert loops.
  Shapes are specialized to the traced input; the graph is only used for its module structure.

The module DAG keeps inputs, leaf calls and the output as nodes; everything between two of them
(views, adds, getitem) folds into a typed edge. A candidate whose side submodules and main-path
submodules have no path between them in that DAG is independent at module level too.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import field
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch.fx.experimental.meta_tracer import MetaTracer
from torch.utils._pytree import tree_map

from msrewrite.records import record

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


@record
class FxResult:
    qualname: str  # "DeepseekV3MoE.forward"
    path: str  # module path in the traced model ("mlp"; "" for the root)
    tracer: str | None  # "leaf" or "meta-leaf"; None when both failed
    reason: str  # why the first (or both) failed; "" when `leaf` worked
    graph: torch.fx.Graph | None = None
    dag: nx.DiGraph | None = None  # module DAG (see module_dag)

    @property
    def ok(self) -> bool:
        return self.dag is not None

    def summary(self) -> str:
        name = self.qualname.rsplit(".", 1)[0]
        if self.tracer == "leaf":
            return f"{name}: ok (leaf tracer, {self.size()})"
        if self.tracer == "meta-leaf":
            return f"{name}: ok (meta-leaf tracer with shape oracle, {self.size()}; plain leaf tracer failed: {self.reason})"
        return f"{name}: failed ({self.reason})"

    def size(self) -> str:
        modules = sum(1 for _, d in self.dag.nodes(data=True) if d["kind"] == "module") if self.dag is not None else 0
        return f"{modules} module nodes"


@record
class _Capture:
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)  # leaf path (relative) -> output as meta
    seen: bool = False


def leaf_names(module: torch.nn.Module) -> set[str]:
    """Direct submodules, looking through ModuleList/ModuleDict children."""
    names: set[str] = set()
    for name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            names |= {f"{name}.{sub}" for sub, _ in child.named_children()}
        else:
            names.add(name)
    return names


def _to_meta(value: Any) -> Any:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


def capture(root: torch.nn.Module, args: tuple, kwargs: dict, paths: list[str]) -> dict[str, _Capture]:
    """One eager run of `root`: the first inputs of each module at `paths` and its leaves' outputs (meta)."""
    modules = dict(root.named_modules())
    captures = {p: _Capture() for p in paths if p in modules}
    handles = []

    def pre(path):
        def hook(_module, hook_args, hook_kwargs):
            cap = captures[path]
            if not cap.seen:
                cap.args, cap.kwargs, cap.seen = hook_args, dict(hook_kwargs), True

        return hook

    def post(path, leaf):
        def hook(_module, _args, output):
            outputs = captures[path].outputs
            if leaf not in outputs:
                outputs[leaf] = _to_meta(output)

        return hook

    try:
        for path in captures:
            module = modules[path]
            handles.append(module.register_forward_pre_hook(pre(path), with_kwargs=True))
            for leaf in leaf_names(module):
                handles.append(module.get_submodule(leaf).register_forward_hook(post(path, leaf)))
        with torch.no_grad():
            root(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return captures


_TORCH_DIR = os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "")


class _StackRecording:
    """Each node's stack trace, the frames from the first `forward` on outside torch, as fx's
    `record_stack_traces` writes them (module_dag reads their lines). fx's own filter calls
    torch.fx.experimental.symbolic_shapes.uninteresting_files(), which imports torch._dynamo
    and torch._inductor: about 2.5 s, most of a traced suggest of a small model."""

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)  # type: ignore[misc]
        if not node.stack_trace:
            node.stack_trace = _user_stack(sys._getframe(1))
        return node


def _user_stack(frame: types.FrameType | None) -> str:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first, as a traceback reads
    first = next((i for i, f in enumerate(frames) if f.f_code.co_name == "forward"), len(frames))
    return "\n".join(
        f'  File "{f.f_code.co_filename}", line {f.f_lineno}, in {f.f_code.co_name}'
        for f in frames[first:]
        if not os.path.realpath(f.f_code.co_filename).startswith(_TORCH_DIR)
    )


class LeafTracer(_StackRecording, torch.fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, _m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves


class MetaLeafTracer(_StackRecording, MetaTracer):
    def __init__(self, leaves: set[str], oracle: dict[str, Any]) -> None:
        super().__init__()
        self.leaves = leaves
        self.oracle = oracle

    def is_leaf_module(self, _m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if kind == "call_module" and target in self.oracle:
            proxy = torch.fx.Tracer.create_proxy(self, kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
            proxy.install_tensor_meta(self.oracle[target])
            return proxy
        return super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)


def _split_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """(tensor-valued inputs by name, concrete inputs by name) for the forward's signature."""
    signature = inspect.signature(inspect.unwrap(type(module).forward))
    bound = signature.bind(module, *args, **kwargs)
    tensors: dict[str, Any] = {}
    concrete: dict[str, Any] = {}
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind == param.VAR_POSITIONAL:
            if bound.arguments.get(name):
                raise ValueError(f"fx cannot take the variadic argument *{name}")
            continue
        if param.kind == param.VAR_KEYWORD:  # passed on by keyword (see _unwrapped_forward)
            for key, value in bound.arguments.get(name, {}).items():
                has_tensor = any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(value))
                (tensors if has_tensor else concrete)[key] = value
            continue
        value = bound.arguments.get(name, param.default)
        if value is inspect.Parameter.empty:
            raise ValueError(f"no value for argument {name!r}")
        has_tensor = any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(value))
        (tensors if has_tensor else concrete)[name] = value
    return tensors, concrete


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = re.split(r"(?<=\.) ", text, maxsplit=1)[0]  # the first sentence says enough
    return f"{type(exc).__name__}: {text}"[:160]


def trace_module(qualname: str, path: str, module: torch.nn.Module, cap: _Capture) -> FxResult:
    """Module-level fx graph of `module.forward`: the leaf tracer, else the meta-leaf tracer."""
    leaves = leaf_names(module)
    try:
        tensors, concrete = _split_inputs(module, cap.args, cap.kwargs)
    except (TypeError, ValueError) as exc:
        return FxResult(qualname, path, None, _one_line(exc))
    reason = ""
    graph = None
    tracer_name = None
    with warnings.catch_warnings(), _unwrapped_forward(module, [*tensors, *concrete]):
        warnings.simplefilter("ignore")
        try:
            graph = LeafTracer(leaves).trace(module, concrete_args=dict(concrete))
            tracer_name = "leaf"
        except Exception as exc:  # noqa: BLE001 - the reason is the record
            reason = _one_line(exc)
        if graph is None:
            oracle = {leaf: out for leaf, out in cap.outputs.items()}
            try:
                graph = MetaLeafTracer(leaves, oracle).trace(
                    module, meta_args=_to_meta(tensors), concrete_args=dict(concrete)
                )
                tracer_name = "meta-leaf"
            except Exception as exc:  # noqa: BLE001
                return FxResult(qualname, path, None, f"leaf: {reason}; meta-leaf: {_one_line(exc)}")
    _drop_dead(graph)
    file = inspect.getsourcefile(inspect.unwrap(type(module).forward))
    return FxResult(qualname, path, tracer_name, reason, graph=graph, dag=module_dag(graph, file))


@contextmanager
def _unwrapped_forward(module: torch.nn.Module, names: list[str]) -> Iterator[None]:
    """Trace the forward without its decorators and without **kwargs, which fx cannot take.

    The instance gets, for the trace only, a subclass whose forward has the explicit parameters
    of the original and calls it (undecorated) by keyword; the ops still run in the original code.
    """
    cls = type(module)
    original = inspect.unwrap(cls.forward)
    params = [p for p in inspect.signature(original).parameters.values()][1:]
    fixed = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    fixed += [n for n in names if n not in fixed]  # **kwargs entries of the captured call
    if original is cls.forward and len(fixed) == len(params):
        yield
        return
    body = ", ".join(f"{n}={n}" for n in fixed)
    namespace: dict[str, Any] = {"_original": original}
    exec(f"def forward(self, {', '.join(fixed)}):\n    return _original(self, {body})\n", namespace)  # noqa: S102
    module.__class__ = type(cls.__name__, (cls,), {"forward": namespace["forward"], "__module__": cls.__module__})
    try:
        yield
    finally:
        module.__class__ = cls


def _drop_dead(graph: torch.fx.Graph) -> None:
    """Dead-code elimination without an owning module: unused pure nodes (not calls, not in-place)."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.users or node.op not in ("call_function", "call_method", "get_attr"):
                continue
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
            if name.endswith("_") and not name.endswith("__"):
                continue
            graph.erase_node(node)
            changed = True


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def _line(node: torch.fx.Node, file: str | None) -> int | None:
    """Line of the traced forward that made this node: its innermost frame in the forward's file."""
    frames = [int(line) for name, line, _ in _FRAME.findall(node.stack_trace or "") if file is None or name == file]
    return frames[-1] if frames else None


_SHAPE_ATTRS = {"shape", "dtype", "device", "size", "dim", "ndim", "numel"}
_KINDS = ("shape", "item", "data")  # weakest to strongest


def _hop(node: torch.fx.Node, arg: torch.fx.Node, kept: dict) -> int:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if target in _SHAPE_ATTRS or (target == "getattr" and len(node.args) > 1 and node.args[1] in _SHAPE_ATTRS):
        return 0
    if target == "getitem" and arg in kept and kept[arg][0] == "module":
        return 1
    return 2


def module_dag(graph: torch.fx.Graph, file: str | None = None) -> nx.DiGraph:
    """Inputs, leaf calls and the output as nodes; what lies between them folds into typed edges.

    Edge kinds: `data` (a tensor flows, maybe through views and arithmetic), `item` (an element
    of a leaf's tuple output, such as the router's top-k indices), `shape` (only sizes flow:
    `x.shape`, `x.size(-1)`). `via` names the fx nodes folded into the edge.
    """
    dag = nx.DiGraph()
    kept = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            kept[node] = ("input", node.target)
        elif node.op == "call_module":
            kept[node] = ("module", node.target)
        elif node.op == "output":
            kept[node] = ("output", "output")
    for node, (kind, target) in kept.items():
        dag.add_node(node.name, kind=kind, target=target, line=_line(node, file) if kind == "module" else None)
    reach: dict[torch.fx.Node, dict[str, tuple[int, frozenset[str]]]] = {}  # node -> kept source -> (kind, via)
    for node in graph.nodes:
        found: dict[str, tuple[int, frozenset[str]]] = {}
        for arg in node.all_input_nodes:
            hop = _hop(node, arg, kept)
            paths = {arg.name: (2, frozenset())} if arg in kept else reach.get(arg, {})
            for src, (path_kind, path_via) in paths.items():
                via = path_via if arg in kept else path_via | {arg.name}
                strength = min(path_kind, hop)
                old = found.get(src)
                if old is None or strength > old[0]:
                    found[src] = (strength, via)
                elif strength == old[0]:
                    found[src] = (strength, old[1] | via)
        reach[node] = found
        if node in kept:
            for src, (strength, via) in found.items():
                dag.add_edge(src, node.name, kind=_KINDS[strength], via=sorted(via))
    return dag


def module_node_for_callee(dag: nx.DiGraph, callee: str) -> list[str]:
    """fx nodes calling the submodule `callee` ("self_attn[1]" -> target "self_attn.1")."""
    target = callee.replace("[", ".").replace("]", "").replace("'", "").replace('"', "")
    return [n for n, d in dag.nodes(data=True) if d["kind"] == "module" and d["target"] == target]


def independence(dag: nx.DiGraph, side_callees: list[str], main_callees: list[str]) -> str:
    """ "independent", "dependent (a -> b)" or "unavailable (why)" for two sets of submodule calls."""
    side = [n for c in side_callees for n in module_node_for_callee(dag, c)]
    main = [n for c in main_callees for n in module_node_for_callee(dag, c)]
    if not side:
        return "unavailable (no submodule call of the side branch in the fx graph)"
    if not main:
        return "unavailable (no submodule call on the main path in the fx graph)"
    if set(side) & set(main):
        return "dependent (the same submodule call on both paths)"
    for a in side:
        reach = nx.descendants(dag, a)
        for b in main:
            if b in reach:
                return f"dependent ({dag.nodes[a]['target']} -> {dag.nodes[b]['target']})"
            if a in nx.descendants(dag, b):
                return f"dependent ({dag.nodes[b]['target']} -> {dag.nodes[a]['target']})"
    return "independent"
