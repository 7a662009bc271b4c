"""The cases: one module per case, each defining CASE (see msrewrite.cases.Case).

A case's module is named after it (moe-shared-expert: moe_shared_expert.py) and imported when
it is asked for: `apply --case X` loads X alone, `cases` and lookups by other names load all.
"""

from __future__ import annotations

import importlib

from msrewrite.cases import Case

# in the order `msrewrite cases` lists them
_MODULES = (
    "moe_shared_expert",
    "moe_shared_expert_phased",
    "moe_shared_mlp_init",
    "indexer_prolog",
    "kvcache_offload",
    "attn_moe_limit_core",
    "afd_overlap",
    "prefill_microbatch",
)


def _case(module: str) -> Case:
    return importlib.import_module(f"{__name__}.{module}").CASE


def all_cases() -> list[Case]:
    return [_case(module) for module in _MODULES]


def get_case(name: str) -> Case | None:
    module = name.replace("-", "_")
    if module in _MODULES and _case(module).name == name:  # its own module: the others stay unread
        return _case(module)
    return next((c for c in all_cases() if c.name == name), None)
