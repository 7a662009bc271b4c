"""Execution-mode detection: which API family the edited file must speak.

torchair's CompilerConfig / get_npu_backend mean GE graph mode; backend="npugraph_ex" means
npugraph-ex (aclgraph); a file that drives torch.cuda streams and never torch_npu means cuda;
otherwise the native eager API. Explicit --mode always wins.
"""

from __future__ import annotations

import re

from msrewrite.plan import MODES

_GE = re.compile(r"\bCompilerConfig\s*\(|\bget_npu_backend\s*\(|npu_stream_switch\s*\(|npu_wait_tensor\s*\(")
_NPUGRAPH_EX = re.compile(r"""backend\s*=\s*["']npugraph_ex["']|npugraph_ex\.""")
# the file already drives CUDA streams or graphs itself, and never torch_npu
_CUDA = re.compile(r"\btorch\.cuda\.(?:Stream|stream|current_stream|Event|set_stream|graph|CUDAGraph)\b")
_NPU = re.compile(r"\btorch_npu\b|\btorch\.npu\b")


def detect_mode(text: str) -> tuple[str, str]:
    """(mode, reason) for a source file."""
    ge = _GE.search(text)
    if ge:
        return "ge-graph", f"found {ge.group(0).strip()!r} (torchair GE graph mode)"
    ex = _NPUGRAPH_EX.search(text)
    if ex:
        return "npugraph-ex", f"found {ex.group(0).strip()!r} (npugraph_ex / aclgraph)"
    cuda = _CUDA.search(text)
    if cuda and not _NPU.search(text):
        return "cuda", f"found {cuda.group(0)!r} and no torch_npu (the file speaks CUDA streams)"
    return "eager", "no torchair or npugraph_ex markers (native torch_npu streams)"


def resolve_mode(requested: str, text: str) -> tuple[str, str]:
    if requested == "auto":
        return detect_mode(text)
    if requested not in MODES:
        raise ValueError(f"unknown mode {requested!r}; choose auto, {', '.join(MODES)}")
    return requested, "given with --mode"
