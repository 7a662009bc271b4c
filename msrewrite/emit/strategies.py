"""One emission strategy per execution mode: the lines that fork, gate and join a side branch.

The emitter (locate.py, function_edit.py) decides where the lines go; a strategy only decides
what they say, so the four API families never mix: native torch_npu streams (eager), the same with capture-stable
streams and events (npugraph-ex), torchair's in-graph scopes (ge-graph), and torch.cuda (cuda).
"""

from __future__ import annotations

from dataclasses import field

from msrewrite.records import record
from msrewrite.validate import literal


@record
class Names:
    """Identifiers the emitted code binds, chosen to avoid every name the function already uses."""

    stream: str  # local: the side stream (native modes) or the enable bool (GE)
    current: str  # local: the current (main) stream, cached
    fork_event: str
    join_event: str
    flag_attr: str  # self.<flag_attr> holds the enable switch
    stream_attr: str  # npugraph-ex: self.<stream_attr>
    events_attr: str  # npugraph-ex: self.<events_attr>
    input_ready: str = "input_ready_event"  # events-per-call sync (native modes)
    side_done: str = "side_done_event"


@record
class Context:
    """What a sync strategy writes its code from: the plan's branch, switch and stream, and the class it edits."""

    case: str
    tag: str
    flag_kind: str  # env | attr
    flag_name: str
    flag_default: bool
    max_tokens: int | None
    has_init: bool  # the enclosing class has an __init__ we can extend
    init_config_param: str | None  # name of __init__'s config parameter, if any
    init_sets_flag: bool  # __init__ already assigns the switch (attr flags, or a second env stream)
    inputs: list[str]
    rebound_inputs: list[str]
    outputs: list[str]
    maybe_unbound: list[str]
    token_input: str | None
    gates: list[tuple[str, str, str]]  # (name the side reads, original name, main-stream anchor)
    names: Names
    what: str  # one clause for comments: "the shared expert"
    stream_source: str = "lazy"  # lazy | constructor (self.<stream_attr> set in __init__)
    sync: str = "wait_stream"  # wait_stream | events
    phased: bool = False  # side phases re-enter the stream after main-stream anchors
    core_limits: tuple[int, int, int, int] | None = None  # side aicore, side vector, main aicore, main vector
    # --gate capture|prefill|decode: the file's own predicate (emit/frameworks.py), read at the fork
    phase_gate: str | None = None
    # names the file's framework provides, imported from it: sglang's get_bool_env_var, ...
    framework_imports: list[tuple[str, str]] = field(default_factory=list)
    model_stream: str = ""  # self.<attr> already holding a side stream of this API family: reused
    # phased plans: (attr, Class) of each submodule whose forward the side statements inline
    inline_guards: list[tuple[str, str]] = field(default_factory=list)
    # inputs snapshot at the fork by _ms_snapshot (their type is not known from the source): the
    # side stream runs only while _ms_can_snapshot says it copies them whole
    snapshot_checked: list[str] = field(default_factory=list)


@record
class Emission:
    """The code lines a sync strategy produced, by where the emitter puts them."""

    init_lines: list[str] = field(default_factory=list)
    prelude: list[str] = field(default_factory=list)
    on_cond: str = ""
    off_cond: str = ""
    on_head: list[str] = field(default_factory=list)
    with_open: str = ""
    side_head: list[str] = field(default_factory=list)
    side_tail: list[str] = field(default_factory=list)
    join: list[str] = field(default_factory=list)
    # Re-entering the side stream for a later phase: lines before its `with` (native modes), and the
    # start gate inside it (GE), a template over {side}, {tensor} and {anchor}.
    phase_head: list[str] = field(default_factory=list)
    phase_gate: str = ""
    helpers: list[str] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)  # guarded imports (helpers.GUARDED_IMPORTS keys)
    needs_os: bool = False
    stdlib: list[str] = field(default_factory=list)  # plain stdlib imports the helpers need
    from_imports: list[tuple[str, str]] = field(default_factory=list)  # (module, name) from the framework
    # Core limits on the main branch: `with <main_limit>:` around the main work between fork and join.
    main_limit: str = ""
    async_comm: bool = False  # side statements are blocking send/recv made asynchronous, no stream


