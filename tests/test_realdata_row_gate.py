"""The row gate on a user's own corpus (training/row_gate.py): its tokenizer's vocabulary, not the
debug presets' 512, sets what random tokens look like; legitimate rows of many distinct tokens and
a high loss (a minority script, a list the model is learning) are not gated, random tokens are."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trimtab.config import load_config
from trimtab.training.loss import IGNORE_INDEX, cross_entropy_sum
from trimtab.training.row_gate import row_gate

pytestmark = pytest.mark.usefixtures("one_thread")

V, T = 4096, 64  # `trimtab data prepare`'s default vocabulary; debug's rows


def _gate(tmp_path):
    """The run's gate for a model of V tokens, its reference rows at ~2 nats (the bar ~3)."""
    sets = [f"model.vocab_size={V}"] + [f"orchestrator.row_gate.{k}=8" for k in ("min_reference", "min_targets")]
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path)}, sets=sets + ["orchestrator.row_gate.window=32"])
    gate = row_gate(cfg, torch.device("cpu"))
    for _ in range(4):
        targets = torch.randint(0, 4, (8, T))  # few distinct tokens: never candidates
        gate.candidates(targets)
        gate.observe((2.0 + 0.05 * torch.randn(8, 1).expand(8, T)).reshape(-1).clone(), targets)
    return gate


def test_uniform_shares_follow_the_vocabulary():
    """What T random tokens over V reach: about the calibrated 0.8 at 512, near 1 at large V."""
    from trimtab.training.row_gate import uniform_shares  # here: the other test runs on the gate before it

    shares = uniform_shares(512, np.array([64]))[0], uniform_shares(V, np.array([64]))[0]
    assert 0.8 < shares[0] < 0.86 and 0.93 < shares[1] < 0.96
    assert uniform_shares(0, np.array([64])).tolist() == [0.0]  # vocabulary unknown: no bar of its own


def test_a_minority_scripts_row_and_a_list_being_learnt_are_kept_random_tokens_gated(tmp_path):
    """Row 0: text of a script the model has not learnt (52 distinct of 64 tokens, share 0.81,
    from a few hundred; scored ~9 nats, far above the bar): gated by the share 0.8 alone, for the
    whole run, as its kind was never trained. Row 1: a list of distinct tokens the model predicts
    at 5 nats, above the bar but better than random tokens (ln 4096 = 8.3). Row 2: random tokens
    over the vocabulary, scored uniform: gated."""
    torch.manual_seed(0)
    gate = _gate(tmp_path)
    script = torch.randperm(300)[:52] + 1000
    text = torch.randint(0, 4, (T,))  # an ordinary row the model predicts well, scored beside them
    targets = torch.stack([torch.cat([script, script[:12]]), torch.randperm(V)[:T], torch.randint(0, V, (T,)), text])
    hidden = torch.zeros(4, T, V)
    hidden[0, :, 7] = 8.0  # its mass on another token: its own tokens score under uniform
    hidden[1] = torch.nn.functional.one_hot(targets[1], V).float() * 3.3
    hidden[3] = torch.nn.functional.one_hot(text, V).float() * 8.7
    head = torch.eye(V)
    picked = gate.candidates(targets)
    trained = gate.mask(hidden, head, targets, picked)
    losses = torch.zeros(targets.numel())
    cross_entropy_sum(hidden, head, targets, token_losses=losses)
    means = losses.view(4, T).mean(1)
    assert means[0] > 8.5 and 4.5 < means[1] < 5.5 and means[2] == pytest.approx(math.log(V), abs=1e-3)
    assert gate.threshold().item() < 3.5  # all three stand far above the recent rows
    assert torch.equal(trained[:2], targets[:2]) and torch.equal(trained[3], text)  # kept: they train
    assert (trained[2] == IGNORE_INDEX).all()
