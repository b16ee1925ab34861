"""Who set a config key, carried from load_config to a resume's config changes (config/provenance.py,
training/changes.py), and the settings a monitor's checkpoint must not keep over the config."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from trimtab.cli_train import _train_config
from trimtab.config import derive, load_config, read_saved
from trimtab.config.checks import leaves
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.provenance import OVERRIDE, saved_sources, sources
from trimtab.orchestrator.core import Orchestrator
from trimtab.training.changes import changes_line, changes_on_resume, journal_text
from trimtab.training.setup import prepare_run_dir


def session(run, *sets: str):
    """`trimtab train --preset debug --out RUN --set ...`'s config."""
    return load_config(preset="debug", overrides={"out": str(run)}, sets=list(sets))


def write(cfg) -> None:
    """config.yaml as a session writes it (prepare_run_dir; the tokenizer is there already)."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "tokenizer.json").write_text("{}")
    prepare_run_dir(cfg, tok=None)


def test_an_explicit_set_equal_to_the_default_is_the_persons_and_a_dropped_one_is_said_not_repeated(tmp_path):
    """Session 1 set weight_decay 0.05 and probe_after 5; session 2 sets weight_decay=0.1, this version's
    default: it was journaled "(this version's default ...)", a setting nobody made. Now it is the
    person's --set, and probe_after, not repeated, says so; a value nobody set that moved: the default."""
    run = tmp_path / "r"
    first = session(run, "optim.weight_decay=0.05", "orchestrator.oom.probe_after=5", "optim.lr=0.002")
    assert sources(derive(first, {"faults": ["nan_loss@3"]}))["optim.weight_decay"] == "--set"  # derive keeps it
    write(first)
    assert read_saved(run) == first and saved_sources(run / "config.yaml")["optim.lr"] == "--set"
    second = session(run, "optim.weight_decay=0.1", "optim.lr=0.002")
    by_key = {c["key"]: c for c in changes_on_resume(second)}
    assert set(by_key) == {"optim.weight_decay", "orchestrator.oom.probe_after"}
    decay, probe = by_key["optim.weight_decay"], by_key["orchestrator.oom.probe_after"]
    assert not decay.get("default") and decay["by"] == "--set"
    assert journal_text(decay, 20)[1].startswith("changed in the config by a person (set by --set)")
    assert probe.get("default") and probe["by"] == "not repeated"
    assert "set by --set in the session before and not repeated" in journal_text(probe, 20)[1]
    assert "probe_after 5 -> 200 (this version's default: set by --set in the session before, not repeated)" in (
        changes_line([decay, probe], 20)
    )
    # journaled: the person's as theirs, the dropped one as nobody's command
    orchestrator = Orchestrator(OrchestratorConfig(), run)
    for change in (decay, probe):
        orchestrator._configured(SimpleNamespace(step=20, phase=0), change)
    assert [d.mode for d in orchestrator.journal.decisions] == ["manual", "default"]
    # the next session: a key nobody set whose saved value is not this version's default moved
    write(second)
    text = (run / "config.yaml").read_text().replace("beta2: 0.95", "beta2: 0.99")  # an older default
    (run / "config.yaml").write_text(text)
    (moved,) = changes_on_resume(session(run, "optim.weight_decay=0.1", "optim.lr=0.002"))
    assert (moved["key"], moved.get("default"), moved["by"]) == ("optim.beta2", True, "default moved")
    assert "the default of the trimtab that wrote its config.yaml, which has moved" in journal_text(moved, 40)[1]


def test_a_runs_own_config_yaml_given_back_keeps_who_set_each_key(tmp_path):
    """`trimtab train RUN/config.yaml --out RUN` marked every key (391) the config file's: config.yaml's
    first line grew to 28 KB, and the next session said a default that moved was that file's setting not
    repeated. The file's own line says who set what: those keys keep it, the rest are nobody's."""
    run = tmp_path / "r"
    write(session(run, "optim.weight_decay=0.05"))
    again = load_config(run / "config.yaml", overrides={"out": str(run)}, sets=["optim.lr=0.002"])
    assert sources(again) == {"optim.weight_decay": "--set", "out": OVERRIDE, "optim.lr": "--set"}
    write(again)
    assert len((run / "config.yaml").read_text().splitlines()[0]) < 200
    text = (run / "config.yaml").read_text().replace("beta2: 0.95", "beta2: 0.99")  # an older default
    (run / "config.yaml").write_text(text)
    by_key = {c["key"]: c for c in changes_on_resume(session(run))}
    assert (by_key["optim.beta2"]["by"], by_key["optim.weight_decay"]["set_by"]) == ("default moved", "--set")
    # a config.yaml an older trimtab wrote, its first line worded as it was then, is read alike
    old = "# keys set by a person in the session that wrote this file: "
    (run / "config.yaml").write_text(old + text.split(": ", 1)[1])
    assert saved_sources(run / "config.yaml") == {"optim.weight_decay": "--set", "out": OVERRIDE, "optim.lr": "--set"}


