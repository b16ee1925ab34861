"""A long document is encoded in pieces (formats.pieces, TEXT_CHUNK_CHARS) whose ids must be the whole text's.
A SentencePiece-converted tokenizer (Llama 2 / Mistral v0.1: normalizer Prepend("▁") + Replace(" ", "▁"), no
pre-tokenizer; newer: Metaspace prepend_scheme "always" / "first") put "▁" before every piece, a token more a
cut: 2,435 -> 2,455 ids on 6,000 characters of prose in 21 pieces, 3,003 -> 3,026 on code (Prepend); 3,544 ->
3,565 on a word a line (all three). Later pieces are now encoded without that prefix, and a text is encoded whole
where the tokenizer cannot be cut exactly there."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from trimtab.data import cutting, formats
from trimtab.data import tokenizer as T
from trimtab.data.sources import Document

REAL = Path(__file__).with_name("data") / "real_pieces.jsonl"  # licences, man pages, docs: real English
PROSE = "\n\n".join(json.loads(line)["text"] for line in REAL.read_text().splitlines()[:8])[:6000]
TEXTS = {
    "prose": PROSE,
    "lines": "\n".join(PROSE.split()),  # no space: cut before a newline
    "code": "\n".join(f"def f{i}(x):\n    if x:\n        return  x + {i}\n" for i in range(150)),
}
KINDS = ["trimtab", "gpt2", "prepend", "metaspace-always", "metaspace-first"]


def _sentencepiece_like(kind: str) -> Tokenizer:
    """A BPE trained as SentencePiece's (words begin with "▁"), then written as its Hugging Face conversions are."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    _train(tok, sorted(set("".join(TEXTS.values()))))
    if kind == "prepend":  # Llama 2's tokenizer.json
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=kind.split("-")[1])
    tok.decoder = decoders.Metaspace()
    return tok


def _gpt2() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    _train(tok, pre_tokenizers.ByteLevel.alphabet())
    return tok


def _train(tok: Tokenizer, alphabet: list[str]) -> None:
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=alphabet, special_tokens=T.SPECIAL_TOKENS)
    trainer.show_progress = False
    tok.train_from_iterator([PROSE, TEXTS["code"]], trainer)


def tokenizer_of(kind: str) -> T.TextTokenizer:
    if kind == "trimtab":
        return T.train_tokenizer([Document([(PROSE, True)]), Document([(TEXTS["code"], True)])], 500)
    return T.TextTokenizer(_gpt2() if kind == "gpt2" else _sentencepiece_like(kind))


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(formats, "TEXT_CHUNK_CHARS", 300)  # 1M in use: the texts here are read in ~20 pieces
    monkeypatch.setattr(T, "ENCODE_CALL_CHARS", 1000)  # several encode calls a text


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("text", sorted(TEXTS))
@pytest.mark.parametrize("kind", KINDS)
def test_a_long_text_in_pieces_has_the_whole_texts_ids(kind, text):
    tok = tokenizer_of(kind)
    whole = tok.encode_text(TEXTS[text])
    short = Document([("A short one.", True)])
    pieced = tok.encode_documents([short, Document([(TEXTS[text], True)]), short])
    assert pieced[1][0] == whole  # before: Prepend +20 ids on prose, +23 on code; all three +21 a word a line
    assert pieced[0][0] == pieced[2][0] == tok.encode_text("A short one.")
    arrays = tok.encode_documents([Document([(TEXTS[text], True)])], arrays=True)
    assert arrays[0][0].tolist() == whole


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("kind", KINDS)
def test_prose_and_code_are_still_cut_so_an_encode_call_stays_small(kind):
    """The bound on an encode call's memory holds where a cut is exact: between two words."""
    tok = tokenizer_of(kind)
    for text in ("prose", "code"):
        assert len(tok._pieces(TEXTS[text])) > 10


