"""Junk that packs like text (data/junk.py): mis-encoded Latin pages, random letters at English
letter frequencies and word salad, which the packing screen (data/quality.py) never flags."""

import json
import logging
import random
import re
import sysconfig
from pathlib import Path

import numpy as np

from test_quality import clean_documents, phase
from trimtab.config import DataConfig
from trimtab.data import bigrams, junk, shards
from trimtab.data.prepare import Options, prepare
from trimtab.data.prepared import PreparedData
from trimtab.orchestrator import screened

# pages in Latin languages with accents: mis-encoded, they pack like text (a few "Ã©" among ASCII)
PAGES = (
    "El niño comió manzanas en el jardín mientras su abuela leía un libro sobre la historia de España. "
    "Después de la lección, todos salieron a caminar por la orilla del río y hablaron de música, de política "
    "y de los años en que la ciudad era pequeña y tranquila. ¿Quién sabe qué traerá el mañana?",
    "L'été dernier, nous sommes allés à la mer avec nos enfants. Le soleil brillait, la plage était calme et "
    "les pêcheurs réparaient leurs filets près du phare. Après le déjeuner, nous avons visité le château et "
    "la cathédrale, où un guide très érudit nous a raconté l'histoire de la région.",
    "Über die Brücke gingen die Mädchen zur Schule, während die Jungen am Fluß spielten. Später aßen alle "
    "zusammen Kuchen und tranken Kaffee, und die Großmutter erzählte von früher, als das Dorf noch größer "
    "war und jeder Bäcker sein eigenes Brot buk. Schön war es damals, sagte sie lächelnd.",
)
ENGLISH = "eeeeeeeeeeeetttttttttaaaaaaaaooooooooiiiiiiinnnnnnnsssssshhhhhhrrrrrrddddlllluuummmwwffggyyppbbvk"


def mojibake(text: str, encoding: str) -> str:
    return text.encode().decode(encoding)


def random_letters(rng: random.Random, n: int = 1500) -> str:
    """Letters drawn independently at English frequencies, in words of English lengths."""
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n:
        words.append("".join(rng.choice(ENGLISH) for _ in range(rng.choice((1, 2, 3, 3, 4, 4, 5, 6, 7, 8)))))
    return " ".join(words)


def crawl(path: Path) -> set[str]:
    """Real documents (trimtab's source, prose with accents) with 3 mis-encoded pages and 3 of random
    letters at random lines, as JSONL at `path`; the junk documents' names (FILE:LINE)."""
    rng = random.Random(0)
    bad = [mojibake(p * 2, enc) for p, enc in zip(PAGES, ("cp1252", "latin-1", "cp1252"))]
    bad += [random_letters(rng) for _ in range(3)]
    docs = [(text, False) for text in clean_documents()] + [(text, False) for text in PAGES]  # real accents stay
    for text in bad:
        docs.insert(rng.randrange(len(docs)), (text, True))
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text, _ in docs))
    return {f"{path}:{n}" for n, (_, junky) in enumerate(docs, 1) if junky}


def test_mojibake_and_random_letters_are_left_out_though_they_pack_like_text(tmp_path, caplog):
    path = tmp_path / "crawl.jsonl"
    bad = crawl(path)
    cfg = DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.0, garbage_filter="drop")
    with caplog.at_level(logging.WARNING):
        kept = set(phase(cfg).train.docs.sources)
    assert not bad & kept  # every junk document is out
    assert len(kept) == sum(1 for _ in open(path)) - len(bad)  # and no real one
    (line,) = [r.message for r in caplog.records if "junk" in r.message]
    assert "3 mojibake" in line and "3 random letters" in line


def test_data_prepare_counts_junk_that_packs_like_text(tmp_path):
    path = tmp_path / "crawl.jsonl"
    bad = crawl(path)
    manifest = prepare([str(path)], tmp_path / "out", vocab_size=300, options=Options(garbage_filter="drop"))
    (entry,) = manifest["files"]
    assert entry["garbage"] == len(bad) and entry["documents"] == sum(1 for _ in open(path)) - len(bad)


# a small grammar: sentences whose adjacent words depend on each other as a language's do (fixed, owned here)
NOUNS = "river city farmer teacher garden window market letter bridge doctor village engine story winter harbour"
NOUNS = (NOUNS + " kitchen soldier forest station painter").split()
ADJS = "old quiet small bright cold narrow busy famous heavy gentle empty distant".split()
VERBS = "crossed watched built opened carried painted visited followed repaired described".split()
PREPS = "near behind across beside under towards".split()


