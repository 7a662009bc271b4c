"""`msrewrite bench`: time an edit with its flag off and on, and rank the arrangements msrewrite can emit.

Timing: `warmup` forwards, then `iters` forwards each bracketed by a device synchronize (CUDA, or
NPU through torch_npu when it imports), wall time per forward; the median with a 95% confidence
interval from order statistics (the ranks n/2 ± 1.96·√n/2 of the sorted times, no assumption
about the distribution). A dry run does the same on CPU under the stream stand-ins
(msrewrite.runtime), so every step runs without a device; its times say nothing about one.

Variants (`--variants`) are what `apply` emits for the case with other options, each carried
out by the same code as `apply --case`: the default (fork as early as the side inputs exist);
the side work at its original place (verify's `late` schedule: no apply option makes it, so it
can win only as a finding); each phased anchor alone; each core-limit preset; `--max-tokens`
thresholds (at the harness's one input size a threshold only switches the overlap on or off).
"""

from __future__ import annotations

import itertools
import math
import shlex
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from msrewrite.errors import BadInput

MAX_TOKEN_THRESHOLDS = (8, 64, 512)
_counter = itertools.count()


@dataclass
class Timing:
    times: list[float]  # seconds per forward

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def interval(self) -> tuple[float, float]:
        """95% confidence interval of the median (order statistics; the whole range for n < 6)."""
        xs = sorted(self.times)
        n = len(xs)
        half = 1.96 * math.sqrt(n) / 2
        lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
        return xs[lo], xs[hi]


@dataclass
class Variant:
    label: str
    options: list[str] | None  # apply options after --case CASE FILE; None when no apply command makes it
    text: str
    command: str | None = None
    timing: Timing | None = None
    notes: list[str] = field(default_factory=list)


