"""Harness for transformers' DeepseekV32Indexer (DeepSeek-V3.2)."""

from transformers.models.deepseek_v32 import modeling_deepseek_v32 as model

from dsa_indexer import make_indexer


def make():
    return make_indexer(model, model.DeepseekV32Config, model.DeepseekV32Indexer, model.DeepseekV32RotaryEmbedding)
