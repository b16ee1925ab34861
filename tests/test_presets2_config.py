"""A large preset's config with the distributed settings a user would set for a cluster: what
cannot split is refused when the config loads (config/distributed.py check_splits), naming the key
and the fix, not at the launch's start after every rank has prepared its data and built the model."""

import pytest

from trimtab.config import load_config
from trimtab.errors import ConfigError


@pytest.mark.parametrize(
    ("preset", "setting", "message"),
    [
        ("dense-1b", "distributed.tp=8", r"distributed.tp=8 must divide model.n_kv_heads \(4\); lower distributed.tp"),
        ("moe-7b", "distributed.tp=3", r"distributed.tp=3 must divide model.n_kv_heads"),
        ("moe-2.4t", "distributed.ep=128", r"distributed.ep=128 must divide model.moe.n_experts \(64\); lower"),
        ("moe-2.4t", "distributed.pp=128", r"128 pipeline stages but the model has 72 layers .*at most 72 stages"),
        ("dense-70b", "distributed.ep=2", r"distributed.ep=2: the model has no MoE layers to split; use .*ep=1"),
    ],
)
def test_a_split_the_model_cannot_take_is_refused_when_the_config_loads(preset, setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(preset=preset, sets=[setting])


def test_virtual_pipeline_stages_count_against_the_layers():
    load_config(preset="moe-14b", sets=["distributed.pp=8", "distributed.pp_stages_per_rank=3"])  # 24 of 24 layers
    with pytest.raises(ConfigError, match=r"asks for 32 pipeline stages but the model has 24 layers"):
        load_config(preset="moe-14b", sets=["distributed.pp=8", "distributed.pp_stages_per_rank=4"])


def test_the_splits_a_cluster_would_use_still_load():
    cfg = load_config(preset="moe-2.4t", sets=["distributed.tp=8", "distributed.ep=64", "distributed.pp=24"])
    assert (cfg.distributed.tp, cfg.distributed.ep, cfg.distributed.pp) == (8, 64, 24)
    load_config(preset="dense-70b", sets=["distributed.tp=8", "distributed.pp=16"])
    load_config(preset="hybrid-300b", sets=["distributed.tp=8", "distributed.ep=32", "distributed.pp=8"])