def sentence(rng: random.Random) -> str:
    n, a, v, p = (rng.choice(words) for words in (NOUNS, ADJS, VERBS, PREPS))
    m, b, o = rng.choice(NOUNS), rng.choice(ADJS), rng.choice(NOUNS)
    said = rng.choice(
        (
            f"the {a} {n} {v} the {m} {p} the {b} {o}.",
            f"a {n} of the {m} {v} every {a} {o}.",
            f"{p} the {n}, a {a} {m} {v} nothing.",
        )
    )
    return said[0].upper() + said[1:]


def grammar_prose(rng: random.Random, n_chars: int = 700) -> str:
    said: list[str] = []
    while sum(len(s) + 1 for s in said) < n_chars:
        said.append(sentence(rng))
    return " ".join(said)


def salad_of(text: str, rng: random.Random) -> str:
    shuffled = junk.words(text)  # real words in random order
    rng.shuffle(shuffled)
    return " ".join(shuffled)


def test_word_salad_is_told_from_real_prose_by_the_corpus_bigrams():
    rng = random.Random(0)
    prose = [grammar_prose(rng) for _ in range(200)]
    salad = [salad_of(text, rng) for text in prose[:20]]
    texts = prose + salad
    tokens = [junk.words(t) for t in texts]
    bits, scored = bigrams.salad_bits(tokens, junk.Bigrams.of(tokens, texts), np.ones(len(texts), dtype=bool))
    assert (scored >= junk.MIN_PAIRS).all()
    real, fake = bits[: len(prose)], bits[len(prose) :]
    assert (fake < junk.SALAD_BITS).all() and (real > junk.SALAD_BITS).all()  # shuffled words: ~0 bits
    assert np.median(real) > 2 * junk.SALAD_BITS and np.median(fake) < junk.SALAD_BITS / 2


def salad_crawl(path: Path, rng: random.Random) -> set[str]:
    """300 documents of grammar prose with 12 of word salad at random lines, as JSONL; the salad's names."""
    docs = [(grammar_prose(rng), False) for _ in range(300)]
    for text, _ in docs[:12]:
        docs.insert(rng.randrange(len(docs)), (salad_of(text, rng), True))
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text, _ in docs))
    return {f"{path}:{n}" for n, (_, salad) in enumerate(docs, 1) if salad}


def test_prepare_judges_word_salad_in_every_batch_against_the_sample(tmp_path, monkeypatch):
    """Each encode batch (here ~3,500 words) holds too few words to judge word order by; the word
    pairs of the sample `prepare` measures its scale on (all 26K words here) do, in every batch."""
    monkeypatch.setattr(junk, "CORPUS_WORDS", 10_000)
    monkeypatch.setattr(shards, "ENCODE_CHARS", 20_000)
    path = tmp_path / "crawl.jsonl"
    salad = salad_crawl(path, random.Random(1))
    out = tmp_path / "out"
    manifest = prepare([str(path)], out, vocab_size=300, options=Options(), workers=1)
    (entry,) = manifest["files"]
    assert entry["garbage"] == len(salad) and (out / shards.BIGRAMS).is_file()
    data = PreparedData(out)
    why = [data.why.get(d, "") for d in range(data.n_docs)]
    flagged = {data.source(d) for d in range(data.n_docs) if why[d]}
    assert flagged == salad and all(
        w.startswith("word salad: ") and w.endswith(f"under {junk.SALAD_BITS:g}") for w in why if w
    )


def test_junk_evidence_says_what_was_found_not_the_packing(tmp_path, caplog):
    path = tmp_path / "crawl.jsonl"
    bad = crawl(path)
    cfg = DataConfig(source=str(path), max_bytes=0, seq_len=64, eval_fraction=0.0)
    (flagged,) = phase(cfg).train.flagged_rows()
    found = screened.finding([flagged], step=0, phase=0)
    (source,) = found.evidence["sources"]
    reasons = list(source["why"].values())
    assert set(source["why"]) <= bad and len(reasons) == len(flagged.names) > 0
    assert all(r.split(":")[0] in junk.KINDS for r in reasons) and not any("bytes per token" in r for r in reasons)
    assert all(f"({r})" in found.summary for r in reasons)


def reversed_lines(text: str) -> str:
    return "\n".join(line[::-1] for line in text.split("\n"))


