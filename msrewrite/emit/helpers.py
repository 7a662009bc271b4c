"""Module-level helpers the emitted code calls, one small function each, per execution mode.

They are written into the edited file (once, after its imports), so the patch is self-contained
and reviewable in one place. Every helper degrades to the original single-stream behaviour when
the flag is off or the backend is missing: no stream (None), the tensor itself, or nothing.
"""

from __future__ import annotations

# Module-level guarded imports, keyed by the name they bind.
GUARDED_IMPORTS = {
    "torch_npu": """\
try:
    import torch_npu  # noqa: F401  (registers torch.npu)
except ImportError:  # no NPU stack: the side stream stays off
    torch_npu = None
""",
    # torch_npu registers `torchair` as a lazy proxy that loads the real package on first attribute
    # access, so a torchair that fails to initialise passes `import torchair` and would raise inside
    # forward. Importing a name from it forces the load here; any failure turns the side stream off.
    "torchair": """\
try:
    import torch_npu  # noqa: F401  (torchair ships inside torch_npu and is registered by it)
    import torchair
    from torchair import scope as _ms_torchair_scope  # noqa: F401  (loads torchair now, not in forward)
except Exception:  # no NPU stack, or torchair fails to initialise: the side stream stays off
    torchair = None

_MS_GE_GRAPH = True  # compiled graphs are GE graphs: this edit's mode, until _ms_torchair_config says
""",
}

STREAM_CACHE = "_MS_SIDE_STREAMS = {}  # tag -> stream, one per process, shared by every layer\n"

