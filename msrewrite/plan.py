"""The plan: one edit, the contract between analysis (cases, `suggest`) and the emitter.

An OverlapPlan moves one branch onto a side stream; a MicrobatchPlan (`"kind": "microbatch"` in
JSON) forks a model's layer loop into two micro-batches (prefill-microbatch). A plan names
statements by their source lines and keeps their text, so a plan file can be checked against the
file before `apply --plan` carries it out: if the file changed since, the stale plan is refused
instead of editing the wrong lines.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import field
from typing import Any, ClassVar

from msrewrite import validate
from msrewrite.records import record

MODES = ("eager", "npugraph-ex", "ge-graph", "cuda")
FLAG_KINDS = ("env", "attr", "sglang", "vllm-ascend")
GATES = ("capture", "prefill", "decode")  # --gate tokens<=N is max_tokens
STREAM_SOURCES = ("lazy", "constructor")
SYNCS = ("wait_stream", "events", "async-comm")
PLAN_VERSION = 1
MAX_PLAN_ERRORS = 3  # shown in the one error line; the rest are counted
# The stream tag of a plan file that names none (the field has been optional in plan files from
# the start, when the only case was moe-shared-expert); plans made in code always name theirs.
PLAN_FILE_STREAM_TAG = "shared_expert"


PROTECT_CHOICES = ("auto", "none", "clone")
# every name an edit adds at module level starts with it (`_ms_side_stream`, `_MS_SIDE_STREAMS`
# aside): how the analysis tells an edit's helpers from the user's code
HELPER_PREFIX = "_ms_"
# Which branch runs on the side stream: "shared", the case's side work (the seed calls: the shared
# expert), or "routed", the rest of the window (the router and routed experts) while the seed calls
# stay on the current stream (SGLang's own convention with `self.alt_stream`).
PLACEMENTS = ("shared", "routed")


def protects(protect: str) -> bool:
    """Whether a --protect value snapshots side inputs (auto, the command line's default, and clone)
    or refuses the move (none, and "": the library's default, Options(), as before --protect auto)."""
    return protect in ("auto", "clone")


def snapshots(protect: str, start_gates: tuple) -> bool:
    """Whether the branch finder snapshots side inputs: --protect auto does not with GE start gates
    (--start-after rebinds the side's input, which a snapshot cannot), so it refuses as none does;
    clone says so explicitly and is refused by the emitter, naming both options."""
    return protects(protect) and (protect == "clone" or not start_gates)


def protect_choice(given: str) -> str:
    """The command line's --protect: auto when not given."""
    return given or "auto"


@record(frozen=True)
class FlagSpec:
    """How the overlap is switched on and off.

    kind "env": an environment variable read once in `__init__` (`os.environ`, SGLang style);
    kind "attr": an attribute set in `__init__` (reused when the class already sets it,
    otherwise read from `config.<name>` when `__init__` takes a config, else the default);
    kind "sglang": SGLang's own `get_bool_env_var(name, default)`, read once in `__init__`;
    kind "vllm-ascend": a field of vllm-ascend's `get_ascend_config()` (its `additional_config`),
    read once in `__init__` into `self.<name>`.
    `gate`: a phase predicate the emitter finds in the file (capture, prefill, decode); with
    `max_tokens`, the overlap runs only when every gate holds, else the original code runs.
    """

    kind: str = "env"
    name: str = "ENABLE_MOE_SHARED_EXPERT_STREAM"
    default: bool = True
    max_tokens: int | None = None
    gate: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "none":  # verify's "no flag found" marker; never emitted
            return
        if self.kind not in FLAG_KINDS:
            raise ValueError(f"flag kind must be {', '.join(FLAG_KINDS)}, got {validate.shown(self.kind)}")
        if self.kind in ("env", "sglang"):
            validate.env_name(self.name, f"{self.kind} flag name")
        else:
            validate.attribute(self.name, f"{self.kind} flag name")
        _boolean(self.default, "flag default")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"flag max_tokens must be a positive token count, got {validate.shown(self.max_tokens)}")
        if self.gate is not None and self.gate not in GATES:
            raise ValueError(f"flag gate must be one of {', '.join(GATES)}, got {validate.shown(self.gate)}")

    @classmethod
    def parse(cls, text: str, default: bool = True, max_tokens: int | None = None, gate: str | None = None) -> FlagSpec:
        kind, sep, name = text.partition(":")
        if not sep or kind not in FLAG_KINDS or not name:
            kinds = " or ".join(f"{k}:NAME" for k in FLAG_KINDS)
            raise ValueError(f"flag must be {kinds}, got {validate.shown(text)}")
        return cls(kind=kind, name=name, default=default, max_tokens=max_tokens, gate=gate)

    def describe(self) -> str:
        state = "on" if self.default else "off"
        text = f"{self.kind}:{self.name} (default {state})"
        if self.gate is not None:
            text += f", only when {self.gate}"
        if self.max_tokens is not None:
            text += f", only for at most {self.max_tokens} tokens"
        return text


@record(frozen=True)
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
    # phased plans, a side `if` split over several phases: the phase of each simple statement
    # inside it, in source order (each phase issues the `if` with its own statements only)
    inner_phases: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.inner_phases, list):
            object.__setattr__(self, "inner_phases", tuple(self.inner_phases))
        if not isinstance(self.inner_phases, tuple) or any(
            isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in self.inner_phases
        ):
            raise ValueError(f"side inner_phases must be phase numbers >= 0, got {validate.shown(self.inner_phases)}")
        if self.inner_phases and self.hoist is not None:
            raise ValueError("a hoisted side call has no inner phases")
        validate.line_number(self.first_line, "side first_line")
        validate.line_number(self.last_line, "side last_line")
        if self.last_line < self.first_line:
            raise ValueError(f"side statement ends (line {self.last_line}) before it starts ({self.first_line})")
        if not isinstance(self.source, str):  # matched against the file, never pasted into it
            raise ValueError(f"side source must be text, got {validate.shown(self.source)}")
        if self.hoist is not None:
            validate.identifier(self.hoist, "side hoist")
        if isinstance(self.phase, bool) or not isinstance(self.phase, int) or self.phase < 0:
            raise ValueError(f"side phase must be a phase number >= 0, got {validate.shown(self.phase)}")


