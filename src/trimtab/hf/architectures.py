"""Hugging Face config.json <-> trimtab ModelConfig, for the architectures whose forward is
trimtab's function (measured parity in tests/test_hf.py; docs/interop.md).

    LlamaForCausalLM / MistralForCausalLM   dense, no bias (Llama 3.x RoPE scaling included)
    Qwen2ForCausalLM                        dense, bias on q, k, v
    Qwen3ForCausalLM                        dense, per-head QK-norm, head_dim apart from d_model / H
    MixtralForCausalLM                      every layer MoE, gates always renormalised, no shared
    Qwen2MoeForCausalLM                     MoE and dense layers (mlp_only_layers), one shared
                                            expert behind a sigmoid gate, q/k/v bias optional

Import refuses, in one line naming the field, any config value trimtab does not implement
(another activation, sliding windows shorter than the context, an unknown RoPE type, a field it
does not know). Export picks a class by the function, never by name: a trimtab model that no
class above computes (Mixture-of-Depths, a non-zero selection bias, unequal expert counts after
surgery) returns None here and leaves as trust_remote_code (hf/remote).
"""

from __future__ import annotations

import re
from typing import Any

from trimtab.config.model import ModelConfig, RopeScalingConfig
from trimtab.config.sparse import MoEConfig
from trimtab.errors import ConfigError
from trimtab.hf.remote import REMOTE_FIELDS, shape_fields
from trimtab.hf.remote import model_config as remote_model_config

DENSE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}

# Keys of any transformers config that do not change the forward function (bookkeeping, ids,
# generation defaults, dtype); each architecture adds the fields it reads below.
GENERIC = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "auto_map",
    "output_router_logits", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "tokenizer_class", "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "prefix",
    "task_specific_params", "finetuning_task", "is_encoder_decoder", "tie_encoder_decoder",
    "decoder_start_token_id", "sep_token_id", "use_bfloat16", "pruned_heads", "tf_legacy_loss",
    "add_cross_attention", "cross_attention_hidden_size", "pretraining_tp", "max_window_layers",
    "rope_theta", "rope_scaling", "rope_parameters", "layer_types", "sliding_window", "use_sliding_window",
    "hidden_act", "attention_dropout", "mlp_bias", "attention_bias", "router_jitter_noise",
}  # fmt: skip
COMMON = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
}  # fmt: skip
FIELDS = {
    "LlamaForCausalLM": COMMON,
    "MistralForCausalLM": COMMON,
    "Qwen2ForCausalLM": COMMON,
    "Qwen3ForCausalLM": COMMON,
    "MixtralForCausalLM": COMMON | {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"},
    "Qwen2MoeForCausalLM": COMMON
    | {
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "router_aux_loss_coef",
    },
}  # fmt: skip

# What each class's config takes for a field config.json omits: transformers' own defaults (the
# config class's __init__), not one generic value (a Mixtral without rope_theta is 1e6, not 1e4).
# Copied, not imported, since import runs without transformers; tests/test_hf_defaults.py checks
# them against transformers. Left out: values derived from others (num_key_value_heads = heads,
# head_dim = hidden / heads), which to_model_config derives.
_SHARED = {"rms_norm_eps": 1e-6, "rope_theta": 1e4, "tie_word_embeddings": False, "hidden_act": "silu"}
_QWEN = {"vocab_size": 151936, "max_position_embeddings": 32768, "use_sliding_window": False}
_SIZES = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}
_MISTRAL = {**_SIZES, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072}
_QWEN_DENSE = {**_SIZES, **_QWEN, "intermediate_size": 22016, "num_key_value_heads": 32}
DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {**_SHARED, **_SIZES, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "MistralForCausalLM": {**_SHARED, **_MISTRAL, "sliding_window": 4096},
    "Qwen2ForCausalLM": {**_SHARED, **_QWEN_DENSE},
    "Qwen3ForCausalLM": {**_SHARED, **_QWEN_DENSE, "head_dim": 128, "attention_bias": False},
    "MixtralForCausalLM": {**_SHARED, **_MISTRAL, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None}
    | {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0},
    "Qwen2MoeForCausalLM": {**_SHARED, **_QWEN, "hidden_size": 2048, "intermediate_size": 5632}
    | {"num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60}
    | {"num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632}
    | {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True}
    | {"router_aux_loss_coef": 0.001},
}

TRIMTAB = "TrimtabForCausalLM"  # trimtab's own remote-code export (hf/remote)
FIELDS[TRIMTAB] = REMOTE_FIELDS


def architecture(hf: dict[str, Any], where: str) -> str:
    """The one supported class named by config.json's `architectures`; ConfigError otherwise."""
    names = hf.get("architectures") or []
    if len(names) != 1 or names[0] not in FIELDS:
        supported = ", ".join([*DENSE, *MOE, "TrimtabForCausalLM (trimtab's own export)"])
        raise ConfigError(f"{where}: field 'architectures' is {names!r}; trimtab imports {supported}")
    return names[0]


def to_model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    """The ModelConfig that computes what config.json `hf` describes (ConfigError naming the first
    field trimtab does not implement). `where` names the file in errors."""
    arch = architecture(hf, where)
    _refuse_unknown(hf, arch, where)
    if arch == TRIMTAB:
        return remote_model_config(hf).resolved()
    hf = _with_defaults(hf, arch)
    _refuse_mistyped(hf, where)
    _refuse_unsupported(hf, arch, where)
    layer_pattern, moe = _moe(hf, arch) if arch in MOE else ([], MoEConfig())
    rope_scaling = _rope_scaling(_rope(hf), where)
    try:
        return _build(hf, arch, layer_pattern, moe, rope_scaling)
    except ConfigError as exc:  # said in trimtab's keys: named as config.json's fields
        raise ConfigError(f"{where}: {_hf_names(str(exc))}") from None


# trimtab's model keys as the config.json fields they come from, for the checks ModelConfig makes
HF_NAMES = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "ffn_hidden": "intermediate_size", "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
}  # fmt: skip


def _hf_names(message: str) -> str:
    message = message.replace("config key ", "field ")
    return re.sub(r"\bmodel\.(\w+)", lambda m: HF_NAMES.get(m.group(1), m.group(0)), message)


def _build(
    hf: dict[str, Any], arch: str, layer_pattern: list[str], moe: MoEConfig, rope_scaling: RopeScalingConfig
) -> ModelConfig:
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=_context(hf),
        rope_theta=float(_rope(hf)["rope_theta"]),
        rope_scaling=rope_scaling,
        norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        attn_bias=arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and bool(hf["qkv_bias"])),
        qk_norm=arch == "Qwen3ForCausalLM",
        layer_pattern=layer_pattern,
        moe=moe,
    ).resolved()