def letters_shuffled(text: str, rng: random.Random) -> str:
    """Each word's letters in random order ("Cmabrigde"), its punctuation and spaces where they were."""
    return re.sub(r"[^\W\d_]+", lambda m: "".join(rng.sample(m.group(), len(m.group()))), text)


def test_words_spelt_backwards_or_with_shuffled_letters_are_scrambled_and_a_language_the_corpus_lacks_is_not():
    """Reversed and letter-shuffled text keeps the corpus's letters and its word pairs' neighbours'
    structure, and scored 0-36 of 144 before; its words are the corpus's letters misspelt."""
    rng = random.Random(2)
    prose = [grammar_prose(rng) for _ in range(120)]
    scrambled = [reversed_lines(t) for t in prose[:6]] + [letters_shuffled(t, rng) for t in prose[6:12]]
    texts = prose + scrambled + [p * 2 for p in PAGES]  # Spanish, French, German: words the corpus lacks
    verdicts = junk.kinds(texts)
    assert [v.kind if v else None for v in verdicts[len(prose) : len(prose) + 6]] == ["scrambled words"] * 6
    assert all(verdicts[len(prose) : -len(PAGES)])  # shuffled letters: some read as random letters first
    assert not any(verdicts[: len(prose)]) and not any(verdicts[-len(PAGES) :])
    tokens = [junk.words(t) for t in texts]
    reference = junk.Bigrams.of(tokens, texts)
    share, _ = bigrams.scrambled(
        tokens, bigrams.word_ids(tokens, reference.vocab, grow=False), reference, np.ones(len(texts))
    )
    real = np.delete(share, range(len(prose), len(prose) + len(scrambled)))
    assert (share[len(prose) : -len(PAGES)] >= 0.8).all() and (real <= 0.13).all()


SYLLABLES = "ka lo mi tu ne sa ri po ve da gu zo fi ha".split()


def foreign_prose(rng: random.Random, lexicon: list[list[str]], n_chars: int = 700) -> str:
    """Sentences of a language of many words (`lexicon`: nouns, adjectives, verbs): its word pairs seldom repeat."""
    nouns, adjs, verbs = lexicon
    said: list[str] = []
    while sum(len(s) + 1 for s in said) < n_chars:
        det, prep = rng.choice(("el", "la")), rng.choice(("con", "sin", "por"))
        said.append(f"{det} {rng.choice(nouns)} {rng.choice(adjs)} {rng.choice(verbs)} {prep} {rng.choice(nouns)}.")
    return " ".join(said)


def test_word_order_is_not_judged_in_a_language_the_corpus_holds_too_little_of(monkeypatch):
    """A few pages of a language of many words: its real word pairs were as unseen in the corpus
    as random ones, and 5 of its 6 pages were named word salad (as Spanish, Russian and Turkish
    pages were in an English and code sample); word salad of the corpus's own language still is."""
    monkeypatch.setattr(junk, "CORPUS_WORDS", 10_000)
    rng = random.Random(3)
    word = lambda: "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3))))  # noqa: E731
    lexicon = [[word() for _ in range(n)] for n in (300, 150, 150)]
    prose = [grammar_prose(rng) for _ in range(200)]
    salad = [salad_of(text, rng) for text in prose[:5]]
    verdicts = junk.kinds(prose + salad + [foreign_prose(rng, lexicon) for _ in range(6)])
    assert not any(verdicts[:200]) and not any(verdicts[205:])
    assert [v.kind if v else None for v in verdicts[200:205]] == ["word salad"] * 5


def code_chunks(path: Path, size: int = 1500) -> list[str]:
    """`path`'s text in pieces of about `size` characters, cut at blank lines (mid-function)."""
    chunks, cur = [], ""
    for part in path.read_text(errors="ignore").split("\n\n"):
        cur += part + "\n\n"
        if len(cur) >= size:
            chunks, cur = [*chunks, cur.strip()], ""
    return chunks


def test_real_code_outside_the_reference_is_not_word_salad_and_its_shuffled_words_are(monkeypatch):
    """Chunks of stdlib files the reference lacks: their identifiers' pairs are unseen, and 10 of 366
    were named word salad (prepare on 9,977 stdlib chunks: 362); code's indented blocks say it is code,
    while its own words shuffled onto one line are still word salad."""
    monkeypatch.setattr(junk, "CORPUS_WORDS", 10_000)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    sample = [chunk for path in files[:60] for chunk in code_chunks(path)]
    judged = [chunk for path in files[60:90] for chunk in code_chunks(path)]
    rng = random.Random(0)
    salad = [" ".join(rng.sample(text.split(), len(text.split()))) for text in rng.sample(judged, 10)]
    verdicts = junk.kinds(judged + salad, junk.Bigrams.of([junk.words(t) for t in sample], sample))
    assert [str(v) for v in verdicts[: len(judged)] if v and v.kind == "word salad"] == []
    assert sum(bool(v) and v.kind == "word salad" for v in verdicts[len(judged) :]) >= 4


