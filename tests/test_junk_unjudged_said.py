"""`trimtab data prepare`'s line for a source whose reference holds under junk.SMALL_WORDS words (junk.unjudged_line):
it said "their sample holds under 5,000 words" and "word salad was not judged" of a one-file source whose sample
held 133K words, all of it left out of the reference as a document judged word salad whole, while the file's
stretches were judged against each other and one of them named. It says what the sample held and what was judged."""

import logging
import re

from test_junk_stretches_training import salad_book
from trimtab.data.prepare import Options, prepare


def said(caplog, what: str) -> str:
    (line,) = [r.getMessage() for r in caplog.records if what in r.getMessage()]
    return line


def test_a_sample_left_out_as_word_salad_is_said_so_not_called_small(tmp_path, caplog):
    path = tmp_path / "book.txt"
    path.write_text(salad_book()[0])
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        prepare([str(path)], tmp_path / "out", vocab_size=400, options=Options(), workers=1)
    line = said(caplog, "was not judged")
    found = re.search(
        r"book.txt: a sample of ([\d,]+) words, ([\d,]+) of them in documents judged word salad whole", line
    )
    assert found and int(found[1].replace(",", "")) > 100_000, line
    assert "their sample holds under" not in line and "stretches of a long text file" in line
    assert said(caplog, "stretches of junk")  # its word order judged all the same


def test_a_small_source_is_said_with_its_sample_s_words(tmp_path, caplog):
    path = tmp_path / "small.txt"
    path.write_text("a few words of real text here and there, not many at all.\n" * 20)
    with caplog.at_level(logging.WARNING, logger="trimtab"):
        prepare([str(path)], tmp_path / "out", vocab_size=300, options=Options(), workers=1)
    assert "small.txt: a sample of 260 words)" in said(caplog, "was not judged")
