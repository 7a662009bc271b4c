"""verify.compare: what makes two runs differ (outputs, then the buffers a train run leaves)."""

from __future__ import annotations

import torch

from msrewrite.verify import RunResult, _snapshot, compare, flatten_outputs


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


def test_the_same_values_in_another_dtype_differ():
    a = RunResult("original", [torch.ones(2)])
    b = RunResult("flag on", [torch.ones(2, dtype=torch.float64)])
    assert compare(a, b, 0.0, 0.0) == "flag on: output 0 has dtype torch.float64, original torch.float32"


def test_nan_where_the_original_has_nan_is_equal_and_a_new_nan_is_not():
    nan = float("nan")
    a = RunResult("original", [torch.tensor([1.0, nan])])
    assert compare(a, RunResult("flag on", [torch.tensor([1.0, nan])]), 0.0, 0.0) is None
    assert "output 0 differs" in compare(a, RunResult("flag on", [torch.tensor([nan, nan])]), 0.0, 0.0)


def test_an_input_written_in_place_is_a_difference_and_a_freed_one_is_named():
    a = RunResult("original", [torch.ones(2)], inputs=[torch.zeros(3)])
    b = RunResult("flag on", [torch.ones(2)], inputs=[torch.ones(3)])
    assert compare(a, b, 0.0, 0.0) == "flag on: input 0 differs from original after the forward (written in place)"
    freed = torch.zeros(3)
    freed.untyped_storage().resize_(0)
    assert _snapshot(freed) is None  # reading it would read past the end of its storage
    assert compare(a, RunResult("flag on", [torch.ones(2)], inputs=[None]), 0.0, 0.0) is not None


def test_gradients_differ_by_a_missing_one_not_by_the_order_of_sums():
    a = RunResult("original", [torch.ones(2)], grads=[("w", torch.tensor([1.0, 3.0]))])
    rounded = RunResult("flag on", [torch.ones(2)], grads=[("w", torch.tensor([1.0, 3.0 + 1e-6]))])
    assert compare(a, rounded, 0.0, 0.0) is None
    missing = RunResult("flag on", [torch.ones(2)], grads=[("w", None)])
    assert compare(a, missing, 0.0, 0.0) == "flag on: no gradient for parameter w, unlike original"
    doubled = RunResult("flag on", [torch.ones(2)], grads=[("w", torch.tensor([2.0, 6.0]))])
    assert compare(a, doubled, 0.0, 0.0) == "flag on: the gradient of parameter w differs from original"


def test_a_python_number_in_the_output_is_compared():
    assert [t.item() for t in flatten_outputs((torch.ones(1), 0.25, {"n": 3}))] == [1.0, 0.25, 3]
    a = RunResult("original", flatten_outputs((torch.ones(1), 0.25)))
    b = RunResult("flag on", flatten_outputs((torch.ones(1), 0.5)))
    assert compare(a, b, 0.0, 0.0) == "flag on: output 1 differs from original (max |diff| 0.25)"


def test_a_scaled_tolerance_is_a_fraction_of_each_tensors_largest_entry():
    a = RunResult("original", [torch.tensor([3.0, 1e-8])], buffers=[("seen", torch.tensor([1e-8]))])
    rounded = RunResult("flag on", [torch.tensor([3.0, 2e-8])], buffers=[("seen", torch.tensor([1e-8]))])
    assert compare(a, rounded, 1e-6, 1e-5, scaled=True) is None  # 1e-8 off next to a 3.0: rounding
    moved = RunResult("flag on", [torch.tensor([3.0, 1e-8])], buffers=[("seen", torch.tensor([2e-8]))])
    assert compare(a, moved, 1e-6, 1e-5, scaled=True) == "flag on: buffer seen differs from original after the forward"
    assert compare(a, moved, 1e-6, 1e-5) is None  # an absolute atol would let it through
