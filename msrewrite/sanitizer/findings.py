"""What the sanitizer reports."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("race-raw", "race-war", "race-waw", "lifetime", "unjoined", "ge-discarded-wait", "mixed-api")

Location = tuple[str, int]


def fmt(loc: Location) -> str:
    return f"{loc[0]}:{loc[1]}" if loc[1] else loc[0]


def where(loc: Location) -> str:
    """`at file:line`; a place no line is behind (line 0, `<phrase>`: before the module was called,
    as its forward returned) is its phrase."""
    if not loc[1] and loc[0].startswith("<") and loc[0].endswith(">"):
        return loc[0][1:-1]
    return f"at {fmt(loc)}"


@dataclass(frozen=True)
class Finding:
    kind: str  # one of KINDS
    message: str  # one line naming both locations as file:line
    first: Location  # the earlier access / call
    second: Location  # the access / free / return it conflicts with

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"
