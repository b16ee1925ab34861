"""Word salad inside a long plain-text file that is mostly text (data/stretches.py): its stretch named, and left out
with drop, the rest of the file kept."""

import logging
import random
import re

import numpy as np

from test_junk import grammar_prose, salad_of
from trimtab.data.prepare import Options, prepare
from trimtab.data.prepared import PreparedData
from trimtab.data.tokenizer import TextTokenizer


def salad_inside(path, rng: random.Random) -> tuple[int, int]:
    """A text file of 1.1M characters of prose, 300K of it in the middle word salad; the salad's characters."""
    paragraphs = [grammar_prose(rng, 2_000) for _ in range(540)]
    head, salad, tail = paragraphs[:200], paragraphs[200:350], paragraphs[350:]
    start = len("\n\n".join(head)) + 2
    middle = "\n\n".join(salad_of(p, rng) for p in salad)
    path.write_text("\n\n".join(head) + "\n\n" + middle + "\n\n" + "\n\n".join(tail))
    return start, start + len(middle)


def test_word_salad_inside_a_long_text_file_is_named_and_left_out_with_drop(tmp_path, caplog):
    """Judged in pieces of 1M characters, this file's first piece, 30% salad, was judged salad (1.43 bits, under
    1.5) and the whole file flagged, its 73% of prose with it; 400K of salad in a 3 MB file was kept, unsaid."""
    path = tmp_path / "book.txt"
    start, end = salad_inside(path, random.Random(0))
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        prepare([str(path)], tmp_path / "warn", vocab_size=400, options=Options(), workers=1)
    (said,) = [r.getMessage() for r in caplog.records if "stretches of junk" in r.getMessage()]
    first, last = (int(x.replace(",", "")) for x in re.search(r"book.txt characters ([\d,]+)-([\d,]+)", said).groups())
    assert start - 100_000 < first and last < end + 100_000 and last - first >= 0.6 * (end - start), said
    assert "kept, and trained on" in said and "word salad" in said
    out = tmp_path / "drop"
    prepare([str(path)], out, vocab_size=400, options=Options(garbage_filter="drop"), workers=1)
    data = PreparedData(out)
    text = TextTokenizer.load(out / "tokenizer.json").decode(data.read(0, data.n_tokens).astype(np.int64).tolist())
    whole = path.read_text()
    assert data.n_docs == 1 and text.startswith(whole[:1000].strip()) and whole[-1000:].strip() in text
    assert whole[first + 1000 : first + 2000] not in text and len(whole) - len(text) > 0.6 * (end - start)
    assert whole[first - 2000 : first - 1000] in text and whole[last + 1000 : last + 2000] in text


def test_a_long_text_file_of_prose_alone_has_no_junk_stretch(tmp_path, caplog):
    path = tmp_path / "book.txt"
    rng = random.Random(1)
    path.write_text("\n\n".join(grammar_prose(rng, 2_000) for _ in range(540)))
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        manifest = prepare(
            [str(path)], tmp_path / "out", vocab_size=400, options=Options(garbage_filter="drop"), workers=1
        )
    assert not [r for r in caplog.records if "junk" in r.getMessage()]
    assert manifest["documents"] == 1 and manifest["files"][0].get("garbage", 0) == 0
