"""An adaptor module that monkey-patches the MoE forward, as HunyuanImage-3's adaptor_patches do."""

import os
import torch

from hunyuan_moe import HunyuanModel, HunyuanMoE

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


def _ms_record_stream(stream, *values):
    """Mark tensors (also inside tuples and lists) as in use on `stream`, so the caching allocator
    cannot hand their memory out early."""
    for value in values:
        if isinstance(value, torch.Tensor):
            value.record_stream(stream)
        elif isinstance(value, (tuple, list)):
            _ms_record_stream(stream, *value)


def moe_forward(self, hidden_states):
    # msrewrite(moe-shared-mlp-init): the shared MLP runs on side stream "shared_mlp" during the routed experts.
    shared_mlp_stream = _ms_side_stream("shared_mlp", _ms_env_flag("ENABLE_SHARED_MLP_STREAM", True))
    if shared_mlp_stream is not None:
        current_stream = torch.cuda.current_stream()
        input_ready_event = torch.cuda.Event()
        input_ready_event.record(current_stream)
        with torch.cuda.stream(shared_mlp_stream):
            input_ready_event.wait(shared_mlp_stream)
            hidden_states_mlp = self.shared_mlp(hidden_states)
    bsz, seq_len, hidden_size = hidden_states.shape
    reshaped_input = hidden_states.reshape(-1, hidden_size)
    weights, experts = torch.topk(self.gate(reshaped_input).softmax(dim=-1), self.top_k, dim=-1)
    if shared_mlp_stream is None:
        hidden_states_mlp = self.shared_mlp(hidden_states)
    combined_output = torch.zeros_like(reshaped_input)
    for expert_id, expert in enumerate(self.experts):
        token_idx, slot = torch.where(experts == expert_id)
        combined_output.index_add_(0, token_idx, expert(reshaped_input[token_idx]) * weights[token_idx, slot, None])
    # msrewrite(moe-shared-mlp-init): join the side stream before the first use of hidden_states_mlp.
    if shared_mlp_stream is not None:
        shared_mlp_done_event = torch.cuda.Event()
        shared_mlp_done_event.record(shared_mlp_stream)
        shared_mlp_done_event.wait(current_stream)
        # Allocated on the side stream, freed on this one: keep them from early reuse.
        _ms_record_stream(current_stream, hidden_states_mlp)
    output = hidden_states_mlp + combined_output.reshape(bsz, seq_len, hidden_size)
    return output


HunyuanMoE.forward = moe_forward


def make():
    torch.manual_seed(0)
    return HunyuanModel().eval(), (torch.randn(2, 8, 64),)
