"""Execution-mode detection: which API family the edited file must speak.

torchair's CompilerConfig / get_npu_backend mean torchair, and its ``config.mode`` says which
graph: "max-autotune" (the default) is GE graph mode, "reduce-overhead" and "npugraph_ex" capture
aclgraphs, which take the native stream API (npugraph-ex). backend="npugraph_ex" means
npugraph-ex; a file that drives torch.cuda streams and never torch_npu means cuda; a file with no
stream code that uses its framework's CUDA helpers (SGLang's `is_cuda()` and cuda graph runner,
vLLM's `current_platform.is_cuda()`) and none of its NPU ones means cuda, both kinds an error
asking for --mode; otherwise the native eager API. Explicit --mode always wins.
"""

from __future__ import annotations

import ast
import re
from functools import cache

from msrewrite.plan import MODES

# The markers, each with the literals every match of it contains: a text holding none of them
# cannot match, and a substring test costs a hundredth of the search (a 600-line file: 0.05 ms
# against 5 ms for the first pattern), so most files are told apart without compiling any.
_MARKERS = {
    "ge": (
        r"\bCompilerConfig\s*\(|\bget_npu_backend\s*\(|npu_stream_switch\s*\(|npu_wait_tensor\s*\(",
        ("CompilerConfig", "get_npu_backend", "npu_stream_switch", "npu_wait_tensor"),
    ),
    "npugraph_ex": (r"""backend\s*=\s*["']npugraph_ex["']|npugraph_ex\.""", ("npugraph_ex",)),
    # the file already drives CUDA streams or graphs itself, and never torch_npu
    "cuda": (r"\btorch\.cuda\.(?:Stream|stream|current_stream|Event|set_stream|graph|CUDAGraph)\b", ("torch.cuda.",)),
    "npu": (r"\btorch_npu\b|\btorch\.npu\b", ("torch_npu", "torch.npu")),
    # the serving frameworks' own platform helpers: SGLang's is_cuda() / cuda graph runner,
    # vLLM's current_platform.is_cuda*(); and their NPU counterparts (SGLang's is_npu(), vllm-ascend)
    "cuda_helpers": (
        r"\bis_cuda(?:_alike)?\s*\(|\bcuda_graph_runner\b|\bcurrent_platform\.is_cuda(?:_alike)?\s*\(",
        ("is_cuda", "cuda_graph_runner"),
    ),
    "npu_helpers": (r"\bis_npu\s*\(|\bvllm_ascend\b", ("is_npu", "vllm_ascend")),
}


@cache
def _pattern(marker: str) -> re.Pattern:
    return re.compile(_MARKERS[marker][0])


def _search(marker: str, text: str) -> re.Match | None:
    """_pattern(marker).search(text), skipped when the text lacks the marker's literals."""
    if not any(literal in text for literal in _MARKERS[marker][1]):
        return None
    return _pattern(marker).search(text)


_TORCHAIR_MODES = {"max-autotune": "ge-graph", "reduce-overhead": "npugraph-ex", "npugraph_ex": "npugraph-ex"}


