"""A mixture source that is junk whole: builtin 0.7 with 0.3 of random letters (every document flagged,
data/junk.py). The orchestrator cannot leave all its rows out (BatchLoader.skip_rows keeps a row of each
source: skip_data failed) and trained it at its 0.3 share, while the repeat warning said the source was
repeated 2457.6 times over its own 0 training tokens."""

import logging
from types import SimpleNamespace

import pytest

from test_mixture import rows_of
from trimtab.data.batches import BatchLoader
from trimtab.data.packing import ConcatRows
from trimtab.errors import DataError
from trimtab.training.run_length import kept_whole, left_out_tokens, mixed_sources

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_source_flagged_whole_is_said_so_and_counted_as_trained(tokenizer, caplog):
    a, b = rows_of(tokenizer, 30, 0), rows_of(tokenizer, 10, 1)
    rows = ConcatRows([a, b])
    junk = list(range(len(a), len(a) + len(b)))  # every row of b flagged
    with pytest.raises(DataError, match="no training data in b"):  # what the orchestrator's skip_data meets
        BatchLoader(rows, 160, 160, seed=3, pad_id=0, weights=[7, 3], names=["a", "b"]).skip_rows(junk)
    built = SimpleNamespace(train=rows, names=["a", "b"], weights=[0.7, 0.3])
    with caplog.at_level(logging.WARNING, logger="trimtab.training.run_length"):
        left = kept_whole(built, "data", left_out_tokens(rows, frozenset([0, *junk])))
    assert left == [a.length(0), 0]
    assert [t for *_, t in mixed_sources(built, "data", left)] == [a.n_tokens - a.length(0), b.n_tokens]
    said = caplog.text
    assert f"data.mix[1] ('b'): every one of its {len(b)} training rows is flagged as junk" in said
    assert "trained on at its full weight 0.30" in said and "remove it from data.mix" in said
    assert "data.mix[0]" not in said  # a source that keeps rows is left out as before
