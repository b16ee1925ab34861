"""`trimtab data prepare` reads a long plain-text file in pieces (formats.TEXT_CHUNK_CHARS) and judged junk in
whole documents only, so a text file of word salad longer than a piece (a 1.2 MB line of it beside licences) was
never judged there, while training, which reads it whole, flagged it. Its pieces are judged now (junk.kinds, the
function training judges with) and the document is flagged at its end when most of its characters are junk."""

import json
import random
from pathlib import Path

import pytest

from test_junk import salad_of
from test_junk_sources import flagged, write
from test_quality import clean_documents
from trimtab.data import formats, junk
from trimtab.data.prepare import Options, prepare
from trimtab.data.prepared import PreparedData

pytestmark = pytest.mark.usefixtures("one_thread")
CHUNK = 30_000  # a piece's characters here (1M in use): the text files below are read in 3-4 pieces
REAL = Path(__file__).with_name("data") / "real_pieces.jsonl"  # licences, man pages, docs: real English


@pytest.fixture
def tok_file(tmp_path, tokenizer):
    path = tmp_path / "tok" / "tokenizer.json"
    tokenizer.save(path)
    return path


def corpus(tmp_path):
    rng = random.Random(0)
    clean = clean_documents()
    write(tmp_path / "src" / "clean.jsonl", clean)
    real = "\n\n".join(json.loads(line)["text"] for line in REAL.read_text().splitlines())
    (tmp_path / "src" / "long.txt").write_text(real[: 4 * CHUNK])  # real text in pieces
    (tmp_path / "src" / "salad.txt").write_text(salad_of("\n".join(clean)[: 4 * CHUNK], rng))  # one line
    return tmp_path / "src"


@pytest.mark.parametrize("garbage_filter", ["warn", "drop"])
def test_a_text_file_of_word_salad_read_in_pieces_is_flagged(tmp_path, tok_file, monkeypatch, garbage_filter):
    monkeypatch.setattr(formats, "TEXT_CHUNK_CHARS", CHUNK)  # the scale of a 1.2 MB line, 30 times smaller
    monkeypatch.setattr(junk, "PIECE_WORDS", junk.PIECE_WORDS // 30)
    src = corpus(tmp_path)
    out = tmp_path / "out"
    manifest = prepare([str(src)], out, str(tok_file), options=Options(garbage_filter=garbage_filter), workers=1)
    salad = manifest["files"][[f["path"] for f in manifest["files"]].index(str(src / "salad.txt"))]
    assert salad.get("garbage") == 1  # before: not judged, 0
    data = PreparedData(out, verify=True)  # a dropped document's pieces taken back: the shards are whole
    if garbage_filter == "warn":
        found = flagged(out)
        assert list(found) == [str(src / "salad.txt")] and found[str(src / "salad.txt")].startswith("word salad")
    else:
        assert salad["tokens"] == 0 and salad["documents"] == 0
        assert data.n_docs == len(clean_documents()) + 1  # the clean records and the long real text, kept whole
