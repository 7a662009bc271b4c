"""The plan: one overlap edit, the contract between analysis (cases, `suggest`) and the emitter.

A plan names statements by their source lines and keeps their text, so a plan written by
`suggest --json` can be checked against the file before `apply --plan` carries it out: if the
file changed since, the emitter refuses the stale plan instead of editing the wrong lines.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

MODES = ("eager", "npugraph-ex", "ge-graph", "cuda")
PLAN_VERSION = 1


@dataclass(frozen=True)
class FlagSpec:
    """How the overlap is switched on and off.

    kind "env": an environment variable read once in `__init__` (SGLang style);
    kind "attr": an attribute set in `__init__` (reused when the class already sets it,
    otherwise read from `config.<name>` when `__init__` takes a config, else the default).
    """

    kind: str = "env"
    name: str = "ENABLE_MOE_SHARED_EXPERT_STREAM"
    default: bool = True
    max_tokens: int | None = None

    @classmethod
    def parse(cls, text: str, default: bool = True, max_tokens: int | None = None) -> "FlagSpec":
        kind, sep, name = text.partition(":")
        if not sep or kind not in ("env", "attr") or not name:
            raise ValueError(f"flag must be env:NAME or attr:NAME, got {text!r}")
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"flag name {name!r} is not a valid identifier")
        if kind == "attr" and "." in name:
            raise ValueError(f"attr flag {name!r} must be a plain attribute name")
        return cls(kind=kind, name=name, default=default, max_tokens=max_tokens)

    def describe(self) -> str:
        state = "on" if self.default else "off"
        text = f"{self.kind}:{self.name} (default {state})"
        if self.max_tokens is not None:
            text += f", only for at most {self.max_tokens} tokens"
        return text


@dataclass(frozen=True)
class SideStatement:
    """One statement of the side branch.

    Either a whole top-level statement of the function (`hoist` is None), or a call expression
    hoisted out of the join statement into a new temporary: `hoist` is the temporary's name and
    `source` the expression's text.
    """

    first_line: int
    last_line: int
    source: str
    hoist: str | None = None
    phase: int = 0  # phased plans: 0 issues at the fork, p >= 1 right after phase_anchors[p - 1]


@dataclass(frozen=True)
class StartGate:
    """Start the side work on `tensor` only after `anchor` (a main-stream value) exists.

    Emitted as `tensor = npu_wait_tensor(tensor, anchor)` in GE graph mode; the native modes
    express the same order by the fork's wait, so they ignore gates.
    """

    tensor: str
    anchor: str


@dataclass(frozen=True)
class OverlapPlan:
    """Move `side` onto a secondary stream, forking before `fork_line` and joining before `join_line`."""

    case: str
    file: str
    function: str  # qualified name: "Class.method" or "function"
    side: tuple[SideStatement, ...]
    fork_line: int  # the side block is inserted before the statement that starts here
    join_line: int  # first statement that consumes a side output
    side_inputs: tuple[str, ...]
    side_outputs: tuple[str, ...]
    stream_tag: str = "shared_expert"
    flag: FlagSpec = field(default_factory=FlagSpec)
    mode: str = "eager"
    start_gates: tuple[StartGate, ...] = ()
    summary: str = ""
    # Inputs rebound on the main stream before the join: only these need record_stream(side)
    # in eager/cuda mode; the others stay referenced by their local until the join.
    inputs_rebound_before_join: tuple[str, ...] = ()
    # Outputs bound only on some paths (inside an `if`): pre-bound to None on the side path so the
    # join's lifetime guard can name them.
    outputs_maybe_unbound: tuple[str, ...] = ()
    # Where the side stream comes from: "lazy" (created on first use, one per process and tag) or
    # "constructor" (created by the outermost model class in the file and handed down to every
    # layer through constructor keyword arguments, with the lazy stream as the default).
    stream_source: str = "lazy"
    # How the native modes fork and join: "wait_stream", "events" recorded and waited per call, or
    # "async-comm" (blocking send/recv made isend/irecv, joined by waiting on their handles).
    sync: str = "wait_stream"
    # Phased plans: main-stream values after which side phases 1, 2, ... start (each phase waits
    # for all main work issued so far: wait_stream, or npu_wait_tensor on the anchor in GE mode).
    phase_anchors: tuple[str, ...] = ()
    # Several-stream cases: which of the case's branches this plan is (one stream tag each).
    case_branch: str = ""
    # Copies moved to the side stream become non_blocking=True (they no longer hold up the host).
    non_blocking: bool = False
    # AI-core budgets (side aicore, side vector, main aicore, main vector) for the two branches.
    core_limits: tuple[int, int, int, int] | None = None
    # Side inputs the main path may write before the join: the side stream reads a copy made at
    # the fork (`--protect clone`; costs one copy of each).
    protect_inputs: tuple[str, ...] = ()
    # Callees the analysis could not see into (it trusted them), and those a reviewer vouched for
    # with --assume-pure: printed with every edit.
    trust_boundary: tuple[str, ...] = ()
    assume_pure: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if not self.side:
            raise ValueError("a plan needs at least one side statement")
        if not self.fork_line <= self.join_line:
            raise ValueError("the fork must come before the join")
        if self.stream_source not in ("lazy", "constructor"):
            raise ValueError(f"stream_source must be lazy or constructor, got {self.stream_source!r}")
        if self.sync not in ("wait_stream", "events", "async-comm"):
            raise ValueError(f"sync must be wait_stream, events or async-comm, got {self.sync!r}")

    @property
    def side_lines(self) -> list[list[int]]:
        return [[s.first_line, s.last_line] for s in self.side]

    def with_changes(self, **changes: Any) -> "OverlapPlan":
        return dataclasses.replace(self, **changes)

    # JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["version"] = PLAN_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OverlapPlan":
        data = dict(data)
        version = data.pop("version", PLAN_VERSION)
        if version != PLAN_VERSION:
            raise ValueError(f"plan version {version} is not supported (expected {PLAN_VERSION})")
        try:
            return cls(
                case=data["case"],
                file=data["file"],
                function=data["function"],
                side=tuple(SideStatement(**s) for s in data["side"]),
                fork_line=int(data["fork_line"]),
                join_line=int(data["join_line"]),
                side_inputs=tuple(data["side_inputs"]),
                side_outputs=tuple(data["side_outputs"]),
                stream_tag=data.get("stream_tag", "shared_expert"),
                flag=FlagSpec(**data.get("flag", {})),
                mode=data.get("mode", "eager"),
                start_gates=tuple(StartGate(**g) for g in data.get("start_gates", ())),
                summary=data.get("summary", ""),
                inputs_rebound_before_join=tuple(data.get("inputs_rebound_before_join", ())),
                outputs_maybe_unbound=tuple(data.get("outputs_maybe_unbound", ())),
                stream_source=data.get("stream_source", "lazy"),
                sync=data.get("sync", "wait_stream"),
                phase_anchors=tuple(data.get("phase_anchors", ())),
                case_branch=data.get("case_branch", ""),
                non_blocking=bool(data.get("non_blocking", False)),
                core_limits=tuple(data["core_limits"]) if data.get("core_limits") else None,
                protect_inputs=tuple(data.get("protect_inputs", ())),
                trust_boundary=tuple(data.get("trust_boundary", ())),
                assume_pure=tuple(data.get("assume_pure", ())),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed plan: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "OverlapPlan":
        return cls.from_dict(json.loads(text))


def load_plans(text: str) -> list[OverlapPlan]:
    """Plans from a JSON file: one plan, a list of plans, or `suggest --json` output."""
    data = json.loads(text)
    if isinstance(data, dict) and "candidates" in data:
        data = [c["plan"] for c in data["candidates"] if c.get("plan")]
    elif isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise ValueError("a plan file holds a plan, a list of plans, or suggest --json output")
    return [OverlapPlan.from_dict(item) for item in data]
