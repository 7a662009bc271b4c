"""Cost model: FLOPs and bytes per op, device profiles, roofline time per branch, predicted saving.

Times are estimates for ranking, not measurements: an op takes max(FLOPs / peak, bytes / HBM
bandwidth); a branch takes the sum of its ops. Overlapping two independent branches can save at
most the shorter one, minus the cost of the fork and join synchronizations (event record + wait
on each side). Two compute-bound branches compete for the same cores, so the saving is an upper
bound; decode (few tokens, bandwidth- and launch-bound) is where it is most real.
"""

from __future__ import annotations

import math

import torch

from msrewrite.records import record
from msrewrite.suggest.profiles import PROFILES, DeviceProfile, profile  # noqa: F401  (re-exported)
from msrewrite.suggest.trace import OpRecord

# FLOPs and bytes ---------------------------------------------------------------------------------
_MATMUL = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear"}
_COLLECTIVE_HINTS = ("c10d", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast_")
_COPY = {"aten.copy_", "aten._to_copy", "aten.clone", "aten.contiguous", "aten.cat", "aten.index_select", "aten.index"}


def _packet(name: str) -> str:
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


def _shape(t) -> list[int]:
    return [int(s) for s in t.shape] if isinstance(t, torch.Tensor) else []


def _numel(t) -> int:
    return math.prod(_shape(t)) if isinstance(t, torch.Tensor) else 0


def _nbytes(t) -> int:
    return _numel(t) * t.element_size() if isinstance(t, torch.Tensor) else 0


def op_flops(op: OpRecord) -> float:
    if op.estimate is not None:
        return op.estimate[0]
    packet = _packet(op.name)
    tensors = [a for a in op.args if isinstance(a, torch.Tensor)]
    if packet in _MATMUL and len(tensors) >= 2:
        a, b = tensors[-2], tensors[-1]
        out = op.outputs[0] if op.outputs else None
        k = _shape(a)[-1] if _shape(a) else 0
        return 2.0 * _numel(out) * k
    if packet == "aten._grouped_mm" and len(tensors) >= 2:
        a, b = tensors[0], tensors[1]
        # (rows, K) x (E, K, N): every row meets one expert's K x N matrix.
        rows, k = (_shape(a) + [0, 0])[:2]
        n = _shape(b)[-1] if _shape(b) else 0
        return 2.0 * rows * k * n
    if "scaled_dot_product" in packet or "flash_attention" in packet:
        query, key = tensors[0], tensors[1]
        *batch, lq, d = _shape(query)
        lk = _shape(key)[-2]
        return 4.0 * math.prod(batch) * lq * lk * d
    if op.is_view or is_collective(op):
        return 0.0
    return float(sum(_numel(t) for t in op.outputs))  # elementwise and reductions: ~1 FLOP per output


def op_bytes(op: OpRecord) -> float:
    if op.estimate is not None:
        return op.estimate[1]
    if op.is_view:
        return 0.0
    packet = _packet(op.name)
    if packet == "aten._grouped_mm":
        tensors = [a for a in op.args if isinstance(a, torch.Tensor)]
        a, b = tensors[0], tensors[1]
        experts = _shape(b)[0] if _shape(b) else 1
        rows = _shape(a)[0] if _shape(a) else 0
        # Only experts that receive a token are read: E * (1 - (1 - 1/E)^rows) of them in expectation.
        touched = experts * (1.0 - (1.0 - 1.0 / experts) ** rows) if experts else 0.0
        weight = _nbytes(b) * touched / max(experts, 1)
        return float(_nbytes(a) + weight + sum(_nbytes(t) for t in op.outputs))
    return float(sum(_nbytes(t) for t in op.inputs) + sum(_nbytes(t) for t in op.outputs))


def is_collective(op: OpRecord) -> bool:
    return any(hint in op.name for hint in _COLLECTIVE_HINTS)


def kind_of(op: OpRecord) -> str:
    packet = _packet(op.name)
    if is_collective(op):
        return "collective"
    if packet in _MATMUL or packet == "aten._grouped_mm" or op.estimate is not None:
        return "matmul"
    if "scaled_dot_product" in packet or "attention" in packet:
        return "attention"
    if op.is_view:
        return "view"
    if packet in _COPY:
        return "copy"
    return "vector"


def op_time(op: OpRecord, device: DeviceProfile) -> float:
    if op.is_view:
        return 0.0
    if is_collective(op):
        return op_bytes(op) / device.link_bandwidth
    return max(op_flops(op) / device.peak_flops, op_bytes(op) / device.hbm_bandwidth)


# Branches ---------------------------------------------------------------------------------------
@record(frozen=True)
class BranchCost:
    side_time: float  # s, the branch moved to the side stream
    main_time: float  # s, the main-path work it overlaps with
    scope_time: float  # s, the whole function
    side_flops: float
    main_flops: float
    side_bytes: float
    main_bytes: float
    sync_time: float
    launches: int
    side_bound: str = ""  # "compute" or "memory": what limits the branch on this device
    main_bound: str = ""

    @property
    def saving(self) -> float:
        return min(self.side_time, self.main_time) - self.sync_time

    @property
    def bound(self) -> float:
        """Critical-path bound of the function: total / (total - overlapped)."""
        overlapped = min(self.side_time, self.main_time)
        rest = self.scope_time - overlapped
        return self.scope_time / rest if rest > 0 else 1.0

    @property
    def same_resource(self) -> str | None:
        """The resource both branches are bound by (then they compete and overlap pays less)."""
        if self.side_bound and self.side_bound == self.main_bound:
            return "HBM bandwidth" if self.side_bound == "memory" else "cube compute"
        return None

    @property
    def too_small(self) -> bool:
        """The shorter branch does not pay for its synchronizations twice over."""
        return min(self.side_time, self.main_time) < 2 * self.sync_time


def branch_cost(
    side: list[OpRecord], main: list[OpRecord], scope: list[OpRecord], device: DeviceProfile, syncs: int | None = None
) -> BranchCost:
    """Costs of one overlap; `syncs` is the fewest fork + join synchronizations (2 when unknown)."""
    return BranchCost(
        side_time=sum(op_time(o, device) for o in side),
        main_time=sum(op_time(o, device) for o in main),
        scope_time=sum(op_time(o, device) for o in scope),
        side_flops=sum(op_flops(o) for o in side),
        main_flops=sum(op_flops(o) for o in main),
        side_bytes=sum(op_bytes(o) for o in side),
        main_bytes=sum(op_bytes(o) for o in main),
        sync_time=(syncs or 2) * device.sync_overhead,  # fork (side waits main) + join (main waits side)
        launches=sum(1 for o in side if not o.is_view),
        side_bound=_bound(side, device),
        main_bound=_bound(main, device),
    )


def _bound(ops: list[OpRecord], device: DeviceProfile) -> str:
    """Roofline: whether the branch's arithmetic or its memory traffic takes longer."""
    flops = sum(op_flops(o) for o in ops if not is_collective(o))
    traffic = sum(op_bytes(o) for o in ops if not o.is_view and not is_collective(o))
    if not flops and not traffic:
        return ""
    return "compute" if flops / device.peak_flops >= traffic / device.hbm_bandwidth else "memory"
