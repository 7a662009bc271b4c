"""Which tensors an aten op reads, writes and allocates, from its schema (as CSAN does)."""

from __future__ import annotations

import re

import torch

# Factories like zeros_like / new_empty only look at metadata of their tensor argument.
_METADATA_ONLY = re.compile(r"^(new_.*|.*_like)$")


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def classify(func, args, kwargs, outputs) -> tuple[list, list, list]:
    """(reads, writes, fresh outputs). Views (alias without write) are neither read nor written."""
    schema = func._schema
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    metadata_only = bool(_METADATA_ONLY.match(func.overloadpacket.__name__))
    for index, argument in enumerate(schema.arguments):
        if index < len(args) and not argument.kwarg_only:
            value = args[index]
        else:
            value = kwargs.get(argument.name)
        tensors = _tensors(value)
        if not tensors:
            continue
        alias = argument.alias_info
        if alias is None:
            if not metadata_only:
                reads.extend(tensors)
        elif alias.is_write:
            writes.extend(tensors)
    fresh: list[torch.Tensor] = []
    results = outputs if isinstance(outputs, (tuple, list)) and len(schema.returns) != 1 else (outputs,)
    for ret, value in zip(schema.returns, results, strict=False):
        if ret.alias_info is None:
            fresh.extend(_tensors(value))
    return reads, writes, fresh
