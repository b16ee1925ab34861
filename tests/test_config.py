import logging

import pytest
import yaml

from trimtab.config import RunConfig, available_presets, load_config
from trimtab.errors import ConfigError


def test_layering_preset_file_overrides_and_set(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: debug\noptim:\n  lr: 1.0e-2\ntrain:\n  max_steps: 7\n")
    cfg = load_config(path, overrides={"train": {"max_steps": 9}}, sets=["optim.lr=3e-4", "model.tie_embeddings=false"])
    assert cfg.preset == "debug"
    assert cfg.model.d_model == 96  # from the preset file
    assert cfg.train.max_steps == 9  # CLI flag beats the YAML file
    assert cfg.optim.lr == pytest.approx(3e-4)  # --set beats everything; YAML reads 3e-4 as a string
    assert cfg.model.tie_embeddings is False


@pytest.mark.parametrize(
    "item, message",
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
        ("modle.d_model=8", "unknown config key 'modle'; did you mean 'model'?"),
        ("model.d_model=abc", "config key 'model.d_model' must be int, got 'abc'"),
        ("train.max_steps=-1", "config key 'train.max_steps' must be a positive number of steps or auto"),
        ("optim.schedule=cosin", "config key 'optim.schedule' must be one of"),
        ("data.seq_len=4096", "data.seq_len' 4096 is larger than the model's model.max_seq_len"),
        ("model.n_kv_heads=3", "config key 'model.n_kv_heads' must divide model.n_heads"),
    ],
)
def test_bad_values_name_the_key(item, message):
    with pytest.raises(ConfigError) as err:
        load_config(preset="debug", sets=[item])
    assert message in str(err.value)


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(ConfigError, match="unknown preset 'debgu'; did you mean 'debug'"):
        load_config(preset="debgu")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(bad)


def test_every_preset_loads_and_round_trips():
    assert {"debug", "small"} <= set(available_presets())
    for name in available_presets():
        cfg = load_config(preset=name)
        again = load_config(overrides=yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
        assert again == cfg


def test_default_preset_and_run_dir():
    cfg = load_config()
    assert isinstance(cfg, RunConfig) and cfg.preset == "small"
    assert str(cfg.run_dir) == "runs/small"
    assert str(load_config(overrides={"out": "x/y"}).run_dir) == "x/y"


def test_example_configs_are_valid():
    from pathlib import Path

    examples = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert examples
    for path in examples:
        if "study" in yaml.safe_load(path.read_text()):  # a trimtab tune space file: its own checks
            from trimtab.tune import load_space

            load_space(path)  # builds the base config at the space's ends: every key checked
        else:
            load_config(path)  # raises ConfigError on any unknown key or bad value


def test_renamed_keys_still_load_with_a_warning_naming_the_new_one(tmp_path, caplog):
    path = tmp_path / "old.yaml"
    path.write_text("data: {vocab_size: 300}\nmodel: {layer_pattern: [moe], moe: {aux_loss_coef: 0.02}}\n")
    with caplog.at_level(logging.WARNING):
        cfg = load_config(path, preset="debug")
    assert cfg.data.bpe_vocab_size == 300 and cfg.model.moe.balance_coef == 0.02
    assert "config key 'data.vocab_size' is now 'data.bpe_vocab_size'" in caplog.text
    assert "'model.moe.aux_loss_coef' is now 'model.moe.balance_coef'" in caplog.text


def test_auto_widths_resolve_to_one_name_each():
    m = load_config(preset="debug-moe").model  # n_kv_heads 2, ffn_hidden and expert_hidden auto
    assert (m.n_kv_heads, m.ffn_hidden, m.moe.expert_hidden) == (2, 256, 128)  # 8/3 x 96 -> 256; / top_k 2
    assert load_config(preset="debug", sets=["model.n_kv_heads=0"]).model.n_kv_heads == 4  # = n_heads
    assert load_config(preset="debug").model.moe.expert_hidden == 0  # no MoE layer: nothing to resolve


def test_old_checkpoints_moe_knob_names_load():
    from trimtab.model import build_model

    cfg = load_config(preset="debug-moe").model
    cfg.vocab_size = 64
    model = build_model(cfg)
    old = {
        "n_experts": 8,
        "capacity_factor": 1.5,
        "temperature": 2.0,
        "aux_loss_coef": 0.03,
        "z_loss_coef": 0.0,
        "bias_update_rate": 0.0,
    }
    model.load_moe_state({"1": old})
    moe = model.blocks[1].ffn
    assert (moe.router_temperature, moe.balance_coef, moe.capacity_factor) == (2.0, 0.03, 1.5)
