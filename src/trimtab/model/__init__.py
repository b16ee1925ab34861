"""The model: a Llama-style decoder-only Transformer (dense and MoE layers) and its KV cache."""

from trimtab.model.cache import KVCache
from trimtab.model.transformer import Transformer, build_model, preset_size

__all__ = ["KVCache", "Transformer", "build_model", "preset_size"]