def _flag(ctx: Context, em: Emission) -> str:
    """The expression that is true when the overlap is enabled, and the __init__ lines behind it."""
    default = "True" if ctx.flag_default else "False"
    em.from_imports += [i for i in ctx.framework_imports if i not in em.from_imports]
    if ctx.flag_kind in ("env", "sglang"):
        if ctx.flag_kind == "env":
            em.helpers.append("_ms_env_flag")
            em.needs_os = True
            read = f"_ms_env_flag({literal(ctx.flag_name)}, {default})"
        else:  # SGLang's own reader takes the default as the text it would find in the environment
            read = f"get_bool_env_var({literal(ctx.flag_name)}, {literal(default.lower())})"
        if not ctx.has_init:
            return read
        if ctx.init_sets_flag:  # another stream behind the same switch set it already
            return f"self.{ctx.names.flag_attr}"
        em.init_lines += [
            f"# msrewrite({ctx.case}): {ctx.flag_name}={'0' if ctx.flag_default else '1'} turns the side stream "
            f"{'off' if ctx.flag_default else 'on'}.",
            f"self.{ctx.names.flag_attr} = {read}",
        ]
        return f"self.{ctx.names.flag_attr}"
    if ctx.flag_kind == "vllm-ascend":
        # A field of vllm-ascend's AscendConfig (its additional_config); getattr: a release without
        # that field keeps the default.
        read = f"getattr(get_ascend_config(), {literal(ctx.flag_name)}, {default})"
        if not ctx.has_init:
            return read
        if not ctx.init_sets_flag:
            switch = "false" if ctx.flag_default else "true"
            em.init_lines += [
                f"# msrewrite({ctx.case}): additional_config {{{literal(ctx.flag_name)}: {switch}}} turns the side "
                f"stream {'off' if ctx.flag_default else 'on'}.",
                f"self.{ctx.flag_name} = {read}",
            ]
        return f"self.{ctx.flag_name}"
    # attr flag
    if not ctx.has_init:
        return f"getattr(self, {literal(ctx.flag_name)}, {default})"
    if not ctx.init_sets_flag:
        source = (
            f"getattr({ctx.init_config_param}, {literal(ctx.flag_name)}, {default})"
            if ctx.init_config_param
            else default
        )
        em.init_lines += [
            f"# msrewrite({ctx.case}): False turns the side stream off.",
            f"self.{ctx.flag_name} = {source}",
        ]
    return f"self.{ctx.flag_name}"


def _gate_condition(ctx: Context, em: Emission) -> str | None:
    """Every gate as one condition: the phase (--gate), the inlined forwards' run-time check
    (phased plans) and `_ms_num_tokens(x) <= N` (--max-tokens), else None. While it is false the original single-stream code runs."""
    gates = [ctx.phase_gate] if ctx.phase_gate else []
    for attr, cls in ctx.inline_guards:  # the inlined forward is what the call would run
        em.helpers.append("_ms_runs_as_inlined")
        gates.append(f"_ms_runs_as_inlined(self.{attr}, {cls})")
    if ctx.snapshot_checked:
        em.helpers.append("_ms_can_snapshot")
        gates.append(f"_ms_can_snapshot({', '.join(ctx.snapshot_checked)})")
    if ctx.max_tokens is not None and ctx.token_input is not None:
        em.helpers.append("_ms_num_tokens")
        gates.append(f"_ms_num_tokens({ctx.token_input}) <= {ctx.max_tokens}")
    return " and ".join(gates) or None


def _gated(ctx: Context, em: Emission, enabled: str) -> str:
    gate = _gate_condition(ctx, em)
    return enabled if gate is None else f"{enabled} and {gate}"


def _prebind(ctx: Context) -> list[str]:
    if not ctx.maybe_unbound:
        return []
    names = ctx.maybe_unbound
    return [
        f"# {_quote(names)} {_is_are(names)} bound only when the side branch's `if` runs.",
        " = ".join(names) + " = None",
    ]


def _native_prelude(ctx: Context, em: Emission, flag: str, gate: str | None, enabled: str, limited: bool) -> None:
    """The side stream of the native modes: the model's own, one handed down through the
    constructor, or the process-wide one for the tag (with its core budget when `limited`)."""
    n = ctx.names

    def side_stream(enabled_expr: str) -> str:
        if not limited:
            return f"_ms_side_stream({literal(ctx.tag)}, {enabled_expr})"
        # The side stream is shared by the whole process: its budget is set once, when it is made.
        assert ctx.core_limits is not None  # `limited`
        side_c, side_v, _, _ = ctx.core_limits
        em.helpers.append("_ms_limited_side_stream")
        return f"_ms_limited_side_stream({literal(ctx.tag)}, {enabled_expr}, {side_c}, {side_v})"

    if ctx.model_stream:
        # the model's own side stream (None where it made none): no second stream next to it
        em.prelude = [f"{n.stream} = self.{ctx.model_stream} if {enabled} else None"]
    elif ctx.stream_source == "constructor" and ctx.has_init:
        param = n.stream_attr
        em.init_lines += [
            "# Handed down by the model so every layer shares one stream; built directly, the layer",
            "# falls back to the same process-wide stream, created on first use.",
            f"if {param} is None:",
            f"    {param} = {side_stream(flag)}",
            f"self.{n.stream_attr} = {param}",
        ]
        stream_expr = f"self.{n.stream_attr}" + (f" if {gate} else None" if gate else "")
        em.prelude = [f"{n.stream} = {stream_expr}"]
    else:
        em.prelude = [f"{n.stream} = {side_stream(enabled)}"]


