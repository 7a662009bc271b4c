"""Full-size cost estimates: the same recorder on the real default config, with fake tensors.

FakeTensorMode allocates nothing, so a 256-expert DeepSeek-V3 layer costs well under a second.
The module is built under `torch.set_default_dtype(torch.bfloat16)` (`.to(dtype)` cannot swap
fake parameters) with `grouped_mm` experts where the class supports it: the eager expert loop is
data-dependent and cannot run on fake tensors. Expert classes without that option (LongcatFlash's
loop over `nonzero()`) run an analytic stand-in instead: one op whose cost is the routed experts'
work from the config, T tokens x top-k (scaled by the share of real experts when the router also
picks zero-compute identity experts) x the expert's three matmuls, reading the weights of the
experts expected to receive a token, E * (1 - (1 - 1/E)^rows).

Configs whose defaults do not build (HunYuan leaves `head_dim=None`, which the attention uses as a
number) get the value the model derives elsewhere, hidden_size // num_attention_heads.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from msrewrite.harness import Harness, moe_layer_index
from msrewrite.suggest.trace import Trace, record

TOKENS = {"decode": 1, "prefill": 4096}


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def full_config(config_cls: type):
    """The class's default config (the real model's sizes), pinned to grouped_mm experts and sdpa."""
    config = config_cls()
    if getattr(config, "head_dim", 0) is None and getattr(config, "num_attention_heads", None):
        config.head_dim = config.hidden_size // config.num_attention_heads
    if hasattr(config, "_attn_implementation"):
        config._attn_implementation = "sdpa"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "grouped_mm"
    return config


def record_full_size(harness: Harness, model_module: types.ModuleType, model_file: Path, phase: str) -> Trace:
    """Record the harness's target class at its default config on fake tensors; raises on failure."""
    if harness.config is None:
        raise ValueError("no config to scale up")
    config = full_config(type(harness.config))
    cls = getattr(model_module, harness.target)
    tokens = TOKENS.get(phase, 1)
    kwargs = {}
    if "layer_idx" in inspect.signature(cls.__init__).parameters:
        kwargs["layer_idx"] = moe_layer_index(config)
    estimates: dict[int, tuple[Any, float, float]] = {}
    with _default_dtype(torch.bfloat16), FakeTensorMode(allow_non_fake_inputs=True):
        module = cls(config, **kwargs).eval()
        stubbed = [_stub_expert_loop(m, estimates) for m in module.modules() if _is_expert_loop(m)]
        hidden = torch.randn(1, tokens, config.hidden_size)
        call_kwargs = _fake_layer_kwargs(harness, model_module, config, hidden)
        trace = record(module, (hidden,), call_kwargs, model_file)
    for op in trace.ops:
        hit = estimates.get(id(op.outputs[0])) if op.outputs else None
        if hit is not None and hit[0] is op.outputs[0]:
            # zeros_like may end in an in-place zero_, whose schema marks its result as a view
            op.name, op.estimate, op.is_view = "msrewrite.routed_experts_estimate", hit[1:], False
    trace.notes = [f"{n} routed experts estimated analytically (data-dependent expert loop)" for n in stubbed]
    return trace


def _is_expert_loop(module: torch.nn.Module) -> bool:
    """An experts module that runs the modeling file's own loop (no experts_implementation switch)."""
    forward = type(module).forward
    return (
        type(module).__name__.endswith("Experts")
        and not hasattr(forward, "__wrapped__")
        and bool(_expert_weights(module))
    )


def _expert_weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """3-D parameters, experts first: (E, out, in)."""
    return [p for p in module.parameters(recurse=False) if p.dim() == 3]


def _stub_expert_loop(module: torch.nn.Module, estimates: dict) -> str:
    """Replace the module's forward by one output-shaped op that carries the loop's analytic cost."""
    weights = _expert_weights(module)
    real = min(w.shape[0] for w in weights)  # experts with weights (gate_up may also hold zero experts' rows)
    slots = max(w.shape[0] for w in weights)
    total = int(getattr(module, "total_experts", slots) or slots)  # routing choices, identity experts included
    per_expert = sum(w[0].numel() for w in weights)  # elements of one expert's matrices
    itemsize = weights[0].element_size()

    # the expert loop's own signature: the stub ignores the weights and any further arguments
    def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):  # noqa: ARG001
        tokens, k = top_k_index.shape[0], top_k_index.shape[-1]
        rows = tokens * k * real / total  # expected selections of experts that compute
        touched = real * (1.0 - (1.0 - 1.0 / real) ** rows)
        flops = 2.0 * rows * per_expert
        activations = rows * (weights[0].shape[-1] + sum(w.shape[1] for w in weights)) * itemsize
        out = torch.zeros_like(hidden_states)
        estimates[id(out)] = (out, flops, touched * per_expert * itemsize + activations)
        return out

    module.forward = forward
    return type(module).__name__


def _fake_layer_kwargs(harness: Harness, model_module: types.ModuleType, config, hidden: torch.Tensor) -> dict:
    if "position_embeddings" not in harness.kwargs:
        return {}
    rotary_cls = next(
        obj for name, obj in vars(model_module).items() if isinstance(obj, type) and name.endswith("RotaryEmbedding")
    )
    position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
    cos, sin = rotary_cls(config=config)(hidden, position_ids)
    kwargs: dict[str, object] = {"position_embeddings": (cos, sin), "attention_mask": None}
    if "position_ids" in harness.kwargs:
        kwargs["position_ids"] = position_ids
    return kwargs
