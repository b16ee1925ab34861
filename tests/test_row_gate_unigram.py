"""The row gate's model-free test (training/unigram.py unigram_z): random tokens in the LR warm-up,
where the model scores text and random tokens alike at ~ln(vocab), are told from text by the unigram
frequencies of the rows trained on before them, and left out of the step that meets them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import trimtab
from test_trainer import debug_cfg
from trimtab.config.orchestrator import RowGateRule
from trimtab.rundir import DECISIONS_FILE
from trimtab.training.loss import IGNORE_INDEX
from trimtab.training.row_gate import RowGate

pytestmark = pytest.mark.usefixtures("one_thread")

V, T = 512, 64  # the debug presets' vocabulary and row length


def _zipf_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """n rows of T tokens drawn from a Zipf distribution over the vocabulary (text's shape)."""
    p = 1 / np.arange(1, V + 1)
    return rng.choice(V, size=(n, T), p=p / p.sum())


def _step(gate: RowGate, targets: np.ndarray) -> torch.Tensor:
    """One micro-batch through the gate as the trainer runs it, the model in its warm-up: hidden
    states of zeros (the head the identity) predict every token alike, so every row scores ln V
    whatever it holds. Returns the targets trained on."""
    targets = torch.as_tensor(targets)
    picked = gate.candidates(targets)
    trained = gate.mask(torch.zeros(*targets.shape, V), torch.eye(V), targets, picked)
    gate.after(torch.full((targets.numel(),), float(np.log(V))), targets, trained)
    return trained


def test_random_rows_in_the_warm_up_are_gated_by_token_frequencies_where_the_loss_cannot_tell():
    """After one step of Zipfian rows (the loss's reference not ready: 32 rows of its 128), a
    micro-batch of 6 Zipfian rows, a row of 64 distinct frequent tokens (a list: as distinct as
    random tokens) and 3 rows of distinct tokens drawn uniformly: only the 3 are gated, at the loss
    every row scores alike. They stay out of the frequencies; the others go in."""
    rng = np.random.default_rng(0)
    gate = RowGate(RowGateRule(), torch.device("cpu"), vocab=V)
    assert not (_step(gate, _zipf_rows(rng, 32)) == IGNORE_INDEX).any()  # no frequencies yet: nothing gated
    listed = rng.permutation(T)[None]  # the 64 most frequent tokens, each once
    uniform = np.stack([rng.choice(V, T, replace=False) for _ in range(3)])
    trained = _step(gate, np.concatenate([_zipf_rows(rng, 6), listed, uniform]))
    assert (trained == IGNORE_INDEX).all(1).tolist() == [False] * 7 + [True] * 3
    assert gate.unigram.frequencies.sum() == (32 + 7) * T


def test_the_frequencies_go_into_the_checkpoint_and_an_emergency_snapshot():
    """Stateful, so saved: a gate loaded from the state (through JSON, as state.json holds it) gates
    what the saved one gates; restore() takes it back to a snapshot (training/emergency.py)."""
    rng = np.random.default_rng(1)
    gate = RowGate(RowGateRule(), torch.device("cpu"), vocab=V)
    _step(gate, _zipf_rows(rng, 32))
    snapshot = gate.snapshot()
    again = RowGate(RowGateRule(), torch.device("cpu"), vocab=V)
    again.load_state_dict(json.loads(json.dumps(gate.state_dict())), gate.tables())
    assert (
        np.array_equal(again.unigram.frequencies, gate.unigram.frequencies)
        and again.unigram.frequencies.sum() == 32 * T
    )
    batch = np.concatenate([_zipf_rows(rng, 4), rng.choice(V, (1, T), replace=False)])
    assert torch.equal(_step(gate, batch), _step(again, batch))
    gate.restore(snapshot)
    assert gate.unigram.frequencies.sum() == 32 * T and gate.judged == snapshot[2]


@pytest.mark.slow  # a whole run (tokenizer, setup, 2 steps, save): 23 s measured on the shared 2-core host
def test_a_garbage_batch_at_step_2_is_left_out_and_journaled(tmp_path):
    """debug, bad_batch@2: its rows are random tokens at step 2, where the model scores text as
    random tokens too (a loss ~6.2 on both); the gate leaves every row out of the update before its
    backward (one row_gate decision, skip_data), where before it was trained on."""
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=2, faults=["bad_batch@2"], data={"max_bytes": 60_000}))
    poisoned = json.loads((run / "faults.json").read_text())["poisoned"]
    decisions = [json.loads(line) for line in (run / DECISIONS_FILE).read_text().splitlines()]
    gated = [d for d in decisions if d["rule"] == "row_gate"]
    assert [(d["step"], d["action"]) for d in gated] == [(2, "skip_data")], decisions
    assert sorted(gated[0]["params"]["rows"]) == sorted(poisoned) and gated[0]["evidence"]["gated"]