# null means "derived" or "off" for these (transformers' reading); for the rest, the default
NULLABLE = {"num_key_value_heads", "head_dim", "sliding_window", "rope_parameters", "rope_scaling", "layer_types"}


def _with_defaults(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """config.json completed with its class's defaults (DEFAULTS)."""
    given = {k: v for k, v in hf.items() if v is not None or k in NULLABLE}
    return {**DEFAULTS[arch], **given}


# Fields read as counts or as real numbers: a hand-edited config.json with "two" or true in one
# failed deep in the config checks with a TypeError traceback that named neither file nor field.
INTS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "num_local_experts",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "decoder_sparse_step",
}  # fmt: skip
FLOATS = {"rms_norm_eps", "rope_theta", "router_aux_loss_coef", "router_jitter_noise"}


# Sizes with no meaning at 0 (trimtab reads a vocab_size of 0 as "the tokenizer's")
POSITIVE = {k for k in COMMON if k in INTS} - {"sliding_window"}


def _refuse_mistyped(hf: dict[str, Any], where: str) -> None:
    for key in sorted((INTS | FLOATS) & hf.keys()):
        value, whole = hf[key], key in INTS
        if value is None:  # NULLABLE: derived or off
            continue
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            kind = "a whole number" if whole else "a number"
            raise ConfigError(f"{where}: field '{key}' is {value!r}; it must be {kind} (unquoted, as JSON writes it)")
        if key in POSITIVE and value < 1:
            raise ConfigError(f"{where}: field '{key}' is {value}; it must be at least 1")


def _refuse_unknown(hf: dict[str, Any], arch: str, where: str) -> None:
    for key in hf:
        if key not in GENERIC and key not in FIELDS[arch]:
            raise ConfigError(
                f"{where}: field '{key}' of {arch} is not implemented by trimtab; "
                "remove it if it does not change the model's function, or use another model"
            )