def test_a_tokenizer_that_puts_nothing_before_a_text_encodes_its_pieces_with_itself():
    tok = tokenizer_of("gpt2")
    learned = cutting.learn(tok._tok)
    assert learned.later is None
    assert learned.exact == {(" ", True), (" ", False), ("\n", True), ("\n", False), ("\t", True)}


@pytest.mark.parametrize("kind", ["prepend", "metaspace-always", "metaspace-first"])
def test_a_later_piece_is_encoded_without_the_prefix(kind):
    tok = tokenizer_of(kind)
    learned = cutting.learn(tok._tok)
    assert (" ", True) in learned.exact and learned.marker == "▁"
    assert learned.later.encode(" sat").ids == tok.encode_text("sat")  # its space is the "▁" the whole text has
    assert learned.later.encode("sat").ids != tok.encode_text("sat")  # a word cut in two gets none


@pytest.mark.usefixtures("small_pieces")
def test_a_token_across_a_word_cut_makes_the_text_encoded_whole():
    """No pre-tokenizer and a token "s▁" (a word's end and the next one's space): no cut between words is exact."""
    letters = sorted(set("▁abcdefghijklmnopqrstuvwxyz."))
    vocab = {c: i for i, c in enumerate(letters)} | {"s▁": len(letters), T.EOS: len(letters) + 1}
    tok = Tokenizer(models.BPE(vocab, [("s", "▁")]))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    text = " ".join(["cats sit on mats."] * 60)
    wrapped = T.TextTokenizer(tok)
    assert (" ", True) not in cutting.learn(wrapped._tok).exact
    assert wrapped.encode_documents([Document([(text, True)])])[0][0] == wrapped.encode_text(text)
    assert wrapped._pieces(text) == [text]


def test_pieces_cut_before_a_space_between_words_not_in_indentation():
    text = "word " * 30 + "\n" + "    indented" * 10
    cut = next(formats.pieces(text, 200))
    assert text[len(cut)] == " " and not text[len(cut) - 1].isspace() and not text[len(cut) + 1].isspace()


@pytest.mark.usefixtures("small_pieces")
def test_a_cut_after_a_space_is_not_taken_where_two_spaces_are_one_token():
    """Llama 2's first merge is "▁▁": text cut between two spaces ("a ", " b") would not have it."""
    definition = json.loads(_sentencepiece_like("prepend").to_str())
    model = definition["model"]
    model["vocab"]["▁▁"] = max(model["vocab"].values()) + 1
    model["merges"].insert(0, ["▁", "▁"])
    tok = T.TextTokenizer(Tokenizer.from_str(json.dumps(definition)))
    assert (" ", False) not in cutting.learn(tok._tok).exact
    text = "two  spaces  between  words  here  " * 40  # no single space between words to cut before
    assert tok.encode_documents([Document([(text, True)])])[0][0] == tok.encode_text(text)
    assert tok._pieces(text) == [text]


def test_training_pieces_learn_the_whole_texts_tokenizer(monkeypatch):
    """trimtab trains only its own byte-level BPE (a Hugging Face tokenizer is used as it is), whose
    pre-tokenizer splits where a piece is cut: 106 pieces learn the merges the whole text does."""
    docs = [Document([(PROSE + TEXTS["code"] + TEXTS["lines"], True)])]
    whole = T.train_tokenizer(docs, 400)
    monkeypatch.setattr(T, "TRAIN_PIECE_CHARS", 300)
    assert len(list(T._pieces(docs))) > 50
    assert T.train_tokenizer(docs, 400).definition() == whole.definition()


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("kind", ["trimtab", "prepend"])
def test_special_token_text_in_a_later_piece_is_text(kind):
    tok = tokenizer_of(kind)
    text = PROSE[:2000] + " a <|endoftext|> in the text " + PROSE[2000:4000]
    assert tok.encode_documents([Document([(text, True)])])[0][0] == tok.encode_text(text)
    assert tok.eos_id not in tok.encode_text(text)
