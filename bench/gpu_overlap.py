"""Does the emitted overlap really overlap on a device? Real MoE blocks at full size, random weights.

    python bench/gpu_overlap.py              # CUDA, or Ascend NPU when torch_npu imports
    python bench/gpu_overlap.py --quick      # fewer token counts and iterations
    python bench/gpu_overlap.py --cpu-smoke  # the plumbing on CPU at tiny size (no timing value)

For transformers' DeepseekV3MoE and Qwen3NextSparseMoeBlock, each built alone from its default
(full-size) config in bf16: the modeling file is rewritten with `moe-shared-expert` (mode `cuda`
on CUDA; `eager` and `npugraph-ex` on an NPU) through the library API, the rewritten file is
imported with msrewrite.harness.load_module, and the edited block shares the original's weights.

Per token count (decode 1, 8, 64; prefill 4096) and experts implementation (transformers'
`eager` loop, and `grouped_mm` when available), device time of:
  shared     the shared-expert branch alone
  routed     router + routed experts alone
  serial     the original, unedited block
  off / on   the edited block with its switch off / on
  saving     (off - on) / min(shared, routed): the part of the shorter branch that was hidden
and the same under CUDA graphs (capture + replay; a block whose experts sync the host cannot be
captured, which the table says). One flag-on run per model under PyTorch's CUDA sanitizer
(TORCH_CUDA_SANITIZER=1, in a subprocess). Exits 0 with a message when there is no device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import models_dir

FLAG = "msrewrite_overlap"  # attr flag: the block reads getattr(config, FLAG, True) in __init__


@dataclass(frozen=True)
class Model:
    key: str
    file: str  # under transformers/models
    config: str
    block: str
    shared: Callable  # (block, x) -> shared branch alone
    routed: Callable  # (block, x) -> router + routed experts alone
    tiny: dict  # config overrides for --cpu-smoke


def _deepseek_shared(block, x):
    return block.shared_experts(x)


def _deepseek_routed(block, x):
    _, weights, indices = block.gate(x)
    return block.experts(x.view(-1, x.shape[-1]), indices, weights)


def _qwen_shared(block, x):
    import torch

    flat = x.view(-1, x.shape[-1])
    return torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)


def _qwen_routed(block, x):
    flat = x.view(-1, x.shape[-1])
    _, weights, selected = block.gate(flat)
    return block.experts(flat, selected, weights)


MODELS = [
    Model(
        "deepseek_v3",
        "deepseek_v3/modeling_deepseek_v3.py",
        "DeepseekV3Config",
        "DeepseekV3MoE",
        _deepseek_shared,
        _deepseek_routed,
        dict(
            hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1
        ),
    ),
    Model(
        "qwen3_next",
        "qwen3_next/modeling_qwen3_next.py",
        "Qwen3NextConfig",
        "Qwen3NextSparseMoeBlock",
        _qwen_shared,
        _qwen_routed,
        dict(
            hidden_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ),
]


# Backends --------------------------------------------------------------------------------------
class Backend:
    """What differs between CUDA, Ascend NPU and the CPU smoke run: device, timing, graphs."""

    name = "cpu"
    device = "cpu"
    modes: tuple[str, ...] = ("cuda",)  # msrewrite modes to emit on this backend
    graphs = False

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def time_ms(self, fn, iters: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        self.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        self.synchronize()
        return (time.perf_counter() - start) * 1e3 / iters

    def capture(self, fn):
        """A graph of fn() that replays it; only where `graphs` is true."""
        raise NotImplementedError(f"{self.name}: no graph capture")

    def describe(self) -> str:
        return "CPU (smoke run: plumbing only, no streams, timings meaningless)"


class _DeviceBackend(Backend):
    """A device behind torch's stream API (torch.cuda, or torch.npu from torch_npu): timed with
    device events."""

    api: Any  # torch.cuda or torch.npu

    def synchronize(self) -> None:
        self.api.synchronize()

    def empty_cache(self) -> None:
        self.api.empty_cache()

    def time_ms(self, fn, iters: int, warmup: int) -> float:
        api = self.api
        for _ in range(warmup):
            fn()
        api.synchronize()
        start, end = api.Event(enable_timing=True), api.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        api.synchronize()
        return start.elapsed_time(end) / iters


class CudaBackend(_DeviceBackend):
    name = "cuda"
    device = "cuda"
    modes = ("cuda",)
    graphs = True

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.api = torch.cuda

    def capture(self, fn):
        """A CUDA graph of fn() on static inputs; returns a replay callable (raises if not capturable)."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs recommends
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def describe(self) -> str:
        torch = self.torch
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"


