"""Asynchronous collectives (analyze/defuse.py `extend_pending`): `work = dist.all_reduce(x,
async_op=True)`, `dist.isend` / `irecv`, `batch_isend_irecv` and the functional collectives of
`torch.distributed._functional_collectives` keep writing (reading, for a send) their buffer after
the call, until `work.wait()` / `wait_tensor` (or, for an AsyncCollectiveTensor, its first use);
without a wait in the function, until its end. The fork never goes between the call and the wait
when the side reads the buffer, the side is not moved across such a pending write, and `work.wait()`
is the end of the write (a barrier, not an unseen callee). Each unsafe model is refused, naming the
collective; its safe twin is edited and (behind `self.training`, off in make()'s eval model) verifies."""

from __future__ import annotations

import pytest

from test_effects import edit, model, refusal, verified

HEADER = "import torch.distributed as dist\nimport torch.distributed._functional_collectives as funcol\n"


def source(body: str) -> str:
    return HEADER + model(body)


WAITED = """
if self.training:
    work = dist.all_reduce(x, async_op=True)
    h = self.identity(x)
    work.wait()
s = self.shared_experts(x)
w = self.gate(x)
y = self.experts(x, w)
return y + s
"""

UNSAFE = {
    # the buffer is still being written when the side would read it
    "never_waited": (WAITED.replace("    work.wait()\n", ""), "dist.all_reduce(...)"),
    "discarded": (WAITED.replace("work = ", "").replace("    work.wait()\n", ""), "dist.all_reduce(...)"),
    "escapes": (WAITED.replace("    work.wait()\n", "    self.pending = work\n"), "dist.all_reduce(...)"),
    "waited_after_the_side": (
        """
req = dist.irecv(x, 1)
s = self.shared_experts(x)
w = self.gate(x)
y = self.experts(x, w)
req.wait()
return y + s
""",
        "dist.irecv(...)",
    ),
    "async_op_variable": (
        WAITED.replace("async_op=True", "async_op=self.training").replace("    work.wait()\n", ""),
        "dist.all_reduce(...)",
    ),
    "batch_never_waited": (
        """
reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, 1)])
s = self.shared_experts(x)
w = self.gate(x)
y = self.experts(x, w)
return y + s
""",
        "dist.batch_isend_irecv(...)",
    ),
    "funcol_irecv_unused": (
        """
r = funcol.irecv_inplace(x, 1)
s = self.shared_experts(x)
w = self.gate(x)
y = self.experts(x, w)
return y + s + r
""",
        "funcol.irecv_inplace(...)",
    ),
}


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_a_read_of_a_buffer_an_async_collective_still_writes_is_refused_naming_it(tmp_path, name):
    body, callee = UNSAFE[name]
    reason = refusal(tmp_path, source(body))
    assert "in place while the side stream reads it" in reason or "the side branch writes its input" in reason, reason
    assert f"({callee} at line" in reason and "writes it asynchronously" in reason, reason


def test_the_side_is_not_moved_across_a_pending_write(tmp_path):
    # the side reads x first; the async all_reduce writes it until its wait, after the side's place
    reason = refusal(
        tmp_path,
        source("""
s = self.shared_experts(x)
w = self.gate(x)
work = dist.all_reduce(x, async_op=True)
y = self.experts(w, w)
work.wait()
return y + s
"""),
    )
    assert "in place while the side stream reads it" in reason, reason


SAFE = {
    "waited": WAITED,
    "irecv_waited": WAITED.replace("dist.all_reduce(x, async_op=True)", "dist.irecv(x, 1)"),
    "isend_read_only": WAITED.replace("dist.all_reduce(x, async_op=True)", "dist.isend(x, 1)"),
    "batch_waited_in_a_loop": """
if self.training:
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, 1)])
    for r in reqs:
        r.wait()
s = self.shared_experts(x)
w = self.gate(x)
y = self.experts(x, w)
return y + s
""",
    "sync_all_reduce": WAITED.replace(", async_op=True", "").replace("    work.wait()\n", ""),
    "funcol_wait_tensor": """
g = x
if self.training:
    g = funcol.all_reduce(x, "sum", [0])
    g = funcol.wait_tensor(g)
s = self.shared_experts(g)
w = self.gate(x)
y = self.experts(x, w)
return y + s
""",
    "funcol_result_on_the_main_path": """
s = self.shared_experts(x)
w = self.gate(x)
if self.training:
    w = funcol.all_gather_tensor(w, 0, [0])
y = self.experts(x, w)
return y + s
""",
}


@pytest.mark.parametrize("name", sorted(SAFE))
def test_the_fork_goes_after_the_wait_and_the_edit_names_no_unseen_callee(tmp_path, name):
    plan, edited, _ = edit(tmp_path, source(SAFE[name]))
    assert plan.protect_inputs == ()
    assert plan.trust_boundary == (), plan.trust_boundary
    text = edited.read_text()
    for wait in (".wait()", "wait_tensor("):
        if wait in SAFE[name]:
            assert text.index(wait) < text.index(".wait_stream("), text


def test_protect_clone_cannot_snapshot_a_buffer_still_being_written(tmp_path):
    # a snapshot at the fork would copy it mid-write: still refused, naming the collective
    reason = refusal(tmp_path, source(UNSAFE["never_waited"][0]), protect="clone")
    assert "(dist.all_reduce(...) at line" in reason and "writes it asynchronously" in reason, reason


def test_a_helper_that_returns_the_work_keeps_the_write_pending_in_its_caller(tmp_path):
    helper = "\n\ndef start(t):\n    return dist.all_reduce(t, async_op=True)\n"
    body = WAITED.replace("dist.all_reduce(x, async_op=True)", "start(x)")
    reason = refusal(tmp_path, source(body.replace("    work.wait()\n", "")) + helper)
    assert "(start(...) at line" in reason and "writes it asynchronously" in reason, reason
    plan, _, _ = edit(tmp_path, source(body) + helper)
    assert plan.trust_boundary == (), plan.trust_boundary


def test_functional_collectives_are_known_not_unseen():
    import libcst as cst

    from msrewrite.analyze.torch_effects import torch_call_effect

    for text in (
        "funcol.all_reduce(x, 'sum', g)",
        "torch.distributed._functional_collectives.reduce_scatter_tensor(x, 'sum', 0, g)",
    ):
        effect = torch_call_effect(cst.parse_expression(text))
        assert effect is not None and not effect.unknown and not effect.writes and not effect.returns
        assert effect.collective and effect.waits_on_use
    inplace = torch_call_effect(cst.parse_expression("funcol.all_reduce_inplace(x, 'sum', g)"))
    assert inplace is not None and [cst.Module([]).code_for_node(w) for w in inplace.writes] == ["x"]
    wait = torch_call_effect(cst.parse_expression("funcol.wait_tensor(y)"))
    assert wait is not None and wait.barrier and [cst.Module([]).code_for_node(r) for r in wait.returns] == ["y"]
    other = torch_call_effect(cst.parse_expression("funcol._unlisted(x)"))
    assert other is not None and other.unknown == ["funcol._unlisted (not visible to msrewrite)"]


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", ["waited", "funcol_wait_tensor", "batch_waited_in_a_loop"])
def test_the_safe_twin_verifies(tmp_path, name):
    verified(tmp_path, source(SAFE[name]))
