"""Harness for transformers' GlmMoeDsaIndexer (GLM-5): a tiny config and its forward's inputs."""

import torch
from transformers.models.glm_moe_dsa import configuration_glm_moe_dsa as configuration
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as model

from msrewrite.harness import tiny_config


def make():
    torch.manual_seed(0)
    config = tiny_config(configuration.GlmMoeDsaConfig, {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 4})
    indexer = model.GlmMoeDsaIndexer(config, layer_idx=0).eval()
    hidden_states = torch.randn(1, 8, config.hidden_size)
    q_resid = torch.randn(1, 8, config.q_lora_rank)
    position_ids = torch.arange(8)[None]
    cos, sin = model.GlmMoeDsaRotaryEmbedding(config)(hidden_states, position_ids)
    causal = torch.ones(1, 8, 8, dtype=torch.bool).tril()
    return indexer, (hidden_states, q_resid, (cos, sin), causal, position_ids)