def test_a_persons_edit_of_a_copied_config_yaml_is_theirs(tmp_path):
    """A person copies RUN/config.yaml (its first line comes along) and edits optim.lr: the key, not in
    the line, was said to be nobody's (the preset's), and left out of the next config.yaml's first line.
    A key whose value is not the preset's and defaults' is the file's; the others stay nobody's."""
    run, mine = tmp_path / "r", tmp_path / "mine.yaml"
    write(session(run, "optim.weight_decay=0.05"))
    mine.write_text((run / "config.yaml").read_text().replace("\n  lr: 0.003\n", "\n  lr: 0.001\n"))
    edited = load_config(mine, overrides={"out": str(run)})
    assert sources(edited) == {"optim.lr": f"the config file {mine}", "optim.weight_decay": "--set", "out": OVERRIDE}
    (lr,) = changes_on_resume(edited)
    assert (lr["key"], lr["by"]) == ("optim.lr", f"the config file {mine}") and not lr.get("default")
    assert journal_text(lr, 20)[1].startswith(f"changed in the config by a person (set by the config file {mine})")
    write(edited)
    assert saved_sources(run / "config.yaml")["optim.lr"] == f"the config file {mine}"
    fresh = load_config(mine, overrides={"out": str(tmp_path / "new")})  # a new run started from the copy
    assert sources(fresh)["optim.lr"] == f"the config file {mine}"


def test_a_copys_edit_of_a_key_its_line_names_is_the_files_even_back_to_the_presets_value(tmp_path):
    """Session 1 set optim.lr 0.001 (--set); a person copies its config.yaml and edits optim.lr: the key its
    first line names kept "--set" as its origin, whatever the copy now said, and an edit back to 0.003, the
    preset's own, was the --set's too. Its second line keeps the values set: a value not that one is the file's."""
    run, mine = tmp_path / "r", tmp_path / "mine.yaml"
    write(session(run, "optim.lr=0.001"))
    text = (run / "config.yaml").read_text()
    assert sources(load_config(run / "config.yaml"))["optim.lr"] == "--set"  # not edited: still the --set's
    for lr in ("0.002", "0.003"):  # 0.003: the debug preset's value
        mine.write_text(text.replace("\n  lr: 0.001\n", f"\n  lr: {lr}\n"))
        edited = load_config(mine, overrides={"out": str(run)})
        assert sources(edited)["optim.lr"] == f"the config file {mine}"
        (change,) = changes_on_resume(edited)
        assert (change["new"], change["by"], change.get("default")) == (float(lr), f"the config file {mine}", None)


def test_a_checkpoints_config_is_compared_and_an_edit_the_session_does_not_read_is_said(tmp_path, caplog):
    """A resume compares with the config its checkpoint was trained with (trained_config), not config.yaml: an
    edit of config.yaml in place is a change where the session reads the file, and is said (not applied, and
    written over) where it does not (`--preset` and flags): it was "0.001 -> 0.003, the default moved"."""
    from trimtab.training.changes import trained_config

    run = tmp_path / "r"
    first = session(run)
    write(first)
    path = run / "config.yaml"
    path.write_text(path.read_text().replace("\n  lr: 0.003\n", "\n  lr: 0.001\n"))
    (lr,) = changes_on_resume(load_config(path), trained_config(first))
    assert (lr["old"], lr["new"], lr["by"]) == (0.003, 0.001, f"the config file {path}")
    with caplog.at_level("WARNING", logger="trimtab"):
        assert changes_on_resume(session(run), trained_config(first)) == []
    assert f"{path} was edited since the checkpoint (optim.lr 0.003 -> 0.001)" in caplog.text
    assert "the edit is not applied" in caplog.text


