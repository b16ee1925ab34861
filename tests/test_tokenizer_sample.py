"""The BPE `trimtab data prepare` trains learns from a share of every file, not the first files'."""

from __future__ import annotations

import pytest

from trimtab.data import prepare_tokenizer
from trimtab.data.prepare import prepare


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sources of the documents the tokenizer is trained on (training stubbed: only the sample matters)."""
    seen: list[str] = []

    def train(docs, size):
        seen.extend(doc.source for doc in docs for _ in range(len(doc.text.encode())))
        raise RuntimeError("sample taken")

    monkeypatch.setattr(prepare_tokenizer, "train_tokenizer", train)
    monkeypatch.setattr(prepare_tokenizer, "TRAIN_SAMPLE_BYTES", 30_000)
    return seen


def test_the_tokenizer_sample_spreads_over_every_file(tmp_path, captured):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, word, lines in (("a.txt", "alpha", 4000), ("b.txt", "beta", 4000), ("c.txt", "gamma", 20)):
        (corpus / name).write_text("".join(f"{word} {i}\n" for i in range(lines)))
    with pytest.raises(RuntimeError, match="sample taken"):
        prepare([str(corpus)], tmp_path / "out", vocab_size=300)
    share = {name: sum(src.endswith(name) for src in captured) / len(captured) for name in ("a.txt", "b.txt", "c.txt")}
    # c.txt (~200 bytes) is taken whole, a.txt and b.txt (~40 KB each) share the rest; the first files until
    # the budget took a.txt alone
    assert share["c.txt"] > 0 and abs(share["a.txt"] - share["b.txt"]) < 0.05, share
    assert 29_000 <= len(captured) <= 30_000
    first = list(captured)
    captured.clear()
    with pytest.raises(RuntimeError, match="sample taken"):
        prepare([str(corpus)], tmp_path / "out2", vocab_size=300)
    assert captured == first  # deterministic
