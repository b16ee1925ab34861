"""A mixture source that is junk whole: builtin 0.7 with 0.3 of random letters (every document flagged,
data/junk.py). The orchestrator cannot leave all its rows out (BatchLoader.skip_rows keeps a row of each
source: skip_data failed) and trained it at its 0.3 share, while the repeat warning said the source was
repeated 2457.6 times over its own 0 training tokens."""

import json
import logging
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from test_mixture import rows_of
from test_quality import clean_documents
from trimtab.config import DataConfig
from trimtab.config.data import MixSource
from trimtab.data.batches import BatchLoader
from trimtab.data.dataset import build_phase_data, open_sources
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
    built = SimpleNamespace(train=rows, names=["a", "b"], weights=[0.7, 0.3], indices=[0, 1])
    with caplog.at_level(logging.WARNING, logger="trimtab.training.run_length"):
        left = kept_whole(built, "data", left_out_tokens(rows, frozenset([0, *junk])))
    assert left == [a.length(0), 0]
    assert [t for *_, t in mixed_sources(built, "data", left)] == [a.n_tokens - a.length(0), b.n_tokens]
    said = caplog.text
    assert f"data.mix[1] ('b'): every one of its {len(b)} training rows is flagged as junk" in said
    assert "trained on at its full weight 0.30" in said and "remove it from data.mix" in said
    assert "data.mix[0]" not in said  # a source that keeps rows is left out as before


def mixture(tmp_path, junk_sources: int, garbage_filter: str = "warn") -> DataConfig:
    """Real text (trimtab's source) at 0.7 beside `junk_sources` sources of random characters at 0.3
    (900 characters of 0-9 and punctuation a document); with 2, the real one is left out."""
    rng = random.Random(0)
    real = tmp_path / "real.jsonl"
    real.write_text("".join(json.dumps({"text": text}) + "\n" for text in clean_documents()[:40]))
    paths = []
    for k in range(junk_sources):
        paths.append(tmp_path / f"noise{k}.jsonl")
        noise = ("".join(rng.choice("0123456789(),.;:+-") for _ in range(900)) for _ in range(6))
        paths[-1].write_text("".join(json.dumps({"text": text}) + "\n" for text in noise))
    mix = [{"source": str(real), "weight": 0.7}] if junk_sources < 2 else []
    mix += [{"source": str(path), "weight": 0.3} for path in paths]
    return DataConfig(mix=[MixSource(**m) for m in mix], seq_len=64, max_bytes=0, garbage_filter=garbage_filter)


def phase(cfg: DataConfig, tokenizer):
    return build_phase_data(cfg, open_sources(cfg, "data", None), tokenizer, seed=0, cache_dir=None)


@pytest.mark.parametrize("garbage_filter", ["warn", "drop"])
def test_a_source_of_junk_alone_is_left_out_of_the_mixture_its_weight_spread(
    tmp_path, caplog, garbage_filter, tokenizer
):
    """Before, it was kept (warn: trained at its 0.3 share, skip_data failing at step 0) or refused as too
    small for one row (drop: 'add data or lower data.seq_len')."""
    cfg = mixture(tmp_path, 1, garbage_filter)
    with caplog.at_level(logging.WARNING, logger="trimtab.data.dataset"):
        built = phase(cfg, tokenizer)
    assert (built.names, built.weights, len(built.evals)) == (["real"], [1.0], 1)
    assert not isinstance(built.train, ConcatRows) and not built.train.flagged_rows()
    said = caplog.text
    assert (
        f"data.mix[1] ('noise0', {tmp_path / 'noise0.jsonl'}): every one of its 6 documents is flagged as junk" in said
    )
    assert "its weight 0.30 spread over the others (each x1.43)" in said and "data.garbage_filter=off" in said


def test_a_mixture_of_junk_only_is_refused_naming_each_source(tmp_path, tokenizer):
    with pytest.raises(
        DataError, match=r"data.mix\[0\].source '.*noise0.jsonl': every one of its 6 documents is flagged as junk"
    ) as e:
        phase(mixture(tmp_path, 2), tokenizer)
    assert "data.mix[1].source" in str(e.value) and "set data.garbage_filter=off" in str(e.value)
    assert len(phase(replace(mixture(tmp_path, 2), garbage_filter="off"), tokenizer).weights) == 2  # off: as asked


def test_a_run_that_trained_a_source_now_left_out_as_junk_is_told_how_to_resume(tokenizer):
    a, b = rows_of(tokenizer, 30, 0), rows_of(tokenizer, 10, 1)
    then = BatchLoader(ConcatRows([a, b]), 160, 160, seed=3, pad_id=0, weights=[7, 3], names=["a", "b"])
    now = BatchLoader(a, 160, 160, seed=3, pad_id=0, weights=[1], names=["a"])
    with pytest.raises(
        DataError, match=r"\(a, b then, a now\); resume with the same data.mix \(data.garbage_filter=off"
    ):
        now.load_state_dict(then.state_dict())
