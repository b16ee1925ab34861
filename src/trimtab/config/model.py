"""The model's section of a run config (model.*): its widths, attention, rotary frequencies and
per-layer kinds (dense, MoE, MoD; the sparse layers' own sections are config/sparse.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trimtab.config.checks import Section, _check, _positive, freeze, thawed
from trimtab.config.sparse import LAYER_KINDS, MoDConfig, MoEConfig


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclass
class RopeScalingConfig(Section):
    """Rotary frequencies for a context longer than pretraining's (Hugging Face `rope_scaling`):
    linear divides every frequency by `factor` (position interpolation, Chen et al. 2023);
    llama3 divides only the low frequencies and blends the middle band (Llama 3.1,
    transformers' _compute_llama3_parameters)."""

    type: str = "none"  # none | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_seq_len / this are scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_seq_len / this are kept
    original_max_seq_len: int = 8192  # llama3: the context the model was pretrained at

    def validate(self) -> None:
        _check(self.type in ROPE_SCALINGS, "model.rope_scaling.type", f"must be one of {', '.join(ROPE_SCALINGS)}")
        _check(self.factor >= 1, "model.rope_scaling.factor", "must be >= 1")
        if self.type == "llama3":
            _check(
                0 < self.low_freq_factor < self.high_freq_factor,
                "model.rope_scaling",
                "needs 0 < low_freq_factor < high_freq_factor",
            )
            _positive(self, "model.rope_scaling", "original_max_seq_len")


@dataclass
class ModelConfig(Section):
    vocab_size: int = 0  # 0: taken from the tokenizer at setup (written out in config.yaml)
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 (auto): n_heads, plain multi-head attention; fewer -> GQA
    head_dim: int = 0  # 0 (auto): d_model / n_heads; Qwen3-style models set it apart
    ffn_hidden: int = 0  # 0 (auto): 8/3 * d_model rounded up to multiple_of (Llama convention)
    multiple_of: int = 64
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attn_bias: bool = False  # bias on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3; Dehghani et al. 2023)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    init_std: float = 0.02
    # Per-layer kinds, repeated to n_layers: dense | moe | mod | moe+mod. Empty: all dense.
    layer_pattern: list[str] = field(default_factory=list)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mod: MoDConfig = field(default_factory=MoDConfig)

    def validate(self) -> None:
        _positive(self, "model", "d_model", "n_layers", "n_heads", "multiple_of", "max_seq_len")
        for i, kind in enumerate(self.layer_pattern):
            _check(
                kind in LAYER_KINDS,
                f"model.layer_pattern[{i}]",
                f"is '{kind}'; each entry must be one of {', '.join(LAYER_KINDS)}",
            )
        # Entries past n_layers were silently never built: [dense, dense, dense, dense, moe] on 4 layers
        # trained an all-dense model while validating and reporting MoE settings.
        _check(
            len(self.layer_pattern) <= self.n_layers,
            "model.layer_pattern",
            f"has {len(self.layer_pattern)} entries, more than model.n_layers {self.n_layers}: the last "
            f"{len(self.layer_pattern) - self.n_layers} would never be built; shorten it or raise model.n_layers",
        )
        if any("moe" in k for k in self.layer_pattern):
            self.moe.validate()
        if any("mod" in k for k in self.layer_pattern):
            self.mod.validate(sum("mod" in kind for kind in self.layers))
        _check(
            self.head_dim > 0 or self.d_model % self.n_heads == 0,
            "model.d_model",
            "must be divisible by model.n_heads (or set model.head_dim)",
        )
        kv = self.n_kv_heads or self.n_heads
        _check(kv > 0 and self.n_heads % kv == 0, "model.n_kv_heads", "must divide model.n_heads")
        _check(self.head_dim >= 0, "model.head_dim", "must be >= 0 (0: d_model / n_heads)")
        # 0 is auto for both; a negative width reached torch as a tensor shape (a RuntimeError traceback)
        _check(self.ffn_hidden >= 0, "model.ffn_hidden", f"must be >= 0 (0: 8/3 d_model), got {self.ffn_hidden}")
        _check(self.vocab_size >= 0, "model.vocab_size", f"must be >= 0 (0: the tokenizer's), got {self.vocab_size}")
        _check(
            (self.head_dim or self.d_model // self.n_heads) % 2 == 0,
            "model.head_dim",
            "(d_model / n_heads when 0) must be even for rotary embeddings",
        )
        self.rope_scaling.validate()
        _check(self.rope_theta > 0, "model.rope_theta", "must be > 0")
        _check(self.init_std > 0, "model.init_std", "must be > 0")
        _check(self.norm_eps > 0, "model.norm_eps", "must be > 0 (RMSNorm divides by sqrt(mean(x^2) + norm_eps))")

    def resolved(self) -> ModelConfig:
        """This model validated, with the widths left at 0 (auto) filled, frozen: itself when it
        already is. The widths get one name each, so config.yaml records what was built:
        n_kv_heads (= n_heads: plain multi-head attention), head_dim (d_model / n_heads),
        ffn_hidden (8/3 d_model rounded up to multiple_of, the Llama convention) and, with MoE
        layers, moe.expert_hidden (the dense width / top_k, so a token's active FLOPs match the
        dense FFN's) and moe.shared_hidden. A draft stays as it was (the result is a copy)."""
        if self.frozen:
            return self
        self.validate()
        m = thawed(self)
        m.n_kv_heads = m.n_kv_heads or m.n_heads
        m.head_dim = m.head_dim or m.d_model // m.n_heads
        if not m.ffn_hidden:
            m.ffn_hidden = _round_up(int(8 * m.d_model / 3), m.multiple_of)
        if any("moe" in kind for kind in m.layer_pattern) and not m.moe.expert_hidden:
            per_expert = -(-m.ffn_hidden // m.moe.top_k)  # ceil
            m.moe.expert_hidden = max(m.multiple_of, _round_up(per_expert, m.multiple_of))
        if m.moe.n_shared_experts and not m.moe.shared_hidden:
            m.moe.shared_hidden = m.moe.n_shared_experts * m.moe.expert_hidden
        return freeze(m)

    @property
    def layers(self) -> list[str]:
        """The kind of each of the n_layers layers (the pattern repeated)."""
        pattern = self.layer_pattern or ["dense"]
        return [pattern[i % len(pattern)] for i in range(self.n_layers)]

    @property
    def mod_capacities(self) -> list[float]:
        """Target capacity of each Mixture-of-Depths layer, in layer order."""
        n = sum("mod" in kind for kind in self.layers)
        return list(self.mod.layer_capacity) or [self.mod.capacity] * n


# Model keys a resume may change: they shape no weight, and training changes them live (trimtab
# ctl, the orchestrator), so a person's new value is a knob turned, not another model.
LIVE_MODEL_KEYS = frozenset(
    {
        "model.moe.capacity_factor",
        "model.moe.router_temperature",
        "model.moe.router_jitter",
        "model.moe.balance_coef",
        "model.moe.z_loss_coef",
        "model.moe.bias_update_rate",
        "model.mod.capacity",
        "model.mod.layer_capacity",
    }
)
