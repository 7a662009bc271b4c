"""The cases: one module per case in this package, each defining CASE (a msrewrite.cases._base.Case).

Cases are discovered with pkgutil over this package's __path__: every module whose name does not
start with "_" is a case (`_base`, `_finder` are the machinery), so a new case is one new file. A
case's module is named after it (moe-shared-expert: moe_shared_expert.py) and imported when it is
asked for: `apply --case X` loads X alone, `cases` and lookups by other names load all. They are
listed by each case's `order`, then by name.

This module imports no case machinery itself: the emitter looks a case's words up here.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from msrewrite.cases._base import Case


def case_modules() -> list[str]:
    """The case modules on this package's path (machinery and subpackages left out)."""
    return sorted(
        info.name for info in pkgutil.iter_modules(__path__) if not info.ispkg and not info.name.startswith("_")
    )


def _case(module: str) -> Case:
    return importlib.import_module(f"{__name__}.{module}").CASE


def all_cases() -> list[Case]:
    return sorted((_case(module) for module in case_modules()), key=lambda case: (case.order, case.name))


def get_case(name: str) -> Case | None:
    module = name.replace("-", "_")
    if module.isidentifier() and not module.startswith("_"):  # its own module: the others stay unread
        try:
            case = _case(module)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{module}":
                raise
        else:
            if case.name == name:
                return case
    return next((c for c in all_cases() if c.name == name), None)


def require_case(name: str) -> Case:
    """The case named, or a one-line BadInput listing the known ones."""
    from msrewrite.errors import BadInput

    case = get_case(name)
    if case is None:
        known = ", ".join(c.name for c in all_cases())
        raise BadInput(f"unknown case {name!r}; known cases: {known}")
    return case
