"""moe-shared-expert as a libcst codemod (msrewrite/cases/moe_shared_expert.py)."""

from __future__ import annotations

from msrewrite.codemods._base import CaseCodemod


class MoeSharedExpert(CaseCodemod):
    CASE = "moe-shared-expert"
    DESCRIPTION = (
        "msrewrite moe-shared-expert: MoE shared expert on a side stream, overlapping the router and routed experts."
    )
