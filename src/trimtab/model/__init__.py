"""The model: a Llama-style decoder-only Transformer (dense, MoE and Mixture-of-Depths layers),
its KV cache, and preset sizing on the meta device."""

from trimtab.model.cache import KVCache
from trimtab.model.catalog import preset_size
from trimtab.model.transformer import Transformer, build_model

__all__ = ["KVCache", "Transformer", "build_model", "preset_size"]
