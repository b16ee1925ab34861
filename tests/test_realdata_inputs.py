"""A user's own corpus on the data path: records scraped text really holds."""

from __future__ import annotations

import pytest

from trimtab.config import DataConfig
from trimtab.data import read_documents
from trimtab.errors import DataError


@pytest.mark.parametrize(
    "field", ['"text": "cut \\ud83d emoji"', '"messages": [{"role": "assistant", "content": "\\udc00"}]']
)
def test_a_lone_surrogate_escape_is_a_bad_record_named_by_file_and_line(tmp_path, field):
    """JSON's \\ud83d without its pair decodes to no Unicode text: it failed later, counting the
    record's UTF-8 bytes, with a traceback naming no file."""
    path = tmp_path / "scraped.jsonl"
    path.write_text('{"text": "fine \\ud83d\\ude00 pair"}\n{' + field + '}\n{"text": "ok"}\n')
    with pytest.raises(DataError, match=r"scraped.jsonl:2: .*lone UTF-16 surrogate.*skip_bad_records"):
        read_documents(DataConfig(source=str(path)))
    docs, skipped = read_documents(DataConfig(source=str(path), skip_bad_records=True))
    assert skipped == 1 and [d.text for d in docs] == ["fine \U0001f600 pair", "ok"]