class NpuBackend(_DeviceBackend):
    """Ascend NPU through torch_npu: eager streams, and npugraph-ex (torch.compile backend)."""

    name = "npu"
    device = "npu"
    modes = ("eager", "npugraph-ex")
    graphs = True

    def __init__(self) -> None:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        self.torch: Any = torch  # with torch.npu, which torch's own type stubs do not know
        self.api = self.torch.npu

    def capture(self, fn):
        """npugraph-ex: torch.compile with the npugraph_ex backend captures and replays NPU graphs."""
        compiled = self.torch.compile(fn, backend="npugraph_ex", dynamic=False)
        for _ in range(3):
            compiled()
        self.torch.npu.synchronize()
        return compiled

    def describe(self) -> str:
        torch = self.torch
        try:
            name = torch.npu.get_device_name()
        except Exception:  # older torch_npu
            name = "Ascend NPU"
        return f"{name} (torch {torch.__version__}, torch_npu)"


def detect_backend() -> Backend | None:
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available():
        return CudaBackend()
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return None
    if hasattr(torch, "npu") and torch.npu.is_available():
        return NpuBackend()
    return None


# Building the blocks -----------------------------------------------------------------------------
def rewrite(model: Model, mode: str, folder: Path) -> tuple[Path, str]:
    """The modeling file rewritten with moe-shared-expert in `mode` (library API, as `apply` does)."""
    from msrewrite.commands.apply import plans_for_case
    from msrewrite.emit.engine import apply_plans
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    path = models_dir() / model.file
    src = load(path)
    plans = plans_for_case(
        path, src.module, "moe-shared-expert", mode, model.block, FlagSpec(kind="attr", name=FLAG), None
    )
    text = apply_plans(src.module, plans).code
    out = folder / mode.replace("-", "_") / Path(model.file).name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out, plans[0].function


def build_blocks(model: Model, edited_path: Path, backend: Backend, experts_impl: str, tiny: bool):
    """(original block, edited block sharing its weights, hidden size)."""
    import torch

    from msrewrite.harness import load_module

    package = f"transformers.models.{Path(model.file).parent.name}"
    original_module = load_module(models_dir() / model.file, package=package)
    edited_module = load_module(edited_path, package=package)
    config = getattr(original_module, model.config)(**(model.tiny if tiny else {}))
    config._experts_implementation = experts_impl
    torch.manual_seed(0)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly: DeepSeek-V3's experts are ~22 GB
    try:
        with torch.device(backend.device):
            original = getattr(original_module, model.block)(config)
        with torch.device("meta"):
            edited = getattr(edited_module, model.block)(config)
    finally:
        torch.set_default_dtype(old_dtype)
    with torch.no_grad():
        for param in original.parameters():
            param.normal_(0.0, 0.02)
    original.eval()
    edited.load_state_dict(original.state_dict(), assign=True)  # same storage: no second copy
    edited.to(backend.device).eval()
    assert hasattr(edited, FLAG), f"the edit did not add self.{FLAG} to {model.block}.__init__"
    return original, edited, config.hidden_size


def experts_impls() -> list[str]:
    import torch

    impls = ["eager"]
    if hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm"):
        impls.append("grouped_mm")
    return impls


