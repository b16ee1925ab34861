import dataclasses
import logging

import pytest
import yaml

from trimtab.config import ModelConfig, RunConfig, available_presets, derive, load_config, read_saved, resolve
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
        ("model.norm_eps=-1e-6", "config key 'model.norm_eps' must be > 0"),  # was accepted (an HF rms_norm_eps too)
        ("orchestrator.above_start.unigram_margin=1", "'orchestrator.above_start.unigram_margin' must be in [0, 1)"),
        ("rl.eps_low=1.5", "config key 'rl.eps_low' must be in (0, 1)"),
        ("rl.eps_high=0", "config key 'rl.eps_high' must be > 0"),  # was told as rl.eps_low's
        ("rl.group_size=1", "config key 'rl.group_size' must be >= 2"),
        ("optim.lr=inf", "config key 'optim.lr' must be a finite number (got inf)"),  # was accepted
        ("optim.grad_clip=-1", "config key 'optim.grad_clip' must be >= 0 (got -1.0)"),
        ("rl.kl_coef=inf", "config key 'rl.kl_coef' must be a finite number"),
        ("rl.full_reward=nan", "config key 'rl.full_reward' must be a finite number (got nan)"),
        ("dpo.beta=inf", "config key 'dpo.beta' must be a finite number"),
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


