"""An RL run's decisions judged on its objective (no likelihood), and its KL reference damaged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from test_orchestrator_incidents import pending
from test_orchestrator_units import finding, metrics
from trimtab.checkpoint import save_checkpoint
from trimtab.config import load_config
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.errors import ConfigError
from trimtab.model import Transformer
from trimtab.orchestrator.journal import Journal
from trimtab.orchestrator.outcomes import Outcomes
from trimtab.rl.reference import check_reference, load_reference

FLAT = {"flat_groups": 0.9, "solved_groups": 0.0, "reward": 0.02}  # an RL step's figures (RolloutBatch.health)


def _rl(step: int, loss: float):
    return dataclasses.replace(metrics(step, loss=loss), rl=dict(FLAT))


def test_an_rl_skip_is_judged_on_its_trouble_not_on_the_sign_of_the_objective(tmp_path):
    """nan_loss@5 under `trimtab rl` (debug, 4 prompts x 4, lr 1e-4): the same skip read "recovered"
    synchronously (objective -5e-3 after, -2e-9 before) and "not recovered" asynchronously (+5e-3
    after, -8e-10 before), by the 5% test of a likelihood; `trimtab runs` counted 1 and 0 healed."""
    journal = Journal(tmp_path / "decisions.jsonl")
    outcomes = Outcomes(journal, OrchestratorConfig())
    skip = pending(journal, 5, "nonfinite", loss_before=-8e-10)
    for s in range(6, 26):
        outcomes.follow(_rl(s, 0.005 if s % 2 else -0.001), [])
    assert skip.outcome["result"] == "recovered"
    again = pending(journal, 30, "nonfinite", loss_before=-8e-10)  # the NaNs back: never recovered
    for s in range(31, 51):
        outcomes.follow(_rl(s, 0.005), [finding(s, rule="nonfinite")] if s == 32 else [])
    assert again.outcome["result"] == "not recovered"
    pretraining = pending(journal, 60, "nonfinite", loss_before=4.0)  # a likelihood's rise still fails
    for s in range(61, 81):
        outcomes.follow(metrics(s, loss=4.5), [])
    assert pretraining.outcome["result"] == "not recovered"


def test_a_damaged_kl_reference_is_refused_naming_the_key_and_the_way_on(tmp_path):
    """`rl.kl_coef=0.1`, step_000000/model.safetensors truncated, then a resume: it stopped at the
    first step with only "model.safetensors: size or checksum differs from the manifest", the same
    words as the resume's own checkpoint, with no key named and no way on."""
    cfg = load_config(preset="debug", sets=["model.vocab_size=64", "model.n_layers=1"]).model
    path = save_checkpoint(tmp_path, 0, Transformer(cfg).state_dict(), {}, {}, keep=1)
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ConfigError, match=r"rl\.kl_coef: .*step-0 checkpoint, is damaged .*rl\.kl_coef=0"):
        load_reference(cfg, tmp_path, torch.device("cpu"))


def test_a_truncated_kl_reference_is_refused_before_the_resume_journals(tmp_path):
    """A resume's check of the reference (check_reference, before config.yaml is rewritten and the change journaled)
    looked only for the step-0 directory: a truncated model.safetensors passed it and stopped the run at the first
    step. The manifest's sizes are read there now; the full hash stays with the load."""
    cfg = load_config(preset="debug", sets=["model.vocab_size=64", "model.n_layers=1", "rl.kl_coef=0.1"])
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, enabled=True), out=str(tmp_path))
    path = save_checkpoint(tmp_path, 0, Transformer(cfg.model).state_dict(), {}, {}, keep=1)
    check_reference(cfg)  # whole: passes
    (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ConfigError, match=r"rl\.kl_coef: .*is damaged .*model\.safetensors: 1000 bytes.*rl\.kl_coef=0"):
        check_reference(cfg)


def test_a_kl_reference_with_a_flipped_byte_is_refused_before_the_resume_journals(tmp_path):
    """A byte of step_000000/model.safetensors flipped (its size whole), then `trimtab rl` resumed with rl.kl_coef
    0.1 -> 0.2: the size check passed, config.yaml was rewritten and the change journaled, and the run stopped at the
    first step. The resume loads the reference (resume_reference: every file's sha256) before either."""
    from trimtab.rl.reference import resume_reference

    cfg = load_config(preset="debug", sets=["model.vocab_size=64", "model.n_layers=1", "rl.kl_coef=0.1"])
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, enabled=True), out=str(tmp_path))
    path = save_checkpoint(tmp_path, 0, Transformer(cfg.model).state_dict(), {}, {}, keep=1)
    assert resume_reference(cfg, torch.device("cpu")) is not None  # whole: loaded
    weights = bytearray((path / "model.safetensors").read_bytes())
    weights[-10] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(weights))
    check_reference(cfg)  # the sizes alone cannot see it
    with pytest.raises(ConfigError, match=r"rl\.kl_coef: .*is damaged .*model\.safetensors.*checksum.*rl\.kl_coef=0"):
        resume_reference(cfg, torch.device("cpu"))