# Measuring ---------------------------------------------------------------------------------------
def measure(
    model: Model, original, edited, hidden: int, tokens: int, backend: Backend, iters: int, warmup: int, graphs: bool
) -> dict:
    import torch

    x = torch.randn(1, tokens, hidden, device=backend.device, dtype=torch.bfloat16)

    def flag(value: bool):
        def run():
            setattr(edited, FLAG, value)
            return edited(x)

        return run

    fns = {
        "shared": lambda: model.shared(original, x),
        "routed": lambda: model.routed(original, x),
        "serial": lambda: original(x),
        "off": flag(False),
        "on": flag(True),
    }
    row: dict = {"tokens": tokens}
    with torch.no_grad():
        ref, got_off, got_on = fns["serial"](), fns["off"](), fns["on"]()
        backend.synchronize()
        row["max_diff_on_vs_serial"] = (ref.float() - got_on.float()).abs().max().item()
        row["max_diff_off_vs_serial"] = (ref.float() - got_off.float()).abs().max().item()
        for name, fn in fns.items():
            row[name] = backend.time_ms(fn, iters, warmup)
        row["saving"] = (row["off"] - row["on"]) / min(row["shared"], row["routed"])
        if graphs and backend.graphs:
            g: dict = {}
            for name in ("shared", "routed", "serial", "off", "on"):
                fn = fns[name]
                if name in ("off", "on"):  # the switch is read at capture time: set it, then capture
                    setattr(edited, FLAG, name == "on")
                    fn = lambda: edited(x)  # noqa: E731
                try:
                    replay = backend.capture(fn)
                    g[name] = backend.time_ms(replay, iters, warmup)
                except Exception as exc:  # e.g. experts that sync the host (nonzero) cannot be captured
                    g[name] = None
                    g.setdefault("error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}")
                    break
            if g.get("off") and g.get("on") and g.get("shared") and g.get("routed"):
                g["saving"] = (g["off"] - g["on"]) / min(g["shared"], g["routed"])
            row["graphs"] = g
    return row


def sanitizer_run(model: Model, mode: str, experts_impl: str, tokens: int, tiny: bool, timeout: int) -> str:
    """One flag-on forward of the edited block under PyTorch's CUDA sanitizer, in a fresh process."""
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--sanitizer-child",
        model.key,
        "--mode-child",
        mode,
        "--experts-child",
        experts_impl,
        "--tokens-child",
        str(tokens),
    ] + (["--cpu-smoke"] if tiny else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout}s"
    if proc.returncode == 0 and "SANITIZER-CLEAN" in proc.stdout:
        return "clean"
    text = (proc.stdout + proc.stderr).strip().splitlines()
    hit = [line for line in text if "CSAN" in line or "race" in line.lower() or "Error" in line]
    return "REPORTED: " + (hit[0] if hit else (text[-1] if text else f"exit {proc.returncode}"))[:200]


def sanitizer_child(args) -> int:
    import torch

    backend = Backend() if args.cpu_smoke else detect_backend()
    if backend is None:
        print("no device")
        return 3
    model = next(m for m in MODELS if m.key == args.sanitizer_child)
    with tempfile.TemporaryDirectory(prefix="msrewrite-gpu-") as folder:
        path, _ = rewrite(model, args.mode_child, Path(folder))
        original, edited, hidden = build_blocks(model, path, backend, args.experts_child, args.cpu_smoke)
        x = torch.randn(1, args.tokens_child, hidden, device=backend.device, dtype=torch.bfloat16)
        setattr(edited, FLAG, True)
        with torch.no_grad():
            for _ in range(3):
                out = edited(x)
                out = out * 2  # a main-stream consumer of the joined result
            backend.synchronize()
    print("SANITIZER-CLEAN")
    return 0