@record(frozen=True)
class StartGate:
    """Start the side work on `tensor` only after `anchor` (a main-stream value) exists.

    Emitted as `tensor = npu_wait_tensor(tensor, anchor)` in GE graph mode; the native modes
    express the same order by the fork's wait, so they ignore gates.
    """

    tensor: str  # "" while options are parsed: the case fills in its first side input
    anchor: str

    def __post_init__(self) -> None:
        if self.tensor != "":
            validate.identifier(self.tensor, "start gate tensor")
        validate.identifier(self.anchor, "start gate anchor")


@record(frozen=True)
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
    stream_tag: str  # the case's (or --stream-tag); a plan file may omit it: PLAN_FILE_STREAM_TAG
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
    # The side statements sit inside the `if` that starts at `guard_line`, and run only when
    # `guard` holds (already negated for its `else:` block). The condition is invariant over the
    # window, so the fork runs under `<stream> and <guard>`; the `if` keeps the join.
    guard: str = ""
    guard_line: int = 0
    # Side inputs the main path may write before the join: the side stream reads a copy made at
    # the fork (`--protect auto`, apply's default, or `clone`; costs one copy of each). A tensor is
    # cloned; a value the source does not show to be one goes through `_ms_snapshot`.
    protect_inputs: tuple[str, ...] = ()
    # Callees the analysis could not see into (it trusted them), and those a reviewer vouched for
    # with --assume-pure: printed with every edit.
    trust_boundary: tuple[str, ...] = ()
    assume_pure: tuple[str, ...] = ()
    # The side work draws random numbers and so does the main path in the window: carried out
    # only because a reviewer allowed it (--allow-rng-reorder); `rng_reorder` says what the
    # analysis found (printed with the edit, never emitted).
    allow_rng_reorder: bool = False
    rng_reorder: str = ""
    # Profiler ranges around the side and main windows (apply --markers, read by msrewrite profile);
    # left out of the JSON when off, so plan files without it read as before.
    markers: bool = False
    # Main calls hoisted out of the join statement (each a SideStatement with its temporary in
    # `hoist`): on the flag-on path they run into their temporaries right before the join, the
    # join statement reading the temporaries; the flag-off path keeps the join statement as it is.
    # Only when the window holds no other main work. Left out of the JSON when empty.
    main_hoists: tuple[SideStatement, ...] = ()
    # Phased plans whose side statements inline a submodule's forward ("attr:Class", self.attr a
    # Class): the side stream is used only while calling self.attr would run Class.forward alone
    # (_ms_runs_as_inlined: no subclass, patch or hook); otherwise the original call runs. Left out
    # of the JSON when empty.
    inline_guards: tuple[str, ...] = ()
    # "routed": `side` holds the window's other work (the router and routed experts), moved onto the
    # side stream, and `main_hoists` the case's own calls hoisted out of the join; the case's
    # statements in the window stay on the current stream and read the snapshots (protect_inputs),
    # since it is the side stream that may write them. Left out of the JSON when "shared".
    placement: str = "shared"

    @property
    def label(self) -> str:
        """What the edit's comments name the plan by, `msrewrite(<label>): ...`: the case, and the
        branch of a several-stream case (apply --markers finds each plan's stream by it)."""
        return f"{self.case}: {self.case_branch}" if self.case_branch else self.case

    @property
    def inline_guard_pairs(self) -> list[tuple[str, str]]:
        """inline_guards as (attribute, class) pairs (each part a checked identifier)."""
        return [(attr, cls) for attr, _, cls in (g.partition(":") for g in self.inline_guards)]

    @property
    def region_tag(self) -> str:
        """The <tag> of the plan's profiler range names (msrewrite:<case>:<tag>:side|main): its
        branch in a several-stream case, where two branches may share a stream, else its stream tag."""
        return self.case_branch or self.stream_tag

    def __post_init__(self) -> None:
        # Every field that reaches emitted code (names, literals, comments) is checked here, so no
        # plan, from a case or from a JSON file, can carry code into the edit (validate.py).
        self._check_location()
        self._check_names()
        self._check_notes()
        self._check_options()
        self._check_main_hoists()
        self._check_inline_guards()

    def _check_location(self) -> None:
        _enum(self.mode, MODES, "mode")
        validate.case_name(self.case, "case")
        if not isinstance(self.file, str):
            raise ValueError(f"file must be a path, got {validate.shown(self.file)}")
        validate.qualified_name(self.function, "function")
        if not self.side:
            raise ValueError("a plan needs at least one side statement")
        if not all(isinstance(s, SideStatement) for s in self.side):
            raise ValueError("side must be a list of side statements")
        validate.line_number(self.fork_line, "fork_line")
        validate.line_number(self.join_line, "join_line")
        if not self.fork_line <= self.join_line:
            raise ValueError("the fork must come before the join")

    def _check_names(self) -> None:
        for what in (
            "side_inputs",
            "side_outputs",
            "inputs_rebound_before_join",
            "outputs_maybe_unbound",
            "phase_anchors",
            "protect_inputs",
        ):
            for name in getattr(self, what):
                validate.identifier(name, f"{what} entry", constants=what == "side_inputs")
        validate.stream_tag(self.stream_tag, "stream_tag")
        if not isinstance(self.flag, FlagSpec) or self.flag.kind not in FLAG_KINDS:
            raise ValueError(f"flag must be one of {', '.join(FLAG_KINDS)}")
        for gate in self.start_gates:
            if not isinstance(gate, StartGate) or not gate.tensor:
                raise ValueError("start_gates entries need a tensor and an anchor")

    def _check_notes(self) -> None:
        _one_line_summary(self)
        _enum(self.stream_source, STREAM_SOURCES, "stream_source")
        _enum(self.sync, SYNCS, "sync")
        for what in ("trust_boundary", "assume_pure"):  # printed, never emitted as code
            for name in getattr(self, what):
                validate.comment_text(name, f"{what} entry")
        _boolean(self.allow_rng_reorder, "allow_rng_reorder")
        validate.comment_text(self.rng_reorder, "rng_reorder")

    def _check_inline_guards(self) -> None:
        if isinstance(self.inline_guards, list):
            object.__setattr__(self, "inline_guards", tuple(self.inline_guards))
        if not isinstance(self.inline_guards, tuple):
            raise ValueError("inline_guards must be a list of attr:Class")
        for guard in self.inline_guards:
            parts = guard.split(":") if isinstance(guard, str) else []
            if len(parts) != 2:
                raise ValueError(f"inline_guards: expected attr:Class, got {validate.shown(guard)}")
            validate.identifier(parts[0], "inline_guards attribute")
            validate.identifier(parts[1], "inline_guards class")

    def _check_main_hoists(self) -> None:
        if isinstance(self.main_hoists, list):
            object.__setattr__(self, "main_hoists", tuple(self.main_hoists))
        if not isinstance(self.main_hoists, tuple) or not all(isinstance(h, SideStatement) for h in self.main_hoists):
            raise ValueError("main_hoists must be a list of hoisted calls")
        for hoist in self.main_hoists:
            if hoist.hoist is None or hoist.phase or hoist.inner_phases:
                raise ValueError(
                    f"a main hoist needs its temporary in hoist, and no phase: {validate.shown(hoist.source)}"
                )
            if not hoist.source.strip():
                raise ValueError("a main hoist needs the call's source")
        temps = [s.hoist for s in (*self.side, *self.main_hoists) if s.hoist is not None]
        if len(set(temps)) != len(temps):
            raise ValueError(f"hoisted temporaries must differ, got {validate.shown(temps)}")
        if self.main_hoists and (self.phase_anchors or self.sync == "async-comm"):
            raise ValueError("main_hoists cannot be combined with phase_anchors or async-comm")

    def _check_options(self) -> None:
        if bool(self.guard) != bool(self.guard_line):
            raise ValueError("a guarded plan needs both guard and guard_line")
        if self.guard:
            # emitted as code: the emitter also refuses a guard that is not the `if`'s own condition
            validate.comment_text(self.guard, "guard")
            validate.line_number(self.guard_line, "guard_line")
        if self.case_branch:
            validate.case_name(self.case_branch, "case_branch")
        _boolean(self.markers, "markers")
        _boolean(self.non_blocking, "non_blocking")
        _enum(self.placement, PLACEMENTS, "placement")
        if self.placement == "routed" and (
            self.phase_anchors or self.guard or self.start_gates or self.core_limits or self.sync == "async-comm"
        ):
            raise ValueError(
                "a routed placement cannot be combined with phases, a guard, start gates, core limits or async-comm"
            )
        if self.core_limits is not None and (
            len(self.core_limits) != 4
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 4096 for n in self.core_limits)
        ):
            raise ValueError(f"core_limits must be four core counts, got {validate.shown(self.core_limits)}")

    def check_lines(self, line_count: int) -> None:
        """The plan's line numbers lie inside a file of `line_count` lines (the join may name
        the line after the last one: a join when the function falls off the end)."""
        for side in self.side:
            validate.line_number(side.last_line, f"{self.function}: side last_line", line_count)
        for hoist in self.main_hoists:
            validate.line_number(hoist.last_line, f"{self.function}: main_hoists last_line", line_count)
        validate.line_number(self.fork_line, f"{self.function}: fork_line", line_count)
        validate.line_number(self.join_line, f"{self.function}: join_line", line_count + 1)
        if self.guard_line:
            validate.line_number(self.guard_line, f"{self.function}: guard_line", line_count)

    @property
    def side_lines(self) -> list[list[int]]:
        return [[s.first_line, s.last_line] for s in self.side]

    def with_changes(self, **changes: Any) -> OverlapPlan:
        return dataclasses.replace(self, **changes)

    # JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not self.markers:
            del data["markers"]
        for side in data["side"]:
            if not side["inner_phases"]:
                del side["inner_phases"]
        if not self.main_hoists:
            del data["main_hoists"]
        if not self.inline_guards:
            del data["inline_guards"]
        if self.placement == "shared":
            del data["placement"]
        for hoist in data.get("main_hoists", ()):
            del hoist["inner_phases"], hoist["phase"]
        data["version"] = PLAN_VERSION
        return data

    @classmethod
    def from_dict(cls, data: Any) -> OverlapPlan:
        """A plan from JSON, checked field by field: ValueError lists what is wrong (one line)."""
        _refuse(plan_errors(data))
        data = dict(data)
        data.pop("version", None)
        try:
            return cls(
                **{
                    **data,
                    "side": tuple(SideStatement(**s) for s in data["side"]),
                    "side_inputs": tuple(data["side_inputs"]),
                    "side_outputs": tuple(data["side_outputs"]),
                    "stream_tag": data.get("stream_tag", PLAN_FILE_STREAM_TAG),
                    "flag": FlagSpec(**data.get("flag", {})),
                    "start_gates": tuple(StartGate(**g) for g in data.get("start_gates", ())),
                    "inputs_rebound_before_join": tuple(data.get("inputs_rebound_before_join", ())),
                    "outputs_maybe_unbound": tuple(data.get("outputs_maybe_unbound", ())),
                    "phase_anchors": tuple(data.get("phase_anchors", ())),
                    "core_limits": tuple(data["core_limits"]) if data.get("core_limits") is not None else None,
                    "protect_inputs": tuple(data.get("protect_inputs", ())),
                    "trust_boundary": tuple(data.get("trust_boundary", ())),
                    "assume_pure": tuple(data.get("assume_pure", ())),
                    "main_hoists": tuple(SideStatement(**h) for h in data.get("main_hoists", ())),
                    "inline_guards": tuple(data.get("inline_guards", ())),
                }
            )
        except ValueError as exc:
            raise ValueError(f"malformed plan: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> OverlapPlan:
        return cls.from_dict(json.loads(text))


# Prefill micro-batching: a model-level fork ------------------------------------------------------
MICROBATCH_KIND = "microbatch"


def microbatch_flag_error(flag: FlagSpec) -> str | None:
    """Why `flag` cannot switch a model-level micro-batch fork, or None. Every flag kind can; of the
    gates only `prefill` means something for a fork that runs the whole layer stack eagerly."""
    if flag.max_tokens is not None:
        return (
            "prefill-microbatch takes no --gate tokens<=N / --max-tokens: an upper token bound keeps "
            "micro-batching to small batches, and it pays only on large ones (each half must fill the device)"
        )
    if flag.gate == "capture":
        return (
            "prefill-microbatch takes no --gate capture: it runs eager, and graph capture is exactly where "
            "its per-call events are not replayed"
        )
    if flag.gate == "decode":
        return "prefill-microbatch takes no --gate decode: it splits prefill batches; use --gate prefill"
    return None


@record(frozen=True)
class SourceSpan:
    """One statement of the file, by its lines and its text (matched against the file, never pasted)."""

    first_line: int
    last_line: int
    source: str

    def __post_init__(self) -> None:
        validate.line_number(self.first_line, "statement first_line")
        validate.line_number(self.last_line, "statement last_line")
        if self.last_line < self.first_line:
            raise ValueError(f"statement ends (line {self.last_line}) before it starts ({self.first_line})")
        if not isinstance(self.source, str):
            raise ValueError(f"statement source must be text, got {validate.shown(self.source)}")


@record(frozen=True)
class MicrobatchStage:
    """Consecutive statements of the layer's forward: compute (main stream) or comm (comm stream)."""

    comm: bool
    statements: tuple[SourceSpan, ...]

    def __post_init__(self) -> None:
        _boolean(self.comm, "stage comm")
        if not self.statements or not all(isinstance(s, SourceSpan) for s in self.statements):
            raise ValueError("a stage needs at least one statement")


@record(frozen=True)
class MicrobatchPlan:
    """Fork `function`'s layer loop (`loop`, over self.<layers> filled with `layer`'s class) into a
    `forward_microbatch` path: two micro-batches, each layer split into `stages` at its collectives,
    comm stages on one comm stream one micro-batch behind (micro-batch 1 over self.<second_group>
    on a stream of its own when given). Written and read as JSON with `"kind": "microbatch"`."""

    case: str
    file: str
    function: str  # the model's forward that holds the layer loop: "Model.forward"
    layer: str  # the layer class's forward: "DecoderLayer.forward"
    loop: SourceSpan  # the `for layer in self.layers:` statement
    stages: tuple[MicrobatchStage, ...]
    stream_tag: str = "microbatch_comm"
    flag: FlagSpec = field(default_factory=lambda: FlagSpec(name="ENABLE_PREFILL_MICROBATCH"))
    mode: str = "eager"
    second_group: str = ""  # an attribute of the layer (a process group); "" = one comm stream
    summary: str = ""
    # Calls whose statement became a comm stage because a collective sits inside them (one module
    # deeper), and callees the analysis could not see into inside comm stages; printed, not emitted.
    trust_boundary: tuple[str, ...] = ()
    assume_pure: tuple[str, ...] = ()
    # values the layer loop passes beside the hidden states that the user said hold one row per
    # sequence (--split-arg) or are the same for every sequence (--shared-arg)
    split_args: tuple[str, ...] = ()
    shared_args: tuple[str, ...] = ()
    kind: str = MICROBATCH_KIND

    # What the commands ask of every plan, with the values a micro-batch fork has.
    markers: ClassVar[bool] = False
    core_limits: ClassVar[None] = None
    protect_inputs: ClassVar[tuple] = ()
    rng_reorder: ClassVar[str] = ""
    case_branch: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self._check_location()
        self._check_stages()
        self._check_options()

    def _check_location(self) -> None:
        if self.kind != MICROBATCH_KIND:
            raise ValueError(f"kind must be {MICROBATCH_KIND!r}, got {validate.shown(self.kind)}")
        _enum(self.mode, MODES, "mode")
        validate.case_name(self.case, "case")
        if not isinstance(self.file, str):
            raise ValueError(f"file must be a path, got {validate.shown(self.file)}")
        validate.qualified_name(self.function, "function")
        validate.qualified_name(self.layer, "layer")
        for what in ("function", "layer"):
            if getattr(self, what).count(".") != 1 or not getattr(self, what).endswith(".forward"):
                raise ValueError(f"{what} must be Class.forward, got {validate.shown(getattr(self, what))}")
        if not isinstance(self.loop, SourceSpan):
            raise ValueError("loop must be a statement (first_line, last_line, source)")

    def _check_stages(self) -> None:
        if not self.stages or not all(isinstance(s, MicrobatchStage) for s in self.stages):
            raise ValueError("a micro-batch plan needs at least one stage")
        if not any(s.comm for s in self.stages):
            raise ValueError("a micro-batch plan needs a comm stage")
        for before, after in itertools.pairwise(self.stages):
            if before.comm == after.comm:
                raise ValueError("stages must alternate between compute and comm")
        lines = [line for s in self.stages for st in s.statements for line in (st.first_line, st.last_line)]
        if lines != sorted(lines) or len({st.first_line for s in self.stages for st in s.statements}) * 2 != len(lines):
            raise ValueError("stage statements must be in source order, each once")

    def _check_options(self) -> None:
        validate.stream_tag(self.stream_tag, "stream_tag")
        if not isinstance(self.flag, FlagSpec) or self.flag.kind not in FLAG_KINDS:
            raise ValueError(f"flag must be one of {', '.join(FLAG_KINDS)}")
        why = microbatch_flag_error(self.flag)
        if why:
            raise ValueError(why)
        if self.second_group != "":
            validate.attribute(self.second_group, "second_group")
        _one_line_summary(self)
        for what in ("trust_boundary", "assume_pure"):
            if not isinstance(getattr(self, what), tuple):
                raise ValueError(f"{what} must be a list")
            for name in getattr(self, what):
                validate.comment_text(name, f"{what} entry")
        for what in ("split_args", "shared_args"):  # emitted as names: identifiers only
            if not isinstance(getattr(self, what), tuple):
                raise ValueError(f"{what} must be a list")
            for name in getattr(self, what):
                validate.identifier(name, f"{what} entry")

    @property
    def statements(self) -> list[SourceSpan]:
        return [st for s in self.stages for st in s.statements]

    def check_lines(self, line_count: int) -> None:
        """The plan's line numbers lie inside a file of `line_count` lines."""
        validate.line_number(self.loop.last_line, f"{self.function}: loop last_line", line_count)
        for st in self.statements:
            validate.line_number(st.last_line, f"{self.layer}: stage statement last_line", line_count)

    def with_changes(self, **changes: Any) -> MicrobatchPlan:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for what in ("split_args", "shared_args"):  # written only when given, as before they existed
            if not data[what]:
                del data[what]
        data["version"] = PLAN_VERSION
        return data

    @classmethod
    def from_dict(cls, data: Any) -> MicrobatchPlan:
        _refuse(microbatch_plan_errors(data))
        data = dict(data)
        data.pop("version", None)
        try:
            return cls(
                **{
                    **data,
                    "loop": SourceSpan(**data["loop"]),
                    "stages": tuple(
                        MicrobatchStage(comm=s["comm"], statements=tuple(SourceSpan(**st) for st in s["statements"]))
                        for s in data["stages"]
                    ),
                    "flag": FlagSpec(**data.get("flag", {"name": "ENABLE_PREFILL_MICROBATCH"})),
                    "trust_boundary": tuple(data.get("trust_boundary", ())),
                    "assume_pure": tuple(data.get("assume_pure", ())),
                    "split_args": tuple(data.get("split_args", ())),
                    "shared_args": tuple(data.get("shared_args", ())),
                }
            )
        except ValueError as exc:
            raise ValueError(f"malformed plan: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> MicrobatchPlan:
        return cls.from_dict(json.loads(text))


def _enum(value: Any, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {validate.shown(value)}")


def _refuse(errors: list[str]) -> None:
    """A plan file's schema errors as one ValueError line: the first few, and how many more."""
    if errors:
        more = f" (and {len(errors) - MAX_PLAN_ERRORS} more)" if len(errors) > MAX_PLAN_ERRORS else ""
        raise ValueError("malformed plan: " + "; ".join(errors[:MAX_PLAN_ERRORS]) + more)


def _boolean(value: Any, what: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, got {validate.shown(value)}")


def _one_line_summary(plan: OverlapPlan | MicrobatchPlan) -> None:
    """The summary is prose for notes and commit messages: made one line, then checked."""
    if isinstance(plan.summary, str):
        object.__setattr__(plan, "summary", " ".join(plan.summary.split()))
    validate.comment_text(plan.summary, "summary")


# The plan file's schema: field -> (JSON type(s), required; tuples from to_dict count as
# lists). Values are then checked by the
# dataclasses' __post_init__ (validate.py); unknown fields are refused, not ignored.
_PLAN_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "version": ((int,), False),
    "case": ((str,), True),
    "file": ((str,), True),
    "function": ((str,), True),
    "side": ((list, tuple), True),
    "fork_line": ((int,), True),
    "join_line": ((int,), True),
    "side_inputs": ((list, tuple), True),
    "side_outputs": ((list, tuple), True),
    "stream_tag": ((str,), False),
    "flag": ((dict,), False),
    "mode": ((str,), False),
    "start_gates": ((list, tuple), False),
    "summary": ((str,), False),
    "inputs_rebound_before_join": ((list, tuple), False),
    "outputs_maybe_unbound": ((list, tuple), False),
    "stream_source": ((str,), False),
    "sync": ((str,), False),
    "phase_anchors": ((list, tuple), False),
    "case_branch": ((str,), False),
    "non_blocking": ((bool,), False),
    "core_limits": ((list, tuple, type(None)), False),
    "guard": ((str,), False),
    "guard_line": ((int,), False),
    "protect_inputs": ((list, tuple), False),
    "trust_boundary": ((list, tuple), False),
    "assume_pure": ((list, tuple), False),
    "allow_rng_reorder": ((bool,), False),
    "rng_reorder": ((str,), False),
    "markers": ((bool,), False),
    "main_hoists": ((list, tuple), False),
    "inline_guards": ((list, tuple), False),
    "placement": ((str,), False),
}
_PART_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "side": {
        "first_line": ((int,), True),
        "last_line": ((int,), True),
        "source": ((str,), True),
        "hoist": ((str, type(None)), False),
        "phase": ((int,), False),
        "inner_phases": ((list, tuple), False),
    },
    "flag": {
        "kind": ((str,), False),
        "name": ((str,), False),
        "default": ((bool,), False),
        "max_tokens": ((int, type(None)), False),
        "gate": ((str, type(None)), False),
    },
    "start_gates": {"tensor": ((str,), True), "anchor": ((str,), True)},
    "main_hoists": {
        "first_line": ((int,), True),
        "last_line": ((int,), True),
        "source": ((str,), True),
        "hoist": ((str,), True),
    },
}


def _type_errors(data: Any, fields: dict[str, tuple[tuple[type, ...], bool]], where: str) -> list[str]:
    if not isinstance(data, dict):
        return [f"{where.removesuffix(': ') or 'plan'} must be an object, got {validate.shown(data)}"]
    errors = [f"{where}unknown field {key!r}" for key in data if key not in fields]
    for key, (types, required) in fields.items():
        if key not in data:
            if required:
                errors.append(f"{where}missing field {key!r}")
            continue
        value = data[key]
        wrong_bool = isinstance(value, bool) and bool not in types
        if wrong_bool or not isinstance(value, types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types if t is not tuple)
            errors.append(f"{where}{key} must be {names}, got {validate.shown(value)}")
    return errors


def plan_errors(data: Any) -> list[str]:
    """What is wrong with one plan's JSON (types and shape; values are checked on construction)."""
    if not isinstance(data, dict):
        return [f"a plan must be an object, got {validate.shown(data)}"]
    if data.get("version", PLAN_VERSION) != PLAN_VERSION:
        return [f"plan version {validate.shown(data['version'])} is not supported (expected {PLAN_VERSION})"]
    errors = _type_errors(data, _PLAN_FIELDS, "")
    if errors:
        return errors
    errors += _type_errors(data.get("flag", {}), _PART_FIELDS["flag"], "flag: ")
    for part in ("side", "start_gates", "main_hoists"):
        for k, item in enumerate(data.get(part, ())):
            errors += _type_errors(item, _PART_FIELDS[part], f"{part}[{k}]: ")
    for part in (
        "side_inputs",
        "side_outputs",
        "inputs_rebound_before_join",
        "outputs_maybe_unbound",
        "phase_anchors",
        "core_limits",
        "protect_inputs",
        "trust_boundary",
        "assume_pure",
        "inline_guards",
    ):
        items = data.get(part) or ()
        kind = int if part == "core_limits" else str
        errors += [
            f"{part}[{k}] must be {kind.__name__}, got {validate.shown(v)}"
            for k, v in enumerate(items)
            if isinstance(v, bool) or not isinstance(v, kind)
        ]
    return errors


_MICROBATCH_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "version": ((int,), False),
    "kind": ((str,), True),
    "case": ((str,), True),
    "file": ((str,), True),
    "function": ((str,), True),
    "layer": ((str,), True),
    "loop": ((dict,), True),
    "stages": ((list, tuple), True),
    "stream_tag": ((str,), False),
    "flag": ((dict,), False),
    "mode": ((str,), False),
    "second_group": ((str,), False),
    "summary": ((str,), False),
    "trust_boundary": ((list, tuple), False),
    "assume_pure": ((list, tuple), False),
    "split_args": ((list, tuple), False),
    "shared_args": ((list, tuple), False),
}
_SPAN_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "first_line": ((int,), True),
    "last_line": ((int,), True),
    "source": ((str,), True),
}
_STAGE_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "comm": ((bool,), True),
    "statements": ((list, tuple), True),
}


