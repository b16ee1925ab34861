"""A `trimtab train` start refused (exit 2) after set-up began: what it leaves in the run
directory, and what the next launch reads there."""

import logging
import time

import pytest


class _RefusedAtStart:
    """The Trainer as far as a refused start goes: the goodput ledger (Resilience) opens this session,
    then a later hook refuses the config in its on_train_start, as orchestrator/faults.py does
    `--inject expert_collapse@3` on a dense model."""

    def __init__(self, built, hooks):
        from types import SimpleNamespace

        self.hooks, self.state = hooks, SimpleNamespace(step=0)

    def fit(self):
        from types import SimpleNamespace

        from trimtab.errors import ConfigError
        from trimtab.orchestrator.restarts import Resilience

        run = SimpleNamespace(is_main=True, step=0, world=1, say=print, propose=lambda f: None, data_position=None)
        next(h for h in self.hooks if isinstance(h, Resilience)).on_train_start(run)
        raise ConfigError("faults: expert_collapse needs a Mixture-of-Experts model (e.g. --preset debug-moe)")


def test_a_start_refused_by_a_hook_leaves_no_session_the_next_launch_reads_as_lost(tmp_path, monkeypatch):
    """A start refused (exit 2) after the goodput ledger opened its session left it open: the next launch
    into the folder journaled 'step 0 restart: the process ended without a word (SIGKILL...) ... 4.1 s
    down'. The session is closed as refused instead. (The real refusal costs ~5 s of set-up: stood in for.)"""
    from trimtab import api
    from trimtab.config import load_config
    from trimtab.resilience.goodput import Ledger

    monkeypatch.setattr(api, "setup", lambda config: None)
    monkeypatch.setattr(api, "Trainer", _RefusedAtStart)
    cfg = load_config(preset="debug", sets=[f"out={tmp_path / 'r'}"])
    cfg.run_dir.mkdir()
    (cfg.run_dir / "config.yaml").write_text("{}")  # a run there already (a new one refused is removed whole)
    with pytest.raises(api.TrimtabError, match="expert_collapse needs a Mixture-of-Experts model"):
        api.train_or_raise(cfg)
    assert Ledger(cfg.run_dir).sessions[-1]["end"] == "refused at start-up"
    assert Ledger(cfg.run_dir).open(time.time(), 0, 1, 0, 0.0) is None  # the next session: no restart incident


class _TrainerWritesConfig:
    """The Trainer as far as a resume goes: it writes config.yaml (Checkpointing.resume) on construction."""

    def __init__(self, built, hooks):
        (built.cfg.run_dir / "config.yaml").write_text("rewritten")


def test_a_resume_refused_for_a_fault_its_model_cannot_take_leaves_config_yaml_as_it_was(tmp_path, monkeypatch):
    """`--inject expert_collapse@7` added to a dense run's resume was refused in the injector's
    on_train_start, after the Trainer had rewritten config.yaml with the refused fault in it (and
    faults.json with its spec): the run's record named a fault it never had. Refused now before the Trainer."""
    from types import SimpleNamespace

    from trimtab import api
    from trimtab.config import load_config

    cfg = load_config(preset="debug", sets=[f"out={tmp_path / 'r'}"], overrides={"faults": ["expert_collapse@7"]})
    cfg.run_dir.mkdir()
    (cfg.run_dir / "config.yaml").write_text("as trained")
    dense = SimpleNamespace(moe_layers=lambda: [])
    built = SimpleNamespace(
        cfg=cfg,
        model=dense,
        dist=SimpleNamespace(world=1),
        resume=(cfg.run_dir / "checkpoints" / "step_5", {"train": {"step": 5}}),
        phases=[SimpleNamespace(train_rows=[])],
    )
    monkeypatch.setattr(api, "setup", lambda config: built)
    monkeypatch.setattr(api, "Trainer", _TrainerWritesConfig)
    with pytest.raises(api.TrimtabError, match="expert_collapse needs a Mixture-of-Experts model"):
        api.train_or_raise(cfg)
    assert (cfg.run_dir / "config.yaml").read_text() == "as trained"
    assert not (cfg.run_dir / "faults.json").exists()


def _writes_run_files(config) -> None:
    """setup()'s writes on a new run (prepare_run_dir), stood in for."""
    (config.run_dir / "config.yaml").write_text("{}")
    (config.run_dir / "checkpoints").mkdir()


@pytest.mark.parametrize("own_file", [False, True])
def test_a_new_run_refused_at_start_leaves_no_run_behind(tmp_path, monkeypatch, own_file, caplog):
    """`--inject expert_collapse@3` on a dense model is refused as the run starts, after setup wrote
    config.yaml and the hooks their files: the folder read as a failed run in `trimtab runs` and a re-run
    resumed it as its own. What the refused session wrote is removed (the folder too, if it made it);
    a file that was there before stays."""
    from trimtab import api
    from trimtab.config import load_config

    monkeypatch.setattr(api, "setup", _writes_run_files)
    monkeypatch.setattr(api, "Trainer", _RefusedAtStart)
    cfg = load_config(preset="debug", sets=[f"out={tmp_path / 'r'}"])
    if own_file:
        cfg.run_dir.mkdir()
        (cfg.run_dir / "notes.txt").write_text("mine")
    with pytest.raises(api.TrimtabError, match="expert_collapse needs a Mixture-of-Experts model"):
        with caplog.at_level(logging.INFO, logger="trimtab.api"):
            api.train_or_raise(cfg)
    left = sorted(p.name for p in cfg.run_dir.iterdir()) if cfg.run_dir.exists() else None
    assert left == (["notes.txt"] if own_file else None)
    # said as it is ("refused at start-up: r holds nothing of this session" read as a run lost)
    removed = f"what it had written into {cfg.run_dir} is removed" if own_file else "the directory it made is removed"
    assert f"the run was refused before it started: {removed}" in caplog.text


def test_a_new_run_refused_in_an_empty_folder_the_user_made_leaves_the_folder(tmp_path, monkeypatch):
    """`mkdir -m 700 runs/x` then a start refused there (`--inject expert_collapse@10` on debug): the
    user's empty folder was removed with what the session wrote, as if the session had made it."""
    from trimtab import api
    from trimtab.config import load_config

    monkeypatch.setattr(api, "setup", _writes_run_files)
    monkeypatch.setattr(api, "Trainer", _RefusedAtStart)
    cfg = load_config(preset="debug", sets=[f"out={tmp_path / 'r'}"])
    cfg.run_dir.mkdir(mode=0o700)
    with pytest.raises(api.TrimtabError, match="expert_collapse needs a Mixture-of-Experts model"):
        api.train_or_raise(cfg)
    assert cfg.run_dir.is_dir() and not any(cfg.run_dir.iterdir())
    assert cfg.run_dir.stat().st_mode & 0o777 == 0o700
