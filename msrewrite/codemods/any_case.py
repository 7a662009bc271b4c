"""Any case, named with --case (a case added as one file needs no codemod file of its own)."""

from __future__ import annotations

from msrewrite.codemods._base import CaseCodemod


class AnyCase(CaseCodemod):
    DESCRIPTION = "Run the msrewrite case named with --case (see `msrewrite cases`)."