def microbatch_plan_errors(data: Any) -> list[str]:
    """What is wrong with one micro-batch plan's JSON (types and shape)."""
    if not isinstance(data, dict):
        return [f"a plan must be an object, got {validate.shown(data)}"]
    if data.get("version", PLAN_VERSION) != PLAN_VERSION:
        return [f"plan version {validate.shown(data['version'])} is not supported (expected {PLAN_VERSION})"]
    errors = _type_errors(data, _MICROBATCH_FIELDS, "")
    if errors:
        return errors
    errors += _type_errors(data.get("flag", {}), _PART_FIELDS["flag"], "flag: ")
    errors += _type_errors(data["loop"], _SPAN_FIELDS, "loop: ")
    for k, stage in enumerate(data["stages"]):
        found = _type_errors(stage, _STAGE_FIELDS, f"stages[{k}]: ")
        errors += found
        if not found:
            for j, st in enumerate(stage["statements"]):
                errors += _type_errors(st, _SPAN_FIELDS, f"stages[{k}].statements[{j}]: ")
    for part in ("trust_boundary", "assume_pure", "split_args", "shared_args"):
        errors += [
            f"{part}[{k}] must be str, got {validate.shown(v)}"
            for k, v in enumerate(data.get(part) or ())
            if not isinstance(v, str)
        ]
    return errors


