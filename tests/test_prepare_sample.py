"""`trimtab data prepare`'s 8 MB sample (the garbage screen's scale, the junk screen's word pairs) reads a large
file's share from across it (data/windows.py), not from its head: a file whose text changes past its head was
judged by its head's kind only."""

import json

from trimtab.data import prepare, windows
from trimtab.data.shards import Options


def _halves(n: int) -> list[str]:
    """n paragraphs of one kind, then n of another: a file whose text changes half way."""
    first = [f"alpha paragraph {i}: the river runs past the mill and the miller counts his sacks" for i in range(n)]
    last = [
        f"omega paragraph {i}: def main(argv): return parse(argv) or exit(2) in the vendored module" for i in range(n)
    ]
    return first + last


def test_a_large_files_share_of_the_sample_is_drawn_from_across_it(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "SCALE_SAMPLE_BYTES", 6_000)  # far under each file: its share is a part of it
    jsonl, text = tmp_path / "crawl.jsonl", tmp_path / "book.txt"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in _halves(300)))
    text.write_text("\n".join(_halves(300)) + "\n")
    for path in (jsonl, text):
        sample = "".join(doc.text for doc in prepare._sample([str(path)], Options(), "hint"))
        assert 0.5 * 6_000 <= len(sample.encode()) <= 1.5 * 6_000  # its share, bounded: not the whole file
        assert sample.count("alpha paragraph") >= 3 and sample.count("omega paragraph") >= 3, path
        assert prepare._sample([str(path)], Options(), "hint")[0].text in sample  # seeded: the same again
    for start, end, _ in windows.spans(text, 6_000):  # each window whole lines
        raw = text.read_bytes()
        assert (start == 0 or raw[start - 1 : start] == b"\n") and raw[end - 1 : end] == b"\n"
