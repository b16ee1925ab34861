"""A first-time user's own data, fed to `trimtab data prepare` and `trimtab train` as docs/data.md
says (a folder of notes, JSONL of text and chats, CSV, Parquet, gzip, other encodings, a 50 MB line,
links): the defects that soak found, each reproduced small."""

from __future__ import annotations

import logging
import os

import pytest

from trimtab.config import DataConfig
from trimtab.data import formats, packing
from trimtab.data import tokenizer as tokenizer_module
from trimtab.data.listing import source_files
from trimtab.data.prepare import prepare
from trimtab.data.sources import Document

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = ["def", "return", "x", "  ", "\t", "42", "f1(x):", "value", "\n", "    "]


class _Spy:
    """A tokenizers.Tokenizer that records the characters of each encode_batch call."""

    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, []

    def encode_batch(self, texts, **kwargs):
        self.calls.append(sum(map(len, texts)))
        return self.tok.encode_batch(texts, **kwargs)


def test_a_one_line_file_read_by_a_run_is_encoded_in_bounded_calls(tokenizer, monkeypatch):
    """A 50 MB file without a newline, trained on as it is (data.max_bytes=0), was one encode call:
    7.7 GB of memory (tokenizers holds ~130 bytes a character), 2.5 GB now, its ids the same."""
    monkeypatch.setattr(formats, "TEXT_CHUNK_CHARS", 64)
    monkeypatch.setattr(tokenizer_module, "ENCODE_CALL_CHARS", 256, raising=False)
    text = " ".join(WORDS * 300)  # ~6,000 characters, one line
    whole = tokenizer.encode_text(text)
    spy = _Spy(tokenizer._plain())
    monkeypatch.setattr(type(tokenizer), "_plain", lambda self: spy)
    docs = packing.tokenize_documents([Document([(text, True)])], tokenizer, DataConfig())
    assert docs.tokens[:-1].tolist() == whole and docs.tokens[-1] == tokenizer.eos_id
    assert max(spy.calls) <= 256 and sum(spy.calls) == len(text)  # before: one call of 5,999


def test_a_repeated_one_line_file_is_counted_as_one_document(tmp_path, tokenizer, monkeypatch, caplog):
    """A 50 MB line of repeated text, read in 50 pieces of 10 stretches each, was said "500 documents are
    repeated text" where the manifest (and a run on the file: "1 of 1") holds one document."""
    monkeypatch.setattr(formats, "TEXT_CHUNK_CHARS", 30_000)  # 1M in use: 10 pieces here, each judged alone
    line = "the quick brown fox jumps over the lazy dog near the river bank today "
    (tmp_path / "loop.txt").write_text(line * 4_500)  # ~300K characters, no newline
    tokenizer.save(tmp_path / "tok.json")
    with caplog.at_level(logging.WARNING):
        manifest = prepare([str(tmp_path / "loop.txt")], tmp_path / "p", str(tmp_path / "tok.json"), workers=1)
    said = [r.getMessage() for r in caplog.records if " repeated text (" in r.getMessage()]
    assert manifest["documents"] == 1
    assert len(said) == 1 and said[0].startswith("the sources: 1 document is repeated text"), said


def test_a_directory_read_through_a_link_is_not_called_a_link(tmp_path, caplog):
    """`link -> real` beside `real/`: the walk reads real's files through the link (it sorts first) and
    said of the directory `real` "(a link to .../real, read already)": it is no link."""
    (tmp_path / "src" / "real").mkdir(parents=True)
    (tmp_path / "src" / "real" / "a.txt").write_text("text")
    os.symlink("real", tmp_path / "src" / "link")
    with caplog.at_level(logging.WARNING):
        files = source_files(str(tmp_path / "src"), "data.source")
    assert [p.relative_to(tmp_path / "src").as_posix() for p, _ in files] == ["link/a.txt"]  # as before
    said, src = " ".join(r.getMessage() for r in caplog.records), tmp_path / "src"
    assert f"{src / 'real'} (the directory read already through the link {src / 'link'})" in said
    assert "a link to" not in said
