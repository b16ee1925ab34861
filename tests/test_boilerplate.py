"""Boilerplate across documents (data/boilerplate.py): the same lines in many files are measured on `data prepare`'s
sample and said in its report and manifest, not removed."""

import logging
from pathlib import Path

from test_junk_sources import flagged
from trimtab.data import boilerplate
from trimtab.data.prepare import Options, prepare

DOCS = Path(__file__).resolve().parents[1] / "docs"
HEADER = (
    "# Copyright (c) 2024 Example Corp. All rights reserved.\n"
    '# Licensed under the Apache License, Version 2.0 (the "License");\n'
    "# you may not use this file except in compliance with the License.\n"
)


def pieces(n: int) -> list[str]:
    """`n` different 2 KB pieces of docs/*.md: real text whose own lines seldom recur across pieces."""
    found = [page.read_text()[i : i + 2000] for page in sorted(DOCS.glob("*.md")) for i in range(0, 8000, 2000)]
    return [piece for piece in found if len(piece) == 2000][:n]


def test_a_licence_header_in_many_documents_is_measured_and_lines_in_a_few_are_not():
    """The header in 8 of 20 pieces: its share of the text and its lines, in 40% of the documents. A line in 4 of
    them (under MIN_DOCS) and the pieces alone: no boilerplate."""
    texts = pieces(20)
    assert len(texts) == 20 and boilerplate.measure(texts)["lines"] == []
    quoted = [text + "\nThis sentence is quoted in a few of the documents only.\n" if i < 4 else text
              for i, text in enumerate(texts)]  # fmt: skip
    assert boilerplate.measure(quoted)["share"] == 0.0
    found = boilerplate.measure([HEADER + text if i % 5 < 2 else text for i, text in enumerate(texts)])
    assert [line for _, line in found["lines"]] == sorted(HEADER.splitlines())
    assert all(share == 0.4 for share, _ in found["lines"])
    header = sum(len("".join(line.split())) for line in HEADER.splitlines()) * 8
    assert 0.5 * header / (20 * 1700) < found["share"] < 2 * header / (20 * 1700)


def test_prepare_says_how_much_of_the_corpus_is_boilerplate_and_keeps_it(tmp_path, caplog):
    """Before: nothing said, nothing in the manifest. After: the share in the manifest and a console line naming the
    header; no document flagged or left out for it."""
    src = tmp_path / "corpus"
    src.mkdir()
    for i, text in enumerate(pieces(20)):
        (src / f"{i}.txt").write_text(HEADER + text if i % 5 < 2 else text)
    with caplog.at_level(logging.INFO):
        manifest = prepare([str(src)], tmp_path / "out", vocab_size=300, options=Options(), workers=1)
    assert manifest["boilerplate"]["share"] > 0 and manifest["documents"] == 20
    assert flagged(tmp_path / "out") == {}
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("boilerplate:")]
    assert "Example Corp. All rights reserved." in line and "in 40% of them" in line
