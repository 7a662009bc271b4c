"""A serving-style MoE block (the vLLM / SGLang shape): the routed experts run one fused call that
writes its result over `hidden_states` (`fused_experts(..., inplace=True)`), and the shared
expert reads the same `hidden_states`. On a side stream the shared expert would race with that
write, so the edit reads a snapshot taken at the fork, as the frameworks' engineers write it.
"""

import os
import torch
import torch.nn.functional as F
from torch import nn

# msrewrite: multi-stream helpers (npugraph-ex mode). With the flag off, or without
# the backend, each one falls back to the original single-stream behaviour.
try:
    import torch_npu  # noqa: F401  (registers torch.npu)
except ImportError:  # no NPU stack: the side stream stays off
    torch_npu = None

_MS_SIDE_STREAMS = {}  # tag -> stream, one per process, shared by every layer


def _ms_env_flag(name, default):
    """A boolean switch from the environment: 1/true/yes/on enable it, 0/false/no/off disable it."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in ("1", "true", "yes", "on")


def _ms_side_stream(tag, enabled=True):
    """The side stream for `tag`, created on first use and shared by every layer; None when off."""
    if not enabled or not hasattr(torch, "npu"):
        return None
    stream = _MS_SIDE_STREAMS.get(tag)
    if stream is None:
        stream = _MS_SIDE_STREAMS[tag] = torch.npu.Stream()
    return stream


def _ms_stream_events(stream):
    """The (fork, join) event pair of one module, made once and reused by every eager call (a compiled
    npugraph_ex graph replaces each event with a tagged event of its own)."""
    if stream is None:
        return None
    return torch.npu.Event(), torch.npu.Event()


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


def _ms_record_stream(stream, *values):
    """Mark tensors (also inside tuples and lists) as in use on `stream`, so the caching allocator
    cannot hand their memory out early."""
    for value in values:
        if isinstance(value, torch.Tensor):
            value.record_stream(stream)
        elif isinstance(value, (tuple, list)):
            _ms_record_stream(stream, *value)


def fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, inplace=False):
    """Every routed expert in one call; with `inplace=True` the result overwrites `hidden_states`."""
    out = torch.zeros_like(hidden_states)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate, up = (hidden_states[token] @ w13[expert].t()).chunk(2, dim=-1)
        out.index_add_(0, token, (F.silu(gate) * up) @ w2[expert].t() * topk_weights[token, slot, None])
    if inplace:
        return hidden_states.copy_(out)
    return out


class SharedExpert(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedMoE(nn.Module):
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size):
        super().__init__()
        self.top_k = top_k
        self.w13 = nn.Parameter(torch.randn(num_experts, 2 * intermediate_size, hidden_size) * 0.05)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden_size, intermediate_size) * 0.05)

    def forward(self, hidden_states, router_logits):
        topk_weights, topk_ids = torch.topk(router_logits.softmax(dim=-1), self.top_k, dim=-1)
        return fused_experts(hidden_states, self.w13, self.w2, topk_weights, topk_ids, inplace=True)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size=64, intermediate_size=32, num_experts=8, top_k=2):
        super().__init__()
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size)
        self.shared_expert = SharedExpert(hidden_size, 2 * intermediate_size)
        # msrewrite(moe-shared-expert): ENABLE_MOE_SHARED_EXPERT_STREAM=0 turns the side stream off.
        self.enable_moe_shared_expert_stream = _ms_env_flag("ENABLE_MOE_SHARED_EXPERT_STREAM", True)
        # Made once per module: eager calls reuse them; a compiled graph resolves the stream by id and
        # swaps each event for a tagged event of its own.
        self.shared_expert_stream = _ms_side_stream("shared_expert", self.enable_moe_shared_expert_stream)
        self.shared_expert_events = _ms_stream_events(self.shared_expert_stream)

    def forward(self, hidden_states):
        num_tokens, hidden_dim = hidden_states.shape
        hidden_states = self.post_attention_layernorm(hidden_states)
        # msrewrite(moe-shared-expert): the shared expert runs on side stream "shared_expert" during the routed experts.
        shared_expert_stream = _ms_capture_safe(self.shared_expert_stream)
        if shared_expert_stream is not None:
            # msrewrite(moe-shared-expert): the main path may write hidden_states before the join: the side stream reads a copy.
            hidden_states_side = hidden_states.clone()
            fork_event, join_event = self.shared_expert_events
            _ms_record_stream(shared_expert_stream, hidden_states_side)
            fork_event.record()
            with torch.npu.stream(shared_expert_stream):
                fork_event.wait()
                shared_output = self.shared_expert(hidden_states_side)
                join_event.record()
        router_logits = self.gate(hidden_states)
        if shared_expert_stream is None:
            shared_output = self.shared_expert(hidden_states)
        # the fused routed experts overwrite hidden_states with their output
        final_hidden_states = self.experts(hidden_states, router_logits)
        # msrewrite(moe-shared-expert): join the side stream before the first use of shared_output.
        if shared_expert_stream is not None:
            join_event.wait()
            _ms_record_stream(torch.npu.current_stream(), shared_output)
        final_hidden_states = final_hidden_states + shared_output
        return final_hidden_states.view(num_tokens, hidden_dim)


def make():
    torch.manual_seed(0)
    return SparseMoeBlock().eval(), (torch.randn(8, 64),)
