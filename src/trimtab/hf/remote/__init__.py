"""Export through trimtab's own modeling file (trust_remote_code), for the models no standard
transformers class computes: Mixture-of-Depths, hybrids, MoE with a selection bias or with
unequal expert counts after surgery. The two files beside this one are copied next to the
weights; they need torch and transformers only."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from trimtab.config import ModelConfig

FILES = ("configuration_trimtab.py", "modeling_trimtab.py")
Getter = Callable[[str], torch.Tensor]


def shape_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields every transformers decoder names the same way (and tools such as
    lm-eval or inference servers read): sizes, heads, context."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def remote_config(cfg: ModelConfig, experts: list[int], out: Path, ids: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Copy the modeling files into `out`; return config.json. `experts`: each layer's expert
    count (0: dense feed-forward), as the checkpoint holds them."""
    for name in FILES:
        shutil.copyfile(Path(__file__).parent / name, out / name)
    s = cfg.rope_scaling
    moe = cfg.moe
    return {
        "architectures": ["TrimtabForCausalLM"],
        "model_type": "trimtab",
        "auto_map": {
            "AutoConfig": "configuration_trimtab.TrimtabConfig",
            "AutoModelForCausalLM": "modeling_trimtab.TrimtabForCausalLM",
        },
        **shape_fields(cfg),
        "rope_theta": cfg.rope_theta,
        "trimtab_rope": {
            "type": s.type,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_seq_len": s.original_max_seq_len,
        },
        "attention_bias": cfg.attn_bias,
        "qk_norm": cfg.qk_norm,
        "layer_kinds": cfg.layers,
        "experts_per_layer": experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_hidden,
        "shared_expert_intermediate_size": moe.shared_hidden if moe.n_shared_experts else 0,
        "shared_expert_gate": moe.shared_gate,
        "norm_topk_prob": moe.renormalize,
        "mod_predictor_hidden": max(8, cfg.d_model // 8),  # trimtab.model.mod.DepthRouter's width
        "dtype": dtype,
        "use_cache": False,
        **ids,
    }


REMOTE_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "trimtab_rope", "rms_norm_eps",
    "tie_word_embeddings", "qk_norm", "layer_kinds", "experts_per_layer", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "shared_expert_gate", "norm_topk_prob",
    "mod_predictor_hidden",
}  # fmt: skip


def model_config(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig a TrimtabForCausalLM config.json describes (remote_config's inverse; the
    expert count of each layer is in experts_per_layer, applied by moe_structure)."""
    from trimtab.config.model import RopeScalingConfig
    from trimtab.config.sparse import MoEConfig

    experts = [n for n in hf["experts_per_layer"] if n]
    shared = hf.get("shared_expert_intermediate_size", 0)
    rope = hf.get("trimtab_rope") or {"type": "none"}
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        rope_theta=float(hf["rope_theta"]),
        rope_scaling=RopeScalingConfig(**rope),
        norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        attn_bias=bool(hf.get("attention_bias", False)),
        qk_norm=bool(hf.get("qk_norm", False)),
        layer_pattern=list(hf["layer_kinds"]),
        moe=MoEConfig(
            n_experts=max(experts, default=8),
            top_k=hf.get("num_experts_per_tok", 2),
            expert_hidden=hf.get("moe_intermediate_size", 0),
            n_shared_experts=1 if shared else 0,
            shared_hidden=shared,
            shared_gate=bool(hf.get("shared_expert_gate", False)),
            norm_topk_prob="true" if hf.get("norm_topk_prob", True) else "false",
        ),
    )


def moe_structure(cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each MoE layer's expert count (unequal after surgery) with the config's knobs, in the form
    Transformer.load_moe_state takes (the router temperature is 1: export folded it in)."""
    moe = cfg.moe
    knobs = {
        "capacity_factor": moe.capacity_factor,
        "router_temperature": 1.0,
        "balance_coef": moe.balance_coef,
        "z_loss_coef": moe.z_loss_coef,
        "bias_update_rate": moe.bias_update_rate,
    }
    return {str(i): {"n_experts": n, **knobs} for i, n in enumerate(hf["experts_per_layer"]) if n}


def remote_tensors(get: Getter, names: Iterable[str], moe_state: dict[str, dict[str, float]]) -> Iterator:
    """The checkpoint's tensors under their own names, each MoE router divided by its layer's
    live temperature (the same logits: x (W / T)^T = (x W^T) / T)."""
    for name in names:
        tensor = get(name)
        if name.endswith(".ffn.router"):
            layer = name.split(".")[1]
            tensor = tensor / moe_state.get(layer, {}).get("router_temperature", 1.0)
        yield name, tensor
