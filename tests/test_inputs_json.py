"""JSON Lines shipped under a .json name (as many datasets are): read as one plain-text document,
JSON syntax and all, it was trained on without a word; now said, with the way to read it as
records. A .json that is one object (a config file in a code corpus) stays quiet."""

import json
import logging

from trimtab.config import DataConfig
from trimtab.data.sources import read_documents

HINT = "one JSON object a line"


def hints(caplog):
    return [r.getMessage() for r in caplog.records if HINT in r.getMessage()]


def test_json_lines_named_json_are_said_with_the_way_to_read_them_as_records(tmp_path, caplog):
    path = tmp_path / "train.json"
    long_text = "def f(x):\n    return x\n" * 40  # a first record longer than 256 characters
    path.write_text("".join(json.dumps({"text": f"{i} {long_text}"}) + "\n" for i in range(30)))
    with caplog.at_level(logging.WARNING):
        docs, _ = read_documents(DataConfig(source=str(path)))
    assert len(docs) == 1 and docs[0].text.startswith('{"text"')  # still text, as before: only said
    said = hints(caplog)
    assert len(said) == 1 and "train.json" in said[0] and "rename it to .jsonl" in said[0]
    assert "data.format=jsonl" in said[0]
    records, _ = read_documents(DataConfig(source=str(path), format="jsonl"))
    assert len(records) == 30 and records[0].text.startswith("0 def f(x)")


def test_a_json_object_or_config_file_is_not_taken_for_json_lines(tmp_path, caplog):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "package.json").write_text(json.dumps({"name": "x", "version": "1"}, indent=2))
    (tmp_path / "src" / "one.json").write_text('{"name": "a setting"}\n')
    (tmp_path / "src" / "broken.json").write_text('{"name": \n{"other": 1}\n')
    with caplog.at_level(logging.WARNING):
        docs, _ = read_documents(DataConfig(source=str(tmp_path / "src")))
    assert len(docs) == 3 and not hints(caplog)
