"""Records (msrewrite/records.py) behave as the dataclasses they replace: each check runs on a
record and on a plain dataclass declared the same way, and the two must agree."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from msrewrite.records import record


def _twins(frozen: bool):
    """The same declarations as a dataclass and as a record."""
    made = []
    for decorate in (dataclass(frozen=frozen), record(frozen=frozen)):

        class Base:
            """a base with a required field, a default, a factory and a field kept out of repr and eq"""

            name: str
            count: int = 0
            tags: list = field(default_factory=list)
            note: str = field(default="", compare=False, repr=False)

        Base = decorate(Base)

        class Child(Base):
            """a subclass adding a keyword-only field and one set after __init__"""

            level: int = field(default=1, kw_only=True)
            seen: frozenset = field(init=False, default_factory=frozenset)

            def __post_init__(self):
                object.__setattr__(self, "seen", frozenset({self.name}))

        made.append((Base, decorate(Child)))
    return made


@pytest.mark.parametrize("frozen", [False, True])
def test_construction_defaults_and_post_init_agree(frozen):
    (plain_base, plain), (rec_base, rec) = _twins(frozen)
    for args, kwargs in [(("a",), {}), (("a", 2), {"tags": [1]}), ((), {"name": "a", "level": 3, "note": "n"})]:
        left, right = plain(*args, **kwargs), rec(*args, **kwargs)
        assert dataclasses.asdict(left) == dataclasses.asdict(right)
        assert repr(left).split("(", 1)[1] == repr(right).split("(", 1)[1]
    assert plain(name="a").tags is not plain(name="a").tags
    assert rec(name="a").tags is not rec(name="a").tags  # a fresh list each time
    assert [f.name for f in dataclasses.fields(rec)] == [f.name for f in dataclasses.fields(plain)]
    assert dataclasses.is_dataclass(rec_base) and dataclasses.is_dataclass(rec("a"))


@pytest.mark.parametrize("frozen", [False, True])
def test_equality_hash_and_replace_agree(frozen):
    (_, plain), (_, rec) = _twins(frozen)
    for cls in (plain, rec):
        a, b = cls("a", note="x"), cls("a", note="y")
        assert a == b  # note is not compared
        assert a != cls("b") and a != cls("a", 1)
        assert (a == "a") is False
        changed = dataclasses.replace(a, count=5)
        assert changed.count == 5 and changed.name == "a" and type(changed) is cls
    if frozen:
        assert hash(plain("a", tags=())) == hash(plain("a", tags=(), note="z"))
        assert hash(rec("a", tags=())) == hash(rec("a", tags=(), note="z"))
    else:
        assert plain.__hash__ is None and rec.__hash__ is None  # mutable with eq: unhashable


def test_frozen_records_refuse_assignment_as_dataclasses_do():
    (_, plain), (_, rec) = _twins(True)
    for cls in (plain, rec):
        value = cls("a")
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.count = 3
        with pytest.raises(dataclasses.FrozenInstanceError):
            del value.count


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((), {}),
        (("a", 1, [], "n", 4), {}),
        (("a",), {"name": "b"}),
        (("a",), {"unknown": 1}),
        (("a",), {"seen": frozenset()}),
    ],
    ids=["missing", "too-many", "twice", "unknown", "init-false"],
)
def test_bad_arguments_are_type_errors_for_both(args, kwargs):
    (_, plain), (_, rec) = _twins(False)
    for cls in (plain, rec):
        with pytest.raises(TypeError):
            cls(*args, **kwargs)


def test_a_method_the_class_writes_itself_is_kept():
    @record(frozen=True)
    class Named:
        """a record with its own repr and hash"""

        name: str

        def __repr__(self) -> str:
            return f"<{self.name}>"

        def __hash__(self) -> int:
            return 7

    assert repr(Named("x")) == "<x>" and hash(Named("x")) == 7 and Named("x") == Named("x")
