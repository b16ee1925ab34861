"""`trimtab data prepare` judges junk per source (data/prepare.py's _measure_references): each input
it is given has its own reference of word pairs and spellings, as training's data.mix entries do."""

import json
import logging
import random
import re
from pathlib import Path

from test_junk import SYLLABLES, grammar_prose, salad_of
from trimtab.data import junk
from trimtab.data import prepare as prepare_module
from trimtab.data.prepare import Options, prepare
from trimtab.data.prepared import PreparedData
from trimtab.data.references import SOURCE_BIGRAMS


def write(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))


def flagged(out: Path) -> dict[str, str]:
    """{file:line: why} of the documents the screen flagged."""
    data = PreparedData(out)
    return {data.source(d): data.why[d] for d in range(data.n_docs) if data.why.get(d)}


def foreign(text: str, rng: random.Random, lexicon: dict[str, str]) -> str:
    """`text` in another language: English's word order, each word replaced by one of its own."""
    word = lambda: "".join(rng.choice(SYLLABLES) for _ in range(3))  # noqa: E731
    return re.sub(r"[A-Za-z]+", lambda m: lexicon.setdefault(m.group().lower(), word()), text)


def test_a_second_language_folder_is_judged_against_its_own_word_pairs(tmp_path, monkeypatch):
    """English first, then a folder of another language with word salad of it: the shared sample
    (here English only, as 8 MB of a large first folder is) held none of its word pairs, so its salad
    was never judged (0 of 6 named); against its own folder's sample all are, and so is salad in a
    file added to the folder later, while its real pages are not."""
    monkeypatch.setattr(junk, "CORPUS_WORDS", 5_000)
    monkeypatch.setattr(prepare_module, "SCALE_SAMPLE_BYTES", 60_000)
    rng, lexicon = random.Random(5), {}
    write(tmp_path / "english" / "a.jsonl", [grammar_prose(rng) for _ in range(120)])
    other = [foreign(grammar_prose(rng), rng, lexicon) for _ in range(120)]
    write(tmp_path / "other" / "a.jsonl", other + [salad_of(text, rng) for text in other[:6]])
    out, sources = tmp_path / "out", [str(tmp_path / "english"), str(tmp_path / "other")]
    manifest = prepare(sources, out, vocab_size=300, options=Options(), workers=1)
    # each folder's sample is its own: the shared one (BIGRAMS) is spread over both
    assert [s["bigrams"] for s in manifest["sources"]] == [SOURCE_BIGRAMS.format(0), SOURCE_BIGRAMS.format(1)]
    salad = {f"{tmp_path / 'other' / 'a.jsonl'}:{n}" for n in range(121, 127)}
    found = flagged(out)
    assert set(found) == salad and all(why.startswith("word salad") for why in found.values())
    more = [foreign(grammar_prose(rng), rng, lexicon) for _ in range(20)] + [salad_of(other[7], rng)]
    write(tmp_path / "other" / "b.jsonl", more)  # added later: judged against its folder's reference
    manifest = prepare(sources, out, options=Options(), workers=1)
    assert manifest["files"][-1]["source"] == 1
    assert set(flagged(out)) == salad | {f"{tmp_path / 'other' / 'b.jsonl'}:21"}


def test_the_reference_sample_is_spread_over_the_source_not_its_first_files(tmp_path, monkeypatch):
    """A source whose first files are of one kind (docs, then code) gave a reference of that kind only: the
    sample was its first 8 MB in input order (here 20 KB: the first ten of 20 files). Spread, every stretch of
    the listing gives some, and a large file of records only its share, as the same files always give."""
    monkeypatch.setattr(prepare_module, "SCALE_SAMPLE_BYTES", 20_000)
    rng = random.Random(0)
    for i in range(20):
        (tmp_path / f"{i:02d}.txt").write_text(f"file{i:02d} " + grammar_prose(rng, 2_000))
    write(tmp_path / "zz.jsonl", [f"record{i:03d} " + grammar_prose(rng, 1_000) for i in range(100)])
    files = [str(path) for path in sorted(tmp_path.iterdir())]
    texts = [doc.text for doc in prepare_module._sample(files, Options(), "")]
    named = [text.split()[0] for text in texts]
    quarters = {int(name[4:]) // 5 for name in named if name.startswith("file")}
    assert quarters == {0, 1, 2, 3}  # before: file00..file09 only, the first half
    assert 1 <= sum(name.startswith("record") for name in named) <= 2  # 20 KB / 21 files each, at least one
    assert texts == [doc.text for doc in prepare_module._sample(files, Options(), "")]


def test_prepare_says_which_sources_were_too_small_for_word_salad_to_be_judged(tmp_path, monkeypatch, caplog):
    """A source under junk.SMALL_WORDS words had its word salad pass unjudged, and prepare said nothing of it:
    the report now names it, and a source large enough (here: the bar lowered under its words) is not named."""
    rng = random.Random(3)
    write(tmp_path / "small" / "a.jsonl", [grammar_prose(rng) for _ in range(30)])
    with caplog.at_level(logging.WARNING):
        prepare([str(tmp_path / "small")], tmp_path / "out", vocab_size=300, options=Options(), workers=1)
    said = [r.getMessage() for r in caplog.records if "word salad" in r.getMessage() and "not judged" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "small") in said[0] and f"{junk.SMALL_WORDS:,} words" in said[0]
    caplog.clear()
    monkeypatch.setattr(junk, "SMALL_WORDS", 1_000)
    with caplog.at_level(logging.WARNING):
        prepare([str(tmp_path / "small")], tmp_path / "again", vocab_size=300, options=Options(), workers=1)
    assert not [r for r in caplog.records if "not judged" in r.getMessage()]
