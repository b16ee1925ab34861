"""The junk screen's verdicts are cached by the documents' text (data/junk_cache.py): every run on the same corpus
judged it again at start-up before."""

import os
import random
from pathlib import Path

import numpy as np
import pytest

from test_junk_small import bad_documents
from trimtab.config import DataConfig
from trimtab.data import junk, junk_cache
from trimtab.data.dataset import build_phase_data, open_sources
from trimtab.data.sources import read_documents
from trimtab.data.tokenizer import train_tokenizer

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _screened(source: Path, cache: Path, tok=None):
    cfg = DataConfig(source=str(source), max_bytes=0, seq_len=64, eval_fraction=0.0, garbage_filter="warn")
    tok = tok or train_tokenizer(read_documents(cfg)[0], 300)
    return build_phase_data(cfg, open_sources(cfg, "data", None), tok, seed=0, cache_dir=cache).train.docs, tok


def _never_judged(*args, **kwargs):
    raise AssertionError("junk.kinds ran: the cached verdicts were not read")


def test_a_second_screen_of_the_same_text_reads_its_verdicts_and_an_edit_is_judged_again(tmp_path, monkeypatch):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    for page in sorted(DOCS.glob("*.md"))[:3]:  # real text: 4 KB of each, enough for it to pass
        (corpus / page.name).write_text(page.read_text()[:4000])
    for name, text in bad_documents(random.Random(0)).items():
        (corpus / f"{name}.txt").write_text(text)
    fresh, tok = _screened(corpus, cache)
    assert {"hex or base64 dump", "random characters"} <= {why.split(":")[0] for why in fresh.why if why}
    assert any("bytes " in why for why in fresh.why)  # a dump's span survives the cache too
    monkeypatch.setattr(junk, "kinds", _never_judged)
    cached = _screened(corpus, cache, tok)[0]
    assert cached.why.tolist() == fresh.why.tolist()
    np.testing.assert_array_equal(cached.garbage, fresh.garbage)
    hex_text = (corpus / "hex.txt").read_text()
    (corpus / "hex.txt").write_text(hex_text + "ff")  # other text: not the cached verdicts
    with pytest.raises(AssertionError, match="junk.kinds ran"):
        _screened(corpus, cache, tok)
    monkeypatch.undo()
    (corpus / "hex.txt").write_text(hex_text)
    for entry in cache.glob("junk-*.npy"):  # a damaged entry: judged again, not a failed run
        entry.write_bytes(b"not an array")
    assert _screened(corpus, cache, tok)[0].why.tolist() == fresh.why.tolist()


def test_the_cache_keeps_the_entries_used_last_and_removes_the_rest(tmp_path, monkeypatch):
    """Every corpus slice and every edit of a rule wrote an entry of its own, and none was ever removed: the cache
    keeps the KEPT used last (a hit counts as a use), and leaves another run's entry being written alone."""
    monkeypatch.setattr(junk_cache, "KEPT", 2)
    corpora = [[f"document {i} " * 40] for i in range(3)]
    junk_cache.kinds(corpora[0], tmp_path)
    junk_cache.kinds(corpora[1], tmp_path)
    first, second = (tmp_path / f"junk-{junk_cache._key(c)}.npy" for c in corpora[:2])
    os.utime(first, (1, 1))  # written long ago, then read again now
    os.utime(second, (2, 2))
    writing = tmp_path / "junk-0123.tmp99.npy"
    writing.write_bytes(b"")
    judge = junk.kinds
    monkeypatch.setattr(junk, "kinds", _never_judged)
    junk_cache.kinds(corpora[0], tmp_path)
    monkeypatch.setattr(junk, "kinds", judge)
    junk_cache.kinds(corpora[2], tmp_path)
    third = tmp_path / f"junk-{junk_cache._key(corpora[2])}.npy"
    assert sorted(tmp_path.iterdir()) == sorted([first, third, writing])
