"""afd-overlap as a libcst codemod (msrewrite/cases/afd_overlap.py)."""

from __future__ import annotations

from msrewrite.codemods._base import CaseCodemod


class AfdOverlap(CaseCodemod):
    CASE = "afd-overlap"
    DESCRIPTION = "msrewrite afd-overlap: sends to a remote FFN issued early and received late (isend/irecv), overlapping local compute."
