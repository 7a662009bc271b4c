"""AI-core budgets for two overlapping branches, per Ascend device.

Limits split the device's cube (AIC) and vector (AIV) cores between the side and the main branch.
Their sum must never exceed the device: parallel branches waiting on cores that do not exist can
deadlock (cann-recipes docs/cann/zh/multi_stream_principles.md §2.2).

Device totals (per die, as torch_npu sees one device):
  a3: Atlas A3 (Ascend 910C die): 24 AIC / 48 AIV. The LongCat-Flash stage-2 preset uses exactly
      that: side c8v16 + main c16v32 (cann-recipes docs/models/longcat_flash/
      longcat_flash_optimization.md); "a3-even" is its symmetric mode-2 split, c12v24 + c12v24.
  a2: Atlas A2 (Ascend 910B): 24 AIC / 48 AIV on 910B1/B2, 20 AIC / 40 AIV on 910B3/B4; the preset
      assumes the smaller part. Read ai_core_cnt / vector_core_cnt from your platform's
      ascend_*.ini and pass --core-limit when your part differs.
"""

from __future__ import annotations

from msrewrite.errors import BadInput
from msrewrite.records import record

DEVICE_CORES = {"a2": (20, 40), "a3": (24, 48)}
PRESETS = {
    "a2": (8, 16, 12, 24),
    "a3": (8, 16, 16, 32),
    "a3-even": (12, 24, 12, 24),
}


@record(frozen=True)
class CoreBudget:
    side_aicore: int
    side_vector: int
    main_aicore: int
    main_vector: int

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.side_aicore, self.side_vector, self.main_aicore, self.main_vector)


def parse_limit(text: str) -> tuple[int, int, int, int]:
    """'8/16,16/32' -> side 8 AIC / 16 AIV, main 16 AIC / 32 AIV."""
    try:
        side, main = text.split(",")
        side_c, side_v = (int(x) for x in side.split("/"))
        main_c, main_v = (int(x) for x in main.split("/"))
    except ValueError:
        raise BadInput(
            f"--core-limit must look like SIDE_AIC/SIDE_AIV,MAIN_AIC/MAIN_AIV (e.g. 8/16,16/32), got {text!r}"
        ) from None
    return side_c, side_v, main_c, main_v


def resolve(preset: str, limit: str | None) -> CoreBudget:
    """The budget for --cores PRESET [--core-limit ...], refused when it exceeds the device."""
    device = preset.split("-")[0]
    if preset not in PRESETS or device not in DEVICE_CORES:
        raise BadInput(f"unknown core preset {preset!r}; choose {', '.join(sorted(PRESETS))}")
    values = parse_limit(limit) if limit else PRESETS[preset]
    side_c, side_v, main_c, main_v = values
    if min(values) < 1:
        raise BadInput("core limits must be at least 1 on each branch")
    total_c, total_v = DEVICE_CORES[device]
    if side_c + main_c > total_c or side_v + main_v > total_v:
        raise BadInput(
            f"core budget {side_c}+{main_c} AIC / {side_v}+{main_v} AIV exceeds {device}'s "
            f"{total_c} AIC / {total_v} AIV: branches waiting for cores that do not exist can deadlock"
        )
    return CoreBudget(*values)
