"""The row gate's model-free test stands down once the model has learnt the step's text: token
frequencies built from one kind of text score a minority kind (a 5% Japanese source beside English,
debug, 80 steps: 7 clean rows gated) as uniform draws, where the loss tells them from random tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_row_gate_unigram import T, V, _zipf_rows
from trimtab.config.orchestrator import RowGateRule
from trimtab.training.loss import IGNORE_INDEX
from trimtab.training.row_gate import RowGate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_minority_kind_of_text_is_not_gated_model_free_once_the_model_has_learnt_the_rest():
    """After a step of Zipfian rows (the frequencies), a micro-batch of 6 such rows the model predicts
    well (hidden states pointing at their targets: learnt text, z far under random) and a row of 64
    distinct tokens from the rarest half of the vocabulary (another script's, unseen by the frequencies:
    it scores as uniform draws under them) that the model scores at ln V: it is not gated (it was before:
    the frequencies alone gated it)."""
    rng = np.random.default_rng(0)
    gate = RowGate(RowGateRule(), torch.device("cpu"), vocab=V)
    first = torch.as_tensor(_zipf_rows(rng, 32))
    assert gate.candidates(first) == []  # its tokens into the frequencies; nothing to judge them by yet
    gate.after(torch.full((first.numel(),), float(np.log(V))), first, first)
    minority = rng.choice(np.arange(V // 2, V), T, replace=False)[None]
    targets = torch.as_tensor(np.concatenate([_zipf_rows(rng, 6), minority]))
    picked = gate.candidates(targets)
    assert picked == [6] and gate.uniform == [6]  # a candidate, and uniform under the frequencies
    hidden = _one_hot(targets) * 10.0  # the learnt rows' logits peak at their targets
    hidden[6] = 0.0  # the minority row: every token alike (loss ln V, as random tokens score)
    trained = gate.mask(hidden, torch.eye(V), targets, picked)
    assert not (trained == IGNORE_INDEX).any()


def _one_hot(targets: torch.Tensor) -> torch.Tensor:
    """[B, T] token ids as [B, T, V] one-hot float hidden states (with the identity head: logits)."""
    return torch.nn.functional.one_hot(targets, V).float()
