"""Regenerate msrewrite/analyze/torch_names.py from the installed torch:

    python -m msrewrite.analyze.gen_torch_names

The analysis needs torch's public names (which tensor methods exist, which `nn` modules, ...) and
a few facts about their signatures, but must not import torch: that alone costs seconds of
start-up for every `apply`. The table is checked against the installed torch by
tests/test_effects.py. Besides the names it holds, as "name:..." words:
  - ALIAS_OPS: public ops one of whose aten schemas returns an alias of its first argument
    (`Tensor(a) self -> Tensor(a)`: views, and ops that may return `self` itself, `to`, `contiguous`);
  - INPLACE_ARGS: "op:i" for the positional tensor arguments an op without the trailing `_`
    writes (`Tensor(a!)` in a schema that is not an `out=` overload);
  - F_INPLACE: "function:i", the position of `inplace` in `torch.nn.functional`'s signatures;
  - DIST_SIGNATURES: "function:p0,p1,..", the parameters of `torch.distributed`'s functions
    (a collective's buffer is found by keyword or position);
  - the random-draw table: RNG_OPS, the aten ops torch tags `nondeterministic_seeded` (what
    `torch.<name>` / `x.<name>()` and verify's recorded ops are matched against); RNG_F_FUNCTIONS,
    the `torch.nn.functional` functions whose code reaches one of them (read from their source,
    following the F functions they call); RNG_NN_MODULES, the `nn` modules whose code calls one
    of those or builds a module that does (nn.Dropout, nn.RReLU, nn.MultiheadAttention, nn.LSTM).
    tests/test_effects.py traces a sample of them under a dispatch mode in training mode.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
from pathlib import Path


def current() -> dict[str, frozenset[str]]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def public(obj) -> frozenset[str]:
        return frozenset(n for n in dir(obj) if not n.startswith("_"))

    tables = {
        "TENSOR_METHODS": public(torch.Tensor),
        "TORCH_FUNCTIONS": public(torch),
        "F_FUNCTIONS": public(F),
        "NN_MODULES": public(nn),
    }
    tables.update(_schema_facts(tables["TENSOR_METHODS"] | tables["TORCH_FUNCTIONS"] | tables["F_FUNCTIONS"]))
    tables["F_INPLACE"] = frozenset(
        f"{name}:{params.index('inplace')}"
        for name, params in _signatures(F, tables["F_FUNCTIONS"])
        if "inplace" in params
    )
    import torch.distributed as dist

    tables["DIST_SIGNATURES"] = frozenset(
        f"{name}:{','.join(params)}"
        for name, params in _signatures(dist, public(dist) | _PRIVATE_COLLECTIVES)
        if params
    )
    tables.update(_random_draws(tables["F_FUNCTIONS"], tables["NN_MODULES"]))
    return tables


def _seeded_ops() -> frozenset[str]:
    """aten ops (by name, any overload) that torch tags `nondeterministic_seeded`: they draw from
    the generator, so their order decides every value drawn after them."""
    import torch

    names: set[str] = set()
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        name = schema.name[6:]
        try:
            op = getattr(getattr(torch.ops.aten, name), schema.overload_name or "default")
        except (AttributeError, RuntimeError):
            continue
        if torch.Tag.nondeterministic_seeded in op.tags:
            names.add(name)
    return frozenset(names)


def _calls_in(function, seen: frozenset[int] = frozenset()) -> set[str]:
    """The names a function's source calls, by their last part (`torch.rrelu(..)` -> rrelu,
    `_VF.feature_dropout(..)` -> feature_dropout, `x.exponential_()` -> exponential_), with those
    of the functions its closure holds (torch's boolean_dispatch wrappers) and of torch's own
    module-level helpers it calls."""
    if id(function) in seen:
        return set()
    seen = seen | {id(function)}
    called: set[str] = set()
    for cell in getattr(function, "__closure__", None) or ():
        if inspect.isfunction(_cell(cell)):
            called |= _calls_in(cell.cell_contents, seen)
    tree = _tree(function)
    local = {n.id for n in _walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local |= {a.arg for n in _walk(tree) if isinstance(n, ast.arguments) for a in (*n.args, *n.kwonlyargs)}
    for node in _walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _leaf(node.func)
        if name:
            called.add(name)
        if isinstance(node.func, ast.Name) and name in local:
            called.add(_ANY_CALLABLE)  # `for mod in self.layers: mod(x)`: whatever it holds
        elif isinstance(node.func, ast.Name) and not hasattr(builtins, name):
            helper = getattr(function, "__globals__", {}).get(name)
            if inspect.isfunction(helper) and helper.__module__.startswith("torch."):
                called |= _calls_in(helper, seen)
    return called


# a call of a callable held in a local (a layer from a constructor argument): it may draw
_ANY_CALLABLE = "<a callable>"


def _module_calls(cls) -> set[str]:
    """What an nn module's `forward` calls, following the methods of its own class it calls
    (`self._sa_block(x)`) and, for a submodule it calls (`self.dropout1(x)`), the class
    `__init__` builds it from (`self.dropout1 = Dropout(p)`): the names `_calls_in` gives."""
    methods = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("torch.nn.modules."):
            methods.update({k: v for k, v in vars(klass).items() if inspect.isfunction(v)})
    built: dict[str, set[str]] = {}
    for node in _walk(_tree(methods.get("__init__"))):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    built.setdefault(target.attr, set()).add(_leaf(node.value.func))
    called: set[str] = set()
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        called |= _calls_in(methods[name])
        for node in _walk(_tree(methods[name])):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                todo.append(func.attr)
                called |= built.get(func.attr, set())
    return called


def _tree(function):
    if not inspect.isfunction(function):
        return None
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None


def _walk(tree):
    return ast.walk(tree) if tree is not None else ()


def _leaf(func) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _random_draws(f_functions: frozenset[str], nn_modules: frozenset[str]) -> dict[str, frozenset[str]]:
    """RNG_OPS, RNG_F_FUNCTIONS and RNG_NN_MODULES (see the module docstring): a fixpoint over
    what each F function and nn module calls."""
    import torch.nn as nn
    import torch.nn.functional as F

    ops = _seeded_ops()
    f_calls = {n: _calls_in(getattr(F, n)) for n in sorted(f_functions) if callable(getattr(F, n, None))}
    drawing = {n for n in f_calls if n in ops}
    while True:
        more = {n for n, calls in f_calls.items() if calls & (ops | drawing)} - drawing
        if not more:
            break
        drawing |= more
    classes = {n: getattr(nn, n) for n in sorted(nn_modules)}
    m_calls = {n: _module_calls(c) for n, c in classes.items() if inspect.isclass(c) and issubclass(c, nn.Module)}
    modules: set[str] = set()
    while True:
        more = {n for n, calls in m_calls.items() if calls & (ops | drawing | modules | {_ANY_CALLABLE})} - modules
        if not more:
            break
        modules |= more
    return {"RNG_OPS": ops, "RNG_F_FUNCTIONS": frozenset(drawing), "RNG_NN_MODULES": frozenset(modules)}


# private collectives model code calls (vLLM's, SGLang's older paths)
_PRIVATE_COLLECTIVES = frozenset({"_all_gather_base", "_reduce_scatter_base"})


def _signatures(module, names):
    """(name, its parameter names) for each plain function or class of `module` that has a signature."""
    for name in sorted(names):
        obj = getattr(module, name, None)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        try:
            params = list(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            continue
        yield name, params


def _schema_facts(public: frozenset[str]) -> dict[str, frozenset[str]]:
    """ALIAS_OPS and INPLACE_ARGS from the aten schemas (alias annotations) of the public ops."""
    import torch

    alias: set[str] = set()
    writes: set[str] = set()
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::") or schema.name[6:] not in public:
            continue
        name = schema.name[6:]
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            alias.add(name)
        if name.endswith("_") or schema.overload_name.endswith("out"):
            continue
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is not None and info.is_write and not arg.kwarg_only and str(arg.type).startswith("Tensor"):
                writes.add(f"{name}:{i}")
    return {"ALIAS_OPS": frozenset(alias), "INPLACE_ARGS": frozenset(writes)}


def render(tables: dict[str, frozenset[str]]) -> str:
    import torch

    lines = [
        f'"""Public names of torch {torch.__version__.split("+")[0]}, for the analysis (no torch import at start-up).',
        "",
        "Generated by `python -m msrewrite.analyze.gen_torch_names`; do not edit by hand.",
        '"""',
        "",
    ]
    for name, names in tables.items():
        lines.append(f"{name} = frozenset(")
        lines.append('    """')
        words = sorted(names)
        row: list[str] = []
        for word in words:
            if sum(len(w) + 1 for w in row) + len(word) > 96:
                lines.append("    " + " ".join(row))
                row = []
            row.append(word)
        if row:
            lines.append("    " + " ".join(row))
        lines.append('    """.split()')
        lines.append(")")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    target = Path(__file__).with_name("torch_names.py")
    target.write_text(render(current()), encoding="utf-8")
    print(f"wrote {target}")
