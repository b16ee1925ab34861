"""A resume past corrupt checkpoints journaled as an incident (orchestrator/fallbacks.py), and a
saved config.yaml holding a key this version removed (config.read_saved)."""

import logging
from types import SimpleNamespace

import pytest
import yaml

import trimtab
from trimtab.config import dump_config, load_config, read_saved
from trimtab.errors import ConfigError
from trimtab.rundir import healed, read_decisions, read_summary
from trimtab.training.changes import changes_line, changes_on_resume, journal_text


def tiny_cfg(out, steps, sets=()):
    base = {
        "out": str(out),
        "train": {
            "max_steps": steps,
            "eval_every": 0,
            "log_every": 1,
            "batch_tokens": 1024,
            "eval_tokens": 1024,
            "precision": "fp32",
        },
        "data": {"max_bytes": 60_000},
        "checkpoint": {"every": 1},
        "log": {"progress": False, "tensorboard": False, "report": False},
    }
    return load_config(preset="debug", overrides=base, sets=list(sets))


def test_a_resume_past_corrupt_checkpoints_is_journaled_with_why_and_the_steps_trained_again(tmp_path, caplog):
    run = tmp_path / "r"
    assert trimtab.train(tiny_cfg(run, steps=3))["status"] == "completed"
    weights = run / "checkpoints" / "step_000003" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])  # 16 bytes flipped in the newest weights
    weights.write_bytes(bytes(data))
    optim = run / "checkpoints" / "step_000002" / "optim.pt"
    optim.write_bytes(optim.read_bytes()[:100])  # the one before's optimizer state truncated
    with caplog.at_level(logging.INFO, logger="trimtab"):
        assert trimtab.train(tiny_cfg(run, steps=4))["status"] == "completed"
    said = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage() or "corrupt" in r.getMessage()]
    assert len(said) == 1, said  # one line: the checkpoint, the ones set aside and why, the data position
    assert "step_000001 (step 1 of 4; data at epoch 0" in said[0] and "step_000002 (optim.pt: size" in said[0]
    assert "step_000003 (model.safetensors: size" in said[0]
    fell = [d for d in read_decisions(run) if d["rule"] == "checkpoint_fallback"]
    assert len(fell) == 1, [d["rule"] for d in read_decisions(run)]
    e = fell[0]["evidence"]
    assert [(r["checkpoint"], r["reason"].rsplit("/", 1)[1][:14]) for r in e["refused"]] == [
        ("step_000002", "optim.pt: size"),
        ("step_000003", "model.safetens"),
    ]
    assert all((run / "checkpoints" / "corrupt" / r["checkpoint"]).is_dir() for r in e["refused"])
    assert (e["resumed_step"], e["newest_step"], e["steps_lost"]) == (1, 3, 2)
    assert fell[0]["action"] == "resume" and fell[0]["outcome"]["result"] == "recovered"
    assert healed(read_decisions(run)) == 1  # `trimtab runs` counts it among the faults healed
    assert not (run / "checkpoints" / "corrupt" / "fallback.json").exists()  # journaled once
    assert read_summary(run)["decisions"] >= 1


def test_a_key_removed_since_the_saved_config_is_ignored_in_one_line_but_refused_from_a_person(tmp_path, caplog):
    run = tmp_path / "r"
    run.mkdir()
    cfg = tiny_cfg(run, steps=4)
    dump_config(cfg, run / "config.yaml")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["orchestrator"]["rows"]["gone_knob"] = 3  # a key an older trimtab wrote, removed since
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    with caplog.at_level(logging.WARNING):
        assert read_saved(run) == cfg
        read_saved(run)
    said = [r.getMessage() for r in caplog.records if "gone_knob" in r.getMessage()]
    assert len(said) == 1 and "ignoring 'orchestrator.rows.gone_knob'" in said[0], said
    # the person's own change is still journaled (it was lost with the whole saved config)
    changes = changes_on_resume(tiny_cfg(run, steps=4, sets=["optim.lr=0.002"]))
    assert [(c["key"], c["new"]) for c in changes] == [("optim.lr", 0.002)]
    with pytest.raises(ConfigError, match="unknown config key 'orchestrator.rows.gone_knob'"):
        tiny_cfg(run, steps=4, sets=["orchestrator.rows.gone_knob=3"])


def test_a_default_that_moved_is_not_journaled_as_a_persons_change(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    cfg = tiny_cfg(run, steps=4)
    saved = cfg.to_dict()
    saved["optim"]["weight_decay"] = cfg.optim.weight_decay / 2  # the older trimtab's default
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    changes = changes_on_resume(tiny_cfg(run, steps=4, sets=["optim.lr=0.002"]))
    by_key = {c["key"]: c for c in changes}
    assert set(by_key) == {"optim.weight_decay", "optim.lr"}
    assert by_key["optim.weight_decay"].get("default") and not by_key["optim.lr"].get("default")
    summary, reasoning = journal_text(by_key["optim.weight_decay"], 30)
    assert "(this version's default: the old value not repeated or the default moved)" in summary
    assert "by a person" not in reasoning and "which of the two is not known" in reasoning  # config.yaml can't tell
    assert journal_text(by_key["optim.lr"], 30)[1].startswith("changed in the config by a person")
    assert "not repeated or the default moved" in changes_line(changes, 30)
    # journaled: the person's change as theirs (mode manual), the default's as nobody's command
    from trimtab.config.orchestrator import OrchestratorConfig
    from trimtab.orchestrator.core import Orchestrator

    orchestrator = Orchestrator(OrchestratorConfig(), run)
    for change in changes:
        orchestrator._configured(SimpleNamespace(step=30, phase=0), change)
    assert {d.evidence["key"]: d.mode for d in orchestrator.journal.decisions} == {
        "optim.weight_decay": "default",
        "optim.lr": "manual",
    }
    from dataclasses import asdict

    from trimtab.rundir import incidents

    assert incidents([asdict(d) for d in orchestrator.journal.decisions]) == []  # neither a fault the run healed


def test_a_run_whose_every_checkpoint_is_corrupt_is_not_called_untrained(tmp_path):
    """merge, export, eval and generate load through api.load_run: "train it first" misled (soak16)."""
    from trimtab.api import load_run
    from trimtab.errors import CheckpointError

    run = tmp_path / "r"
    run.mkdir()
    dump_config(tiny_cfg(run, steps=2), run / "config.yaml")
    for step in (1, 2):  # saved, then damaged: weights without the manifest that vouches for them
        ckpt = run / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"all 2 checkpoints under .*checkpoints are corrupt") as err:
        load_run(run)
    assert "train it first" not in str(err.value)