def test_a_model_edit_of_config_yaml_in_place_is_checked_against_the_checkpoints_config(tmp_path):
    """The model check compared config.yaml with the config read from it: an edited ffn_hidden fell to the
    weights' shape mismatch (no key named), and an edited router knob was not applied over the checkpoint's
    while the journal said it was. The checkpoint's own config is compared."""
    from trimtab.errors import CheckpointError
    from trimtab.training.changes import trained_config
    from trimtab.training.setup import check_resume_compatible

    run = tmp_path / "r"
    first = load_config(preset="debug-moe", overrides={"out": str(run)})
    write(first)
    path, text = run / "config.yaml", (run / "config.yaml").read_text()
    path.write_text(text.replace("capacity_factor: 1.25", "capacity_factor: 2.0"))
    live = check_resume_compatible(load_config(path), trained=trained_config(first))
    assert live == {"model.moe.capacity_factor": (1.25, 2.0)}
    path.write_text(text.replace("ffn_hidden: 256", "ffn_hidden: 320"))
    with pytest.raises(CheckpointError, match=r"model.ffn_hidden: 256 there, 320 now"):
        check_resume_compatible(load_config(path), trained=trained_config(first))


def test_trimtab_rl_s_own_settings_are_said_to_be_its_own_not_a_persons_flags(tmp_path):
    """`trimtab rl` turns the likelihood rules off and the rl section on: provenance called each
    "a flag or an API override", and a resume journaled each as a person's change."""
    run = tmp_path / "r"
    write(session(run))
    flags = argparse.Namespace(config=None, preset="debug", out=str(run), max_steps=None, set=[], inject=[])
    cfg = _train_config(argparse.Namespace(**vars(flags), orchestrator="advise"), "rl")
    found = sources(cfg)
    assert found["orchestrator.spike.enabled"] == found["rl.enabled"] == "trimtab rl for its runs"
    assert found["orchestrator.mode"] == found["out"] == OVERRIDE
    spike = {c["key"]: c for c in changes_on_resume(cfg)}["orchestrator.spike.enabled"]
    assert (
        journal_text(spike, 20)[1]
        == "changed in the config by trimtab rl for its runs, not by a person: " + (spike["effect"])
    )
    assert "spike.enabled True -> False (set by trimtab rl for its runs) (" in changes_line([spike], 20)
    orchestrator = Orchestrator(OrchestratorConfig(), run)  # journaled as the command's, not a person's (manual)
    orchestrator._configured(SimpleNamespace(step=20, phase=0), spike)
    assert orchestrator.journal.decisions[-1].mode == "command"
    assert "[command" not in orchestrator.journal.decisions[-1].console_line()  # applied: no "not applied" tag


def _all_on(cfg, bump: bool = False):
    """`cfg` (an OrchestratorConfig draft) with every rule on and, with `bump`, every number moved."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _all_on(value, bump)
            if hasattr(value, "enabled"):
                value.enabled = True
        elif bump and isinstance(value, int) and not isinstance(value, bool):
            setattr(cfg, f.name, value + 7)
        elif bump and isinstance(value, float):
            setattr(cfg, f.name, value * 0.77 if value else 0.5)
    return cfg


# Saved because learned: the OOM probe's wait, doubled by each failed probe, and the config's value it
# was doubled from (OutOfMemory.load_state_dict takes an edit of it: test_orchestrator_units.py)
LEARNED = {"monitors.oom.probe_after", "monitors.oom.probe_configured"}


def test_no_monitor_checkpoints_a_copy_of_its_config_that_a_resume_would_keep_over_an_edit(tmp_path):
    """A setting copied from the config into a monitor went into its checkpoint, and a resume put the
    old value back over the person's edit (plateau's above_start margins; the OOM probe's probe_after).
    A fresh orchestrator's state must not depend on the config's numbers, the learned ones aside."""

    def state(cfg):
        return leaves(Orchestrator(cfg, tmp_path).state_dict())

    ours, theirs = state(_all_on(OrchestratorConfig())), state(_all_on(OrchestratorConfig(), bump=True))
    assert {k for k in ours if ours[k] != theirs.get(k)} - LEARNED == set()
    loaded, cfg = Orchestrator(OrchestratorConfig(), tmp_path), OrchestratorConfig()
    loaded.load_state_dict(Orchestrator(_all_on(OrchestratorConfig(), bump=True), tmp_path).state_dict())
    assert loaded.monitors["plateau"].margin == (cfg.above_start.margin, cfg.above_start.rel_margin)
