"""attn-moe-limit-core as a libcst codemod (msrewrite/cases/attn_moe_limit_core.py)."""

from __future__ import annotations

from msrewrite.codemods._base import CaseCodemod


class AttnMoeLimitCore(CaseCodemod):
    CASE = "attn-moe-limit-core"
    DESCRIPTION = "msrewrite attn-moe-limit-core: shortcut MoE on a side stream next to attention, with AI cores split between the streams."