def device_kind() -> str | None:
    """ "cuda", "npu" (torch_npu imports and sees a device), or None. torch_npu is never installed here."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return None
    return "npu" if hasattr(torch, "npu") and torch.npu.is_available() else None


def synchronizer(kind: str) -> Callable[[], None]:
    import torch

    if kind == "cuda":
        return torch.cuda.synchronize
    if kind == "npu":
        return torch.npu.synchronize  # type: ignore[attr-defined]  # torch_npu adds torch.npu on import
    return lambda: None


def time_forward(run: Callable[[], object], sync: Callable[[], None], iters: int, warmup: int) -> Timing:
    import torch

    from msrewrite.harness import exit_if_forked  # a process user code forked ends here

    with torch.no_grad():
        for _ in range(warmup):
            run()
            exit_if_forked()
        sync()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - start)
            exit_if_forked()
    return Timing(times)


def edit_for(file: Path, text: str, case: str, mode: str, options: list[str]) -> tuple[str, str, list]:
    """What `msrewrite apply --case CASE --mode MODE FILE OPTIONS` makes: the edited text, and the
    text its last step was made on with that step's plans (verify's schedule source)."""
    from msrewrite import cores
    from msrewrite.cases import get_case
    from msrewrite.commands.apply import case_steps, parse_flag
    from msrewrite.load import parse_source

    known = get_case(case)
    if known is None:
        raise BadInput(f"unknown case {case!r} (see `msrewrite cases`)")
    opts = dict(zip(options[::2], options[1::2], strict=False))  # a trailing option without a value drops
    anchors = tuple(v for k, v in zip(options[::2], options[1::2], strict=False) if k == "--anchor")
    max_tokens = int(opts["--max-tokens"]) if "--max-tokens" in opts else None
    spec = parse_flag("", "on", max_tokens, known.flag_name)
    budget = cores.resolve(opts.get("--cores", "a3"), None).as_tuple() if known.core_limits else None
    steps = case_steps(
        file, text, parse_source(file, text), case, mode, None, spec, None, (), anchors, budget, protect="auto"
    )
    return steps[-1].new, steps[-1].old, steps[-1].plans


def variants(file: Path, text: str, case: str, mode: str, every: bool) -> list[Variant]:
    from msrewrite.cases import get_case
    from msrewrite.cores import PRESETS

    base_text, last_old, plans = edit_for(file, text, case, mode, [])
    out = [Variant("fork as early as possible (default)", [], base_text)]
    if not every:
        return out
    known = get_case(case)
    assert known is not None  # edit_for refused an unknown case
    if plans:
        from msrewrite.emit.schedules import NoSchedule, ScheduleSource, variant

        try:
            out.append(
                Variant(
                    "side work at its original place (late)", None, variant(ScheduleSource(last_old, plans), "late")
                )
            )
        except NoSchedule as exc:  # async-comm side work: no side stream to defer
            out[0].notes.append(f"no original-place variant: {exc}")
    if known.phased and plans:
        for anchor in plans[0].phase_anchors:
            options = ["--anchor", anchor]
            out.append(Variant(f"phased, anchor {anchor} only", options, edit_for(file, text, case, mode, options)[0]))
    if known.core_limits:
        for preset in sorted(PRESETS):
            options = ["--cores", preset]
            out.append(Variant(f"core limits {preset}", options, edit_for(file, text, case, mode, options)[0]))
    for n in MAX_TOKEN_THRESHOLDS:
        options = ["--max-tokens", str(n)]
        out.append(Variant(f"overlap up to {n} tokens", options, edit_for(file, text, case, mode, options)[0]))
    seen: dict[str, Variant] = {}
    unique = []
    for v in out:  # one timing per distinct text (a preset may equal the default)
        if v.text in seen:
            seen[v.text].notes.append(f"same code as: {v.label}")
            continue
        seen[v.text] = v
        unique.append(v)
    for v in unique:
        if v.options is not None:
            v.command = " ".join(
                [
                    "msrewrite",
                    "apply",
                    "--case",
                    case,
                    "--mode",
                    mode,
                    *map(shlex.quote, v.options),
                    shlex.quote(str(file)),
                ]
            )
    return unique


def run_variants(
    file: Path,
    harness: str,
    items: list[Variant],
    flag_name: str,
    kind: str,
    iters: int,
    warmup: int,
    dry_run: bool,
    phase: Callable[[str], None] = lambda _name: None,
) -> Timing:
    """Time each variant flag on (in place) and the first one flag off; returns the flag-off timing.
    Runs user code: `msrewrite bench` calls it in a child (harness.run_in_child), `phase` telling
    the parent where the user code is."""
    import contextlib
    import os

    import torch

    from msrewrite.harness import build_harness, load_module, package_of, scratch_folder

    install: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    threads = torch.get_num_threads()
    if dry_run:
        from msrewrite.runtime import install as stand_ins  # the stand-ins instead of a device

        install = stand_ins

        torch.set_num_threads(1)  # CPU timings of a shared machine: no thread oversubscription
    sync = synchronizer(kind)
    package = package_of(file)

    def env(on: bool):
        @contextlib.contextmanager
        def switch():
            old = os.environ.get(flag_name)
            os.environ[flag_name] = "1" if on else "0"
            try:
                yield
            finally:
                if old is None:
                    os.environ.pop(flag_name, None)
                else:
                    os.environ[flag_name] = old

        return switch()

    with scratch_folder("msrewrite-bench-") as folder:
        phase("building the harness")
        with env(False):
            reference = build_harness(file, harness=harness, package=package)
        device = {"cuda": "cuda", "npu": "npu"}.get(kind)

        def built(text: str, on: bool):
            path = Path(folder) / f"{file.stem}_{next(_counter)}.py"
            path.write_text(text, encoding="utf-8")
            with env(on):
                module = load_module(path, package=package, name=f"{package}.{path.stem}" if package else path.stem)
                made = reference.rebuild_from(module)
            if device:
                made.module.to(device)
                made.args = tuple(a.to(device) if hasattr(a, "to") else a for a in made.args)
                made.kwargs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in made.kwargs.items()}
            return made

        with install():
            phase("loading the model, flag off")
            off = built(items[0].text, False)
            phase("timing the model, flag off")
            with env(False):
                off_timing = time_forward(off.run, sync, iters, warmup)
            for v in items:
                phase(f"loading the model, {v.label}")
                on = built(v.text, True)
                phase(f"timing the model, {v.label}")
                with env(True):
                    v.timing = time_forward(on.run, sync, iters, warmup)
    torch.set_num_threads(threads)
    return off_timing
