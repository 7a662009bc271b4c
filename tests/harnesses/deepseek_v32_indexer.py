"""Harness for transformers' DeepseekV32Indexer: a tiny config and the inputs its forward takes."""

import torch
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as model

from msrewrite.harness import tiny_config


def make():
    torch.manual_seed(0)
    config = tiny_config(model.DeepseekV32Config, {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 4})
    indexer = model.DeepseekV32Indexer(config, layer_idx=0).eval()
    hidden_states = torch.randn(1, 8, config.hidden_size)
    q_resid = torch.randn(1, 8, config.q_lora_rank)
    position_ids = torch.arange(8)[None]
    cos, sin = model.DeepseekV32RotaryEmbedding(config)(hidden_states, position_ids)
    causal = torch.ones(1, 8, 8, dtype=torch.bool).tril()
    return indexer, (hidden_states, q_resid, (cos, sin), causal, position_ids)
