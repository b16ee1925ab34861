"""Where a clean row stands against the row gate's bars (training/row_gate.py gated), with the spread taken
between neighbouring rows. Measured (2026-12-02, 100 steps, no faults; debug, debug-moe, debug-hybrid seeds
0-3, and debug on real English text, /usr/share/common-licenses at a 1,024-token BPE): the loss's bar alone
no longer keeps clean rows 0.75 nats off. At the reference's first steps (5-7) every row scores near ln V
and the spread is the rows' noise, ~0.04 nats: the bar stands ~0.16 over the median, and clean rows of
mostly distinct tokens came within 0.21 nats of it (real text; the presets 0.24-0.65), 1.5 nats or more
from step 25 on (real text 0.36). What keeps them is their score against random tokens: z -4.1 for that
real-text row, -5.2 or less on the presets, where random tokens score z > -3.09."""

import torch

from test_row_gate import T
from trimtab.config.orchestrator import RowGateRule
from trimtab.training.row_gate import RowGate


def _young_gate() -> RowGate:
    """The reference as the gate first judges (debug on real text, step 5): rows at ~6.8 nats, 0.045 apart."""
    gate = RowGate(RowGateRule(window=128, min_reference=32, min_targets=8), torch.device("cpu"), vocab=1024)
    torch.manual_seed(0)
    for _ in range(8):
        targets = torch.randint(0, 4, (8, T))  # few distinct tokens: never candidates
        gate.candidates(targets)
        gate.observe((6.8 + 0.045 * torch.randn(8, 1).expand(8, T)).reshape(-1).clone(), targets)
    return gate


def test_a_young_runs_clean_row_over_the_loss_bar_is_kept_by_its_score_against_random_tokens():
    """Row 0: the measured real-text row (z -4.1) put 0.3 nats over the median, past the bar;
    row 1: random tokens at the same loss (z ~0): gated. Ordinary rows at the median, learnt (z -9.4)."""
    gate = _young_gate()
    middle, spread = (x.item() for x in gate._reference())
    assert 4 * spread < 0.3  # the rows' noise: the bar stands under 0.3 nats over the median
    means = torch.tensor([middle + 0.3, middle + 0.3])
    ordinary = middle + 0.045 * torch.linspace(-1, 1, 8)
    gated = gate.gated(means, torch.tensor([-4.1, -0.3]), ordinary, torch.full((8,), -9.4))
    assert gated.tolist() == [False, True]