# Driver ------------------------------------------------------------------------------------------
def fmt(value, width=8, digits=3) -> str:
    if value is None:
        return f"{'n/a':>{width}}"
    return f"{value:>{width}.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="decode 1 and 64, prefill 4096; fewer iterations")
    parser.add_argument("--cpu-smoke", action="store_true", help="run the plumbing on CPU with tiny configs")
    parser.add_argument("--models", nargs="*", default=[m.key for m in MODELS], choices=[m.key for m in MODELS])
    parser.add_argument("--tokens", type=int, nargs="*", default=None, help="token counts (default 1 8 64 4096)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--no-sanitizer", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--sanitizer-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode-child", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--experts-child", default="eager", help=argparse.SUPPRESS)
    parser.add_argument("--tokens-child", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sanitizer_child:
        return sanitizer_child(args)

    backend = Backend() if args.cpu_smoke else detect_backend()
    if backend is None:
        print(
            "gpu_overlap: no CUDA GPU and no Ascend NPU (torch_npu) here; nothing to measure. "
            "Run on a machine with a device, or pass --cpu-smoke to check the plumbing."
        )
        return 0
    tokens = args.tokens or ([1, 64, 4096] if args.quick else [1, 8, 64, 4096])
    if args.cpu_smoke:
        tokens = args.tokens or [1, 64]
    iters = args.iters or (2 if args.cpu_smoke else 10 if args.quick else 30)
    warmup = 1 if args.cpu_smoke else 3
    print(f"device: {backend.describe()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="msrewrite-gpu-") as folder:
        for model in [m for m in MODELS if m.key in args.models]:
            for mode in backend.modes:
                path, function = rewrite(model, mode, Path(folder))
                for impl in experts_impls():
                    try:
                        original, edited, hidden = build_blocks(model, path, backend, impl, args.cpu_smoke)
                        for t in tokens:
                            start = time.perf_counter()
                            row = measure(
                                model,
                                original,
                                edited,
                                hidden,
                                t,
                                backend,
                                iters,
                                warmup,
                                graphs=not args.no_graphs and mode != "eager",
                            )
                            row.update(model=model.key, mode=mode, experts=impl, seconds=time.perf_counter() - start)
                            rows.append(row)
                            _print_row(row)
                    except Exception as exc:  # one configuration failing must not hide the others
                        print(
                            f"{model.key:<12}{mode:<12}{impl:<11} FAILED: {type(exc).__name__}: {str(exc)[:200]}",
                            flush=True,
                        )
                        rows.append(
                            {"model": model.key, "mode": mode, "experts": impl, "error": f"{type(exc).__name__}: {exc}"}
                        )
                    original = edited = None
                    _free(backend)
            if backend.name == "cuda" and not args.no_sanitizer:
                verdict = sanitizer_run(model, "cuda", "eager", 8, args.cpu_smoke, timeout=240)
                print(f"CUDA sanitizer, {model.key} flag on, 8 tokens: {verdict}")
                rows.append({"model": model.key, "sanitizer": verdict})
    if args.json:
        args.json.write_text(json.dumps({"device": backend.describe(), "rows": rows}, indent=1))
    return 0


_HEADER_DONE = False


def _print_row(row: dict) -> None:
    global _HEADER_DONE
    if not _HEADER_DONE:
        print(
            f"{'model':<12}{'mode':<12}{'experts':<11}{'tokens':>6} |{'shared':>8}{'routed':>8}{'serial':>8}{'off':>8}{'on':>8}"
            f"{'saving':>8} | graphs:{'serial':>8}{'off':>8}{'on':>8}{'saving':>8} | max|on-serial|  (ms; saving = (off-on)/min(shared, routed))"
        )
        _HEADER_DONE = True
    g = row.get("graphs") or {}
    graphs = (
        f"{fmt(g.get('serial'))}{fmt(g.get('off'))}{fmt(g.get('on'))}{fmt(g.get('saving'), digits=2)}"
        if g and "error" not in g
        else f"  {g.get('error', 'off')[:30]:<30}"
    )
    print(
        f"{row['model']:<12}{row['mode']:<12}{row['experts']:<11}{row['tokens']:>6} |{fmt(row['shared'])}{fmt(row['routed'])}"
        f"{fmt(row['serial'])}{fmt(row['off'])}{fmt(row['on'])}{fmt(row['saving'], digits=2)} |       {graphs} | "
        f"{row['max_diff_on_vs_serial']:.3g}",
        flush=True,
    )


def _free(backend: Backend) -> None:
    import gc

    gc.collect()
    backend.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
