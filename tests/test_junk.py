"""Junk that packs like text (data/junk.py): mis-encoded Latin pages, random letters at English
letter frequencies and word salad, which the packing screen (data/quality.py) never flags."""

import json
import logging
import random
from pathlib import Path

import numpy as np

from test_quality import clean_documents, phase
from trimtab.config import DataConfig
from trimtab.data import junk
from trimtab.data.prepare import Options, prepare

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


def test_word_salad_is_told_from_real_prose_by_the_corpus_bigrams():
    rng = random.Random(0)
    docs_dir = Path(__file__).parents[1] / "docs"
    prose = [b for f in sorted(docs_dir.glob("*.md")) for b in f.read_text().split("\n\n") if len(b) > 600]
    salad = []
    for text in rng.sample(prose, 20):
        words = junk.words(text)  # real words in random order (whole tokens shuffled keep "data/quality.py" whole)
        rng.shuffle(words)
        salad.append(" ".join(words))
    bits, scored = junk.salad_bits([junk.words(t) for t in prose + salad])
    judged = scored >= junk.MIN_PAIRS
    real, fake = bits[: len(prose)][judged[: len(prose)]], bits[len(prose) :][judged[len(prose) :]]
    assert len(real) > 100 and len(fake) == len(salad)
    assert (fake < junk.SALAD_BITS).all()  # shuffled words: ~0 bits
    assert np.mean(real < junk.SALAD_BITS) < 0.02 and np.median(real) > 2 * junk.SALAD_BITS
