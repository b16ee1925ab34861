"""A run whose model is a Hugging Face model's (train.init_from a transformers directory, or a run
that was started from one: its hf_source.json): its config.json is the model section. Apart from
setup.py because the model.* settings a person gave such a run are weighed against it here."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from trimtab import hf
from trimtab.config import ModelConfig, RunConfig, derive, load_config, merge, nested
from trimtab.config.checks import leaves
from trimtab.config.model import LIVE_MODEL_KEYS
from trimtab.errors import ConfigError
from trimtab.hf.architectures import to_model_config
from trimtab.hf.importer import SOURCE, read_source


def adopt_hf_model(cfg: RunConfig) -> RunConfig:
    """train.init_from a Hugging Face model directory: its config.json is the model (a config
    whose model section is replaced, MoE training knobs included: dropless, its aux-loss
    coefficient), but for the live knobs (LIVE_MODEL_KEYS) this run's config sets itself. A
    resumed run reads it from its hf_source.json, so the directory may be gone by then. Without
    one, `cfg` itself. A model.* key the config sets otherwise is refused (it was replaced
    without a word)."""
    record = cfg.run_dir / SOURCE
    if cfg.train.init_from and hf.is_hf_dir(cfg.train.init_from):
        model, source = hf.model_config(cfg.train.init_from), f"{cfg.train.init_from}/config.json"
    elif cfg.train.init_from and record.is_file():
        fix = f"restore it, or set train.init_from to that model's directory ({cfg.train.init_from} now)"
        model, source = to_model_config(read_source(cfg.run_dir, fix)["config"], str(record)), str(record)
    else:
        return cfg
    changes = {"model": asdict(model)}
    for key, value in _set_keys(cfg, model, source).items():  # the live knobs this run sets itself
        changes = merge(changes, nested(key.split("."), value))
    return derive(cfg, changes)


def _set_keys(cfg: RunConfig, model: ModelConfig, source: str) -> dict[str, Any]:
    """The model.* values this run's config sets (unlike its preset's) that the Hugging Face model
    has otherwise: the live knobs among them, by dotted key; ConfigError naming the others."""
    preset = leaves(asdict(load_config(preset=cfg.preset).model), "model.")
    ours, theirs = leaves(asdict(cfg.model), "model."), leaves(asdict(model), "model.")
    differ = {k: v for k, v in ours.items() if v != preset.get(k) and k in theirs and v != theirs[k]}
    refused = [f"{k}={v!r} (the model's: {theirs[k]!r})" for k, v in differ.items() if k not in LIVE_MODEL_KEYS]
    if refused:
        raise ConfigError(
            f"train.init_from is a Hugging Face model, and its {source} is the model: "
            f"{'; '.join(refused)}. Drop those model.* settings (or start from another model)"
        )
    return {k: v for k, v in differ.items() if k in LIVE_MODEL_KEYS}
