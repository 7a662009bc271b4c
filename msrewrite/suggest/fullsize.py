"""Full-size cost estimates: the same recorder on the real default config, with fake tensors.

FakeTensorMode allocates nothing, so a 256-expert DeepSeek-V3 layer costs well under a second.
The module is built under `torch.set_default_dtype(torch.bfloat16)` (`.to(dtype)` cannot swap
fake parameters) with `grouped_mm` experts where the class supports it: the eager expert loop is
data-dependent and cannot run on fake tensors. Models without that option (LongcatFlash) fall
back to the tiny trace's costs, and the candidate says so.
"""

from __future__ import annotations

import inspect
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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
    with _default_dtype(torch.bfloat16), FakeTensorMode(allow_non_fake_inputs=True):
        module = cls(config, **kwargs).eval()
        hidden = torch.randn(1, tokens, config.hidden_size)
        call_kwargs = _fake_layer_kwargs(harness, model_module, config, hidden)
        return record(module, (hidden,), call_kwargs, model_file)


def _fake_layer_kwargs(harness: Harness, model_module: types.ModuleType, config, hidden: torch.Tensor) -> dict:
    if "position_embeddings" not in harness.kwargs:
        return {}
    rotary_cls = next(
        obj for name, obj in vars(model_module).items() if isinstance(obj, type) and name.endswith("RotaryEmbedding")
    )
    position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
    cos, sin = rotary_cls(config=config)(hidden, position_ids)
    kwargs = {"position_embeddings": (cos, sin), "attention_mask": None}
    if "position_ids" in harness.kwargs:
        kwargs["position_ids"] = position_ids
    return kwargs
