"""The model zoo: norms, placements (a registry each) and the causal LM."""

from .lm import KV, MLP, Block, CausalLM, CausalSelfAttention, LayerCache, ModelConfig, cache_keep, masked_softmax
from .norms import NORMS, LayerNorm, RMSNorm, make_norm
from .placements import PLACEMENTS, Placement, deepnorm_beta, get_placement

__all__ = [
    "Block", "CausalLM", "CausalSelfAttention", "KV", "LayerCache", "MLP", "ModelConfig", "cache_keep",
    "masked_softmax",
    "NORMS", "LayerNorm", "RMSNorm", "make_norm",
    "PLACEMENTS", "Placement", "deepnorm_beta", "get_placement",
]
