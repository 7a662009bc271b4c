"""Verify: prove a multi-stream edit on CPU.

Runs the model built from the harness three ways and compares the outputs:
  original   the unedited file (when given)
  flag off   the edited file with its switch off: must equal the original, all ops on main
  flag on    the edited file with its switch on, under the CPU stream runtime and the stream
             sanitizer: must equal too, run some ops on a side stream, and raise no finding.
GE-graph edits run flag-on twice: as a torchair graph would (graph mode) and eagerly, as
prefill does, where npu_wait_tensor must never be reached.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from msrewrite.errors import BadInput
from msrewrite.plan import MODES, FlagSpec

_ENV_FLAG = re.compile(r'_ms_env_flag\("(\w+)",\s*(True|False)\)')
_ATTR_FLAG = re.compile(r"_ms_(?:side_stream|graph_streams)\((?:\"[^\"]*\",\s*)?(?:self\.)?(\w+)")
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


@dataclass
class VerifyResult:
    mode: str
    flag: FlagSpec
    runs: list[RunResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    findings: list[Any] = field(default_factory=list)
    tolerance: tuple[float, float] = (0.0, 0.0)  # (atol, rtol); zero means exact

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": self.ok,
                "mode": self.mode,
                "flag": f"{self.flag.kind}:{self.flag.name}",
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


def compare(reference: RunResult, other: RunResult, atol: float, rtol: float) -> str | None:
    if len(reference.outputs) != len(other.outputs):
        return f"{other.name}: {len(other.outputs)} output tensors, {reference.name} has {len(reference.outputs)}"
    for i, (a, b) in enumerate(zip(reference.outputs, other.outputs)):
        if a.shape != b.shape:
            return f"{other.name}: output {i} has shape {tuple(b.shape)}, {reference.name} {tuple(a.shape)}"
        same = torch.equal(a, b) if atol == 0 and rtol == 0 else torch.allclose(a, b, atol=atol, rtol=rtol)
        if not same:
            diff = (a.float() - b.float()).abs().max().item()
            return f"{other.name}: output {i} differs from {reference.name} (max |diff| {diff:.3g})"
    return None


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
) -> VerifyResult:
    from msrewrite.harness import build_harness, load_module, one_line, package_of
    from msrewrite.load import read_source
    from msrewrite.runtime import install
    from msrewrite.sanitizer import Sanitizer

    text = read_source(rewritten)
    if mode == "auto":
        detected = detect_emitted_mode(text)
        if detected is None:
            raise BadInput(f"{rewritten}: no msrewrite multi-stream edit found (pass --mode for hand-written code)")
        mode = detected
    elif mode not in MODES:
        raise BadInput(f"unknown mode {mode!r}; choose auto, {', '.join(MODES)}")
    flag = flag or detect_flag(text)
    reference_file = original or rewritten
    package = package or package_of(reference_file)
    if harness is None and re.search(r"^def make\(", read_source(reference_file), re.M):
        harness = f"{reference_file}:make"
    if harness is not None and target is not None and not explicit_target:
        target = None  # make() may build the whole model around the edited class
    if flag is None:  # hand-written multi-stream code without a switch: check it as written
        return _verify_as_written(rewritten, original, harness, target, mode, atol, rtol, package)

    result = VerifyResult(mode=mode, flag=flag, tolerance=(atol, rtol))

    def switch(on: bool):
        if flag.kind == "env":
            return _env(flag.name, "1" if on else "0")
        return contextlib.nullcontext()

    def build_edited(reference, on: bool):
        # A fresh module each run: module-level stream caches must belong to this runtime.
        fresh = f"_msrewrite_verify_{next(_counter)}"
        module = load_module(rewritten, package=package, name=f"{package}.{fresh}" if package else fresh)
        if flag.kind == "attr":
            _set_attr_flag(reference.config, flag.name, on)
        built = reference.rebuild_from(module)
        if flag.kind == "attr":
            for sub in built.module.modules():
                if hasattr(sub, flag.name):
                    setattr(sub, flag.name, on)
        return built

    with switch(False):
        if original is not None:
            reference = build_harness(original, harness=harness, target=target, package=package)
            try:
                runs = [RunResult("original", flatten_outputs(reference.run()))]
            except Exception as exc:  # the user's model, before any edit: bad input, not our crash
                raise BadInput(f"the original {reference.target} fails on the harness inputs: {one_line(exc)}") from None
        else:
            with install():
                reference = build_harness(rewritten, harness=harness, target=target, package=package)
            runs = []
        with install() as rt:
            off = build_edited(reference, on=False)
            try:
                with rt.record_ops() as ops:
                    out = off.run()
            except Exception as exc:
                result.problems.append(f"flag off: raised {one_line(exc)}")
                return result
        runs.append(RunResult("flag off", flatten_outputs(out), _count_streams(ops)))
    side_off = {s: n for s, n in runs[-1].streams.items() if s != "main"}
    if side_off:
        result.problems.append(f"flag off: {sum(side_off.values())} ops still ran off the main stream ({', '.join(side_off)})")

    # An async-comm edit (afd-overlap: isend/irecv issued early) moves no op to a stream.
    uses_streams = re.search(r"^[^#\n]*stream\w*\s*\(", text, re.M) is not None
    flag_on_runs = [("flag on", mode == "ge-graph")]
    if mode == "ge-graph":
        flag_on_runs.append(("flag on, eager (prefill)", False))
    with switch(True):
        for name, graph in flag_on_runs:
            with install() as rt:
                on = build_edited(reference, on=True)
                try:
                    with rt.graph_mode() if graph else contextlib.nullcontext():
                        with Sanitizer(rt, user_files=[str(rewritten)]) as san, rt.record_ops() as ops:
                            out = on.run()
                            san.check_output(out)
                except Exception as exc:  # the edit itself failed: that is a finding, not a crash
                    result.problems.append(f"{name}: raised {one_line(exc)}")
                    continue
            run = RunResult(name, flatten_outputs(out), _count_streams(ops))
            runs.append(run)
            result.findings += list(san.findings)
            if (graph or mode != "ge-graph") and uses_streams:
                if not any(s != "main" for s in run.streams):
                    result.problems.append(f"{name}: no op ran on a side stream (is the flag wired?)")
    result.runs = runs
    reference_run = runs[0]
    for run in runs[1:]:
        problem = compare(reference_run, run, atol, rtol)
        if problem:
            result.problems.append(problem)
    seen = set()
    for finding in result.findings:
        line = f"sanitizer: [{finding.kind}] {finding.message}"
        if line not in seen:
            seen.add(line)
            result.problems.append(line)
    return result


def _verify_as_written(rewritten, original, harness, target, mode, atol, rtol, package) -> VerifyResult:
    """Multi-stream code with no enable flag (written by hand): run it once under the stand-ins
    and the sanitizer, and compare with the original when one is given."""
    from msrewrite.harness import build_harness, load_module, one_line
    from msrewrite.runtime import install
    from msrewrite.sanitizer import Sanitizer

    result = VerifyResult(mode=mode, flag=FlagSpec(kind="none", name="-"), tolerance=(atol, rtol))
    runs: list[RunResult] = []
    reference = None
    if original is not None:
        reference = build_harness(original, harness=harness, target=target, package=package)
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
    for finding in result.findings:
        line = f"sanitizer: [{finding.kind}] {finding.message}"
        if line not in result.problems:
            result.problems.append(line)
    return result


def _count_streams(ops) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.stream] = counts.get(op.stream, 0) + 1
    return counts


def summary(result: VerifyResult) -> list[str]:
    lines = []
    for run in result.runs:
        streams = ", ".join(f"{n} ops on {s}" for s, n in sorted(run.streams.items()))
        lines.append(f"{run.name}: {len(run.outputs)} output tensor(s)" + (f"; {streams}" if streams else ""))
    if result.ok:
        names = " = ".join(r.name for r in result.runs)
        atol, rtol = result.tolerance
        how = "exactly" if atol == rtol == 0 else f"within atol={atol:g}, rtol={rtol:g}"
        flag = "no flag, checked as written" if result.flag.kind == "none" else f"flag {result.flag.kind}:{result.flag.name}"
        if len(result.runs) > 1:
            lines.append(f"OK: outputs equal {how} ({names}); sanitizer clean [{result.mode}, {flag}]")
        else:
            lines.append(f"OK: sanitizer clean [{result.mode}, {flag}]")
    return lines
