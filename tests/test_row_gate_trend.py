"""The row gate's spread is the rows' noise, not a falling loss's trend (training/row_gate.py _reference):
early in a run the reference's rows fall step by step, and a spread taken about their median counted
that fall as noise (debug, bad_rows@10:4, step 10: 0.27 about the median against 0.064 between neighbouring
rows, a bar of 7.03 over garbage at 6.31-6.58: trained on; seed 0, val +2.9% over clean, now -0.4%)."""

from __future__ import annotations

import torch

from test_row_gate import T, V, _predicted, _rows
from trimtab.config.orchestrator import RowGateRule
from trimtab.training.loss import IGNORE_INDEX
from trimtab.training.row_gate import RowGate


def _falling_gate() -> RowGate:
    """A gate whose reference holds 8 steps of 8 rows whose loss fell from 3.8 to 2.0 nats (0.26 a step),
    the rows of a step 0.03 nats apart: a young run's."""
    gate = RowGate(RowGateRule(window=64, min_reference=8, min_targets=8), torch.device("cpu"))
    for step in range(8):
        targets = torch.randint(0, 4, (8, T))  # few distinct tokens: never candidates
        gate.candidates(targets)
        losses = 3.8 - 0.26 * step + 0.03 * torch.randn(8, 1).expand(8, T)
        gate.observe(losses.reshape(-1).clone(), targets)
    return gate


def test_a_random_row_over_a_falling_reference_is_gated_at_the_rows_noise_not_the_trend():
    """Row 0: distinct tokens the model scores as random tokens (ln 64 = 4.16), 2 nats above the step's
    ordinary rows; its spread about the reference's median (~0.55) put the bar at ~5.1, over it (trained
    on); the rows' own noise puts it near 3.0. Row 1, distinct tokens the model predicts well, is kept."""
    torch.manual_seed(0)
    gate = _falling_gate()
    targets = torch.stack([torch.randperm(V)[:T], torch.randperm(V)[:T], *torch.randint(0, 4, (3, T))])
    hidden = torch.zeros(5, T, V)
    hidden[1] = _predicted(targets[1], 20)
    for r in (2, 3, 4):
        hidden[r] = _predicted(targets[r], 2.2)  # ordinary rows at ~2 nats: the step's, learnt
    picked, trained, _ = _rows(hidden, targets, gate)
    assert picked == [0, 1] and gate.controls == [2, 3, 4]
    assert (trained[0] == IGNORE_INDEX).all() and torch.equal(trained[1:], targets[1:])
    assert gate._reference()[1].item() < 0.1  # the rows' noise (0.03), not the fall
