"""The transformers model a dense trimtab shape is compared with: LlamaForCausalLM, built
locally from a config of the same shape (no hub download), at transformers' defaults."""

from __future__ import annotations

from typing import Any


def llama_like(m: Any):
    """LlamaForCausalLM with trimtab ModelConfig `m`'s vocabulary, widths, heads, RoPE and norm."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=m.vocab_size,
            hidden_size=m.d_model,
            intermediate_size=m.ffn_hidden,
            num_hidden_layers=m.n_layers,
            num_attention_heads=m.n_heads,
            num_key_value_heads=m.n_kv_heads,
            max_position_embeddings=m.max_seq_len,
            rope_theta=m.rope_theta,
            rms_norm_eps=m.norm_eps,
            tie_word_embeddings=m.tie_embeddings,
        )
    )
