"""What the sanitizer reports."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("race-raw", "race-war", "race-waw", "lifetime", "unjoined", "ge-discarded-wait", "mixed-api")

Location = tuple[str, int]


def fmt(loc: Location) -> str:
    return f"{loc[0]}:{loc[1]}" if loc[1] else loc[0]


@dataclass(frozen=True)
class Finding:
    kind: str  # one of KINDS
    message: str  # one line naming both locations as file:line
    first: Location  # the earlier access / call
    second: Location  # the access / free / return it conflicts with

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"
