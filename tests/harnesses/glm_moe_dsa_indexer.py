"""Harness for transformers' GlmMoeDsaIndexer (GLM-5)."""

from transformers.models.glm_moe_dsa import configuration_glm_moe_dsa as configuration
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as model

from dsa_indexer import make_indexer


def make():
    return make_indexer(model, configuration.GlmMoeDsaConfig, model.GlmMoeDsaIndexer, model.GlmMoeDsaRotaryEmbedding)
