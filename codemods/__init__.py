"""The cases: one module per case, each defining CASE (see msrewrite.cases.Case)."""

from __future__ import annotations

from msrewrite.cases import Case
from msrewrite.codemods import (
    afd_overlap,
    attn_moe_limit_core,
    indexer_prolog,
    kvcache_offload,
    moe_shared_expert,
    moe_shared_expert_phased,
    moe_shared_mlp_init,
    prefill_microbatch,
)

_CASES = [
    moe_shared_expert.CASE,
    moe_shared_expert_phased.CASE,
    moe_shared_mlp_init.CASE,
    indexer_prolog.CASE,
    kvcache_offload.CASE,
    attn_moe_limit_core.CASE,
    afd_overlap.CASE,
    prefill_microbatch.CASE,
]


def all_cases() -> list[Case]:
    return list(_CASES)


def get_case(name: str) -> Case | None:
    return next((c for c in _CASES if c.name == name), None)
