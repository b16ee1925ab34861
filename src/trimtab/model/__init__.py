"""The model: a Llama-style decoder-only Transformer and its KV cache."""

from trimtab.model.cache import KVCache
from trimtab.model.transformer import Transformer, build_model

__all__ = ["KVCache", "Transformer", "build_model"]
