"""What `data prepare` flags in a corpus of many languages, and what it says it found. Random bytes
(data/quality.py's `noise`): the languages widen the spread of how documents pack until the packing
screen's threshold falls under where random bytes pack; `data prepare` named 0 of 36 random Latin-1
documents of such a corpus."""

import base64
import json
import logging
import random
import sysconfig
from pathlib import Path

from test_junk import code_chunks, crawl
from test_quality import ARABIC, GREEK, RUSSIAN, clean_documents, prepared_lines
from test_quality_languages import LANGUAGES
from trimtab.data import junk, quality
from trimtab.data.prepare import Options, prepare

KEPT = "kept; --garbage-filter drop leaves them out"
DATA = Path(__file__).parent / "data"


def latin1(rng: random.Random, n: int) -> str:
    """n random Latin-1 characters, C0 controls but newline left out: a binary file read as Latin-1."""
    return "".join(chr(rng.choice([10, *range(32, 256)])) for _ in range(n))


def mixed_corpus(path, rng: random.Random) -> tuple[set[int], set[int]]:
    """Code and English prose, as many pages of seven other languages (three scripts, four in Latin
    letters) and six of random Latin-1 bytes at random lines: (the random lines, the other languages'
    pages). Those pages are their passages' words in new orders (a corpus does not repeat a page): word
    salad, which the screen may name from a source of 5K words (data/junk.py SMALL_WORDS)."""
    docs = [(text, "") for text in clean_documents()]
    languages = (RUSSIAN, GREEK, ARABIC, *LANGUAGES)
    for k in range(len(docs)):
        words = languages[k % len(languages)].split()
        docs.append((" ".join(rng.choices(words, k=120)) + ".", "salad"))
    rng.shuffle(docs)
    for _ in range(6):
        docs.insert(rng.randrange(len(docs)), (latin1(rng, 1200), "bytes"))
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text, _ in docs))
    return tuple({n for n, (_, kind) in enumerate(docs, 1) if kind == want} for want in ("bytes", "salad"))


def test_random_bytes_are_flagged_however_far_other_languages_widen_the_spread(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    bad, salad = mixed_corpus(path, random.Random(0))
    with caplog.at_level(logging.WARNING):
        manifest = prepare([str(path)], tmp_path / "p", vocab_size=512, options=Options(garbage_filter="drop"))
    n_docs = sum(1 for _ in open(path))
    assert manifest["garbage"]["threshold"] < 0.5  # the languages' spread: random bytes pack above it
    out = set(range(1, n_docs + 1)) - prepared_lines(tmp_path / "p")
    assert bad <= out <= bad | salad  # all of them out; of the rest, only the shuffled pages may be
    (line,) = [r.message for r in caplog.records if " flagged (counted per file" in r.message]
    assert line.startswith(f"{len(out)} documents flagged")
    assert f"{len(bad)} random characters" in line  # the random bytes as what they are, each by itself, not as salad


def test_prepare_says_what_each_kind_of_junk_is_with_its_count(tmp_path, caplog):
    """prepare's closing line called mis-encoded pages and random letters, which pack like text,
    documents that "pack under 0.35x the median ... as random bytes" do."""
    bad = crawl(tmp_path / "crawl.jsonl")  # 3 mis-encoded pages, 3 of random letters
    with caplog.at_level(logging.WARNING):
        prepare([str(tmp_path / "crawl.jsonl")], tmp_path / "p", vocab_size=300)
    (line,) = [r.message for r in caplog.records if " flagged (counted per file" in r.message]
    assert line.startswith(f"{len(bad)} documents flagged") and "pack under" not in line
    for kind in ("mojibake", "random letters"):
        assert f"3 {kind} ({junk.SAID[kind]})" in line


def test_random_characters_are_told_from_tables_and_scripts_of_many_characters():
    """Tables of numbers and code points (the stdlib's unicode and CJK-frequency tables) are as independent
    between neighbours as random bytes, and Chinese text's characters as many: neither is random."""
    rng = random.Random(1)
    table = ",".join(f"{rng.randrange(5000):4d}" for _ in range(300))
    code_points = "\n".join(f'    (0x{rng.randrange(0x10000, 0x1FFFF):X}, "{rng.choice("XV")}"),' for _ in range(60))
    chinese = "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(600))
    assert not any(quality.random_characters(t) for t in (table, code_points, chinese, *clean_documents()[:20]))
    assert all(quality.random_characters(latin1(rng, n)) for n in (600, 1500))


def test_prepare_names_a_flagged_text_file_without_a_line_zero(tmp_path, caplog):
    """A plain-text file is one document (formats.Record line 0): prepare named a base64 dump in a
    directory of source files "charset.py:0", a line the file does not have; a run names it FILE."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for n, text in enumerate(clean_documents()[: quality.MIN_DOCS + 4]):
        (corpus / f"doc{n}.py").write_text(text)
    (corpus / "dump.py").write_text(base64.b64encode(random.Random(0).randbytes(3000)).decode())
    with caplog.at_level(logging.WARNING):
        prepare([str(corpus)], tmp_path / "p", vocab_size=300)
    (line,) = [r.message for r in caplog.records if " flagged (counted per file" in r.message]
    assert line.startswith("1 document flagged") and line.endswith(f"; {KEPT}")
    why = line.split(f"{corpus / 'dump.py'} (")[1].removesuffix(f"); {KEPT}")  # named FILE (its reason), not FILE:0
    assert why.startswith("hex or base64 dump: 1.00 ") and why.endswith(", bytes 0-4,000 of its text")


def test_random_characters_are_judged_without_the_pair_statistics_where_compression_or_letters_decide(monkeypatch):
    """Judged in every document, random characters cost `data prepare` the information between neighbours of each
    (two sorts of its pairs): now code that zlib packs as text is decided by its packing (quality.GLANCE), and a
    document of letters reuses the information its letter structure read. What is flagged stays: random bytes
    and characters over 18 symbols, not code nor tests/data/real_pieces.jsonl."""
    calls: list[int] = []
    information = quality.information
    monkeypatch.setattr(quality, "information", lambda symbols: calls.append(len(symbols)) or information(symbols))
    stdlib = Path(sysconfig.get_paths()["stdlib"]) / "asyncio"  # the built-in corpus's code, in 1.5 KB pieces
    code = [c for path in sorted(stdlib.glob("*.py")) for c in code_chunks(path) if len(c) >= quality.NOISE_CHARS]
    assert len(code) > 100 and not random_characters(junk.kinds(code))
    assert len(calls) < len(code) / 4  # was one for each (measured: 29 of 271, those with long docstrings)
    calls.clear()
    prose = [json.loads(line)["text"] for line in (DATA / "real_pieces.jsonl").read_text().splitlines()]
    lettered = sum(junk.letter_structure(text) is not None for text in prose if len(text) >= junk.MIN_CHARS)
    judged, calls[:] = sum(len(text) >= quality.NOISE_CHARS for text in prose), []
    assert not random_characters(junk.kinds(prose))
    assert lettered and len(calls) <= judged  # once each at most: was twice for those of letters (lettered)
    rng = random.Random(2)
    noise = [latin1(rng, 900), "".join(rng.choice("0123456789(),.;:+-") for _ in range(900))]
    assert random_characters(junk.kinds(noise)) == 2


def random_characters(verdicts: list[junk.Verdict | None]) -> int:
    return sum(v is not None and v.kind == "random characters" for v in verdicts)
