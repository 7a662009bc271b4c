"""An adaptor module that monkey-patches the MoE forward, as HunyuanImage-3's adaptor_patches do."""

import torch

from hunyuan_moe import HunyuanModel, HunyuanMoE


def moe_forward(self, hidden_states):
    bsz, seq_len, hidden_size = hidden_states.shape
    reshaped_input = hidden_states.reshape(-1, hidden_size)
    weights, experts = torch.topk(self.gate(reshaped_input).softmax(dim=-1), self.top_k, dim=-1)
    hidden_states_mlp = self.shared_mlp(hidden_states)
    combined_output = torch.zeros_like(reshaped_input)
    for expert_id, expert in enumerate(self.experts):
        token_idx, slot = torch.where(experts == expert_id)
        combined_output.index_add_(0, token_idx, expert(reshaped_input[token_idx]) * weights[token_idx, slot, None])
    output = hidden_states_mlp + combined_output.reshape(bsz, seq_len, hidden_size)
    return output


HunyuanMoE.forward = moe_forward


def make():
    torch.manual_seed(0)
    return HunyuanModel().eval(), (torch.randn(2, 8, 64),)