def _callee(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _nfkc(text: str) -> str:
    import unicodedata  # only for a non-ASCII file

    return unicodedata.normalize("NFKC", text)


def _torchair_config_mode(text: str) -> tuple[str, str] | None:
    """(mode, reason) from the `<config>.mode = "..."` assignments of the file's torchair CompilerConfig.

    None when the file builds no CompilerConfig. ValueError when the mode cannot be told (a computed
    value, an unknown name, or both kinds of graph in one file): the caller asks for --mode.
    """
    if "CompilerConfig" not in text and (text.isascii() or "CompilerConfig" not in _nfkc(text)):
        return None  # the name is not written (Python reads identifiers NFKC-normalized)
    from msrewrite.analyze.positions import parsed_tree

    tree = parsed_tree(text)  # the one ast parse of this text the analysis shares
    if tree is None:
        return None
    configs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _callee(node.value) == "CompilerConfig":
            configs |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    if not configs:
        return None
    found: dict[str, int] = {}  # torchair mode -> first line
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if not (
                isinstance(target, ast.Attribute)
                and target.attr == "mode"
                and isinstance(target.value, ast.Name)
                and target.value.id in configs
            ):
                continue
            value = node.value
            if not (isinstance(value, ast.Constant) and value.value in _TORCHAIR_MODES):
                raise ValueError(
                    f"cannot tell torchair's graph mode: line {node.lineno} sets "
                    f"{target.value.id}.mode = {ast.unparse(value)}; give --mode ge-graph (max-autotune) "
                    f"or --mode npugraph-ex (reduce-overhead, npugraph_ex)"
                )
            found.setdefault(value.value, node.lineno)
    if not found:
        return "ge-graph", "torchair CompilerConfig with the default mode max-autotune (GE graph mode)"
    kinds = {_TORCHAIR_MODES[m] for m in found}
    if len(kinds) > 1:
        where = ", ".join(f"{m!r} (line {line})" for m, line in sorted(found.items(), key=lambda kv: kv[1]))
        raise ValueError(
            f"cannot tell torchair's graph mode: the file sets {where}, and no edit is right in both; "
            f"give --mode ge-graph or --mode npugraph-ex"
        )
    mode, line = min(found.items(), key=lambda kv: kv[1])
    kind = kinds.pop()
    graph = "GE graph mode" if kind == "ge-graph" else "aclgraph capture: native streams and events"
    return kind, f"torchair CompilerConfig mode {mode!r} at line {line} ({graph})"


def _imports_torch_npu(text: str) -> bool:
    """`import torch_npu` (or `from torch_npu ...`) at the module's top level, outside any `if`/`try`:
    the file runs on the NPU whatever else it mentions (torch_npu can map torch.cuda onto the NPU)."""
    return re.search(r"^(?:import|from)\s+torch_npu\b", text, re.MULTILINE) is not None


def detect_mode(text: str) -> tuple[str, str]:
    """(mode, reason) for a source file; ValueError when torchair's mode cannot be told."""
    configured = _torchair_config_mode(text)
    if configured:
        return configured
    ge = _search("ge", text)
    if ge:
        return "ge-graph", f"found {ge.group(0).strip()!r} (torchair GE graph mode)"
    ex = _search("npugraph_ex", text)
    if ex:
        return "npugraph-ex", f"found {ex.group(0).strip()!r} (npugraph_ex / aclgraph)"
    cuda = _search("cuda", text)
    npu = _search("npu", text)
    if cuda and not npu:
        return "cuda", f"found {cuda.group(0)!r} and no torch_npu (the file speaks CUDA streams)"
    if cuda and npu and not _imports_torch_npu(text):
        # SGLang's deepseek_v2.py: its streams are torch.cuda; torch.npu appears in an NPU branch
        n_cuda, n_npu = len(_pattern("cuda").findall(text)), len(_pattern("npu").findall(text))
        if n_cuda > n_npu:
            return "cuda", (
                f"the file's stream code is torch.cuda ({n_cuda} uses against {n_npu} of torch.npu / "
                f"torch_npu, which it never imports at module level)"
            )
    if npu:
        return "eager", "no torchair or npugraph_ex markers (native torch_npu streams)"
    # No stream code of either kind: the framework's platform helpers say which device it runs on.
    cuda_helper, npu_helper = _search("cuda_helpers", text), _search("npu_helpers", text)
    if cuda_helper and npu_helper:
        raise ValueError(
            f"cannot tell the device: the file checks for both ({cuda_helper.group(0).strip()!r} and "
            f"{npu_helper.group(0).strip()!r}) and drives no streams itself; give --mode cuda, or "
            f"--mode eager, npugraph-ex or ge-graph for an Ascend NPU"
        )
    if cuda_helper:
        return "cuda", f"found {cuda_helper.group(0).strip()!r}, the framework's CUDA helper, and no NPU code"
    return "eager", "no torchair or npugraph_ex markers (native torch_npu streams)"


def resolve_mode(requested: str, text: str) -> tuple[str, str]:
    if requested == "auto":
        return detect_mode(text)
    if requested not in MODES:
        raise ValueError(f"unknown mode {requested!r}; choose auto, {', '.join(MODES)}")
    return requested, "given with --mode"
