"""A resume whose tokenizer was swapped for another of the same size (as many rows, other tokens)
is refused naming the tokenizer, not the corpus (data/batches.py BatchLoader._changed)."""

from __future__ import annotations

import json

import pytest

from test_data import synthetic_rows
from trimtab.data import BatchLoader
from trimtab.errors import DataError

WHERE = "the run directory's tokenizer.json"


def _state(fingerprint: str) -> dict:
    loader = BatchLoader(synthetic_rows(), 60, 30, 9, 0, tokenizer=(fingerprint, WHERE))
    loader.next_batch()
    return json.loads(json.dumps(loader.state_dict()))


def test_a_resume_over_rows_of_another_tokenizer_names_the_tokenizer():
    state = _state("a" * 64)
    for rows in (synthetic_rows(seed=1), synthetic_rows(5)):  # other tokens; other row counts
        with pytest.raises(DataError, match=rf"the tokenizer changed: {WHERE} is not the one .* aaaaaaaaaaaa then"):
            BatchLoader(rows, 60, 30, 9, 0, tokenizer=("b" * 64, WHERE)).load_state_dict(state)


def test_the_same_tokenizer_over_other_rows_still_blames_the_corpus():
    state = _state("a" * 64)
    with pytest.raises(DataError, match=r"other tokens; the corpus or a data\.\* setting changed") as caught:
        BatchLoader(synthetic_rows(seed=1), 60, 30, 9, 0, tokenizer=("a" * 64, WHERE)).load_state_dict(state)
    assert "tokenizer" not in str(caught.value)
    older = {k: v for k, v in state.items() if k != "tokenizer"}  # a checkpoint from before the fingerprint
    with pytest.raises(DataError, match="the corpus or a data"):
        BatchLoader(synthetic_rows(seed=1), 60, 30, 9, 0, tokenizer=("b" * 64, WHERE)).load_state_dict(older)
