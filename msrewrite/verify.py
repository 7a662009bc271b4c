"""Verify: prove a multi-stream edit on CPU.

Runs the model built from the harness three ways and compares the outputs:
  original   the unedited file (when given)
  flag off   the edited file with its switch off: must equal the original, all ops on main
  flag on    the edited file with its switch on, under the CPU stream runtime and the stream
             sanitizer: must equal too, run some ops on a side stream, and raise no finding.
GE-graph edits run flag-on twice: as a torchair graph would (graph mode) and eagerly, as
prefill does, where npu_wait_tensor must never be reached. Graph-mode edits also run, in the
default scenario, compiled in every other way their helpers claim to handle (COMPILED_RUNS):
npugraph-ex captured on torch_npu 2.14 and 2.10, ge-graph under torchair's reduce-overhead,
npugraph_ex and run_eagerly configs, each handed to the edit's own _ms_torchair_config.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from msrewrite.analyze.torch_names import RNG_OPS
from msrewrite.errors import BadInput
from msrewrite.load import encode_source, read_source
from msrewrite.plan import MODES, FlagSpec

_ENV_FLAG = re.compile(r'_ms_env_flag\("(\w+)",\s*(True|False)\)')
_SGLANG_FLAG = re.compile(r'get_bool_env_var\("(\w+)",\s*"(true|false)"\)')
# --gate capture: SGLang's predicate, which verify opens (flag on) and closes (the gate-false run)
_CAPTURE_GATE = re.compile(r"\band get_is_capture_mode\(\)")
_VLLM_ASCEND_FLAG = re.compile(r'getattr\(get_ascend_config\(\),\s*"(\w+)",\s*(True|False)\)')
# a call site, never the helper's own `def _ms_side_stream(tag, enabled=True):`
_ATTR_FLAG = re.compile(r"(?<!def )_ms_(?:side_stream|graph_streams|microbatch)\((?:\"[^\"]*\",\s*)?(?:self\.)?(\w+)")
_counter = itertools.count()


def detect_emitted_mode(text: str) -> str | None:
    """The execution mode an msrewrite edit was emitted for, from the APIs it calls."""
    if "torchair.scope.npu_stream_switch(" in text:
        return "ge-graph"
    if "torch.cuda.stream(" in text:
        return "cuda"
    if "_ms_stream_events" in text or "_ms_module_events" in text:
        return "npugraph-ex"
    if "torch.npu.stream(" in text:
        return "eager"
    return None


def detect_flag(text: str) -> FlagSpec | None:
    env = _ENV_FLAG.search(text)
    if env:
        return FlagSpec(kind="env", name=env.group(1), default=env.group(2) == "True")
    sglang = _SGLANG_FLAG.search(text)
    if sglang:
        return FlagSpec(kind="sglang", name=sglang.group(1), default=sglang.group(2) == "true")
    ascend = _VLLM_ASCEND_FLAG.search(text)
    if ascend:
        return FlagSpec(kind="vllm-ascend", name=ascend.group(1), default=ascend.group(2) == "True")
    attr = _ATTR_FLAG.search(text)
    if attr and attr.group(1) not in ("True", "False"):
        try:
            return FlagSpec(kind="attr", name=attr.group(1))
        except ValueError:  # not a name an edit would use as its switch (None, training, ...)
            return None
    return None


@dataclass
class RunResult:
    name: str
    outputs: list[torch.Tensor]
    streams: dict[str, int] = field(default_factory=dict)  # stream name -> op count
    # after the forward, None where a tensor's storage was freed:
    buffers: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)
    inputs: list[torch.Tensor | None] = field(default_factory=list)  # the caller's tensors
    grads: list[tuple[str, torch.Tensor | None]] | None = None  # train runs: each parameter's gradient
    backward_error: str = ""  # train runs whose backward raised
    raw: Any = None  # the module's own return value (for the sanitizer's output check)


@dataclass
class VerifyResult:
    mode: str
    flag: FlagSpec
    runs: list[RunResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    findings: list[Any] = field(default_factory=list)
    tolerance: tuple[float, float] = (0.0, 0.0)  # (atol, rtol); zero means exact
    tolerance_why: str = ""  # why verify compares within a tolerance the user did not give
    schedules: list[str] = field(default_factory=lambda: ["early"])  # side work issued at the fork, ...
    schedule_note: str = ""  # why some schedules were not run
    scenarios: list[str] = field(default_factory=lambda: ["eval"])
    skipped: list[str] = field(default_factory=list)  # scenarios the original itself cannot run

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": self.ok,
                "mode": self.mode,
                "flag": f"{self.flag.kind}:{self.flag.name}",
                "schedules": self.schedules,
                "schedule_note": self.schedule_note,
                "scenarios": self.scenarios,
                "skipped": self.skipped,
                "runs": {r.name: {"streams": r.streams, "outputs": len(r.outputs)} for r in self.runs},
                "problems": self.problems,
                "findings": [
                    {"kind": f.kind, "message": f.message, "first": list(f.first), "second": list(f.second)}
                    for f in self.findings
                ],
            },
            indent=2,
        )


def flatten_outputs(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) model output, in a stable order, detached; a Python number (an
    auxiliary loss as a float, a token count) as a 0-dim tensor, so it is compared too."""
    return [t.detach() for t in _tensors(value)]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (bool, int, float, complex)):
        return [torch.tensor(value)]
    if isinstance(value, dict):
        return [t for key in value for t in _tensors(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return _tensors(value.to_tuple())
    return []


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _set_attr_flag(obj: Any, name: str, value: bool) -> None:
    if obj is not None:
        with contextlib.suppress(Exception):
            setattr(obj, name, value)


class _OverriddenConfig:
    """vllm-ascend's AscendConfig with one field switched (verify's flag off / flag on)."""

    def __init__(self, config: Any, name: str, value: bool) -> None:
        self._config, self._name, self._value = config, name, value

    def __getattr__(self, attr: str) -> Any:
        return self._value if attr == self._name else getattr(self._config, attr)


def _ascend_config_with(get_ascend_config, name: str, value: bool):
    """get_ascend_config() as the edited module sees it, with `name` set: the edit reads it in __init__."""
    return lambda: _OverriddenConfig(get_ascend_config(), name, value)


def compare(reference: RunResult, other: RunResult, atol: float, rtol: float, scaled: bool = False) -> str | None:
    """How `other` differs from `reference`, first difference only: its outputs, the caller's
    inputs and the buffers after the forward, and (train runs) the parameters' gradients.
    `scaled`: atol is a fraction of each tensor's largest entry (float rounding of its sums)."""
    return (
        _compare_outputs(reference, other, atol, rtol, scaled)
        or _compare_inputs(reference, other)
        or _compare_grads(reference, other, atol, rtol)
        or _compare_buffers(reference, other, atol, rtol, scaled)
    )


def _compare_outputs(reference: RunResult, other: RunResult, atol: float, rtol: float, scaled: bool) -> str | None:
    if len(reference.outputs) != len(other.outputs):
        return f"{other.name}: {len(other.outputs)} output tensors, {reference.name} has {len(reference.outputs)}"
    for i, (a, b) in enumerate(zip(reference.outputs, other.outputs, strict=True)):
        if a.shape != b.shape:
            return f"{other.name}: output {i} has shape {tuple(b.shape)}, {reference.name} {tuple(a.shape)}"
        if a.dtype != b.dtype:  # torch.equal compares values only: f32 ones equal f64 ones
            return f"{other.name}: output {i} has dtype {b.dtype}, {reference.name} {a.dtype}"
        if not _same_values(a, b, atol, rtol, scaled):
            diff = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item() if a.numel() else 0.0
            return f"{other.name}: output {i} differs from {reference.name} (max |diff| {diff:.3g})"
    return None


def _compare_inputs(reference: RunResult, other: RunResult) -> str | None:
    """The caller's tensors as the forward left them: exactly (an edit writes no input it did not)."""
    if len(reference.inputs) != len(other.inputs):
        return (
            f"{other.name}: {len(other.inputs)} input tensors after the forward, "
            f"{reference.name} has {len(reference.inputs)}"
        )
    for i, (a, b) in enumerate(zip(reference.inputs, other.inputs, strict=True)):
        if not _same_snapshot(a, b, 0.0, 0.0):
            return f"{other.name}: input {i} differs from {reference.name} after the forward (written in place)"
    return None


def _compare_buffers(reference: RunResult, other: RunResult, atol: float, rtol: float, scaled: bool) -> str | None:
    theirs = dict(other.buffers)
    ours = {name for name, _ in reference.buffers}
    if ours != theirs.keys():  # an edit adds or drops no buffer
        missing, extra = sorted(ours - theirs.keys()), sorted(theirs.keys() - ours)
        what = ", ".join([*(f"no buffer {n}" for n in missing), *(f"an extra buffer {n}" for n in extra)])
        return f"{other.name}: {what} after the forward, unlike {reference.name}"
    for name, mine in reference.buffers:
        exact = mine is None or not (mine.is_floating_point() or mine.is_complex())
        if not _same_snapshot(mine, theirs[name], *((0.0, 0.0, False) if exact else (atol, rtol, scaled))):
            return f"{other.name}: buffer {name} differs from {reference.name} after the forward"
    return None


def _compare_grads(reference: RunResult, other: RunResult, atol: float, rtol: float) -> str | None:
    """Train runs: the same parameters get the same gradients (an edit that detaches the side
    output, or computes it under no_grad, stops training the shared expert)."""
    if reference.grads is None:
        return None  # not a train run, or the original's own backward raised
    if other.grads is None:
        return f"{other.name}: backward raised {other.backward_error}" if other.backward_error else None
    theirs = dict(other.grads)
    for name, a in reference.grads:
        b = theirs.get(name, None)
        if (a is None) != (b is None):
            which = "no gradient" if b is None else "a gradient"
            return f"{other.name}: {which} for parameter {name}, unlike {reference.name}"
        if a is not None and b is not None and not (a.shape == b.shape and _close_grads(a, b, atol, rtol)):
            return f"{other.name}: the gradient of parameter {name} differs from {reference.name}"
    return None


def _close_grads(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    """Equal up to the order of the backward's sums: an edit reorders the forward, and autograd
    accumulates a gradient used more than once in the reverse of that order, so float rounding
    differs (relative 1e-4 of the largest entry at most); a dropped or doubled gradient does not."""
    scale = a.abs().max().item() if a.numel() else 0.0
    return torch.allclose(a, b, rtol=max(rtol, 1e-4), atol=max(atol, 1e-4 * scale), equal_nan=True)


def _same_snapshot(
    a: torch.Tensor | None, b: torch.Tensor | None, atol: float, rtol: float, scaled: bool = False
) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and _same_values(a, b, atol, rtol, scaled)


def _same_values(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float, scaled: bool = False) -> bool:
    """Equal (or within the tolerance), NaN where the reference has NaN: an edit that computes
    the same NaN is not a difference, one that makes or hides a NaN is."""
    if atol == 0 and rtol == 0:
        if torch.equal(a, b):
            return True
        if not (a.is_floating_point() or a.is_complex()):
            return False
    if scaled and a.numel():
        atol *= a.abs().nan_to_num(0.0, 0.0, 0.0).max().item()
    return torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True)


# the aten ops torch tags `nondeterministic_seeded` (the generated table analyze/torch_names.RNG_OPS):
# rrelu_with_noise, native_dropout, bernoulli_, exponential_, ... by any overload
RANDOM_OPS = re.compile(r"^aten\.(" + "|".join(sorted(map(re.escape, RNG_OPS))) + r")\.")
# torch.distributed's collectives and point-to-point ops as the dispatcher sees them (c10d.allreduce_,
# _c10d_functional.all_gather_into_tensor); waiting on one is not one
COLLECTIVE_OPS = re.compile(r"^(c10d|_c10d_functional)\.(?!wait)")


@dataclass
class Scenario:
    """One way of running the model: train or eval, on which inputs."""

    name: str  # "" for the default run (eval, make()'s inputs); "train", "zero tokens", "draw 1", ...
    training: bool = False
    inputs: tuple[tuple, dict] | None = None  # None: the harness's own
    fallback: tuple[tuple, dict] | None = None  # inputs of make()'s shape, when the original rejects these

    def label(self, run: str) -> str:
        return f"{self.name}: {run}" if self.name else run

    def at_make_shape(self) -> Scenario:
        """The same draw at make()'s shape ("draw 1 (batch 1)" -> "draw 1"), for an original that
        rejects the cut one."""
        assert self.fallback is not None
        return Scenario(self.name.split(" (")[0], training=self.training, inputs=self.fallback)


def run_module(built, scenario: Scenario, seed: int = 0, restore: bool = False, backward: bool = True) -> RunResult:
    """One forward of a built harness under `scenario`.

    Train runs enable grad. Every run keeps the buffers (running statistics, caches) and the
    caller's input tensors as the forward left them: an edit that writes either differently is
    not the original. Every run starts from the same RNG seed, so dropout draws match when their
    order does. `restore` puts the module's parameters and buffers back afterwards (a module run
    again). Train runs also backpropagate (`backward`; a sanitized run does it after the sanitizer,
    see `run_backward`)."""
    from msrewrite.harness import clone_tree, exit_if_forked, manual_seed

    module = built.module
    state = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()} if restore else {}
    args, kwargs = scenario.inputs or (built.args, built.kwargs)
    module.train(scenario.training)
    manual_seed(seed)
    try:
        call_args, call_kwargs = clone_tree(args), clone_tree(kwargs)
        with torch.enable_grad() if scenario.training else torch.no_grad():
            out = module(*call_args, **call_kwargs)
        exit_if_forked()
        with _disable_current_modes():  # the harness looking, not the model: no op to record or sanitize
            buffers = [(n, _snapshot(b)) for n, b in module.named_buffers()]
            inputs = [_snapshot(t) for t in flatten_outputs((call_args, call_kwargs))]
        result = RunResult("", flatten_outputs(out), buffers=buffers, inputs=inputs)
        result.raw = out
        if backward and scenario.training:
            run_backward(built, result)  # before `restore` writes the parameters it saved
    finally:
        if restore:
            with torch.no_grad():
                for key, value in module.state_dict(keep_vars=True).items():
                    if key in state and value.shape == state[key].shape:
                        value.copy_(state[key])
        module.eval()
    return result


def _snapshot(tensor: torch.Tensor) -> torch.Tensor | None:
    """A copy of `tensor`, or None when its storage no longer holds it (freed with
    `untyped_storage().resize_(0)`: reading it would read past the end)."""
    tensor = tensor.detach()
    if tensor.numel():
        last = tensor.storage_offset() + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
        if tensor.untyped_storage().nbytes() < (last + 1) * tensor.element_size():
            return None
    return tensor.clone()


def run_backward(built, result: RunResult) -> None:
    """Backpropagate a fixed random weighting of the float outputs and keep every parameter's
    gradient in `result.grads` (the parameters' own .grad stay as they were).

    A sanitized run calls this after the sanitizer: the CPU runtime issues the backward on the
    main stream, where a device runs each op's backward on the stream of its forward."""
    outputs = [t for t in _tensors(result.raw) if t.requires_grad]
    params = [(name, p) for name, p in built.module.named_parameters() if p.requires_grad]
    if not outputs or not params:
        return
    gen = torch.Generator().manual_seed(7)
    loss = torch.stack([(t * torch.randn(t.shape, generator=gen).to(t.dtype)).sum().float() for t in outputs]).sum()
    try:
        with warnings.catch_warnings():  # e.g. "no autograd kernel for c10d::allreduce_": the original's too
            warnings.simplefilter("ignore")
            grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    except Exception as exc:  # the model's own backward: compared, not a crash
        from msrewrite.harness import one_line

        result.backward_error = one_line(exc)[:200]
        return
    result.grads = [
        (name, None if g is None else g.detach().clone()) for (name, _), g in zip(params, grads, strict=True)
    ]


_SPLITS_THE_BATCH = "# msrewrite(prefill-microbatch): two micro-batches"
_PEER_MESSAGES = re.compile(r"\b(?:dist|distributed)\.i?(?:send|recv)\(")


def scenarios_for(reference, inputs: int, train: bool = True) -> list[Scenario]:
    """eval on make()'s inputs, train on them, a zero-token batch and `inputs` random draws with
    outliers (the zero-token batch is dropped later when the original rejects it).

    The first draw is cut to a batch of one and the second to one token (decode), where the
    inputs have such dims: a join or a guard that depends on the batch size gets both sides
    of its test. A draw the original rejects at that size is drawn at make()'s shape instead."""
    found = [Scenario("")]
    if train:
        found.append(Scenario("train", training=True))
    zero = cut_inputs(reference.args, reference.kwargs, "token", 0)
    if zero is not None:
        found.append(Scenario("zero tokens", inputs=zero))
    for k in range(1, inputs + 1):
        drawn = random_inputs(reference.args, reference.kwargs, k)
        dim, label = {1: ("batch", "batch 1"), 2: ("token", "1 token")}.get(k, ("", ""))
        cut = cut_inputs(*drawn, dim, 1) if dim else None
        if cut is not None:
            found.append(Scenario(f"draw {k} ({label})", inputs=cut, fallback=drawn))
        else:
            found.append(Scenario(f"draw {k}", inputs=drawn))
    return found


def cut_inputs(args: tuple, kwargs: dict, dim_name: str, size: int) -> tuple[tuple, dict] | None:
    """The inputs cut to `size` along the token dim (-2 of the first float tensor with 2+ dims) or
    the batch dim (0 of the first float tensor with 3+ dims), in every float tensor of that rank
    with the same length there; None when there is no such dim (or it is already that size)."""
    rank = 2 if dim_name == "token" else 3
    first = next((t for t in (*args, *kwargs.values()) if _is_float(t) and t.dim() >= rank), None)
    if first is None:
        return None
    dim = first.dim() - 2 if dim_name == "token" else 0
    length = first.shape[dim]
    if length == size:
        return None

    def cut(value):
        if _is_float(value) and value.dim() == first.dim() and value.shape[dim] == length:
            return value.narrow(dim, 0, size).clone()
        return value

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def random_inputs(args: tuple, kwargs: dict, draw: int) -> tuple[tuple, dict]:
    """Fresh normal values in every float tensor, with a few outliers (|x| = 3e4): data-dependent
    paths such as a clamp that fires only on outliers get exercised."""
    gen = torch.Generator().manual_seed(1000 + draw)

    def redraw(value):
        if not _is_float(value) or value.numel() == 0:
            return value
        fresh = torch.randn(value.shape, generator=gen, dtype=torch.float32).to(value.dtype)
        flat = fresh.view(-1)
        picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 64),), generator=gen)
        flat[picks] = 3e4 * torch.sign(torch.randn(picks.shape, generator=gen)).to(value.dtype)
        return fresh

    return tuple(redraw(a) for a in args), {k: redraw(v) for k, v in kwargs.items()}


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def fresh_module(path: Path, package: str | None):
    """`path` loaded as a module of its own, under a new name: module-level stream caches and the
    model's classes belong to the runtime of the run that loads it."""
    from msrewrite.harness import load_module

    fresh = f"_msrewrite_verify_{next(_counter)}"
    return load_module(path, package=package, name=f"{package}.{fresh}" if package else fresh)


