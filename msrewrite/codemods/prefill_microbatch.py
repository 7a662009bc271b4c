"""prefill-microbatch as a libcst codemod (msrewrite/cases/prefill_microbatch.py)."""

from __future__ import annotations

from msrewrite.codemods._base import CaseCodemod


class PrefillMicrobatch(CaseCodemod):
    CASE = "prefill-microbatch"
    DESCRIPTION = "msrewrite prefill-microbatch: two micro-batches through every layer, collectives on a comm stream one micro-batch behind."
