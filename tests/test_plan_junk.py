"""`trimtab plan --data` on raw text runs the junk screen training runs (plan/junk_screen.py): it ran none, so a
source of random characters was planned at its full tokens where training refuses it, and word salad that
training leaves out was counted as training tokens."""

import dataclasses
import json
import logging
import random
import re

import pytest

from test_junk import salad_of
from test_mixture_junk_source import mixture
from test_plan_counts import CPU
from test_quality import clean_documents
from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.plan import make_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def config(tmp_path, **data):
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "r")})
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_bytes=0, **data))


def test_raw_text_of_junk_only_is_refused_as_training_refuses_it(tmp_path):
    source = mixture(tmp_path, 2).mix[0].source  # 6 documents of random characters
    with pytest.raises(ConfigError, match=r"--data .*noise0.jsonl: every one of its 6 documents is junk \(6 random"):
        make_plan(config(tmp_path), data_path=source, hardware=CPU)  # before: 1,323 tokens planned
    assert make_plan(config(tmp_path, garbage_filter="off"), data_path=source, hardware=CPU).data.dataset_tokens > 0


def test_word_salad_in_raw_text_is_counted_out_where_training_leaves_it_out(tmp_path, caplog):
    rng = random.Random(0)
    clean = clean_documents()
    salad = [salad_of(text, rng) for text in clean[:30]]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in clean + salad))
    off = make_plan(config(tmp_path, garbage_filter="off"), data_path=str(path), hardware=CPU).data
    with caplog.at_level(logging.WARNING, logger="trimtab.plan.junk_screen"):
        drop = make_plan(config(tmp_path, garbage_filter="drop"), data_path=str(path), hardware=CPU).data
    assert re.search(r"mixed.jsonl: (2\d|30) of its documents \(.*word salad", caplog.text)  # of the 30
    share = 1 - drop.dataset_tokens / off.dataset_tokens  # before: 0, the salad counted as training tokens
    assert 0.15 < share < 0.3, share  # the salad: ~22% of the bytes
    assert "judged junk" in drop.source and "training leaves it out" in drop.source