def _compiles(text: str) -> bool:
    try:
        compile(text, "<edited>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False  # loading the file reports it, with its line
    return True


def flag_is_read(text: str, flag: FlagSpec) -> bool:
    """Whether the edited file reads the switch at all (a misspelled --flag is bad input)."""
    if flag.kind in ("env", "sglang"):
        return re.search(rf"[\"']{re.escape(flag.name)}[\"']", text) is not None
    return re.search(rf"\b{re.escape(flag.name)}\b", text) is not None


def verify_files(
    rewritten: Path,
    *,
    original: Path | None = None,
    harness: str | None = None,
    target: str | None = None,
    flag: FlagSpec | None = None,
    mode: str = "auto",
    atol: float = 0.0,
    rtol: float = 0.0,
    package: str | None = None,
    explicit_target: bool = True,
    schedule_source: Any = None,
    inputs: int = 2,
    train: bool = True,
    schedules: tuple[str, ...] | None = None,
    progress: Any = None,
) -> VerifyResult:
    """`schedule_source` (emit.schedules.ScheduleSource): the plans behind the edit; derived from
    `original` when not given. `schedules`: which to run (default: every one the edit allows).
    `progress` (harness.ChildProgress): told where user code is, when run in a child process."""
    text = read_source(rewritten)
    mode = _mode_of(rewritten, text, mode)
    if flag is not None and _compiles(text) and not flag_is_read(text, flag):
        raise BadInput(f"no such flag: {rewritten} never reads {flag.kind}:{flag.name}")
    flag = flag or detect_flag(text)
    package, harness, target = _harness_of(rewritten, original, harness, target, package, explicit_target)
    phase, stage = _progress_hooks(progress)
    phase("building the harness")
    stage("building the model")
    if flag is None:  # hand-written multi-stream code without a switch: check it as written
        return _stripped(
            _verify_as_written(rewritten, original, harness, target, mode, atol, rtol, package, phase, inputs, train)
        )

    result = VerifyResult(mode=mode, flag=flag, tolerance=(atol, rtol))
    scaled = atol == rtol == 0 and _SPLITS_THE_BATCH in text
    if scaled:
        # each micro-batch's GEMMs have fewer rows: the kernels block and round them differently,
        # by a fraction of the tensor's scale (a buffer near zero keeps a tight bound)
        atol, rtol = 1e-6, 1e-5
        result.tolerance = (atol, rtol)
        result.tolerance_why = "atol relative to each tensor's largest entry: micro-batches run smaller GEMMs"
    variants, result.schedule_note, schedule_source = _schedule_variants(
        text, original, mode, flag, schedule_source, schedules
    )
    result.schedules = ["early", *variants]
    # the edit's own gate, not a capture test the file already had (SGLang's forward picks its
    # dual-stream path with `... and get_is_capture_mode()`): more of them than in the original
    capture_gate = len(_CAPTURE_GATE.findall(text)) > (
        len(_CAPTURE_GATE.findall(read_source(original))) if original is not None else 0
    )
    edited = _Edited(rewritten, package, flag, capture_gate=capture_gate)
    with edited.switch(False):
        reference = _build_reference(rewritten, original, harness, target, package)
    phase("running the model")
    scenarios = _scenarios(result, reference, text, inputs, train)
    from msrewrite.harness import scratch_folder

    with scratch_folder("msrewrite-schedules-") as folder:
        variant_paths = _write_variants(variants, Path(folder), rewritten.stem)
        job = _Job(result, reference, original, edited, variant_paths, schedule_source, atol, rtol, stage)
        job.call_again = not _PEER_MESSAGES.search(text)  # a peer expects one forward's messages
        job.scaled = scaled
        _run_scenarios(job, scenarios)
    _add_findings(result)
    return _stripped(result)


def _mode_of(rewritten: Path, text: str, mode: str) -> str:
    """The execution mode to check: `mode`, or the one the edit was emitted for ("auto")."""
    if mode == "auto":
        detected = detect_emitted_mode(text)
        if detected is None:
            raise BadInput(f"{rewritten}: no msrewrite multi-stream edit found (pass --mode for hand-written code)")
        return detected
    if mode not in MODES:
        raise BadInput(f"unknown mode {mode!r}; choose auto, {', '.join(MODES)}")
    return mode


def _harness_of(rewritten, original, harness, target, package, explicit_target):
    """(package, harness, target) for the reference file: a `make()` in it is the harness, and then
    a target that was not given explicitly is dropped (make() may build the whole model around it)."""
    from msrewrite.harness import package_of

    reference_file = original or rewritten
    package = package or package_of(reference_file)
    if harness is None and re.search(r"^def make\(", read_source(reference_file), re.M):
        harness = f"{reference_file}:make"
    if harness is not None and target is not None and not explicit_target:
        target = None
    return package, harness, target


def _progress_hooks(progress) -> tuple[Callable[[str], None], Callable[[str], None]]:
    """(phase, stage): where user code is (a child's parent watches it), and what a person watching sees."""
    phase = progress.phase if progress is not None else (lambda _name: None)
    stage = getattr(progress, "stage", None) or (lambda _name: None)
    return phase, stage


@dataclass
class _Edited:
    """The edited file as verify loads it, run by run, and how its switch is set."""

    path: Path
    package: str | None
    flag: FlagSpec
    capture_gate: bool  # the edit opens only while SGLang captures a graph (--gate capture)

    def switch(self, on: bool):
        if self.flag.kind in ("env", "sglang"):  # SGLang's get_bool_env_var reads 1/0 as well
            return _env(self.flag.name, "1" if on else "0")
        return contextlib.nullcontext()

    def load(self, path: Path | None = None):
        """The edited file (or a schedule variant of it at `path`) as a fresh module."""
        return fresh_module(path or self.path, self.package)

    def build(self, reference, on: bool, path: Path | None = None, gate_open: bool = True, module=None):
        """`reference`'s module rebuilt from the edited file (or a schedule variant of it at `path`;
        `module`: that file, already loaded)."""
        flag = self.flag
        module = module if module is not None else self.load(path)
        if self.capture_gate and callable(getattr(module, "get_is_capture_mode", None)):
            vars(module)["get_is_capture_mode"] = lambda: gate_open  # as while SGLang captures a graph, or not
        if flag.kind == "vllm-ascend" and callable(getattr(module, "get_ascend_config", None)):
            vars(module)["get_ascend_config"] = _ascend_config_with(module.get_ascend_config, flag.name, on)
        if flag.kind == "attr":
            _set_attr_flag(reference.config, flag.name, on)
        built = reference.rebuild_from(module)
        if flag.kind in ("attr", "vllm-ascend"):  # vllm-ascend: self.NAME, read from get_ascend_config()
            for sub in built.module.modules():
                if hasattr(sub, flag.name):
                    setattr(sub, flag.name, on)
        return built


def _build_reference(rewritten, original, harness, target, package):
    """The harness every run is compared with: from the original, or (none given) from the edited
    file itself, built under the stand-ins since its constructor may create streams."""
    from msrewrite.harness import build_harness
    from msrewrite.runtime import install

    if original is not None:
        return build_harness(original, harness=harness, target=target, package=package)
    with install():
        return build_harness(rewritten, harness=harness, target=target, package=package)


def _scenarios(result: VerifyResult, reference, text: str, inputs: int, train: bool) -> list[Scenario]:
    scenarios = scenarios_for(reference, inputs, train)
    if _PEER_MESSAGES.search(text):
        # A model that exchanges messages with a peer process follows the peer's fixed protocol
        # (how many messages, what sizes): other inputs or extra forwards would desynchronize it.
        result.skipped += [f"{s.name} (the model sends to or receives from a peer process)" for s in scenarios[1:]]
        scenarios = scenarios[:1]
    return scenarios


def _write_variants(variants: dict[str, str], folder: Path, stem: str) -> dict[str, Path]:
    paths = {}
    for name, variant_text in variants.items():
        paths[name] = folder / f"{stem}_{name}.py"
        paths[name].write_bytes(encode_source(variant_text))
    return paths


@dataclass
class _Job:
    """What every scenario of one verify shares."""

    result: VerifyResult  # problems, findings and skipped scenarios go here
    reference: Any  # the harness built from the original (or the edited file)
    original: Path | None
    edited: _Edited
    variant_paths: dict[str, Path]  # schedule -> its variant of the edit
    window_source: Any  # the ScheduleSource behind the variants (None: early only)
    atol: float
    rtol: float
    stage: Callable[[str], None]
    uses_streams: bool = field(init=False)  # an async-comm edit (afd-overlap) moves no op to a stream
    call_again: bool = True  # the sanitized run calls the module twice more (not with a peer process)
    scaled: bool = False  # atol is a fraction of each tensor's largest entry (compare's `scaled`)
    gate_runs: set[str] = field(init=False)  # flag-on runs with the edit's gate closed

    def __post_init__(self) -> None:
        text = read_source(Path(self.edited.path), python=False)
        self.uses_streams = re.search(r"^[^#\n]*stream\w*\s*\(", text, re.M) is not None
        self.gate_runs = {"flag on, gate false"} if self.edited.capture_gate else set()


class _Compiled(NamedTuple):
    """A compiled graph the edit's helpers claim to handle, run as a user compiles the model:
    torch.compile(backend="npugraph_ex") (an aclgraph capture) when `torchair_mode` is None, else
    torchair's backend built from a CompilerConfig that goes through the edit's _ms_torchair_config."""

    torchair_mode: str | None  # CompilerConfig.mode
    run_eagerly: bool = False  # CompilerConfig.debug.run_eagerly
    torch_npu: str = "2.14"  # the release whose lowering the runtime models (runtime.install)
    side_stream: bool = False  # the edit keeps its side stream there: the default run must use it


class _FlagOn(NamedTuple):
    name: str
    graph: bool  # inside a GE graph
    path: Path | None  # a schedule variant; None: the edit itself, sanitized
    gate_open: bool
    compiled: _Compiled | None = None  # None: eager (or, with `graph`, the GE graph itself)


# The compiled graphs each mode's helpers guard against, beyond the run as emitted (eager; a GE
# graph for ge-graph edits). npugraph-ex: _ms_capture_safe drops the side stream where torch_npu
# 2.10 lowers record_stream onto a stream of its own and keeps it on 2.14. ge-graph:
# _ms_torchair_config records that reduce-overhead, npugraph_ex and run_eagerly are no GE graph
# (npu_wait_tensor raises, a tag's stream is never joined), so the original path runs there.
COMPILED_RUNS = {
    "npugraph-ex": {
        "flag on, npugraph_ex capture (torch_npu 2.14)": _Compiled(None, torch_npu="2.14", side_stream=True),
        "flag on, npugraph_ex capture (torch_npu 2.10)": _Compiled(None, torch_npu="2.10"),
    },
    "ge-graph": {
        "flag on, torchair reduce-overhead": _Compiled("reduce-overhead"),
        "flag on, torchair npugraph_ex": _Compiled("npugraph_ex"),
        "flag on, torchair run_eagerly": _Compiled("max-autotune", run_eagerly=True),
    },
}


def _run_scenarios(job: _Job, scenarios: list[Scenario]) -> None:
    result = job.result
    result.scenarios = []
    extra_runs: list[RunResult] = []
    for scenario in scenarios:
        runs = _run_scenario(job, scenario)
        if runs is None and scenario.fallback is not None:  # the original rejects the cut draw
            rejected = result.skipped.pop()
            result.skipped.append(f"{rejected}; drawn at make()'s shape instead")
            scenario = scenario.at_make_shape()
            runs = _run_scenario(job, scenario)
        if runs is None:
            continue
        result.scenarios.append(scenario.name or "eval")
        if not scenario.name:
            result.runs = runs
        else:
            extra_runs += runs
    result.runs += extra_runs


def _add_findings(result: VerifyResult) -> None:
    """Every sanitizer finding is a problem, each once."""
    for finding in result.findings:
        line = f"sanitizer: [{finding.kind}] {finding.message}"
        if line not in result.problems:
            result.problems.append(line)


def _stripped(result: VerifyResult) -> VerifyResult:
    """Without the modules' raw return values (the result crosses a process boundary)."""
    for run in result.runs:
        run.raw = None
    return result


def _schedule_variants(text, original, mode, flag, source, wanted):
    """({schedule: variant source} beyond early, a note on what was not run, the ScheduleSource)."""
    from msrewrite.emit.schedules import SCHEDULES, NoSchedule, derive_source, variant

    wanted = tuple(s for s in (wanted or SCHEDULES) if s != "early")
    if not wanted:
        return {}, "", None
    if source is None:
        source, why = derive_source(text, original, mode, flag)
        if source is None:
            return {}, f"early schedule only: {why}", None
    found: dict[str, str] = {}
    try:
        if variant(source, "early") != text:
            return {}, "early schedule only: the plans do not reproduce this edit", None
        for name in wanted:
            found[name] = variant(source, name)
    except NoSchedule as exc:
        return {}, f"early schedule only: {exc}", None
    return found, source.note, source


def _run_scenario(job: _Job, scenario: Scenario) -> list[RunResult] | None:
    """original, flag off, flag on (early, sanitized) and the other schedules under one scenario;
    problems go to `job.result`. None when the original itself rejects a derived scenario."""
    found = _reference_runs(job, scenario)
    if found is None:
        return None
    runs, flag_off_ran = found
    if not flag_off_ran:
        return runs
    side_off = _off_main(runs[-1].streams)
    if side_off and side_off != _original_side_ops(job, scenario):
        job.result.problems.append(
            f"{runs[-1].name}: {sum(side_off.values())} ops still ran off the main stream ({', '.join(side_off)})"
        )
    early_ops = late_ops = None  # what the early and late flag-on runs issued, in order
    with job.edited.switch(True):
        for spec in _flag_on_specs(job, scenario):
            out, ops = _flag_on_run(job, scenario, spec)
            if out is None:
                continue
            runs.append(out)
            if spec.name in job.gate_runs:
                _check_gate_closed(job.result, spec.name, out)
                continue
            _check_side_stream_used(job, scenario, spec, out)
            if spec.path is None and spec.name == "flag on":
                early_ops = ops
            elif spec.name == "flag on, late schedule":
                late_ops = ops
    if early_ops is not None:
        _check_order(job.result, scenario, early_ops, late_ops if "late" in job.variant_paths else None)
    _compare_runs(job, scenario, runs)
    return runs


def _reference_runs(job: _Job, scenario: Scenario) -> tuple[list[RunResult], bool] | None:
    """The original (when given) and flag off, switch off: (runs, whether flag off ran; when it
    raised, that is a problem). None when the reference itself rejects a derived scenario."""
    from msrewrite.harness import one_line
    from msrewrite.runtime import install

    result, reference = job.result, job.reference
    runs: list[RunResult] = []
    with job.edited.switch(False):
        if job.original is not None:
            job.stage(scenario.label("original"))
            try:
                ref = run_module(reference, scenario, restore=True)
            except Exception as exc:  # the user's model, before any edit: bad input, not our crash
                if scenario.name:  # an inference-only model, or one that rejects this input shape
                    result.skipped.append(f"{scenario.name} (the original raises {one_line(exc)[:120]})")
                    return None
                raise BadInput(
                    f"the original {reference.target} fails on the harness inputs"
                    f"{' (' + scenario.name + ')' if scenario.name else ''}: {one_line(exc)}"
                ) from None
            ref.name = scenario.label("original")
            runs.append(ref)
        job.stage(scenario.label("flag off"))
        with install() as rt:
            off = job.edited.build(reference, on=False)
            try:
                with rt.record_ops() as ops:
                    out = run_module(off, scenario)
            except Exception as exc:
                if not runs and scenario.name:  # flag off is the reference: as for the original
                    result.skipped.append(f"{scenario.name} (flag off raises {one_line(exc)[:120]})")
                    return None
                result.problems.append(f"{scenario.label('flag off')}: raised {one_line(exc)}")
                return runs, False
        out.name, out.streams = scenario.label("flag off"), _count_streams(ops)
        runs.append(out)
    return runs, True


def _flag_on_specs(job: _Job, scenario: Scenario) -> list[_FlagOn]:
    """The flag-on runs of a scenario: the edit (GE edits also eagerly, as prefill runs them), each
    schedule variant, and in the default scenario the edit with its gate closed and the edit
    compiled in each way its mode's helpers handle (COMPILED_RUNS)."""
    ge = job.result.mode == "ge-graph"
    specs = [_FlagOn("flag on", ge, None, True)]
    if ge:
        specs.append(_FlagOn("flag on, eager (prefill)", False, None, True))
    for name, path in job.variant_paths.items():
        specs.append(_FlagOn(f"flag on, {name} schedule", ge, path, True))
    if job.gate_runs and not scenario.name:  # flag on, gate closed: must be the original code, all on main
        specs.append(_FlagOn("flag on, gate false", ge, None, False))
    if not scenario.name:  # compiled graphs serve fixed-shape inference: the default eval run
        for name, compiled in COMPILED_RUNS.get(job.result.mode, {}).items():
            specs.append(_FlagOn(name, False, None, True, compiled))
    return specs


def _flag_on_run(job: _Job, scenario: Scenario, spec: _FlagOn) -> tuple[RunResult | None, list]:
    """One flag-on run under the stand-ins (sanitized unless a schedule variant): (its result or
    None when it raised, the ops it issued). Findings go to `job.result` either way."""
    from msrewrite.harness import one_line
    from msrewrite.runtime import install
    from msrewrite.sanitizer import Sanitizer

    result = job.result
    job.stage(scenario.label(spec.name) + (", sanitized" if spec.path is None else ""))
    san = None
    out: RunResult | None = None
    ops: list = []
    with install(torch_npu_version=spec.compiled.torch_npu if spec.compiled else "2.14") as rt:
        module = job.edited.load(spec.path)
        on = job.edited.build(job.reference, on=True, gate_open=spec.gate_open, module=module)
        try:
            with rt.graph_mode() if spec.graph else contextlib.nullcontext():
                if spec.path is None:
                    san = Sanitizer(rt, user_files=[str(job.edited.path)])
                    _compile(spec.compiled, module, on)
                    with san:
                        with rt.record_ops() as ops:
                            out = run_module(on, scenario, backward=False)
                            san.check_output(out.raw)
                        if job.call_again and not scenario.name and not spec.graph and spec.compiled is None:
                            _call_again(rt, san, on, scenario)
                    if scenario.training:
                        run_backward(on, out)
                else:
                    with rt.record_ops() as ops:
                        out = run_module(on, scenario)
        except Exception as exc:  # the edit itself failed: that is a finding, not a crash
            result.problems.append(f"{scenario.label(spec.name)}: raised {one_line(exc)}")
            out = None
    if san is not None:  # what it saw before a failure counts too (a free, then a crash)
        result.findings += [f for f in _found_in(spec, san.findings, result.findings) if f not in result.findings]
    if out is None:
        return None, ops
    out.name, out.streams = scenario.label(spec.name), _count_streams(ops)
    return out, ops


def _call_again(rt, san, built, scenario: Scenario) -> None:
    """The sanitized module called twice more, as a serving loop calls it: once more as before (a
    fork or a record made only on the first call races from the second one), then under a stream
    of the caller's own, as graph capture and overlapped schedulers call it (an edit that forks
    from or joins into the default stream instead of the current one races there)."""
    from msrewrite.runtime import Stream

    first = len(san.findings)
    again = run_module(built, scenario, backward=False)
    san.check_output(again.raw)
    caller = Stream(_runtime=rt, _name="caller")
    caller.wait_stream(rt.default_stream())
    with caller:  # the inputs are made on the caller's stream too
        again = run_module(built, scenario, backward=False)
        san.check_output(again.raw)
    rt.default_stream().wait_stream(caller)
    # the first call's findings again (same kind, same line) say nothing new
    seen = {(f.kind, f.second) for f in san.findings[:first]}
    san.findings[first:] = [f for f in san.findings[first:] if (f.kind, f.second) not in seen]


def _found_in(spec: _FlagOn, found: list, known: list) -> list:
    """A compiled run's findings name the graph they need, each unless an earlier run found it."""
    if spec.compiled is None:
        return found
    seen = {(f.kind, f.first, f.second) for f in known}
    where = spec.name.removeprefix("flag on, ")
    return [replace(f, message=f"under {where}: {f.message}") for f in found if (f.kind, f.first, f.second) not in seen]


def _compile(compiled: _Compiled | None, module, built) -> None:
    """Compile `built`'s model as `compiled` says, the way torch.compile(model) does: its forward
    becomes the graph (the inputs exist before the graph starts, the output once it has ended),
    built by the stand-in backend from a config handed to the edit's own hook when it has one."""
    from msrewrite.runtime import active_runtime, torchair_api

    if compiled is None:
        return
    forward = built.module.forward
    if compiled.torchair_mode is None:  # torch.compile(backend="npugraph_ex"): captured into an aclgraph

        def captured(*args, **kwargs):
            with active_runtime().aclgraph_mode():
                return forward(*args, **kwargs)

        built.module.forward = captured
        return
    config: Any = torchair_api.CompilerConfig()
    config.mode, config.debug.run_eagerly = compiled.torchair_mode, compiled.run_eagerly
    hook = getattr(module, "_ms_torchair_config", None)
    if callable(hook):  # torchair.get_npu_backend(compiler_config=_ms_torchair_config(config))
        config = hook(config)
    built.module.forward = torchair_api.get_npu_backend(compiler_config=config)(forward, [])


def _off_main(streams: dict[str, int]) -> dict[str, int]:
    return {s: n for s, n in streams.items() if s != "main"}


def _check_gate_closed(result: VerifyResult, name: str, out: RunResult) -> None:
    side = _off_main(out.streams)
    if side:
        result.problems.append(f"{name}: {sum(side.values())} ops ran off the main stream ({', '.join(side)})")


def _check_side_stream_used(job: _Job, scenario: Scenario, spec: _FlagOn, out: RunResult) -> None:
    """The sanitized default-scenario run of an edit that uses streams must put some op on a side
    stream (a GE edit: in graph mode; eagerly, prefill stays on main; a compiled run: where the
    edit keeps its side stream)."""
    if spec.compiled is not None and not spec.compiled.side_stream:
        return  # the edit's original path runs there
    if spec.path is None and (spec.graph or job.result.mode != "ge-graph") and not scenario.name and job.uses_streams:
        if not any(s != "main" for s in out.streams):
            job.result.problems.append(f"{spec.name}: no op ran on a side stream (is the flag wired?)")


def _original_side_ops(job: _Job, scenario: Scenario) -> dict[str, int] | None:
    """The ops the original itself issues off the main stream under the stand-ins (a model with a
    stream of its own, outside the edit); None without an original."""
    from msrewrite.runtime import install

    if job.original is None:
        return None
    with job.edited.switch(False), install() as rt:
        try:  # built afresh: streams the model keeps belong to this runtime
            built = job.reference.rebuild_from(fresh_module(job.original, job.edited.package))
            with rt.record_ops() as ops:
                run_module(built, scenario, backward=False)
        except Exception:  # the original ran without the stand-ins; under them it is flag off's to answer
            return None
    return _off_main(_count_streams(ops))


def _compare_runs(job: _Job, scenario: Scenario, runs: list[RunResult]) -> None:
    """Every run against the first; a schedule variant that differs names the statement it races
    with, unless flag off already differs (then the edit changed the code, not the timing)."""
    reference_run = runs[0]
    flag_off_differs = False
    for run in runs[1:]:
        problem = compare(reference_run, run, job.atol, job.rtol, job.scaled)
        if problem is None:
            continue
        flag_off_differs = flag_off_differs or run.name == scenario.label("flag off")
        schedule = next((s for s in job.variant_paths if run.name.endswith(f"{s} schedule")), None)
        if schedule is not None and job.window_source is not None and not flag_off_differs:
            problem += "; " + _leak(job, scenario, reference_run)
        job.result.problems.append(problem)


@dataclass(frozen=True)
class _Ordered:
    """Ops whose order against the main path's own is part of the result."""

    problem: str  # the problem's key
    ops: re.Pattern[str]
    verb: str  # "draws random numbers"
    nouns: str  # "the draws"


ORDERED = (
    _Ordered("rng-order", RANDOM_OPS, "draws random numbers", "the draws"),
    _Ordered("collective-order", COLLECTIVE_OPS, "runs a collective", "the collectives"),
)


def _check_order(result, scenario, early_ops, late_ops=None) -> None:
    """Random draws (or collectives) on the side stream and main-path ones between the fork and
    the join: their order changes (a device may run the side work anywhere in that window).

    The early run issues the side work at the fork, the late run just before the join, so the
    main ops in the window are those the late run issues before its first side op and the early
    run after it. Without a late run, any main op next to a side one counts."""
    for kind in ORDERED:
        groups = {op.group for op in early_ops if kind.ops.match(op.name)}
        for group in sorted(groups):  # collectives on different communicators keep their own orders
            _check_kind_order(result, scenario, kind, group, early_ops, late_ops)


def _check_kind_order(result, scenario, kind: _Ordered, group: str, early_ops, late_ops) -> None:
    early = _ordered_ops(early_ops, kind.ops, group)
    if early.side and early.main:
        window_op = early.main[0]
        if late_ops is not None:
            late = _ordered_ops(late_ops, kind.ops, group)
            if late.main_before_side <= early.main_before_side:
                return  # the main path runs them only before the fork or after the join: same order
            window_op = early.main[min(early.main_before_side, len(early.main) - 1)]
        side = early.side[0]
        line = (
            f"{kind.problem}: {scenario.label('flag on')}: the side stream {kind.verb} ({side.name} at "
            f"{Path(side.file).name}:{side.line}) and so does the main path between the fork and the join "
            f"({window_op.name} at {Path(window_op.file).name}:{window_op.line}): moving the side work changes "
            f"the order of {kind.nouns}"
        )
        if line not in result.problems:
            result.problems.append(line)


@dataclass
class _OrderedOps:
    side: list  # matching ops on a side stream, in issue order
    main: list  # matching ops on the main stream, in issue order
    main_before_side: int  # main ones issued before the first side-stream op


def _ordered_ops(ops, pattern: re.Pattern[str], group: str = "") -> _OrderedOps:
    found = _OrderedOps([], [], 0)
    seen_side = False
    for op in ops:
        on_side = op.stream != "main"
        seen_side = seen_side or on_side
        if pattern.match(op.name) and op.group == group:
            if on_side:
                found.side.append(op)
            else:
                found.main.append(op)
                found.main_before_side += not seen_side
    return found


def _leak(job: _Job, scenario: Scenario, reference_run: RunResult) -> str:
    """Name the main statement the side work races with: the first K for which the side work
    issued right after the K-th main statement of the window gives another result."""
    from msrewrite.emit.schedules import NoSchedule, variant
    from msrewrite.harness import scratch_folder
    from msrewrite.runtime import install

    source = job.window_source
    statements = list(source.window_statements)
    with scratch_folder("msrewrite-leak-") as folder:
        for k in range(1, len(statements) + 1):
            try:
                text = variant(source, f"after:{k}")
            except NoSchedule:
                break
            path = Path(folder) / f"after_{k}.py"
            path.write_bytes(encode_source(text))
            try:
                with job.edited.switch(True), install():
                    out = run_module(job.edited.build(job.reference, on=True, path=path), scenario)
                out.name = "probe"
                differs = compare(reference_run, out, job.atol, job.rtol, job.scaled) is not None
            except Exception:
                differs = True
            if differs:
                line, code = statements[k - 1]
                at = f"line {line}: " if line else ""
                return f"race: the result changes when the side work runs after the main statement at {at}{code}"
    return "race: the result depends on when the side work runs"


def _verify_as_written(
    rewritten, original, harness, target, mode, atol, rtol, package, phase, inputs=2, train=True
) -> VerifyResult:
    """Multi-stream code with no enable flag (written by hand): run it under the stand-ins and the
    sanitizer in every scenario a flagged edit gets (train, zero tokens, random draws; called
    again, and under a caller's stream), and compare with the original when one is given."""
    from msrewrite.harness import build_harness, one_line
    from msrewrite.runtime import install

    result = VerifyResult(mode=mode, flag=FlagSpec(kind="none", name="-"), tolerance=(atol, rtol))
    result.schedule_note = "early schedule only: hand-written multi-stream code has no plan to move its side work"
    text = read_source(rewritten)
    if original is not None:
        reference = build_harness(original, harness=harness, target=target, package=package)
    else:
        with install():
            reference = build_harness(rewritten, harness=harness, target=target, package=package)

    def build():
        if original is None:
            return build_harness(rewritten, harness=harness, target=target, package=package)
        return reference.rebuild_from(fresh_module(rewritten, package))

    phase("running the model")
    result.scenarios = []
    for scenario in _scenarios(result, reference, text, inputs, train):
        runs: list[RunResult] = []
        if original is not None:
            try:
                try:
                    runs.append(run_module(reference, scenario, restore=True))
                except Exception:
                    if scenario.fallback is None:
                        raise
                    scenario = scenario.at_make_shape()
                    runs.append(run_module(reference, scenario, restore=True))
            except Exception as exc:
                if scenario.name:
                    result.skipped.append(f"{scenario.name} (the original raises {one_line(exc)[:120]})")
                    continue
                raise BadInput(
                    f"the original {reference.target} fails on the harness inputs: {one_line(exc)}"
                ) from None
            runs[0].name = scenario.label("original")
        written = _as_written_run(result, scenario, build, mode, str(rewritten), call_again=not scenario.name)
        result.scenarios.append(scenario.name or "eval")
        if written is None:
            continue
        runs.append(written)
        result.runs += runs
        if len(runs) == 2:
            problem = compare(runs[0], runs[1], atol, rtol)
            if problem:
                result.problems.append(problem)
    _add_findings(result)
    return result


def _as_written_run(result, scenario: Scenario, build, mode: str, user_file: str, call_again: bool):
    """One sanitized run of the hand-written file (findings and a raise go to `result`)."""
    from msrewrite.harness import one_line
    from msrewrite.runtime import install
    from msrewrite.sanitizer import Sanitizer

    san = None
    with install() as rt:
        built = build()
        try:
            with rt.graph_mode() if mode == "ge-graph" else contextlib.nullcontext():
                with Sanitizer(rt, user_files=[user_file]) as san:
                    with rt.record_ops() as ops:
                        out = run_module(built, scenario, backward=False)
                        san.check_output(out.raw)
                    if call_again and mode != "ge-graph":
                        _call_again(rt, san, built, scenario)
                if scenario.training:
                    run_backward(built, out)
        except Exception as exc:
            result.problems.append(f"{scenario.label('as written')}: raised {one_line(exc)}")
            out = None
    if san is not None:
        result.findings += [f for f in san.findings if f not in result.findings]
    if out is None:
        return None
    out.name, out.streams = scenario.label("as written"), _count_streams(ops)
    return out


def _count_streams(ops) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.stream] = counts.get(op.stream, 0) + 1
    return counts


