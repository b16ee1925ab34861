"""The row gate's token-frequency tables (training/unigram.py UnigramTables): keyed by their data.mix
source's name, so a later phase's mixture keeps a source's table; a minority source judged from its second
row's worth of tokens; and an emergency snapshot that copies no table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_row_gate_sources import _minority_rows, _step
from test_row_gate_unigram import T, V, _zipf_rows
from trimtab.config.orchestrator import RowGateRule
from trimtab.data.batches import BatchLoader
from trimtab.data.packing import ConcatRows, Rows
from trimtab.training.loss import IGNORE_INDEX
from trimtab.training.row_gate import RowGate
from trimtab.training.unigram import PRIOR_TOKENS

pytestmark = pytest.mark.usefixtures("one_thread")


def _gate() -> RowGate:
    return RowGate(RowGateRule(), torch.device("cpu"), vocab=V)


def test_a_later_phase_keeps_a_source_table_by_name_and_starts_a_new_one_empty():
    """Phase 1 mixes en and ja; phase 2 mixes ja and code (ja now first): ja keeps its counts, code starts
    empty (by position, code took ja's table and ja took en's); an older checkpoint's tables, by position,
    are named from the mixture resumed into."""
    rng = np.random.default_rng(0)
    gate = _gate()
    gate.candidates(
        torch.as_tensor(np.concatenate([_zipf_rows(rng, 4), _minority_rows(rng, 2)])),
        (np.array([0] * 4 + [1] * 2), ["en", "ja"]),
    )
    en, ja = gate.unigram.frequencies.copy()
    gate.candidates(torch.as_tensor(_zipf_rows(rng, 1)), (np.array([1]), ["ja", "code"]))
    assert gate.unigram.sources == ["en", "ja", "code"]
    assert np.array_equal(gate.unigram.frequencies[1], ja) and gate.unigram.frequencies[2].sum() == T
    old = {**gate.state_dict(), "frequencies": [en.tolist(), ja.tolist()]}
    del old["sources"]
    again = _gate()
    again.load_state_dict(old)
    again.candidates(torch.as_tensor(_zipf_rows(rng, 1)), (np.array([0]), ["en", "ja"]))
    assert again.unigram.sources == ["en", "ja"] and np.array_equal(again.unigram.frequencies[1], ja)


def test_a_reordered_mixture_judges_a_source_by_its_own_table():
    """Phase 1 mixes en and ja half and half; phase 2 states them as [ja, en]: a clean ja row of its 64 most
    frequent tokens (distinct: a candidate) is not gated in the warm-up (by position it was judged by en's
    table, which scores ja's tokens as rare: gated)."""
    rng = np.random.default_rng(3)
    gate = _gate()
    for _ in range(10):
        _step(gate, np.concatenate([_zipf_rows(rng, 16), _minority_rows(rng, 16)]), [0] * 16 + [1] * 16)
    text = np.arange(V // 2, V // 2 + T)[None]
    targets = torch.as_tensor(np.concatenate([_minority_rows(rng, 15), text, _zipf_rows(rng, 16)]))
    picked = gate.candidates(targets, (np.array([0] * 16 + [1] * 16), ["ja", "en"]))
    trained = gate.mask(torch.zeros(*targets.shape, V), torch.eye(V), targets, picked)
    assert 15 in picked and not (trained == IGNORE_INDEX).any()


def test_a_minority_source_is_judged_once_its_table_holds_two_rows():
    """In the warm-up (the model-free test alone), a 5% source's third row on: random rows of it gated,
    its clean rows not (its table had to hold a token per vocabulary entry, 8 rows: bad_batch@2 trained
    2 of 32 garbage rows)."""
    rng = np.random.default_rng(1)
    gate = _gate()
    _step(gate, np.concatenate([_zipf_rows(rng, 30), _minority_rows(rng, 2)]), [0] * 30 + [1] * 2)
    clean, noise = _minority_rows(rng, 24), rng.choice(V, (2, T), replace=False)
    gated = _step(gate, np.concatenate([clean, noise]), [1] * 26)
    assert gated.tolist() == [False] * 24 + [True] * 2


def _source(stream: np.ndarray) -> Rows:
    """A token stream cut into rows of T targets."""
    n = (len(stream) - 1) // T
    return Rows(stream, np.ones(len(stream), dtype=bool), np.arange(n) * T, np.full(n, T))


def test_a_minority_source_first_rows_are_judged_under_a_prior_of_its_own_rows():
    """In the warm-up, a 5% source's very first micro-batch: its table starts from a sample of its own rows
    (PRIOR_TOKENS), so two random rows of it are gated and a row of its 64 most frequent tokens (as distinct
    as they: a candidate) is not; an empty table gave no verdict (both random rows trained on)."""
    rng = np.random.default_rng(4)
    en, ja = _zipf_rows(rng, 120).reshape(-1), _minority_rows(rng, 90).reshape(-1)
    loader = BatchLoader(
        ConcatRows([_source(en), _source(ja)]), 2048, 2048, 0, 0, weights=[0.95, 0.05], names=["en", "ja"]
    )
    gate = _gate()
    text, noise = np.arange(V // 2, V // 2 + T)[None], np.stack([rng.choice(V, T, replace=False) for _ in range(2)])
    targets = torch.as_tensor(np.concatenate([_minority_rows(rng, 5), text, noise]))
    picked = gate.candidates(targets, (np.ones(8, dtype=np.int64), ["en", "ja"]), loader)
    trained = gate.mask(torch.zeros(*targets.shape, V), torch.eye(V), targets, picked)
    assert (trained == IGNORE_INDEX).all(1).tolist() == [False] * 6 + [True] * 2
    prior = gate.unigram.frequencies[1] - np.bincount(targets[:6].reshape(-1), minlength=V)  # less the 6 counted
    assert PRIOR_TOKENS - T <= prior.sum() <= PRIOR_TOKENS and prior[: V // 2].sum() == 0  # its own rows' alone


def test_a_snapshot_copies_no_table_and_restore_takes_the_step_back():
    """snapshot() (every step, training/emergency.py) holds no copy of the S x V tables; restore() takes
    back the counts made since, new sources' included."""
    rng = np.random.default_rng(2)
    gate = _gate()
    _step(gate, _zipf_rows(rng, 8), [0] * 8)
    before, judged = gate.unigram.frequencies.copy(), gate.judged
    snapshot = gate.snapshot()
    assert not any(isinstance(part, np.ndarray) for part in snapshot)
    gate.candidates(torch.as_tensor(_zipf_rows(rng, 4)), (np.array([0, 1, 2, 0]), ["en", "ja", "code"]))
    gate.restore(snapshot)
    assert np.array_equal(gate.unigram.frequencies[:2], before) and gate.unigram.frequencies[2].sum() == 0
    assert gate.judged == judged
