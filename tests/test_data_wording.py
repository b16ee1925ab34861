"""A user's data, in their words: one malformed record is "1 malformed record", and an empty text
field is refused when the config is read (it failed every record as "no '' key")."""

from __future__ import annotations

import logging

import pytest

from trimtab.config import DataConfig
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
