"""A mixture source is named by its index in the user's config (data.mix[i]) where a junk source left out
before it shifted its place among the sources kept: run_length.kept_whole named 'other', the config's
data.mix[2], data.mix[1] (the junk source data.mix[0] left out), and the repeat warning's key did the same."""

import json
import logging
import random

import pytest

from test_mixture_junk_source import phase
from test_quality import clean_documents
from trimtab.config import DataConfig
from trimtab.config.data import MixSource
from trimtab.training.run_length import kept_whole, mixed_sources

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_source_after_one_left_out_as_junk_is_named_by_its_config_index(tmp_path, tokenizer, caplog):
    rng = random.Random(0)
    noise = ("".join(rng.choice("0123456789(),.;:+-") for _ in range(900)) for _ in range(6))
    docs = clean_documents()
    files = {"noise": noise, "real": docs[:40], "other": docs[40:80]}
    for name, texts in files.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    mix = [MixSource(str(tmp_path / f"{name}.jsonl"), w) for name, w in zip(files, [0.2, 0.4, 0.4])]
    built = phase(DataConfig(mix=mix, seq_len=64, max_bytes=0), tokenizer)
    assert (built.names, built.indices) == (["real", "other"], [1, 2])  # the junk source left out
    assert [key for key, *_ in mixed_sources(built, "data")] == ["data.mix[1]", "data.mix[2]"]
    with caplog.at_level(logging.WARNING, logger="trimtab.training.run_length"):
        left = kept_whole(built, "data", [0, built.train.parts[1].n_tokens])  # every row of 'other' flagged
    assert left == [0, 0]
    assert "data.mix[2] ('other'): every one of its" in caplog.text and "data.mix[1]" not in caplog.text
