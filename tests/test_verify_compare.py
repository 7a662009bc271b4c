"""verify.compare: what makes two runs differ (outputs, then the buffers a train run leaves)."""

from __future__ import annotations

import torch

from msrewrite.verify import RunResult, compare


def run(name: str, buffers: list[tuple[str, torch.Tensor]]) -> RunResult:
    return RunResult(name, [torch.ones(2)], buffers=buffers)


def test_equal_buffers_by_name_are_equal():
    a = run("original", [("bn.running_mean", torch.zeros(3)), ("bn.num_batches_tracked", torch.tensor(1))])
    b = run("flag on", [("bn.running_mean", torch.zeros(3)), ("bn.num_batches_tracked", torch.tensor(1))])
    assert compare(a, b, 0.0, 0.0) is None


def test_a_changed_buffer_is_named():
    a = run("original", [("bn.running_mean", torch.zeros(3))])
    b = run("flag on", [("bn.running_mean", torch.ones(3))])
    assert compare(a, b, 0.0, 0.0) == "flag on: buffer bn.running_mean differs from original after the forward"


def test_a_missing_buffer_is_a_difference_not_skipped():
    # the old pairing by position stopped at the shorter list and passed this
    a = run("original", [("cache", torch.zeros(3)), ("bn.running_mean", torch.zeros(3))])
    b = run("flag on", [("cache", torch.zeros(3))])
    assert compare(a, b, 0.0, 0.0) == "flag on: no buffer bn.running_mean after the forward, unlike original"


def test_an_extra_buffer_is_a_difference():
    a = run("original", [("cache", torch.zeros(3))])
    b = run("flag on", [("cache", torch.zeros(3)), ("side_copy", torch.zeros(3))])
    assert compare(a, b, 0.0, 0.0) == "flag on: an extra buffer side_copy after the forward, unlike original"
