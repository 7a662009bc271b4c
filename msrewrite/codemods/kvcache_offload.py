"""kvcache-offload as a libcst codemod (msrewrite/cases/kvcache_offload.py)."""

from __future__ import annotations

from msrewrite.codemods._base import CaseCodemod


class KvcacheOffload(CaseCodemod):
    CASE = "kvcache-offload"
    DESCRIPTION = "msrewrite kvcache-offload: KV-cache offload and prefetch copies on a copy stream, joined where the buffer is reused."
