"""A full cache disk ($TRIMTAB_CACHE: the tokenizer and the corpus's tokens) at start-up: a cache
only saves time, so the run goes on without the entry, said, and no half-written copy stays to
hold the space (it ended the run with "the disk is full", naming no path, and left the copy)."""

import errno
import logging

import numpy as np
import pytest

from trimtab.config import DataConfig
from trimtab.data import packing, tokenizer
from trimtab.data.packing import tokenize_documents
from trimtab.data.sources import Document
from trimtab.data.tokenizer import get_tokenizer

DOCS = [Document([(f"document {i}: the quick brown fox jumps over the lazy dog", True)]) for i in range(20)]


def full_disk(path, *args, **kwargs):
    with open(path, "wb") as fh:  # part of it written, then the disk is full
        fh.write(b"\0" * 1000)
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_cache_disk_neither_stops_the_run_nor_keeps_a_partial_copy(tmp_path, monkeypatch, caplog):
    cfg = DataConfig(bpe_vocab_size=300)
    monkeypatch.setattr(tokenizer.Tokenizer, "save", lambda self, path, *a: full_disk(path))
    monkeypatch.setattr(packing.np, "savez", full_disk)
    with caplog.at_level(logging.WARNING):
        tok = get_tokenizer(cfg, DOCS, tmp_path)
        tokens = tokenize_documents(DOCS, tok, cfg, tmp_path)
    assert tok.vocab_size == 300
    assert np.array_equal(tokens.tokens, tokenize_documents(DOCS, tok, cfg).tokens)  # as tokenized uncached
    assert list(tmp_path.iterdir()) == []  # neither entry, nor a partial copy of either
    said = [r.getMessage() for r in caplog.records]
    assert sum("not cached" in line and "TRIMTAB_CACHE" in line for line in said) == 2, said


def test_a_full_run_directory_while_its_tokenizer_is_written_is_said_with_the_file(tmp_path):
    """The run directory filling as its tokenizer was written: tokenizers' bare Exception ("... (os
    error 28)") reached the CLI as "the disk is full" naming no file. It is the OSError it names now,
    with the file, and no temp file is left beside it."""
    from types import SimpleNamespace

    from trimtab.config import load_config
    from trimtab.training.setup import prepare_run_dir

    def full(path):
        raise Exception("No space left on device (os error 28)")

    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "run")})
    with pytest.raises(OSError) as exc:
        prepare_run_dir(cfg, SimpleNamespace(save=full))
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == str(tmp_path / "run" / "tokenizer.json")
    assert not list((tmp_path / "run").glob("tokenizer.json*"))
