"""A package's function with an unseen call is summarized strictly (it may write every argument),
and the collectives, RNG draws and stream work it is seen to do still count: the strict summary
used to drop them, so a package helper calling `dist.all_reduce` next to an unseen kernel looked
like no collective at all."""

from __future__ import annotations

import libcst as cst

from msrewrite.analyze.summaries import ModuleSummaries

PACKAGE = """
import torch
import torch.distributed as dist
from somewhere_unseen import fused_kernel


def reduce_then_kernel(x):
    dist.all_reduce(x)
    return fused_kernel(x)


def draw_then_kernel(x):
    noise = torch.rand_like(x)
    return fused_kernel(x + noise)


def kernel_only(x):
    return fused_kernel(x)
"""


def summary(name: str, package: bool):
    index = ModuleSummaries(cst.parse_module(PACKAGE), _package=package)
    return index.function_summary(None, index.functions[name])


def test_a_strict_package_summary_keeps_the_collective_and_rng_it_saw():
    reduce, draw, only = (summary(n, package=True) for n in ("reduce_then_kernel", "draw_then_kernel", "kernel_only"))
    assert reduce.unknown and reduce.may_write  # strict: may write every argument
    assert reduce.collective and not reduce.rng
    assert draw.rng and not draw.collective
    assert not (only.collective or only.rng or only.stream)


def test_the_users_own_file_is_summarized_the_same_way():
    assert summary("reduce_then_kernel", package=False).collective
    assert summary("draw_then_kernel", package=False).rng
