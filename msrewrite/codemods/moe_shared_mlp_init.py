"""moe-shared-mlp-init as a libcst codemod (msrewrite/cases/moe_shared_mlp_init.py)."""

from __future__ import annotations

from msrewrite.codemods._base import CaseCodemod


class MoeSharedMlpInit(CaseCodemod):
    CASE = "moe-shared-mlp-init"
    DESCRIPTION = "msrewrite moe-shared-mlp-init: shared MLP on a side stream created at model construction and handed to every MoE layer."
