"""Device profiles for the cost model (no torch import, so the static tier stays fast)."""

from __future__ import annotations

from msrewrite.records import record


@record(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: float  # dense bf16/fp16 FLOP/s of one device (one torch device)
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s per device for collectives
    launch_overhead: float  # s per kernel launch from the host (eager mode)
    sync_overhead: float  # s for one cross-stream event record + wait


# Sources (public spec sheets; rounded, dense, no sparsity):
# - A2 (Ascend 910B, Atlas 800T A2): ~313 TFLOP/s FP16/BF16 and 1.6 TB/s HBM2e per chip (Huawei
#   Atlas 800T A2 / 910B product pages; figures vary 280-376 TFLOP/s by bin); HCCS 56 GB/s per link x7
#   ≈ 392 GB/s, of which ~200 GB/s is usable per direction for all-to-all.
# - A3 (Ascend 910C, Atlas 900 A3 SuperPoD): per die (one torch_npu device) ~376 TFLOP/s BF16 and
#   1.6 TB/s HBM; 752 TFLOP/s and 3.2 TB/s per two-die package (CloudMatrix384 paper, arXiv 2506.12708);
#   UB fabric ~196 GB/s per die per direction (same paper).
# - H200 SXM: 989 TFLOP/s BF16 dense (1,979 with sparsity), 4.8 TB/s HBM3e, NVLink 900 GB/s total
#   (NVIDIA H200 datasheet), so ~450 GB/s per direction.
# Launch and sync overheads are typical eager figures: a few µs per kernel launch through the runtime,
# and an event record plus a stream wait costs about as much as one or two launches; graph modes lower both.
PROFILES: dict[str, DeviceProfile] = {
    "a2": DeviceProfile("Ascend 910B (A2)", 313e12, 1.6e12, 200e9, 5e-6, 5e-6),
    "a3": DeviceProfile("Ascend 910C die (A3)", 376e12, 1.6e12, 196e9, 5e-6, 5e-6),
    "h200": DeviceProfile("NVIDIA H200 SXM", 989e12, 4.8e12, 450e9, 4e-6, 3e-6),
}


def profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; expected one of {', '.join(PROFILES)}") from None