def test_yaml_is_read_by_libyaml_and_a_bad_file_worded_by_the_pure_parser(tmp_path, monkeypatch):
    """libyaml reads a config 8x faster than the pure parser; its errors word a fault differently
    (here "did not find expected ',' or ']'"), so text it refuses is read again by the pure parser,
    whose message users were shown."""
    loaders = []
    real = yaml.load
    monkeypatch.setattr(yaml, "load", lambda text, Loader: loaders.append(Loader) or real(text, Loader=Loader))
    assert load_config(preset="debug").model.d_model == 96
    assert loaders and all(issubclass(loader, yaml.CSafeLoader) for loader in loaders)
    loaders.clear()
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [1, 2\n")
    expected = r"bad.yaml:3: invalid YAML \(expected ',' or '\]', but got '<stream end>'\); fix the syntax"
    with pytest.raises(ConfigError, match=expected):
        load_config(bad)
    assert [issubclass(loader, yaml.CSafeLoader) for loader in loaders] == [True, False]


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


@pytest.mark.parametrize("name", ["debug", "debug-moe", "debug-hybrid", "small"])
def test_a_resolved_config_is_frozen_and_resolving_it_again_changes_nothing(name):
    cfg = load_config(preset=name)
    for section, key in [(cfg, "out"), (cfg.train, "max_steps"), (cfg.model, "vocab_size"), (cfg.model.moe, "top_k")]:
        with pytest.raises(dataclasses.FrozenInstanceError, match="resolved and read-only"):
            setattr(section, key, getattr(section, key))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.orchestrator.spike.sigma = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        del cfg.plan.adjust
    assert resolve(cfg) is cfg  # resolved once: a resolved config is kept as it is
    again = resolve(cfg.to_dict())
    assert again == cfg and again.to_dict() == cfg.to_dict() and again.frozen
    assert resolve(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg  # as config.yaml holds it


def test_derive_makes_a_new_resolved_config_and_leaves_the_old_one():
    cfg = load_config(preset="debug")
    new = derive(cfg, {"train": {"max_steps": 5}, "model": {"vocab_size": 300}})
    assert (new.train.max_steps, new.model.vocab_size) == (5, 300) and new.frozen
    assert (cfg.train.max_steps, cfg.model.vocab_size) == (load_config(preset="debug").train.max_steps, 0)
    assert new.optim == cfg.optim and new.model.ffn_hidden == cfg.model.ffn_hidden
    with pytest.raises(ConfigError, match="train.max_steps"):
        derive(cfg, {"train": {"max_steps": -1}})  # validated like any resolution


def test_a_draft_is_changeable_until_resolved_and_resolving_leaves_it_a_draft():
    draft = RunConfig(model=ModelConfig(d_model=64, n_heads=4, layer_pattern=["moe"]))
    draft.model.moe.top_k = 1
    cfg = resolve(draft)
    assert (cfg.model.head_dim, cfg.model.moe.top_k, cfg.model.moe.expert_hidden) == (16, 1, 192)
    assert cfg.frozen and not draft.frozen and not draft.model.moe.frozen
    assert draft.model.head_dim == 0  # the draft itself is not filled in
    draft.train.max_steps = 3  # still a draft
    m = cfg.model.resolved()
    assert m is cfg.model


def test_yaml_off_for_the_orchestrator_mode_is_translated_at_load_only(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("orchestrator:\n  mode: off\n")  # YAML 1.1: false
    assert load_config(path, preset="debug").orchestrator.mode == "off"
    assert load_config(preset="debug", sets=["orchestrator.mode=off"]).orchestrator.mode == "off"
    assert load_config(preset="debug", overrides={"orchestrator": {"mode": "false"}}).orchestrator.mode == "off"
    with pytest.raises(ConfigError, match="orchestrator.mode"):
        load_config(preset="debug", sets=["orchestrator.mode=on"])
    # the `garbage` decision tells a person to set data.garbage_filter off: it was refused ("must be one of")
    path.write_text("data:\n  garbage_filter: off\nfinetune:\n  data:\n    garbage_filter: off\n")
    loaded = load_config(path, preset="debug", sets=["data.garbage_filter=off"])
    assert loaded.data.garbage_filter == loaded.finetune.data.garbage_filter == "off"


def test_activation_checkpointing_reads_the_older_booleans_as_full_and_off(tmp_path):
    """A config (or a run directory's config.yaml) from before selective checkpointing said true
    or false: they still mean a whole block's recompute and none."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  activation_checkpointing: true\n")
    assert load_config(path, preset="debug").train.activation_checkpointing == "full"
    for value, mode in [("false", "off"), ("true", "full"), ("selective", "selective"), ("full", "full")]:
        cfg = load_config(preset="debug", sets=[f"train.activation_checkpointing={value}"])
        assert cfg.train.activation_checkpointing == mode
    assert load_config(preset="dense-7b").train.activation_checkpointing == "full"
    with pytest.raises(ConfigError, match="train.activation_checkpointing.*off, selective, full"):
        load_config(preset="debug", sets=["train.activation_checkpointing=some"])


def test_read_saved_resolves_what_a_run_wrote(tmp_path):
    cfg = load_config(preset="debug-moe", overrides={"out": str(tmp_path)})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    saved = read_saved(tmp_path)
    assert saved == cfg and saved.frozen


def test_old_checkpoints_moe_knob_names_load():
    from trimtab.model import build_model

    cfg = load_config(preset="debug-moe", sets=["model.vocab_size=64"]).model
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


def test_a_yaml_list_of_sources_is_read_and_trains(tmp_path):
    """data.source, data.eval_source and a mixture's source take a list (docs/data.md): the union
    type's last option was never tried, so every list was refused ('must be list')."""
    import trimtab

    for name, text in (("a.txt", "def alpha():\n    return 1\n"), ("b.txt", "class Beta:\n    pass\n")):
        (tmp_path / name).write_text(text * 400)
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data": {"source": files, "eval_source": files[:1], "bpe_vocab_size": 300}}))
    cfg = load_config(config, overrides={"out": str(tmp_path / "r")}, preset="debug")
    assert list(cfg.data.source) == files and list(cfg.data.eval_source) == files[:1]
    mixed = load_config(preset="debug", overrides={"data": {"mix": [{"source": files, "weight": 1.0}]}})
    assert list(mixed.data.mix[0].source) == files
    with pytest.raises(ConfigError, match="config key 'data.source' must be str or list, got {'dir': 'x'}"):
        load_config(preset="debug", overrides={"data": {"source": {"dir": "x"}}})
    quick = {"max_steps": 2, "eval_every": 0, "batch_tokens": 256, "micro_batch_tokens": 0, "eval_tokens": 256}
    summary = trimtab.train(
        load_config(
            config, preset="debug", overrides={"out": str(tmp_path / "r"), "train": quick, "log": {"progress": False}}
        )
    )
    assert summary["status"] == "completed"


def test_a_source_beside_a_mixture_is_refused_not_ignored():
    mix = [{"source": "a.txt", "weight": 1.0}]
    with pytest.raises(ConfigError, match="config key 'data.source' 'b.txt' is unused beside data.mix: add it"):
        load_config(preset="debug", overrides={"data": {"mix": mix, "source": "b.txt"}})
    assert load_config(preset="debug", overrides={"data": {"mix": mix}}).data.sources[0].source == "a.txt"


def test_a_key_set_in_a_section_keeps_the_fields_own_defaults_for_the_rest():
    """finetune.optim starts at lr 3e-4 with a 10-step warm-up and finetune.data at no source: one
    key set there kept them (it rebuilt the section from OptimConfig's and DataConfig's own: a
    warm-up of 50, and the built-in corpus as finetuning data)."""
    cfg = load_config(preset="debug", sets=["finetune.optim.lr=1e-4", "finetune.data.format=chat"])
    assert (cfg.finetune.optim.lr, cfg.finetune.optim.warmup_steps) == (1e-4, 10)
    assert cfg.finetune.data.source == ""
    with pytest.raises(ConfigError, match="finetune.data.source' must name the finetuning data"):
        load_config(preset="debug", sets=["finetune.steps=5", "finetune.data.format=chat"])


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [("train: 5\n", "train", "5"), ("train: [1]\n", "train", "[1]"), ("finetune: {data: 7}\n", "finetune.data", "7")],
)
@pytest.mark.parametrize("cli", [{}, {"train": {"max_steps": 3}}, {"finetune": {"data": {"seq_len": 32}}}])
def test_a_section_written_as_a_value_is_refused_even_when_a_flag_touches_it(tmp_path, text, key, value, cli):
    """`train: 5` with --max-steps: the flag's mapping replaced the file's value, which was dropped
    without a word; it is refused as without the flag, naming the file and the key."""
    path = tmp_path / "s.yaml"
    path.write_text("preset: debug\n" + text)
    with pytest.raises(ConfigError, match=f"config key '{key}' must be a section") as err:
        load_config(path, overrides=cli)
    assert str(err.value).startswith(f"{path}: ") and value in str(err.value)


def test_finetune_rows_are_the_runs_length_unless_set(tmp_path):
    """A finetune section without data.seq_len on the debug preset (max_seq_len 128) was refused
    for the default 256: it takes the run's data.seq_len; one set is kept and checked as before."""
    path = tmp_path / "ft.yaml"
    path.write_text("preset: debug\nfinetune: {steps: 2, data: {source: builtin}}\n")
    cfg = load_config(path)
    assert cfg.finetune.data.seq_len == cfg.data.seq_len == 64
    assert load_config(path, sets=["data.seq_len=32"]).finetune.data.seq_len == 32
    assert load_config(path, sets=["finetune.data.seq_len=16"]).finetune.data.seq_len == 16
    with pytest.raises(ConfigError, match="finetune.data.seq_len' 200 is larger than the model's"):
        load_config(path, sets=["finetune.data.seq_len=200"])
    assert resolve(RunConfig()).finetune.data.seq_len == 256  # the small preset's rows, and no phase
    # a config a run saved before keeps its value (the resume reads the same rows)
    saved = cfg.to_dict()
    saved["finetune"]["data"]["seq_len"] = 48
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(saved))
    assert read_saved(tmp_path / "run").finetune.data.seq_len == 48


def test_a_whole_number_in_exponent_form_is_one_and_a_fraction_is_refused():
    """YAML 1.1 reads 1e3 as a string: `--set train.max_steps=1e3` was refused as 'not a number of
    steps', though the float fields take 3e-4 so. A whole number written so is that number."""
    cfg = load_config(preset="debug", sets=["train.max_steps=1e3", "train.eval_every=2.5e1", "optim.lr=3e-4"])
    assert (cfg.train.max_steps, cfg.train.eval_every, cfg.optim.lr) == (1000, 25, 3e-4)
    with pytest.raises(ConfigError, match="train.eval_every"):
        load_config(preset="debug", sets=["train.eval_every=1.5e0"])


def test_a_set_into_a_lists_item_says_to_set_the_list_whole():
    """`--set data.mix[0].weight=0.5` got "unknown config key 'data.mix[0]'; did you mean 'data.mix'"."""
    with pytest.raises(ConfigError, match=r"set data.mix whole, e.g. --set 'data.mix=\[\{source: web"):
        load_config(preset="debug", sets=["data.mix[0].weight=0.5"])
    with pytest.raises(ConfigError, match=r"'data.mix.0.weight=0.5': a list's items are not set one by one"):
        load_config(preset="debug", sets=["data.mix.0.weight=0.5"])  # was "config key 'data.mix' must be list"
    whole = "data.mix=[{source: builtin, weight: 0.7}, {source: 'builtin:arithmetic', weight: 0.3}]"
    assert [part.weight for part in load_config(preset="debug", sets=[whole]).data.mix] == [0.7, 0.3]