FUNCTIONS = {
    "_ms_env_flag": '''\
def _ms_env_flag(name, default):
    """A boolean switch from the environment: 1/true/yes/on enable it, 0/false/no/off disable it."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in ("1", "true", "yes", "on")
''',
    "_ms_side_stream:npu": '''\
def _ms_side_stream(tag, enabled=True):
    """The side stream for `tag`, created on first use and shared by every layer; None when off."""
    if not enabled or not hasattr(torch, "npu"):
        return None
    stream = _MS_SIDE_STREAMS.get(tag)
    if stream is None:
        stream = _MS_SIDE_STREAMS[tag] = torch.npu.Stream()
    return stream
''',
    "_ms_side_stream:cuda": '''\
def _ms_side_stream(tag, enabled=True):
    """The side stream for `tag`, created on first use and shared by every layer; None when off."""
    if not enabled or not torch.cuda.is_available():
        return None
    stream = _MS_SIDE_STREAMS.get(tag)
    if stream is None:
        stream = _MS_SIDE_STREAMS[tag] = torch.cuda.Stream()
    return stream
''',
    "_ms_limited_side_stream": '''\
def _ms_limited_side_stream(tag, enabled, aicore_num, vectorcore_num):
    """The side stream for `tag` under its own core budget, set once when the stream is made."""
    made_before = tag in _MS_SIDE_STREAMS
    stream = _ms_side_stream(tag, enabled)
    if stream is not None and not made_before:
        torch.npu.set_stream_limit(stream, aicore_num, vectorcore_num)
    return stream
''',
    "_ms_same_batch": '''\
def _ms_same_batch(hidden_states, *values):
    """Every value split with the batch is None or has the hidden states' rows: else the original loop runs."""
    return all(value is None or value.shape[0] == hidden_states.shape[0] for value in values)
''',
    "_ms_microbatch:npu": '''\
def _ms_microbatch(enabled, hidden_states):
    """Micro-batching needs the NPU stream backend and at least two sequences to split."""
    return bool(enabled) and hasattr(torch, "npu") and hidden_states.shape[0] >= 2
''',
    "_ms_microbatch:cuda": '''\
def _ms_microbatch(enabled, hidden_states):
    """Micro-batching needs CUDA and at least two sequences to split."""
    return bool(enabled) and torch.cuda.is_available() and hidden_states.shape[0] >= 2
''',
    "_ms_stream_events:npu": '''\
def _ms_stream_events(stream):
    """The (fork, join) event pair of one module, made once and reused by every eager call (a compiled
    npugraph_ex graph replaces each event with a tagged event of its own)."""
    if stream is None:
        return None
    return torch.npu.Event(), torch.npu.Event()
''',
    "_ms_module_events": '''\
def _ms_module_events(module, tag, stream):
    """The module's (fork, join) events for `tag`: created on first use, then reused every call."""
    if stream is None:
        return None
    key = "_ms_events_" + tag
    events = module.__dict__.get(key)
    if events is None:
        events = module.__dict__[key] = (torch.npu.Event(), torch.npu.Event())
    return events
''',
    "_ms_capture_safe": '''\
def _ms_capture_safe(stream):
    """`stream`, or None (the original single-stream path) inside a compiled graph whose
    record_stream would not reach it.

    torch_npu 2.10 traces Tensor.record_stream as torch.npu.fake_record_stream, which npugraph_ex
    lowers to record_tagged_stream_(t, <FX node name>): a stream made for that name, not this one,
    so buffers used across the streams would lose their protection. torch_npu 2.14 lowers it by
    stream id (record_tagged_on_stream_) and keeps the side stream; so does eager code, everywhere.
    """
    if stream is not None and torch.compiler.is_compiling() and hasattr(torch.npu, "fake_record_stream"):
        return None
    return stream
''',
    "_ms_core_limit:eager": '''\
@contextlib.contextmanager
def _ms_core_limit(enabled, aicore_num, vectorcore_num):
    """Cap the current stream's AI cores inside the block, then restore the limit it had before."""
    if not enabled:
        yield
        return
    stream = torch.npu.current_stream()
    previous = torch.npu.get_stream_limit(stream)
    torch.npu.set_stream_limit(stream, aicore_num, vectorcore_num)
    try:
        yield
    finally:
        torch.npu.set_stream_limit(stream, previous["cube_core_num"], previous["vector_core_num"])
''',
    "_ms_core_limit:ge-graph": '''\
def _ms_core_limit(enabled, aicore_num, vectorcore_num):
    """torchair's op-level core limit inside a GE graph; a no-op context when off."""
    if not enabled or torchair is None:
        return contextlib.nullcontext()
    return torchair.scope.limit_core_num(aicore_num, vectorcore_num)
''',
    "_ms_core_limit:npugraph-ex": '''\
def _ms_core_limit(enabled, aicore_num, vectorcore_num):
    """npugraph_ex's stream-level core limit; a no-op context when off."""
    if not enabled or not hasattr(torch, "npu"):
        return contextlib.nullcontext()
    return torch.npu.npugraph_ex.scope.limit_core_num(aicore_num, vectorcore_num)
''',
    "_ms_record_stream": '''\
def _ms_record_stream(stream, *values):
    """Mark tensors (also inside tuples and lists) as in use on `stream`, so the caching allocator
    cannot hand their memory out early."""
    for value in values:
        if isinstance(value, torch.Tensor):
            value.record_stream(stream)
        elif isinstance(value, (tuple, list)):
            _ms_record_stream(stream, *value)
''',
    "_ms_can_snapshot": '''\
def _ms_can_snapshot(*values):
    """True when _ms_snapshot copies all of `values` that could be written: tensors, immutable
    values (None, numbers, strings, dtypes, devices) and plain tuples, lists and dicts of these.
    Any other object may hold state a snapshot cannot copy: the original single-stream code runs."""
    for value in values:
        if type(value) in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
            if not _ms_can_snapshot(*value):
                return False
        elif type(value) is dict:
            if not _ms_can_snapshot(*value.values()):
                return False
        elif not isinstance(
            value, (torch.Tensor, type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
        ):
            return False
    return True
''',
    "_ms_snapshot": '''\
def _ms_snapshot(value):
    """A copy of `value` for the side stream to read while the main path may write the original:
    tensors are cloned, also inside tuples, lists and dicts; immutable values are returned as they
    are (_ms_can_snapshot has checked there is nothing else)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple keeps its type
        return type(value)(*(_ms_snapshot(v) for v in value))
    if type(value) in (tuple, list):
        return type(value)(_ms_snapshot(v) for v in value)
    if type(value) is dict:
        return {k: _ms_snapshot(v) for k, v in value.items()}
    return value
''',
    "_ms_num_tokens": '''\
def _ms_num_tokens(hidden_states):
    """Tokens in a [..., hidden] activation, for the token-count gate."""
    return hidden_states.numel() // max(hidden_states.shape[-1], 1)
''',
    "_ms_runs_as_inlined": '''\
def _ms_runs_as_inlined(module, cls):
    """True when calling `module` would run nothing but `cls.forward` as written in this file, so the
    side stream may run that forward's statements inlined: `module` is a `cls` (no subclass), the
    forward is this file's own (not replaced on the class or the instance), and its __call__ has
    nothing else to do (no forward, pre-forward or backward hooks, on it or torch's global ones, no
    torch.compile'd call, no JIT trace; a global hook marked `_ms_observer`, as msrewrite verify's
    sanitizer marks its own, only watches). Otherwise False, and the original call runs instead, on the
    current stream. Checked on every forward: attribute and dict reads only."""
    try:
        forward = vars(cls).get("forward")
        code = getattr(forward, "__code__", None)
        hooks = torch.nn.modules.module
        return not (
            type(module) is not cls
            or code is None
            or code.co_filename != __file__
            or getattr(forward, "__qualname__", None) != cls.__qualname__ + ".forward"
            or hasattr(forward, "__wrapped__")
            or "forward" in vars(module)
            or "_call_impl" in vars(module)
            or cls.__call__ is not torch.nn.Module._wrapped_call_impl
            or module._compiled_call_impl is not None
            or module._forward_hooks
            or module._forward_pre_hooks
            or module._backward_hooks
            or module._backward_pre_hooks
            or any(not getattr(h, "_ms_observer", False) for h in hooks._global_forward_hooks.values())
            or any(not getattr(h, "_ms_observer", False) for h in hooks._global_forward_pre_hooks.values())
            or hooks._global_backward_hooks
            or hooks._global_backward_pre_hooks
            or torch._C._get_tracing_state()
        )
    except Exception:  # another torch, a module without these attributes: keep the call
        return False
''',
    "_ms_torchair_config": '''\
def _ms_torchair_config(config):
    """Record whether torchair compiles GE graphs with `config`, and return it:
    torchair.get_npu_backend(compiler_config=_ms_torchair_config(config)).

    npu_wait_tensor and the implicit join exist only in a GE graph (mode "max-autotune"), and
    torchair has no predicate for it: torch.compiler.is_compiling() is also true under
    reduce-overhead, npugraph_ex and debug.run_eagerly, where the op raises and nothing joins
    the side stream.
    """
    global _MS_GE_GRAPH
    mode = getattr(config.mode, "value", config.mode)
    run_eagerly = getattr(config.debug.run_eagerly, "value", config.debug.run_eagerly)
    _MS_GE_GRAPH = mode == "max-autotune" and not run_eagerly
    return config
''',
    "_ms_graph_streams": '''\
def _ms_graph_streams(enabled):
    """GE multi-stream needs torchair, and inside a compiled graph GE graph mode: other graphs do not
    join the side stream. Otherwise the original single-stream path runs (in eager the switch is a no-op)."""
    if not enabled or torchair is None:
        return False
    return _MS_GE_GRAPH or not torch.compiler.is_compiling()
''',
    "_ms_wait_tensor": '''\
def _ms_wait_tensor(tensor, dependency):
    """Order `tensor`'s consumers after `dependency` inside a GE graph.

    torchair's npu_wait_tensor raises outside a GE graph (prefill runs eager; reduce-overhead,
    npugraph_ex and run_eagerly too), so it is only called while torch.compile traces a GE graph;
    in eager the stream switch is a no-op and the order holds anyway.
    """
    if torchair is None or not (_MS_GE_GRAPH and torch.compiler.is_compiling()):
        return tensor
    while isinstance(dependency, (tuple, list)) and dependency:  # an op's outputs: any one orders it
        dependency = next((d for d in dependency if isinstance(d, torch.Tensor)), dependency[0])
    return torchair.scope.npu_wait_tensor(tensor, dependency)
''',
}


def helper_source(names: list[str]) -> str:
    """Source text for the helpers in `names` (keys of FUNCTIONS), in a stable order."""
    return "\n\n".join(FUNCTIONS[name] for name in FUNCTIONS if name in names)


def defined_name(key: str) -> str:
    return key.split(":")[0]
