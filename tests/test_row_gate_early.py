"""Random rows at a young run's first judged steps (training/row_gate.py mask): the step's ordinary rows
already score as learnt text (z -11 at step 5 on debug) while random tokens, at ln V, still stand under the
loss's bar (the rows' median + 4 x ~0.045). Read as "the loss decides", the model-free test stood down and
the loss could not tell: debug, bad_rows@5:4, the garbage scored 6.2-6.3 against a bar of 6.34-6.40
(ln 512 = 6.24), none of its 40 rows gated, val 4.959 against 4.710 clean. The frequencies decide until
random tokens clear the loss's bar."""

from __future__ import annotations

import math

import numpy as np
import torch

from test_row_gate_unigram import T, V, _zipf_rows
from trimtab.config.orchestrator import RowGateRule
from trimtab.training.loss import IGNORE_INDEX
from trimtab.training.row_gate import RowGate

LEVEL = 6.1  # nats: the young run's rows, under ln 512 = 6.24 by less than the bar's width


def _learnt(targets: torch.Tensor, loss: float) -> torch.Tensor:
    """Hidden states (= logits, the head the identity) that score each target at `loss` nats and far better
    than random tokens (z << -3): s on the target, 0 elsewhere, log(e^s + V - 1) - s = loss."""
    s = math.log((V - 1) / math.expm1(loss))
    return torch.nn.functional.one_hot(targets, V).float() * s


def test_random_rows_under_the_loss_bar_of_a_young_run_are_gated_by_token_frequencies():
    rng, noise = np.random.default_rng(0), torch.Generator().manual_seed(0)
    gate = RowGate(RowGateRule(), torch.device("cpu"), vocab=V)
    for _ in range(5):  # the first steps' rows, trained on: the reference (160 rows) and the frequencies
        targets = torch.as_tensor(_zipf_rows(rng, 32))
        gate.candidates(targets)
        losses = LEVEL + 0.045 * torch.randn(32, 1, generator=noise).expand(32, T)
        gate.observe(losses.reshape(-1).clone(), targets)
    text = torch.as_tensor(_zipf_rows(rng, 6))
    garbage = torch.as_tensor(np.stack([rng.choice(V, T, replace=False) for _ in range(3)]))
    targets = torch.cat([text, garbage])
    hidden = torch.cat([_learnt(text, LEVEL), torch.zeros(3, T, V)])  # random tokens score ln V
    picked = gate.candidates(targets)
    assert picked == [6, 7, 8] and gate.uniform == [6, 7, 8]
    assert gate._step_bar(torch.full((6,), LEVEL)).item() > math.log(V)  # the loss cannot tell them
    trained = gate.mask(hidden, torch.eye(V), targets, picked)
    assert (trained == IGNORE_INDEX).all(1).tolist() == [False] * 6 + [True] * 3
