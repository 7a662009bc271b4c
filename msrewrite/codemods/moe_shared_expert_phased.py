"""moe-shared-expert-phased as a libcst codemod (msrewrite/cases/moe_shared_expert_phased.py)."""

from __future__ import annotations

from msrewrite.codemods._base import CaseCodemod


class MoeSharedExpertPhased(CaseCodemod):
    CASE = "moe-shared-expert-phased"
    DESCRIPTION = "msrewrite moe-shared-expert-phased: shared expert inlined and issued in phases between dispatch, expert compute and combine."