def _refuse_unsupported(hf: dict[str, Any], arch: str, where: str) -> None:
    """Values of known fields that would make trimtab compute another function."""
    checks = [
        ("hidden_act", hf.get("hidden_act", "silu") == "silu", "must be silu (trimtab's SwiGLU)"),
        ("attention_bias", not hf.get("attention_bias", False), "is true: a bias on o_proj is not implemented"),
        ("mlp_bias", not hf.get("mlp_bias", False), "is true: biases in the MLP are not implemented"),
        ("attention_dropout", not hf.get("attention_dropout", 0.0), "must be 0 (trimtab has no dropout)"),
        ("pretraining_tp", hf.get("pretraining_tp", 1) == 1, "must be 1"),
        ("decoder_sparse_step", hf.get("decoder_sparse_step", 1) >= 1, "must be >= 1"),
    ]
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    checks.append(("layer_types", layer_types == {"full_attention"}, "must all be full_attention"))
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"{where}: field '{key}' {why}")
    if arch == "Qwen3ForCausalLM" and hf.get("attention_bias"):
        raise ConfigError(f"{where}: field 'attention_bias' is true: a bias on o_proj is not implemented")


def _context(hf: dict[str, Any]) -> int:
    """The context trimtab builds: max_position_embeddings, capped at a sliding window that is on
    (within it, windowed attention is full attention: the same function)."""
    context = hf["max_position_embeddings"]
    window = hf.get("sliding_window")
    on = hf.get("use_sliding_window", True) if "use_sliding_window" in hf else bool(window)
    return min(context, window) if on and window else context


