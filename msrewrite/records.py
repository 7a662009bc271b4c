"""Records: dataclasses whose methods are shared, not generated.

`@record` and `@record(frozen=True)` make a class that every dataclass tool accepts
(`dataclasses.fields`, `replace`, `asdict`, `is_dataclass`, `field(default_factory=...)`), with the
`__init__`, `__repr__`, `__eq__` and `__hash__` a dataclass would have, but written once here
instead of generated per class: a dataclass compiles each of those methods from source text when
its module is imported, and the tool's records on `apply`'s path cost every run more in that than
all of its other imports together. A record is made by `dataclasses.dataclass` with method
generation off (it still collects the fields, defaults and inheritance), then gets the shared
methods below. Classes made per op at run time (verify's recordings, the sanitizer's) stay plain
dataclasses: the generated `__init__` is faster per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform, overload

T = TypeVar("T", bound=type)
MISSING = dataclasses.MISSING


class _Spec:
    """What the shared methods need of one record class, worked out when it is made."""

    def __init__(self, cls: type, frozen: bool) -> None:
        every = dataclasses.fields(cls)
        self.name = cls.__qualname__
        self.frozen = frozen
        self.positional = tuple(f for f in every if f.init and not f.kw_only)
        self.keyword = tuple(f for f in every if f.init and f.kw_only)
        self.names = frozenset(f.name for f in every if f.init)
        self.later = tuple(f for f in every if not f.init)  # field(init=False): set from its default
        self.shown = tuple(f.name for f in every if f.repr)
        self.compared = tuple(f.name for f in every if f.compare)
        self.hashed = tuple(f.name for f in every if (f.compare if f.hash is None else f.hash))
        self.post_init = hasattr(cls, "__post_init__")


def _default(spec: _Spec, f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"{spec.name}.__init__() missing required argument: '{f.name}'")


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    spec: _Spec = type(self).__record_spec__
    if len(args) > len(spec.positional):
        raise TypeError(
            f"{spec.name}.__init__() takes {len(spec.positional) + 1} positional arguments but {len(args) + 1} were given"
        )
    unknown = [name for name in kwargs if name not in spec.names]
    if unknown:
        raise TypeError(f"{spec.name}.__init__() got an unexpected keyword argument '{unknown[0]}'")
    put = object.__setattr__  # a frozen record refuses plain assignment
    for f, value in zip(spec.positional, args, strict=False):  # the rest come by keyword
        if f.name in kwargs:
            raise TypeError(f"{spec.name}.__init__() got multiple values for argument '{f.name}'")
        put(self, f.name, value)
    for f in (*spec.positional[len(args) :], *spec.keyword):
        put(self, f.name, kwargs[f.name] if f.name in kwargs else _default(spec, f))
    for f in spec.later:
        put(self, f.name, _default(spec, f))
    if spec.post_init:
        self.__post_init__()


def _repr(self: Any) -> str:
    spec: _Spec = type(self).__record_spec__
    return f"{spec.name}({', '.join(f'{name}={getattr(self, name)!r}' for name in spec.shown)})"


def _eq(self: Any, other: Any) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    names = type(self).__record_spec__.compared
    return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)


def _hash(self: Any) -> int:
    return hash(tuple(getattr(self, n) for n in type(self).__record_spec__.hashed))


def _frozen_setattr(_self: Any, name: str, _value: Any) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(_self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _make(cls: T, frozen: bool) -> T:
    own = dict(cls.__dict__)
    dataclasses.dataclass(init=False, repr=False, eq=False)(cls)  # fields only; the same class back
    type.__setattr__(cls, "__record_spec__", _Spec(cls, frozen))
    for name, method in (("__init__", _init), ("__repr__", _repr), ("__eq__", _eq)):
        if name not in own:  # as a dataclass: a method the class writes itself is kept
            type.__setattr__(cls, name, method)
    if own.get("__hash__") is None:  # as a dataclass with eq: hashed by value when frozen, else unhashable
        type.__setattr__(cls, "__hash__", _hash if frozen else None)
    if frozen:
        type.__setattr__(cls, "__setattr__", _frozen_setattr)
        type.__setattr__(cls, "__delattr__", _frozen_delattr)
    return cls


@overload
def record(cls: T, /) -> T: ...
@overload
def record(*, frozen: bool = False) -> Callable[[T], T]: ...


@dataclass_transform(field_specifiers=(dataclasses.field, dataclasses.Field))
def record(cls: Any = None, /, *, frozen: bool = False) -> Any:
    """`@record` / `@record(frozen=True)`: a dataclass (init, repr and eq as a dataclass has them)
    without code generated at import."""
    if cls is None:
        return lambda c: _make(c, frozen)
    return _make(cls, frozen)
