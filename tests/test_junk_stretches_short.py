"""Word salad inside a plain-text file under formats.TEXT_CHUNK_CHARS (one document, one piece): its stretch judged
on its own (data/stretches.py), not by the half-of-the-document rule alone."""

import logging
import random
import re

from test_junk import grammar_prose, salad_of
from trimtab.data.prepare import Options, prepare


def test_word_salad_inside_a_text_file_under_one_piece_is_named(tmp_path, caplog):
    """900K characters, 400K of them salad in the middle: read as one piece, only the half rule judged it (44%
    salad, under half) and nothing was named: the salad was trained on, unsaid."""
    rng = random.Random(0)
    paragraphs = [grammar_prose(rng, 2_000) for _ in range(450)]
    head, salad, tail = paragraphs[:130], paragraphs[130:330], paragraphs[330:]
    start = len("\n\n".join(head)) + 2
    middle = "\n\n".join(salad_of(p, rng) for p in salad)
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(head) + "\n\n" + middle + "\n\n" + "\n\n".join(tail))
    end = start + len(middle)
    assert len(path.read_text()) < 1_000_000
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        manifest = prepare([str(path)], tmp_path / "warn", vocab_size=400, options=Options(), workers=1)
    said = [r.getMessage() for r in caplog.records if "stretches of junk" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    first, last = (
        int(x.replace(",", "")) for x in re.search(r"book.txt characters ([\d,]+)-([\d,]+)", said[0]).groups()
    )
    assert start - 100_000 < first and last < end + 100_000 and last - first >= 0.6 * (end - start), said
    assert manifest["documents"] == 1 and manifest["files"][0].get("garbage", 0) == 0


def test_word_salad_inside_a_long_document_is_named_by_training_s_screen(tokenizer, caplog):
    """Training's in-memory screen judged a long document whole only: 3 MB of prose with 395K characters of salad
    in the middle (13%) went unsaid and was trained on; its stretch is named now, and trained on (warn)."""
    from trimtab.config import DataConfig
    from trimtab.data.packing import build_splits
    from trimtab.data.sources import Document

    rng = random.Random(0)
    paragraphs = [grammar_prose(rng, 2_000) for _ in range(700)]
    head, salad, tail = paragraphs[:250], paragraphs[250:450], paragraphs[450:]
    start = len("\n\n".join(head)) + 2
    middle = "\n\n".join(salad_of(p, rng) for p in salad)
    text = "\n\n".join(head) + "\n\n" + middle + "\n\n" + "\n\n".join(tail)
    docs = [Document([(text, True)], source="book.txt")]
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        build_splits(DataConfig(seq_len=16, eval_fraction=0.0), tokenizer, docs, None, seed=0, screen=True)
    said = [r.getMessage() for r in caplog.records if "stretches of junk" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    first, last = (
        int(x.replace(",", "")) for x in re.search(r"book.txt characters ([\d,]+)-([\d,]+)", said[0]).groups()
    )
    end = start + len(middle)
    assert start - 100_000 < first and last < end + 100_000 and last - first >= 0.6 * (end - start), said
    assert "kept, and trained on" in said[0]
