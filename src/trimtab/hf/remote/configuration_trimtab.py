"""TrimtabConfig: the configuration of a model trained with trimtab and exported where no
standard transformers class computes it (Mixture-of-Depths, hybrids, a selection bias, unequal
expert counts after surgery). Self-contained: needs transformers only, not trimtab."""

from transformers import PretrainedConfig


class TrimtabConfig(PretrainedConfig):
    """Field names follow transformers where one exists (hidden_size, num_hidden_layers, ...);
    per-layer structure is data: layer_kinds (dense | moe | mod | moe+mod) and experts_per_layer
    (0 for a dense feed-forward)."""

    model_type = "trimtab"

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=256,
        rope_theta=10000.0,
        trimtab_rope=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=False,
        layer_kinds=None,
        experts_per_layer=None,
        num_experts_per_tok=2,
        moe_intermediate_size=0,
        shared_expert_intermediate_size=0,
        shared_expert_gate=False,
        norm_topk_prob=True,
        mod_predictor_hidden=0,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.trimtab_rope = trimtab_rope or {"type": "none"}  # none | linear | llama3, with its factors
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.qk_norm = qk_norm
        self.layer_kinds = layer_kinds or ["dense"] * num_hidden_layers
        self.experts_per_layer = experts_per_layer or [0] * num_hidden_layers
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.shared_expert_gate = shared_expert_gate
        self.norm_topk_prob = norm_topk_prob
        self.mod_predictor_hidden = mod_predictor_hidden
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
