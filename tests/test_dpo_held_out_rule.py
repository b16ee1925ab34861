"""Rule dpo_held_out (orchestrator/dpo_health.py, docs/rl.md): under `trimtab dpo` an LR 30x too high got no
intervention while the held-out preference loss rose 0.69 -> 0.91 and the chosen reward fell to -5.7; the
rule reads each evaluation's held-out loss and rolls back to the best one's policy with the LR cut. And two
small DPO / data ops: the held-out cap said, and skipped records named by file and line."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from trimtab.config import DataConfig, load_config
from trimtab.config.dpo import DPOConfig
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.policy import Policy
from trimtab.rl.dpo_phase import pairs_of

# (step, held-out loss, accuracy, chosen reward) of measured runs (docs/rl.md, rule dpo_held_out): 300 arithmetic
# pairs (30 held out) from a 60-step warm start, dpo.beta 0.1, seed 1: lr 1e-4 (healthy), and 1e-2 (x100), where
# the chosen responses' log-ratio fell to -6.7 nats at step 5 and the loss rose 0.693 -> 0.940 by step 30
HEALTHY = [(0, 0.693, 0.0, 0.0), (10, 0.698, 0.40, -0.01), (30, 0.700, 0.40, -0.05), (60, 0.702, 0.37, -0.14)]
TOO_HIGH = [(0, 0.693, 0.0, 0.0), (5, 0.715, 0.40, -0.67), (10, 0.712, 0.40, -0.62), (15, 0.721, 0.40, -0.76)]
TOO_HIGH += [(20, 0.703, 0.47, -0.83), (25, 0.766, 0.47, -0.99), (30, 0.940, 0.40, -1.49)]


def _evaluate(tmp_path, readings, dpo: DPOConfig | None = None) -> list:
    """Each reading through Orchestrator.on_eval as the trainer passes a DPO evaluation; the findings."""
    orch, found = Orchestrator(OrchestratorConfig(), tmp_path), []
    orch.decide = lambda run, f: found.append(f)
    run = SimpleNamespace(phase=0, weights_finite=lambda: True, cfg=SimpleNamespace(dpo=dpo or DPOConfig()))
    for step, loss, accuracy, chosen in readings:
        metrics = {"step": step, "dpo/held_out_loss": loss, "dpo/held_out_accuracy": accuracy}
        orch.on_eval(run, {**metrics, "dpo/held_out_chosen_reward": chosen})
    return found


def test_an_lr_far_too_high_for_dpo_is_found_on_the_held_out_pairs_and_rolled_back_with_the_lr_cut(tmp_path):
    """The chosen responses' log-ratio 5 nats below the reference's at chance accuracy, two evaluations in a
    row, fires at step 10; without a reference to compare with (SimPO) only the loss's rise, at step 30."""
    assert _evaluate(tmp_path, HEALTHY) == []
    # a loss that rises as more pairs are ranked rightly is a sharper policy, not a broken one
    sharper = [(0, 0.693, 0.0, 0.0), (10, 0.60, 0.6, -0.1), (20, 0.70, 0.7, -0.6), (30, 0.72, 0.8, -0.8)]
    assert _evaluate(tmp_path, sharper) == []
    f = _evaluate(tmp_path, TOO_HIGH)[0]
    assert (f.rule, f.step, f.evidence["best_step"], f.evidence["held_out_chosen_logratio"]) == (
        "dpo_held_out",
        10,
        0,
        pytest.approx(-6.2),
    )
    (risen,) = _evaluate(tmp_path, TOO_HIGH, DPOConfig(loss="simpo"))
    assert risen.step == 30 and risen.evidence["best_held_out_loss"] == 0.693 and "rose to 0.940" in risen.summary
    view = SimpleNamespace(lr_scale=1.0, has_checkpoint=lambda step: step >= 0)
    policy = Policy(OrchestratorConfig())
    remedy = policy.plan(f, view)
    assert remedy.action == "rollback" and remedy.params["to"] == 0 and remedy.params["lr_factor"] == 0.1
    assert "chosen responses down" in remedy.reasoning
    remedy.commit()
    for _ in range(OrchestratorConfig().max_rollbacks):  # the incident's rollbacks spent: it stops
        remedy = policy.plan(f, view)
        if remedy.action == "rollback":
            remedy.commit()
    assert remedy.action == "stop" and "optim.lr" in remedy.params["reason"]


def test_the_held_out_cap_of_a_pairs_file_is_said(tmp_path, caplog):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"} for i in range(300)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        preset="debug", overrides={"out": str(tmp_path / "r")}, sets=[f"dpo.pairs={path}", "dpo.held_out=32"]
    )
    with caplog.at_level(logging.WARNING, logger="trimtab.rl.dpo_phase"):
        _, held, _ = pairs_of(cfg)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "trimtab.rl.dpo_phase"]
    assert len(held) == 30 and "dpo.held_out=32" in message and "holds out 30 of its 300 pairs" in message


def test_skipped_bad_records_are_named_by_file_and_line(tmp_path, caplog):
    from trimtab.data.sources import read_documents

    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document {i}"}) if i not in (2, 5, 6, 8) else "{broken" for i in range(1, 10)]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="trimtab.data.sources"):
        _, skipped = read_documents(DataConfig(source=str(path), skip_bad_records=True))
    assert skipped == 4
    assert (
        f"skipped 4 malformed records (data.skip_bad_records=true; the first: {path}:2, {path}:5, {path}:6, ...)"
        in (caplog.text)
    )
