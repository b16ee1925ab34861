"""The row gate judges a row against its own data.mix source's token frequencies (training/unigram.py
UnigramTables, a table per source): English's score a 5% Japanese source's rows as uniform draws
(debug, 80 steps: a clean Japanese row gated at step 2), and the loss's test alone gated 28-33 clean
Japanese rows at 16,384-token steps; a row its own source's frequencies call text is gated by neither."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from test_row_gate_minority import _one_hot
from test_row_gate_unigram import T, V, _zipf_rows
from trimtab.config.orchestrator import RowGateRule
from trimtab.training.loss import IGNORE_INDEX
from trimtab.training.row_gate import RowGate

pytestmark = pytest.mark.usefixtures("one_thread")


def _minority_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """n rows of another script's text: Zipfian over the rarest half of the vocabulary (English's never)."""
    p = 1 / np.arange(1, V // 2 + 1)
    return V // 2 + rng.choice(V // 2, size=(n, T), p=p / p.sum())


def _step(gate: RowGate, targets: np.ndarray, parts: list[int], hidden: torch.Tensor | None = None) -> np.ndarray:
    """One micro-batch through the gate as the trainer runs it (hidden states of zeros by default: the
    warm-up, every row at ln V); its rows' losses into the reference at 1 nat. Which rows were gated."""
    targets = torch.as_tensor(targets)
    picked = gate.candidates(targets, (np.array(parts), ["en", "ja"]))
    hidden = torch.zeros(*targets.shape, V) if hidden is None else hidden
    trained = gate.mask(hidden, torch.eye(V), targets, picked)
    gate.after(torch.full((targets.numel(),), 1.0), targets, trained)
    return (trained == IGNORE_INDEX).all(1).numpy()


def test_a_minority_source_is_judged_by_its_own_frequencies_in_the_warm_up():
    """In the warm-up (the model-free test alone), a minority source's first row, distinct tokens of its
    own script, is not gated (the majority's frequencies alone gated it); once its own table holds a token
    per vocabulary entry its text passes and a random row of it is gated; and a checkpoint of the tables
    (through JSON, as state.json holds them) gates what the gate gates."""
    rng = np.random.default_rng(0)
    gate = RowGate(RowGateRule(), torch.device("cpu"), vocab=V)
    _step(gate, _zipf_rows(rng, 32), [0] * 32)
    first = rng.choice(np.arange(V // 2, V), T, replace=False)[None]  # the minority's first row, all distinct
    assert _step(gate, np.concatenate([_zipf_rows(rng, 6), first]), [0] * 6 + [1]).tolist() == [False] * 7
    _step(gate, _minority_rows(rng, 8), [1] * 8)
    text = np.arange(V // 2, V // 2 + T)[None]  # the minority's 64 most frequent tokens, each once: its text
    noise = rng.choice(V, (1, T), replace=False)
    batch, parts = np.concatenate([_zipf_rows(rng, 4), text, noise]), [0] * 4 + [1, 1]
    again = RowGate(RowGateRule(), torch.device("cpu"), vocab=V)
    again.load_state_dict(json.loads(json.dumps(gate.state_dict())), gate.tables())
    assert gate.unigram.frequencies.shape == (2, V) and np.array_equal(
        again.unigram.frequencies, gate.unigram.frequencies
    )
    assert _step(gate, batch, parts).tolist() == _step(again, batch, parts).tolist() == [False] * 5 + [True]


def test_the_loss_test_leaves_a_row_its_source_frequencies_call_text():
    """The reference ready (rows at 1 nat) and the model learnt the step's text (its ordinary rows
    predicted well): a row of 64 distinct frequent tokens and a random row both score ln V, far above
    the bar. The random row is gated; the text row, which its source's frequencies call text, is not
    (the loss's test alone gated both)."""
    rng = np.random.default_rng(1)
    gate = RowGate(RowGateRule(), torch.device("cpu"), vocab=V)
    for _ in range(5):  # 160 rows: the reference ready (min_reference 128)
        _step(gate, _zipf_rows(rng, 32), [0] * 32)
    text, noise = rng.permutation(T)[None], rng.choice(V, (1, T), replace=False)
    targets = torch.as_tensor(np.concatenate([_zipf_rows(rng, 6), text, noise]))
    hidden = _one_hot(targets) * 10.0  # learnt rows: their logits peak at their targets
    hidden[6:] = 0.0  # the two candidates: every token alike (loss ln V, as random tokens score)
    assert _step(gate, targets.numpy(), [0] * 8, hidden).tolist() == [False] * 7 + [True]
