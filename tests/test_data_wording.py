"""A user's data, in their words: one malformed record is "1 malformed record", and an empty text
field is refused when the config is read (it failed every record as "no '' key"); a Latin-1 / cp1252 file is told
the command that converts it, as a UTF-16 file is, in a folder too (skipped, and the warning says the fix); a junk
line's "1 of 1 document"."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from trimtab.config import DataConfig
from trimtab.data import junk
from trimtab.data.formats import Unreadable, records
from trimtab.data.sources import read_documents
from trimtab.errors import ConfigError


def test_one_malformed_record_is_counted_in_the_singular(tmp_path, caplog):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a line of text"}\nnot json\n{"text": "another"}\n')
    with caplog.at_level(logging.WARNING):
        docs, skipped = read_documents(DataConfig(source=str(path), skip_bad_records=True))
    assert skipped == 1 and len(docs) == 2
    assert "skipped 1 malformed record (data.skip_bad_records=true" in caplog.text


@pytest.mark.parametrize("field", ["", "  "])
def test_an_empty_text_field_is_refused_naming_the_key(field):
    with pytest.raises(ConfigError, match=r"data\.text_field.*default: text"):
        DataConfig(text_field=field).validate()


def test_an_empty_file_in_a_data_folder_is_said_when_training_reads_it(tmp_path, caplog):
    """`data prepare` said an empty file; training read nothing of it without a word (a file a tool left
    empty, or one half written, is a person's lost data). A records file with no record is empty too."""
    (tmp_path / "a.txt").write_text("some text to train on. " * 20)
    (tmp_path / "b.txt").write_text("")
    (tmp_path / "c.jsonl").write_text("\n\n")
    with caplog.at_level(logging.WARNING):
        docs, _ = read_documents(DataConfig(source=str(tmp_path)))
    assert [d.source for d in docs] == [str(tmp_path / "a.txt")]
    said = [r.getMessage() for r in caplog.records if "empty" in r.getMessage()]
    assert len(said) == 1 and "skipped 2 empty files" in said[0], said
    assert str(tmp_path / "b.txt") in said[0] and str(tmp_path / "c.jsonl") in said[0]


def test_a_latin1_file_is_told_the_command_that_converts_it(tmp_path):
    """Before: "not UTF-8 text at line 1 (...); convert it to UTF-8", naming no encoding (UTF-16 named its iconv)."""
    path = tmp_path / "notes.txt"
    path.write_bytes("Caf\u00e9 cr\u00e8me \u2014 r\u00e9sum\u00e9\n".encode("cp1252"))
    with pytest.raises(Unreadable) as caught:
        list(records(path))
    assert f"iconv -f cp1252 -t utf-8 {path}" in str(caught.value)


def test_bytes_cp1252_leaves_undefined_are_told_latin1(tmp_path):
    path = tmp_path / "old.txt"
    path.write_bytes(b"na\xefve \x81 text\n")  # 0x81 has no cp1252 character
    with pytest.raises(Unreadable) as caught:
        list(records(path))
    assert f"iconv -f latin1 -t utf-8 {path}" in str(caught.value)


def test_the_junk_lines_say_one_document():
    flagged = [junk.Verdict("word salad", 0.1, junk.SMALL_BITS)]
    line = junk.report(flagged, np.array([True]), ["a.txt"], np.array([300]), "data.source", dropped=False)
    assert "1 of 1 document (" in line


def test_a_cp1252_file_skipped_in_a_folder_is_told_its_fix_too(tmp_path, caplog):
    # a folder's file that is not UTF-8 is skipped with a warning, which cut the message before its fix
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "ok.txt").write_text("fine text " * 20)
    (tmp_path / "src" / "win.txt").write_bytes("Café “quoted” text. ".encode("cp1252") * 20)
    with caplog.at_level(logging.WARNING):
        docs, _ = read_documents(DataConfig(source=str(tmp_path / "src")))
    assert [d.source for d in docs] == [str(tmp_path / "src" / "ok.txt")]
    assert f"iconv -f cp1252 -t utf-8 {tmp_path / 'src' / 'win.txt'} > NEW" in caplog.text, caplog.text
