"""Shared harness for transformers' DSA indexers: a tiny config and the inputs their forward takes."""

import torch

from msrewrite.harness import tiny_config


def make_indexer(model, config_cls, indexer_cls, rotary_cls):
    torch.manual_seed(0)
    config = tiny_config(config_cls, {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 4})
    indexer = indexer_cls(config, layer_idx=0).eval()
    hidden_states = torch.randn(1, 8, config.hidden_size)
    q_resid = torch.randn(1, 8, config.q_lora_rank)
    position_ids = torch.arange(8)[None]
    cos, sin = rotary_cls(config)(hidden_states, position_ids)
    causal = torch.ones(1, 8, 8, dtype=torch.bool).tril()
    return indexer, (hidden_states, q_resid, (cos, sin), causal, position_ids)