def _native(ctx: Context, api: str) -> Emission:
    """eager (torch.npu) and cuda (torch.cuda): fork by wait_stream, join by wait_stream."""
    em = Emission()
    n = ctx.names
    flag = _flag(ctx, em)
    gate = _gate_condition(ctx, em)
    enabled = flag if gate is None else f"{flag} and {gate}"
    if not ctx.model_stream:
        em.helpers += ["_ms_side_stream:" + ("cuda" if api == "torch.cuda" else "npu")]
    if api == "torch.npu":
        em.imports.append("torch_npu")
    limited = bool(ctx.core_limits) and api == "torch.npu"
    _native_prelude(ctx, em, flag, gate, enabled, limited)
    em.on_cond, em.off_cond = f"{n.stream} is not None", f"{n.stream} is None"
    if ctx.sync == "events":
        # Fresh events each call, recorded on the stream that produced the data.
        em.on_head = [
            f"{n.current} = {api}.current_stream()",
            f"{n.input_ready} = {api}.Event()",
            f"{n.input_ready}.record({n.current})",
            *_prebind(ctx),
        ]
        em.side_head = [f"{n.input_ready}.wait({n.stream})"]
    else:
        em.on_head = [
            f"{n.current} = {api}.current_stream()",
            f"{n.stream}.wait_stream({n.current})",
            *_prebind(ctx),
        ]
    if ctx.rebound_inputs:
        em.helpers.append("_ms_record_stream")
        em.on_head += [
            f"# {_quote(ctx.rebound_inputs)} {_is_are(ctx.rebound_inputs)} rebound before the join: "
            "keep the memory until the side stream is done.",
            f"_ms_record_stream({n.stream}, {', '.join(ctx.rebound_inputs)})",
        ]
    em.with_open = f"with {api}.stream({n.stream}):"
    em.phase_head = [f"{n.stream}.wait_stream({n.current})"]
    if limited:
        # The main stream's budget holds for the main work between fork and join only; the limit
        # it had before (torch_npu keeps limits per stream, for the whole process) comes back after.
        assert ctx.core_limits is not None  # `limited`
        _, _, main_c, main_v = ctx.core_limits
        em.helpers.append("_ms_core_limit:eager")
        em.stdlib.append("contextlib")
        em.main_limit = f"with _ms_core_limit({n.stream} is not None, {main_c}, {main_v}):"
    if ctx.sync == "events":
        em.join = [
            f"{n.side_done} = {api}.Event()",
            f"{n.side_done}.record({n.stream})",
            f"{n.side_done}.wait({n.current})",
        ]
    else:
        em.join = [f"{n.current}.wait_stream({n.stream})"]
    if ctx.outputs:
        em.helpers.append("_ms_record_stream")
        em.join += [
            "# Allocated on the side stream, freed on this one: keep them from early reuse.",
            f"_ms_record_stream({n.current}, {', '.join(ctx.outputs)})",
        ]
    return em


def eager(ctx: Context) -> Emission:
    return _native(ctx, "torch.npu")


def cuda(ctx: Context) -> Emission:
    return _native(ctx, "torch.cuda")


