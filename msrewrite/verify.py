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
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

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
    buffers: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # train runs: after the forward
    raw: Any = None  # the module's own return value (for the sanitizer's output check)


@dataclass
class VerifyResult:
    mode: str
    flag: FlagSpec
    runs: list[RunResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    findings: list[Any] = field(default_factory=list)
    tolerance: tuple[float, float] = (0.0, 0.0)  # (atol, rtol); zero means exact
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
    """Every tensor in a (nested) model output, in a stable order."""
    if isinstance(value, torch.Tensor):
        return [value.detach()]
    if isinstance(value, dict):
        return [t for key in value for t in flatten_outputs(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in flatten_outputs(item)]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return flatten_outputs(value.to_tuple())
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


def compare(reference: RunResult, other: RunResult, atol: float, rtol: float) -> str | None:
    if len(reference.outputs) != len(other.outputs):
        return f"{other.name}: {len(other.outputs)} output tensors, {reference.name} has {len(reference.outputs)}"
    for i, (a, b) in enumerate(zip(reference.outputs, other.outputs, strict=True)):
        if a.shape != b.shape:
            return f"{other.name}: output {i} has shape {tuple(b.shape)}, {reference.name} {tuple(a.shape)}"
        same = torch.equal(a, b) if atol == 0 and rtol == 0 else torch.allclose(a, b, atol=atol, rtol=rtol)
        if not same:
            diff = (a.float() - b.float()).abs().max().item()
            return f"{other.name}: output {i} differs from {reference.name} (max |diff| {diff:.3g})"
    theirs = dict(other.buffers)
    ours = {name for name, _ in reference.buffers}
    if ours != theirs.keys():  # an edit adds or drops no buffer
        missing, extra = sorted(ours - theirs.keys()), sorted(theirs.keys() - ours)
        what = ", ".join([*(f"no buffer {n}" for n in missing), *(f"an extra buffer {n}" for n in extra)])
        return f"{other.name}: {what} after the forward, unlike {reference.name}"
    for name, a in reference.buffers:
        b = theirs[name]
        same = a.shape == b.shape and (
            torch.equal(a, b)
            if atol == 0 and rtol == 0 or not a.is_floating_point()
            else torch.allclose(a, b, atol=atol, rtol=rtol)
        )
        if not same:
            return f"{other.name}: buffer {name} differs from {reference.name} after the forward"
    return None


RANDOM_OPS = re.compile(
    r"^aten\.(bernoulli|native_dropout|dropout|rand|randn|randint|randperm|rand_like|randn_like|randint_like|"
    r"normal|uniform|multinomial|exponential|geometric|cauchy|log_normal|random)_?\."
)
# torch.distributed's collectives and point-to-point ops as the dispatcher sees them (c10d.allreduce_,
# _c10d_functional.all_gather_into_tensor); waiting on one is not one
COLLECTIVE_OPS = re.compile(r"^(c10d|_c10d_functional)\.(?!wait)")


@dataclass
class Scenario:
    """One way of running the model: train or eval, on which inputs."""

    name: str  # "" for the default run (eval, make()'s inputs); "train", "zero tokens", "draw 1", ...
    training: bool = False
    inputs: tuple[tuple, dict] | None = None  # None: the harness's own

    def label(self, run: str) -> str:
        return f"{self.name}: {run}" if self.name else run


def run_module(built, scenario: Scenario, seed: int = 0, restore: bool = False) -> RunResult:
    """One forward of a built harness under `scenario`.

    Train runs enable grad and compare the buffers after the forward (running statistics, caches);
    every run starts from the same RNG seed, so dropout draws match when their order does.
    `restore` puts the module's parameters and buffers back afterwards (a module run again)."""
    from msrewrite.harness import clone_tree, exit_if_forked, manual_seed

    module = built.module
    state = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()} if restore else {}
    args, kwargs = scenario.inputs or (built.args, built.kwargs)
    module.train(scenario.training)
    manual_seed(seed)
    try:
        with torch.enable_grad() if scenario.training else torch.no_grad():
            out = module(*clone_tree(args), **clone_tree(kwargs))
        exit_if_forked()
        buffers = [(name, b.detach().clone()) for name, b in module.named_buffers()] if scenario.training else []
    finally:
        if restore:
            with torch.no_grad():
                for key, value in module.state_dict(keep_vars=True).items():
                    if key in state and value.shape == state[key].shape:
                        value.copy_(state[key])
        module.eval()
    result = RunResult("", flatten_outputs(out), buffers=buffers)
    result.raw = out
    return result


_PEER_MESSAGES = re.compile(r"\b(?:dist|distributed)\.i?(?:send|recv)\(")


def scenarios_for(reference, inputs: int, train: bool = True) -> list[Scenario]:
    """eval on make()'s inputs, train on them, a zero-token batch and `inputs` random draws with
    outliers (the zero-token batch is dropped later when the original rejects it)."""
    found = [Scenario("")]
    if train:
        found.append(Scenario("train", training=True))
    zero = zero_token_inputs(reference.args, reference.kwargs)
    if zero is not None:
        found.append(Scenario("zero tokens", inputs=zero))
    for k in range(1, inputs + 1):
        found.append(Scenario(f"draw {k}", inputs=random_inputs(reference.args, reference.kwargs, k)))
    return found


def zero_token_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The inputs with no tokens: the token dim (-2 of the first float tensor with 2+ dims) cut to
    0 in every float tensor that has the same size there."""
    first = next((t for t in (*args, *kwargs.values()) if _is_float(t) and t.dim() >= 2), None)
    if first is None:
        return None
    dim = first.dim() - 2
    size = first.shape[dim]

    def cut(value):
        if _is_float(value) and value.dim() == first.dim() and value.shape[dim] == size:
            return value.narrow(dim, 0, 0).clone()
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
        return _stripped(_verify_as_written(rewritten, original, harness, target, mode, atol, rtol, package, phase))

    result = VerifyResult(mode=mode, flag=flag, tolerance=(atol, rtol))
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
    with tempfile.TemporaryDirectory(prefix="msrewrite-schedules-") as folder:
        variant_paths = _write_variants(variants, Path(folder), rewritten.stem)
        job = _Job(result, reference, original, edited, variant_paths, schedule_source, atol, rtol, stage)
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
        """The edited file (or a schedule variant of it at `path`) as a fresh module: module-level
        stream caches must belong to this run's runtime."""
        from msrewrite.harness import load_module

        package = self.package
        fresh = f"_msrewrite_verify_{next(_counter)}"
        return load_module(path or self.path, package=package, name=f"{package}.{fresh}" if package else fresh)

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
    if side_off:
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
                    with san, rt.record_ops() as ops:
                        out = run_module(on, scenario)
                        san.check_output(out.raw)
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


def _compare_runs(job: _Job, scenario: Scenario, runs: list[RunResult]) -> None:
    """Every run against the first; a schedule variant that differs names the statement it races with."""
    reference_run = runs[0]
    for run in runs[1:]:
        problem = compare(reference_run, run, job.atol, job.rtol)
        if problem is None:
            continue
        schedule = next((s for s in job.variant_paths if run.name.endswith(f"{s} schedule")), None)
        if schedule is not None and job.window_source is not None:
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
    from msrewrite.runtime import install

    source = job.window_source
    statements = list(source.window_statements)
    with tempfile.TemporaryDirectory(prefix="msrewrite-leak-") as folder:
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
                differs = compare(reference_run, out, job.atol, job.rtol) is not None
            except Exception:
                differs = True
            if differs:
                line, code = statements[k - 1]
                at = f"line {line}: " if line else ""
                return f"race: the result changes when the side work runs after the main statement at {at}{code}"
    return "race: the result depends on when the side work runs"


def _verify_as_written(rewritten, original, harness, target, mode, atol, rtol, package, phase) -> VerifyResult:
    """Multi-stream code with no enable flag (written by hand): run it once under the stand-ins
    and the sanitizer, and compare with the original when one is given."""
    from msrewrite.harness import build_harness, load_module, one_line
    from msrewrite.runtime import install
    from msrewrite.sanitizer import Sanitizer

    result = VerifyResult(mode=mode, flag=FlagSpec(kind="none", name="-"), tolerance=(atol, rtol))
    result.schedule_note = "early schedule only: hand-written multi-stream code has no plan to move its side work"
    runs: list[RunResult] = []
    reference = None
    if original is not None:
        reference = build_harness(original, harness=harness, target=target, package=package)
        phase("running the model")
        try:
            runs.append(RunResult("original", flatten_outputs(reference.run())))
        except Exception as exc:
            raise BadInput(f"the original {reference.target} fails on the harness inputs: {one_line(exc)}") from None
    with install() as rt:
        if reference is not None:
            fresh = f"_msrewrite_verify_{next(_counter)}"
            built = reference.rebuild_from(
                load_module(rewritten, package=package, name=f"{package}.{fresh}" if package else fresh)
            )
        else:
            built = build_harness(rewritten, harness=harness, target=target, package=package)
        phase("running the model")
        try:
            with rt.graph_mode() if mode == "ge-graph" else contextlib.nullcontext():
                with Sanitizer(rt, user_files=[str(rewritten)]) as san, rt.record_ops() as ops:
                    out = built.run()
                    san.check_output(out)
        except Exception as exc:
            result.problems.append(f"as written: raised {one_line(exc)}")
            result.runs = runs
            return result
    runs.append(RunResult("as written", flatten_outputs(out), _count_streams(ops)))
    result.runs = runs
    result.findings = list(san.findings)
    if len(runs) == 2:
        problem = compare(runs[0], runs[1], atol, rtol)
        if problem:
            result.problems.append(problem)
    _add_findings(result)
    return result


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
    if result.flag.kind != "none":
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
