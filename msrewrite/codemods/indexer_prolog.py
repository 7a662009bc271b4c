"""indexer-prolog as a libcst codemod (msrewrite/cases/indexer_prolog.py)."""

from __future__ import annotations

from msrewrite.codemods._base import CaseCodemod


class IndexerProlog(CaseCodemod):
    CASE = "indexer-prolog"
    DESCRIPTION = (
        "msrewrite indexer-prolog: indexer prolog: q path and weights projection on two side streams, k path on main."
    )
