"""A prepared directory that lost its trimtab-data.json (deleted, or the shards copied without
it): read as raw text it trained a BPE on its tokenizer.json and skipped the shards as binary,
with only a warning about unreadable files; now refused, with the way to rebuild it."""

import logging

import pytest

from trimtab.config import DataConfig
from trimtab.data.listing import PREPARED_MANIFEST
from trimtab.data.prepare import prepare
from trimtab.data.sources import read_documents
from trimtab.errors import DataError


@pytest.fixture
def manifest_lost(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta gamma delta\n" * 200)
    out = tmp_path / "prepared"
    prepare([str(src)], out, vocab_size=300)
    (out / PREPARED_MANIFEST).unlink()
    return src, out


def test_a_prepared_directory_without_its_manifest_is_refused_with_the_rebuild(manifest_lost):
    src, out = manifest_lost
    with pytest.raises(DataError, match=rf"holds shards .* not its {PREPARED_MANIFEST}.*--out {out} again"):
        read_documents(DataConfig(source=str(out)))
    prepare([str(src)], out, vocab_size=300)  # the fix the message names works
    assert (out / PREPARED_MANIFEST).is_file()


def test_one_inside_a_source_directory_is_skipped_not_read_as_text(manifest_lost, caplog):
    src, out = manifest_lost
    out.rename(src / "prepared")
    with caplog.at_level(logging.WARNING):
        docs, _ = read_documents(DataConfig(source=str(src)))
    assert [d.text[:5] for d in docs] == ["alpha"]  # not the tokenizer.json beside the shards
    assert any(f"{PREPARED_MANIFEST} is missing" in r.getMessage() for r in caplog.records)