def summary(result: VerifyResult) -> list[str]:
    lines = []
    main_runs = [r for r in result.runs if ": " not in r.name]  # the default scenario, run by run
    for run in main_runs:
        streams = ", ".join(f"{n} ops on {s}" for s, n in sorted(run.streams.items()))
        lines.append(f"{run.name}: {len(run.outputs)} output tensor(s)" + (f"; {streams}" if streams else ""))
    note = f" ({result.schedule_note})" if result.schedule_note else ""
    lines.append(f"schedules: {', '.join(result.schedules)}{note}")
    others = [s for s in result.scenarios if s != "eval"]
    if others:
        count = len(result.runs) - len(main_runs)
        lines.append(f"also run: {', '.join(others)} ({count} runs)")
    if result.skipped:
        lines.append(f"not run: {'; '.join(result.skipped)}")
    if result.ok:
        names = " = ".join(r.name for r in main_runs)
        atol, rtol = result.tolerance
        how = "exactly" if atol == rtol == 0 else f"within atol={atol:g}, rtol={rtol:g}"
        how += f" ({result.tolerance_why})" if result.tolerance_why else ""
        flag = (
            "no flag, checked as written"
            if result.flag.kind == "none"
            else f"flag {result.flag.kind}:{result.flag.name}"
        )
        if len(main_runs) > 1:
            lines.append(f"OK: outputs equal {how} ({names}); sanitizer clean [{result.mode}, {flag}]")
        else:
            lines.append(f"OK: sanitizer clean [{result.mode}, {flag}]")
    return lines
