"""A helper that stores one argument in another (`def put(buf, x): buf[0] = x`, `buf.append(x)`,
`d[k] = x`, `setattr(obj, "a", x)`, `obj.a = x`) makes its summary say "argument buf now holds
argument x" (analyze/summaries.py `Summary.holds`), so that a caller's later write through the
container (`lst[0].mul_(2)`) is a write of the tensor it holds. A callee msrewrite cannot see into
may store any argument in any other. Each shape: a model that must be refused, naming the callee
that stored it, and a safe twin (the container holds a copy) that is still edited and verifies."""

from __future__ import annotations

import pytest

from test_effects import edit, model, refusal, verified

HELPERS = """

def put(buf, x):
    buf[0] = x


def put_append(buf, x):
    buf.append(x)


def put_key(d, k, x):
    d[k] = x


def put_setattr(obj, x):
    setattr(obj, "a", x)


def put_attr(obj, x):
    obj.a = x


def put_twice(buf, x):
    put(buf, x)  # through another helper


class Holder:
    pass
"""


def stored_then_written(store: str, write: str) -> str:
    """`store` keeps x in a container before the side reads x; after the fork the main path
    writes through the container."""
    return (
        model(f"""
    {store}
    s = self.shared_experts(x)
    w = self.gate(x)
    {write}
    y = self.experts(x, w)
    return y + s
    """)
        + HELPERS
    )


UNSAFE = {
    "subscript": ("lst = [None]\n    put(lst, STORED)", "lst[0].mul_(2)", "put"),
    "append": ("lst = []\n    put_append(lst, STORED)", "lst[0].mul_(2)", "put_append -> buf.append"),
    "dict_key": ("d = {}\n    put_key(d, 'k', STORED)", "d['k'].mul_(2)", "put_key"),
    "setattr": ("o = Holder()\n    put_setattr(o, STORED)", "o.a.mul_(2)", "put_setattr"),
    "attribute": ("o = Holder()\n    put_attr(o, STORED)", "o.a.mul_(2)", "put_attr"),
    "nested_helper": ("lst = [None]\n    put_twice(lst, STORED)", "lst[0].mul_(2)", "put_twice"),
    "setattr_direct": ("o = Holder()\n    setattr(o, 'a', STORED)", "o.a.add_(1)", "setattr"),
    "list_append_direct": ("lst = []\n    lst.append(STORED)", "lst[0].mul_(2)", "lst.append"),
    "unseen_helper": ("lst = []\n    _unseen_store(lst, STORED)", "lst[0].mul_(2)", "_unseen_store"),
}


def _source(name: str, stored: str) -> str:
    store, write, _ = UNSAFE[name]
    source = stored_then_written(store.replace("STORED", stored), write)
    if name == "unseen_helper":  # bound at run time: msrewrite cannot read it
        source += "\n\n_unseen_store = getattr(list, 'append')\n"
    return source


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_a_write_through_a_container_a_callee_filled_is_refused_naming_it(tmp_path, name):
    reason = refusal(tmp_path, _source(name, "x"))
    assert "writes '" in reason and "in place while the side stream reads it" in reason, reason
    assert "may hold the storage of 'x' (stored in it at line" in reason, reason
    assert f"by {UNSAFE[name][2]}" in reason, reason


@pytest.mark.parametrize(
    "name", sorted(n for n in UNSAFE if n not in ("append", "list_append_direct", "unseen_helper"))
)
def test_the_container_holding_a_copy_is_still_edited(tmp_path, name):
    plan, _, _ = edit(tmp_path, _source(name, "x.clone()"))
    assert plan.protect_inputs == ()
    assert plan.trust_boundary == (), plan.trust_boundary


@pytest.mark.parametrize("name", ["append", "list_append_direct", "unseen_helper"])
def test_the_copy_stored_by_an_unseen_callee_is_edited_naming_it(tmp_path, name):
    plan, _, _ = edit(tmp_path, _source(name, "x.clone()"))
    assert plan.protect_inputs == ()
    assert plan.trust_boundary, plan.trust_boundary  # the edit says what it assumed of the callee


def test_protect_clone_snapshots_the_input_a_helper_stored(tmp_path):
    plan, _, _ = edit(tmp_path, _source("subscript", "x"), protect="clone")
    assert plan.protect_inputs == ("x",)


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", ["subscript", "append", "setattr"])
def test_the_container_holding_a_copy_verifies(tmp_path, name):
    verified(tmp_path, _source(name, "x.clone()"))


@pytest.mark.slow  # runs the model through verify
def test_protect_clone_of_a_stored_input_verifies(tmp_path):
    verified(tmp_path, _source("subscript", "x"), protect="clone")