def test_hex_dumps_and_base64_are_named_and_real_code_with_hex_constants_and_hashes_is_not():
    """`xxd` output packs like text (~5.5 bytes per token, ~4 bits a character): neither screen named it. Most
    of its characters are hex groups; stdlib code that holds digests and hex constants has few (<= 0.05)."""
    from test_quality import garbage

    rng = random.Random(0)
    dumps = [garbage(kind, 1500, rng) for kind in ("hexdump", "base64") for _ in range(3)]
    dumps.append("\n".join(rng.randbytes(32).hex() for _ in range(40)))  # `xxd -p`
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    real = [
        chunk for name in ("hashlib.py", "uuid.py", "secrets.py", "base64.py") for chunk in code_chunks(stdlib / name)
    ]
    verdicts = junk.kinds(dumps + real)
    assert [v.kind if v else None for v in verdicts[: len(dumps)]] == ["hex or base64 dump"] * len(dumps)
    assert str(verdicts[0]).startswith("hex or base64 dump: 0.")
    assert not any(v and v.kind == "hex or base64 dump" for v in verdicts[len(dumps) :])


def test_paths_and_long_integers_are_not_base64_and_base64_with_slashes_still_is():
    """`[A-Za-z0-9+/]{40,}` also matches a pip RECORD's paths ("cfnlint/data/schemas/resources/0300e1630e8b2eb9") and
    a fraction of long integers ("I/8777..."): 1.5 KB pieces of such files scored 0.5-0.6 as dumps. Their letters
    and digits come in words and numbers, where random bytes as base64 change class (upper, lower, digit) often."""
    import base64
    import hashlib

    rng = random.Random(0)
    lines = []
    for i in range(120):  # a RECORD of content-addressed schema files (cfn-lint's): path, urlsafe sha256, size
        digest = base64.urlsafe_b64encode(hashlib.sha256(str(i).encode()).digest()).rstrip(b"=").decode()
        lines.append(
            f"cfnlint/data/schemas/resources/{rng.randbytes(8).hex()}.json,sha256={digest},{rng.randrange(9999)}"
        )
    record = "\n".join(lines)
    numbers = "\n".join(
        f"    assert sqrt(-{rng.randrange(10**40)}*I/{rng.randrange(10**150)}) == r[{i}]" for i in range(30)
    )
    real = [text[i : i + 1500] for text in (record, numbers) for i in range(0, len(text) - 500, 1500)]
    dumps = [base64.encodebytes(rng.randbytes(1100)).decode() for _ in range(5)]  # 76 columns, with its slashes
    verdicts = junk.kinds(real + dumps)
    assert [str(v) for v in verdicts[: len(real)] if v] == []
    assert [v.kind if v else None for v in verdicts[len(real) :]] == ["hex or base64 dump"] * len(dumps)


def test_word_salad_is_judged_in_a_source_of_100k_words_across_spaces_only():
    """A source of 100K words, an eighth of it word salad (its whitespace-separated words shuffled), 40% of its
    words joined by hyphens as options, paths and "e.g." are. Before: word order was not judged under 400K words
    (0 named), and even then the salad kept its joined pairs in order (43 of 93 named, as man-page salad's 38 of 64)."""
    rng = random.Random(4)
    hyphens = lambda text: re.sub(r"(?<=[a-z]) (?=[a-z])", lambda _: "-" if rng.random() < 0.4 else " ", text)  # noqa: E731
    prose = [hyphens(grammar_prose(rng)) for _ in range(750)]
    salad = [" ".join(rng.sample(text.split(), len(text.split()))) for text in prose[:93]]
    assert junk.CORPUS_WORDS <= sum(len(junk.words(text)) for text in prose + salad) < 400_000
    verdicts = junk.kinds(prose + salad)
    assert [str(v) for v in verdicts[: len(prose)] if v] == []
    assert all(v is not None and v.kind == "word salad" for v in verdicts[len(prose) :])