def plan_from_dict(data: Any) -> OverlapPlan | MicrobatchPlan:
    """One plan from JSON, of either kind: `"kind": "microbatch"` is a micro-batch fork, no kind an overlap."""
    if isinstance(data, dict) and "kind" in data:
        if data["kind"] != MICROBATCH_KIND:
            raise ValueError(
                f"malformed plan: kind must be {MICROBATCH_KIND!r} or absent, got {validate.shown(data['kind'])}"
            )
        return MicrobatchPlan.from_dict(data)
    return OverlapPlan.from_dict(data)


def load_plans(text: str) -> list[OverlapPlan | MicrobatchPlan]:
    """Plans from a JSON file: one plan, a list of plans, or `suggest --json` output.
    Every problem is a ValueError with a one-line message."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError("not a plan file: the JSON is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if isinstance(data, dict) and "candidates" in data:
        candidates = data["candidates"]
        if not isinstance(candidates, list):
            raise ValueError(f"candidates must be a list, got {type(candidates).__name__}")
        items = []
        for k, candidate in enumerate(candidates, start=1):
            if not isinstance(candidate, dict):
                raise ValueError(f"candidate {k} must be an object, got {validate.shown(candidate)}")
            if candidate.get("plan") is not None:
                items.append((f"candidate {k}", candidate["plan"]))
    elif isinstance(data, dict):
        items = [("plan", data)]
    elif isinstance(data, list):
        items = [(f"plan {k}", item) for k, item in enumerate(data, start=1)]
    else:
        raise ValueError("a plan file holds a plan, a list of plans, or suggest --json output")
    plans = []
    for where, item in items:
        try:
            plans.append(plan_from_dict(item))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return plans
