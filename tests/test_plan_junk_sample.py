"""`trimtab plan --data` on raw text whose junk-screen sample (data/junk_sample.py) is all junk: it warned and planned
the source, where training refuses a source of junk alone (data/packing.py JunkSource); now it judges the source
whole and refuses it with the same error as a source judged whole (plan/junk_screen.py)."""

import dataclasses
import functools

import pytest

from test_mixture_junk_source import mixture
from test_plan_counts import CPU
from test_plan_junk import config
from trimtab.data import junk_sample
from trimtab.errors import ConfigError
from trimtab.plan import make_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_sample_all_junk_is_refused_as_training_refuses_the_source(tmp_path, monkeypatch):
    source = mixture(tmp_path, 2).mix[0].source  # 6 documents of random characters
    # a budget of one document's 900 characters: the sample is 1 of the 6, as a real corpus's is a share of it
    monkeypatch.setattr(junk_sample, "sampled_kinds", functools.partial(junk_sample.sampled_kinds, budget=900))
    with pytest.raises(ConfigError, match=r"--data .*noise0.jsonl: every one of its 6 documents is junk \(6 random"):
        make_plan(config(tmp_path), data_path=source, hardware=CPU)  # before: warned, 1,323 tokens planned


def test_a_sample_all_junk_kept_by_the_screen_is_refused_too(tmp_path, monkeypatch):
    source = mixture(tmp_path, 2).mix[0].source
    monkeypatch.setattr(junk_sample, "sampled_kinds", functools.partial(junk_sample.sampled_kinds, budget=900))
    cfg = config(tmp_path, garbage_filter="warn")
    cfg = dataclasses.replace(cfg, orchestrator=dataclasses.replace(cfg.orchestrator, mode="off"))
    with pytest.raises(ConfigError, match=r"every one of its 6 documents is junk"):
        make_plan(cfg, data_path=source, hardware=CPU)  # before: warned, then planned every token (exit 0)
