"""Repeated text as bad data (data/repeats.py): a line or passage over and over is named per document; a source that
is mostly repeated text (a toy corpus, a text repeated on purpose) is kept and said once, not left out whole."""

import logging
import random
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from test_junk_sources import flagged
from test_quality import phase
from trimtab.config import DataConfig
from trimtab.data import junk
from trimtab.data.prepare import Options, prepare
from trimtab.data.repeats import REPEATED, repeated_share, row_repeat_share

DOCS = Path(__file__).resolve().parents[1] / "docs"


def loops(real: str) -> dict[str, str]:
    """A line repeated, a passage repeated 5x and 40x, and a file that is 20% text then a loop."""
    return {
        "line": "ERROR: connection to db-3 refused, retrying in 5 seconds\n" * 60,
        "passage5": real[:700] * 5,
        "passage40": real[1000:1300] * 40,
        "tail": real[:1000] + "Click here to subscribe to our newsletter and get the latest news!\n" * 60,
    }


def test_repeated_text_is_named_and_real_pages_are_not():
    """Each repetition named "repeated text" with its share over the bar (before: none named, as the packing screen
    and the other junk tests cannot see it); no docs/*.md page is, whole or in 2 KB pieces."""
    real = [p.read_text() for p in sorted(DOCS.glob("*.md"))]
    pieces = [page[i : i + 2000] for page in real for i in range(0, len(page), 2000)]
    bad = loops(real[0])
    verdicts = junk.kinds(list(bad.values()) + real)
    assert [v.kind if v else None for v in verdicts[: len(bad)]] == ["repeated text"] * len(bad)
    assert all(v.score >= v.bar == junk.REPEATED for v in verdicts[: len(bad)])
    assert verdicts[len(bad) :] == [None] * len(real)
    assert len(pieces) > 50 and max(map(repeated_share, pieces)) < junk.REPEATED / 2


def test_a_run_leaves_out_a_loop_but_keeps_a_source_that_is_all_repetition(tmp_path, caplog):
    """Nine real pages and a loop: the loop left out (before: trained on). A source that is one text repeated, as the
    tests' toy corpora are: kept whole and said once (left out, it would leave no training row)."""
    mixed, toy = tmp_path / "mixed", tmp_path / "toy"
    mixed.mkdir(), toy.mkdir()
    for page in sorted(DOCS.glob("*.md"))[:9]:
        (mixed / f"{page.stem}.txt").write_text(page.read_text()[:3000])
    (mixed / "loop.txt").write_text(loops("")["line"])
    cfg = DataConfig(source=str(mixed), max_bytes=0, seq_len=64, eval_fraction=0.0, garbage_filter="drop")
    kept = set(phase(cfg).train.docs.sources)
    assert len(kept) == 9 and str(mixed / "loop.txt") not in kept
    for name in ("a", "b"):
        (toy / f"{name}.txt").write_text(f"def {name}(x):\n    return x + 1\n" * 200)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        rows = phase(replace(cfg, source=str(toy))).train  # garbage_filter=drop: nothing left out all the same
    assert len(set(rows.docs.sources)) == 2 and len(rows) > 0
    said = [r.getMessage() for r in caplog.records if "repeated text" in r.getMessage()]
    assert len(said) == 1 and "2 of 2 documents" in said[0] and "deduplicate" in said[0]


def test_prepare_names_a_loop_among_real_files(tmp_path):
    """`data prepare` of seven pages and a file that is 20% text then a loop: the loop flagged (before: not)."""
    src = tmp_path / "corpus"
    src.mkdir()
    for page in sorted(DOCS.glob("*.md"))[:7]:
        shutil.copy(page, src / f"{page.stem}.txt")
    (src / "tail.txt").write_text(loops((DOCS / "architecture.md").read_text())["tail"])
    prepare([str(src)], tmp_path / "out", vocab_size=300, options=Options(), workers=1)
    assert {Path(name).stem: why.split(":")[0] for name, why in flagged(tmp_path / "out").items()} == {
        "tail": "repeated text"
    }


def test_prepare_keeps_a_toy_corpus_and_says_so_once(tmp_path, caplog):
    """A corpus of one text repeated, as the tests' toy corpora are: no document flagged, one line says why."""
    (tmp_path / "toy.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    with caplog.at_level(logging.WARNING):
        prepare([str(tmp_path / "toy.txt")], tmp_path / "out", vocab_size=300, options=Options(), workers=1)
    assert flagged(tmp_path / "out") == {}
    assert len([r for r in caplog.records if "1 document is repeated text" in r.getMessage()]) == 1


def test_prepare_judges_each_source_on_its_own_share_of_repeated_text(tmp_path):
    """A toy source of one line repeated beside a source of real pages and a loop: the toy kept, the loop flagged.
    Before: the shared sample (mostly the toy's files) was most repetition, so the real source's loop was spared too."""
    toy, real = tmp_path / "toy", tmp_path / "real"
    toy.mkdir(), real.mkdir()
    for i in range(12):
        (toy / f"t{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
    for page in sorted(DOCS.glob("*.md"))[:4]:
        (real / f"{page.stem}.txt").write_text(page.read_text()[:3000])
    (real / "loop.txt").write_text(loops("")["line"])
    prepare([str(toy), str(real)], tmp_path / "out", vocab_size=300, options=Options(), workers=1)
    assert {Path(name).stem: why.split(":")[0] for name, why in flagged(tmp_path / "out").items()} == {
        "loop": "repeated text"
    }


def test_a_row_of_a_handful_of_tokens_repeated_is_a_repeat_and_random_tokens_never_are():
    """The data watch keeps a row whose 4 commonest tokens are half its targets (orchestrator/attribution.py): debug,
    seed 1, a test_quopri.py row of 64 targets, 37 of them one "zzzz" token, read 0.64; a table of zeros
    (two tokens) and base64 of zero bytes are repeats too. Random tokens over 512, 64 a row, never reach the bar."""
    quopri = [430] * 37 + [12] * 2 + list(range(100, 125))  # 27 distinct, as the row's
    zeros = [7, 12] * 32
    padding = list(range(20)) + [61] * 44  # base64 of zero bytes: "AAAA..."
    assert [row_repeat_share(np.array(r)) >= REPEATED for r in (quopri, zeros, padding)] == [True] * 3
    assert abs(row_repeat_share(np.array(quopri)) - 41 / 64) < 1e-9
    rng = random.Random(0)
    drawn = max(row_repeat_share(np.array([rng.randrange(512) for _ in range(64)])) for _ in range(2000))
    assert drawn < 0.25
    assert row_repeat_share(np.array([5] * 15)) == 0.0  # too few targets to say
