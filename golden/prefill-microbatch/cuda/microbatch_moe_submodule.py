"""A prefill MoE decoder stack whose collectives sit one module deeper: the layer calls
`self.moe(x)`, and the MoE block's forward exchanges the tokens with collectives over the
expert-parallel group before and after the experts (all_reduce stands in for the all-to-all, so
it runs with gloo on a CPU). Sequences are independent, so the batch can be split between
micro-batches.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# msrewrite: multi-stream helpers (cuda mode). With the flag off, or without
# the backend, each one falls back to the original single-stream behaviour.
_MS_SIDE_STREAMS = {}  # tag -> stream, one per process, shared by every layer


def _ms_env_flag(name, default):
    """A boolean switch from the environment: 1/true/yes/on enable it, 0/false/no/off disable it."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in ("1", "true", "yes", "on")


def _ms_side_stream(tag, enabled=True):
    """The side stream for `tag`, created on first use and shared by every layer; None when off."""
    if not enabled or not torch.cuda.is_available():
        return None
    stream = _MS_SIDE_STREAMS.get(tag)
    if stream is None:
        stream = _MS_SIDE_STREAMS[tag] = torch.cuda.Stream()
    return stream


def _ms_microbatch(enabled, hidden_states):
    """Micro-batching needs CUDA and at least two sequences to split."""
    return bool(enabled) and torch.cuda.is_available() and hidden_states.shape[0] >= 2


class MoE(nn.Module):
    def __init__(self, hidden_size, num_experts):
        super().__init__()
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.Parameter(torch.randn(num_experts, hidden_size, hidden_size) * 0.05)

    def forward(self, hidden_states):
        weights = self.router(hidden_states).softmax(dim=-1)
        tokens = hidden_states.clone()
        dist.all_reduce(tokens)  # dispatch
        expert_out = torch.einsum("bte,ehd,bth->btd", weights, self.experts, tokens)
        dist.all_reduce(expert_out)  # combine
        return expert_out / dist.get_world_size()


class MoEDecoderLayer(nn.Module):
    def __init__(self, hidden_size=64, num_experts=4):
        super().__init__()
        self.input_norm = nn.LayerNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.post_norm = nn.LayerNorm(hidden_size)
        self.moe = MoE(hidden_size, num_experts)

    def forward(self, hidden_states):
        q, k, v = self.qkv(self.input_norm(hidden_states)).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden_states = hidden_states + self.o_proj(attn)
        moe_out = self.moe(self.post_norm(hidden_states))
        return hidden_states + moe_out

    def forward_microbatch(self, hidden_states_mb0, hidden_states_mb1):
        """forward for two micro-batches: collectives on the comm stream, one micro-batch behind (msrewrite)."""
        current_stream = torch.cuda.current_stream()
        comm_stream = _ms_side_stream("microbatch_comm")
        comm_stream.wait_stream(current_stream)
        # stage 0 (compute), micro-batch 0
        q_mb0, k_mb0, v_mb0 = self.qkv(self.input_norm(hidden_states_mb0)).chunk(3, dim=-1)
        attn_mb0 = F.scaled_dot_product_attention(q_mb0, k_mb0, v_mb0, is_causal=True)
        hidden_states_mb0 = hidden_states_mb0 + self.o_proj(attn_mb0)
        stage0_mb0_done = current_stream.record_event()
        # stage 1 (communication), micro-batch 0
        with torch.cuda.stream(comm_stream):
            comm_stream.wait_event(stage0_mb0_done)
            moe_out_mb0 = self.moe(self.post_norm(hidden_states_mb0))
            stage1_mb0_done = comm_stream.record_event()
        # stage 0 (compute), micro-batch 1
        q_mb1, k_mb1, v_mb1 = self.qkv(self.input_norm(hidden_states_mb1)).chunk(3, dim=-1)
        attn_mb1 = F.scaled_dot_product_attention(q_mb1, k_mb1, v_mb1, is_causal=True)
        hidden_states_mb1 = hidden_states_mb1 + self.o_proj(attn_mb1)
        stage0_mb1_done = current_stream.record_event()
        # stage 2 (compute), micro-batch 0
        current_stream.wait_event(stage1_mb0_done)
        out_mb0 = hidden_states_mb0 + moe_out_mb0
        # stage 1 (communication), micro-batch 1
        with torch.cuda.stream(comm_stream):
            comm_stream.wait_event(stage0_mb1_done)
            moe_out_mb1 = self.moe(self.post_norm(hidden_states_mb1))
            stage1_mb1_done = comm_stream.record_event()
        # stage 2 (compute), micro-batch 1
        current_stream.wait_event(stage1_mb1_done)
        out_mb1 = hidden_states_mb1 + moe_out_mb1
        # the streams meet before the micro-batches leave the layer
        current_stream.wait_stream(comm_stream)
        comm_stream.wait_stream(current_stream)
        return out_mb0, out_mb1


class MoEModel(nn.Module):
    def __init__(self, hidden_size=64, num_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(MoEDecoderLayer(hidden_size) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size)
        # msrewrite(prefill-microbatch): ENABLE_PREFILL_MICROBATCH=0 keeps the single-batch layer loop.
        self.enable_prefill_microbatch = _ms_env_flag("ENABLE_PREFILL_MICROBATCH", True)

    def forward(self, hidden_states):
        # msrewrite(prefill-microbatch): two micro-batches on two streams when enabled (forward_microbatch);
        # the loop below is the original path.
        if _ms_microbatch(self.enable_prefill_microbatch, hidden_states):
            return self.forward_microbatch(hidden_states)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)

    def forward_microbatch(self, hidden_states):
        """forward with its layers run as two micro-batches (msrewrite)."""
        # msrewrite(prefill-microbatch): two micro-batches through every layer, then back together.
        hidden_states_mb0, hidden_states_mb1 = hidden_states.chunk(2, dim=0)
        for layer in self.layers:
            hidden_states_mb0, hidden_states_mb1 = layer.forward_microbatch(hidden_states_mb0, hidden_states_mb1)
        hidden_states = torch.cat([hidden_states_mb0, hidden_states_mb1], dim=0)
        return self.norm(hidden_states)


def make():
    """The model and its input. Run alone (by `msrewrite verify` or `suggest`), it first starts a
    one-process gloo group on loopback, so the collectives run for real."""
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    return MoEModel().eval(), (torch.randn(4, 8, 64),)  # 4 sequences of 8 tokens
