"""`trimtab data prepare` reads a long plain-text file in records of formats.TEXT_CHUNK_CHARS and encoded each
as a document of its own, so a SentencePiece-converted tokenizer (Llama 2: Prepend("▁"); Metaspace "always" /
"first") gave each later record a "▁" of its own (2.4M characters, an 8K-token Llama-2-style tokenizer: 454,535
tokens, 454,559 judged in stretches of 100K characters, each one a piece too), where the in-memory path gives the
whole text's 454,533 (data/cutting.py). Its records were also cut before the last space that precedes a word,
after another space too, where Llama 2's "▁▁" spans the cut. Now its shards hold the ids the in-memory path
gives: a later record is encoded as a later piece, a record is cut where formats.pieces cuts a text, and records
are joined where the tokenizer cannot be cut exactly."""

import json

import pytest

from test_tokenizer_cuts import TEXTS, _sentencepiece_like, tokenizer_of
from trimtab.cli import main
from trimtab.data import formats, stretches
from trimtab.data import tokenizer as T
from trimtab.data.prepared import PreparedData
from trimtab.data.sources import Document

pytestmark = pytest.mark.usefixtures("one_thread")
MIXED = TEXTS["prose"] + "\n\n" + TEXTS["code"]  # "return  x": a cut between two spaces would split "▁▁"
SHORT = "A short file after the long one."


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Each kind's tokenizer on disk: trimtab's own and Metaspace ones as a tokenizer.json, Llama 2's as a
    Hugging Face directory (its own start and end tokens: a document starts with <s>)."""
    root = tmp_path_factory.mktemp("tok")
    paths = {"trimtab": root / "trimtab.json"}
    tokenizer_of("trimtab").save(paths["trimtab"])
    for kind in ("metaspace-always", "metaspace-first"):
        paths[kind] = root / f"{kind}.json"
        _sentencepiece_like(kind).save(str(paths[kind]))
    llama = _sentencepiece_like("prepend")
    llama.add_special_tokens(["<s>", "</s>"])
    (root / "llama").mkdir()
    llama.save(str(root / "llama" / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}
    (root / "llama" / T.HF_CONFIG).write_text(json.dumps(settings))
    paths["prepend"] = root / "llama"
    return paths


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(formats, "TEXT_CHUNK_CHARS", 300)  # 1M in use: the files here are read in ~40 records
    monkeypatch.setattr(T, "ENCODE_CALL_CHARS", 1000)
    monkeypatch.setattr(stretches, "JUDGE_CHARS", 120)  # a record judged in stretches (1M / 100K in use)


def _in_memory(tok: T.TextTokenizer, text: str) -> list[int]:
    """A file's document as training reads it (one document, encode_documents) and packs it (start, end)."""
    ids = tok.encode_documents([Document([(text, True)])])[0][0]
    assert ids == tok.encode_text(text)  # the whole text's, in pieces or whole (test_tokenizer_cuts.py)
    return [tok.bos_id] * tok.prepends_bos(text) + ids + [tok.eos_id]


@pytest.mark.usefixtures("small")
@pytest.mark.parametrize("garbage_filter", ["off", "warn"])
@pytest.mark.parametrize("text", ["mixed", "lines"])
@pytest.mark.parametrize("kind", ["trimtab", "prepend", "metaspace-always", "metaspace-first"])
def test_prepared_shards_hold_the_in_memory_ids(tmp_path, tokenizers, kind, text, garbage_filter):
    long = MIXED if text == "mixed" else TEXTS["lines"]  # "lines": cut before a newline, not exact for Metaspace
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(long)
    (tmp_path / "src" / "b.txt").write_text(SHORT)
    args = ["--out", str(tmp_path / "p"), "--tokenizer", str(tokenizers[kind]), "--workers", "1"]
    assert main(["data", "prepare", str(tmp_path / "src"), *args, "--garbage-filter", garbage_filter]) == 0
    data = PreparedData(tmp_path / "p", verify=True)
    tok = T.TextTokenizer.load(tokenizers[kind])
    expected = [_in_memory(tok, long), _in_memory(tok, SHORT)]
    bounds = data.doc_bounds().tolist()
    got = [data.read(a, b).tolist() for a, b in zip(bounds, bounds[1:])]
    # before: Llama 2 +44 ids on "mixed" (+132 judged in stretches); "lines" +21 (+63) all three
    assert len(got) == 2 and [len(g) for g in got] == [len(e) for e in expected]
    assert got == expected


@pytest.mark.usefixtures("small")
def test_a_text_file_is_read_in_the_pieces_a_text_is_encoded_in(tmp_path):
    """formats._cut cuts where formats.pieces does: before a space between two words first (before: the last
    space before a word, after another space too: "return ▁| x" split Llama 2's "▁▁")."""
    (tmp_path / "a.txt").write_text(MIXED)
    records = list(formats.records(tmp_path / "a.txt"))
    assert [r.value for r in records] == list(formats.pieces(MIXED, formats.TEXT_CHUNK_CHARS))
    assert [r.last for r in records] == [False] * (len(records) - 1) + [True]