def npugraph_ex(ctx: Context) -> Emission:
    """Native streams and events, made once in __init__. Inside a compiled graph npugraph_ex resolves
    the stream by its id and replaces each event with a tagged event of the graph's own; the side
    stream stays off where record_stream would not reach it (helpers: _ms_capture_safe)."""
    em = Emission()
    n = ctx.names
    enabled = _flag(ctx, em)
    em.helpers += ["_ms_side_stream:npu", "_ms_stream_events:npu", "_ms_record_stream", "_ms_capture_safe"]
    em.imports.append("torch_npu")
    if ctx.has_init:
        em.init_lines += [
            "# Made once per module: eager calls reuse them; a compiled graph resolves the stream by id and",
            "# swaps each event for a tagged event of its own.",
            f"self.{n.stream_attr} = _ms_side_stream({literal(ctx.tag)}, {enabled})",
            f"self.{n.events_attr} = _ms_stream_events(self.{n.stream_attr})",
        ]
        stream_expr = f"_ms_capture_safe(self.{n.stream_attr})"
        events_expr = f"self.{n.events_attr}"
    else:
        stream_expr = f"_ms_capture_safe(_ms_side_stream({literal(ctx.tag)}, {enabled}))"
        events_expr = None
    gate = _gate_condition(ctx, em)
    if gate:
        stream_expr = f"{stream_expr} if {gate} else None"
    em.prelude = [f"{n.stream} = {stream_expr}"]
    em.on_cond, em.off_cond = f"{n.stream} is not None", f"{n.stream} is None"
    if events_expr is None:
        em.helpers.append("_ms_module_events")
        events_expr = f"_ms_module_events(self, {literal(ctx.tag)}, {n.stream})"
    em.on_head = [f"{n.fork_event}, {n.join_event} = {events_expr}"]
    if ctx.inputs:
        em.on_head += [f"_ms_record_stream({n.stream}, {', '.join(ctx.inputs)})"]
    em.on_head += [*_prebind(ctx), f"{n.fork_event}.record()"]
    em.with_open = f"with torch.npu.stream({n.stream}):"
    if ctx.core_limits:
        side_c, side_v, main_c, main_v = ctx.core_limits
        em.helpers.append("_ms_core_limit:npugraph-ex")
        em.stdlib.append("contextlib")
        em.with_open = f"with torch.npu.stream({n.stream}), _ms_core_limit(True, {side_c}, {side_v}):"
        em.main_limit = f"with _ms_core_limit({n.stream} is not None, {main_c}, {main_v}):"
    em.side_head = [f"{n.fork_event}.wait()"]
    em.side_tail = [f"{n.join_event}.record()"]
    em.join = [f"{n.join_event}.wait()"]
    if ctx.outputs:
        em.join += [f"_ms_record_stream(torch.npu.current_stream(), {', '.join(ctx.outputs)})"]
    return em


def ge_graph(ctx: Context) -> Emission:
    """torchair in-graph streams: the switch scope, start gates by rebinding, implicit join."""
    em = Emission()
    n = ctx.names
    enabled = _gated(ctx, em, _flag(ctx, em))
    em.helpers += ["_ms_torchair_config", "_ms_graph_streams"]
    em.imports.append("torchair")
    em.prelude = [f"{n.stream} = _ms_graph_streams({enabled})"]
    em.on_cond, em.off_cond = n.stream, f"not {n.stream}"
    em.with_open = f"with torchair.scope.npu_stream_switch({literal(ctx.tag)}, 0):"
    if ctx.core_limits:
        # limit_core_num nests inside the stream switch; the main branch gets its own budget
        side_c, side_v, main_c, main_v = ctx.core_limits
        em.helpers.append("_ms_core_limit:ge-graph")
        em.stdlib.append("contextlib")
        em.with_open = (
            f"with torchair.scope.npu_stream_switch({literal(ctx.tag)}, 0), _ms_core_limit(True, {side_c}, {side_v}):"
        )
        em.main_limit = f"with _ms_core_limit({n.stream}, {main_c}, {main_v}):"
    if ctx.phased:
        em.helpers.append("_ms_wait_tensor")
        em.phase_gate = "{side} = _ms_wait_tensor({tensor}, {anchor})"
    if ctx.gates:
        em.helpers.append("_ms_wait_tensor")
        em.side_head = [f"{side} = _ms_wait_tensor({orig}, {anchor})" for side, orig, anchor in ctx.gates]
    # No explicit join: GE orders the consumer after the side stream from the data dependency.
    return em


def async_comm(ctx: Context) -> Emission:
    """Point-to-point transfers: isend/irecv issued as early as their tensors exist, the waits
    right before the first use; the communication library moves the data, so no side stream."""
    em = Emission()
    n = ctx.names
    enabled = _gated(ctx, em, _flag(ctx, em))
    em.prelude = [f"{n.stream} = {enabled}"]
    em.on_cond, em.off_cond = n.stream, f"not {n.stream}"
    em.async_comm = True
    return em


STRATEGIES = {"eager": eager, "npugraph-ex": npugraph_ex, "ge-graph": ge_graph, "cuda": cuda}


def _quote(names: list[str]) -> str:
    return ", ".join(f"{name!r}" for name in names)  # identifiers (validated plan fields)


def _is_are(names: list[str]) -> str:
    return "is" if len(names) == 1 else "are"