def window_back(source: dict[str, Any], arch: str, context: int) -> dict[str, Any]:
    """The fields an export of an imported model takes back from its config.json where its sliding
    window capped trimtab's context (_context): the window and the positions as they came (a window
    that capped nothing: the window alone, as it came). Within
    the window windowed attention is trimtab's full attention (the same function); without them a
    fine-tuned Mistral (window 4096 of 32768 positions) went out with max_position_embeddings 4096 and
    no window: serving stacks cap it at 4096, and transformers attends over everything past it."""
    if source.get("architectures", [None])[0] != arch or arch not in DEFAULTS:
        return {}
    theirs = _with_defaults(source, arch)
    if _context(theirs) != context:
        return {}  # trimtab's context changed since the import: the source's fields no longer describe it
    # A window that capped nothing (off, or at least the positions: a Mistral's 4096 over 256) goes back
    # as it came, for the round trip: over the exported positions it changes nothing either.
    keys = ("sliding_window", "use_sliding_window")
    if theirs["max_position_embeddings"] != context:
        keys = ("max_position_embeddings", *keys)
    return {k: theirs[k] for k in keys if k in theirs}


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE parameters from transformers 5's rope_parameters, or 4.x's rope_theta + rope_scaling
    (`hf` has the class's defaults: a missing theta is the class's)."""
    if hf.get("rope_parameters"):
        return {"rope_theta": hf["rope_theta"], **hf["rope_parameters"]}
    params = dict(hf.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    return {**params, "rope_theta": hf["rope_theta"]}


def _rope_scaling(rope: dict[str, Any], where: str) -> RopeScalingConfig:
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return RopeScalingConfig()
    if kind == "linear":
        return RopeScalingConfig(type="linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScalingConfig(
            type="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_seq_len=int(rope["original_max_position_embeddings"]),
        )
    raise ConfigError(
        f"{where}: field 'rope_parameters.rope_type' is '{kind}'; trimtab implements default, linear, llama3"
    )


def _moe(hf: dict[str, Any], arch: str) -> tuple[list[str], MoEConfig]:
    """Layer pattern and MoE section. Training knobs: dropless (as transformers trains), the
    config's aux-loss coefficient, no z-loss."""
    n = hf["num_hidden_layers"]
    balance = float(hf["router_aux_loss_coef"])
    common = dict(capacity_factor=0.0, balance_coef=balance, z_loss_coef=0.0)
    common["router_jitter"] = float(hf.get("router_jitter_noise") or 0.0)
    if arch == "MixtralForCausalLM":
        moe = MoEConfig(
            n_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            expert_hidden=hf["intermediate_size"],
            norm_topk_prob="true",
            **common,
        )
        return ["moe"] * n, moe
    step, dense = hf["decoder_sparse_step"], set(hf["mlp_only_layers"] or [])
    pattern = ["moe" if i not in dense and (i + 1) % step == 0 else "dense" for i in range(n)]
    shared = hf["shared_expert_intermediate_size"]
    moe = MoEConfig(
        n_experts=hf["num_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_hidden=hf["moe_intermediate_size"],
        n_shared_experts=1 if shared else 0,
        shared_hidden=shared,
        shared_gate=bool(shared),
        norm_topk_prob="true" if hf["norm_topk_prob"] else "false",
        **common,
    )
    return pattern, moe


# ---- export: which class computes a trimtab model ------------------------------------------


def export_class(
    cfg: ModelConfig, moe_state: dict[str, dict[str, float]], biased: bool, prefer: str = ""
) -> str | None:
    """The transformers class whose forward is this model's function, or None (remote code).
    `biased`: some MoE layer has a non-zero selection bias (no standard class has one with
    softmax gates and these layouts). `prefer`: the class the model was imported from, kept
    when it still fits (so an imported model goes back to its own class)."""
    kinds = cfg.layers
    if any("mod" in k for k in kinds):
        return None
    if not any("moe" in k for k in kinds):
        fits = _dense_classes(cfg)
    else:
        counts = {int(s["n_experts"]) for s in moe_state.values()} or {cfg.moe.n_experts}
        fits = [] if biased or len(counts) != 1 or cfg.qk_norm else _moe_classes(cfg)
    if prefer in fits:
        return prefer
    return fits[0] if fits else None


def _dense_classes(cfg: ModelConfig) -> list[str]:
    if cfg.qk_norm:
        return [] if cfg.attn_bias else ["Qwen3ForCausalLM"]
    return ["Qwen2ForCausalLM"] if cfg.attn_bias else ["LlamaForCausalLM", "MistralForCausalLM"]


def _moe_classes(cfg: ModelConfig) -> list[str]:
    """Mixtral computes all-MoE stacks with always-renormalised gates and no shared expert;
    Qwen2-MoE the rest (its shared expert zero-width when trimtab has none; an ungated one
    exported behind a zero gate, sigmoid(0) = 1/2, with down_proj doubled: exact)."""
    moe = cfg.moe
    all_moe = all("moe" in k for k in cfg.layers)
    mixtral = all_moe and moe.renormalize and moe.n_shared_experts == 0 and not cfg.attn_bias
    return ["MixtralForCausalLM", "Qwen2MoeForCausalLM"] if mixtral else ["Qwen2MoeForCausalLM"]


def to_hf_config(cfg: ModelConfig, arch: str, ids: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json for class `arch` computing `cfg` (export_class chose it). `ids`: bos / eos /
    pad token ids."""
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        **shape_fields(cfg),
        "hidden_act": "silu",
        "rope_parameters": _rope_parameters(cfg),
        "rope_theta": cfg.rope_theta,  # transformers 4.x reads this one
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,  # the name transformers 4.x reads
        **ids,
    }
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        hf["attention_bias"] = False
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        hf["sliding_window"] = None
    if arch == "MixtralForCausalLM":
        hf.update(num_local_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.top_k)
        hf.update(intermediate_size=cfg.moe.expert_hidden, router_aux_loss_coef=cfg.moe.balance_coef)
    if arch == "Qwen2MoeForCausalLM":
        hf.update(_qwen2_moe_fields(cfg))
    return hf


def _qwen2_moe_fields(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return {
        "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_hidden,
        "shared_expert_intermediate_size": moe.shared_hidden if moe.n_shared_experts else 0,
        "norm_topk_prob": moe.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, kind in enumerate(cfg.layers) if "moe" not in kind],
        "qkv_bias": cfg.attn_bias,
        "use_sliding_window": False,
        "router_aux_loss_coef": moe.balance_coef,
    }


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    s = cfg.rope_scaling
    params: dict[str, Any] = {"rope_type": "default" if s.type == "none" else s.type, "rope_theta": cfg.rope_theta}
    if s.type != "none":
        params["factor"] = s.factor
    if s.type == "llama3":
        params.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_seq_len,
        )
    return params
