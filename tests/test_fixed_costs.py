"""Costs every training run paid at start-up for the same result: the config's YAML through PyYAML's pure-Python
emitter (config/__init__.py dump_yaml) and a walk of the whole stdlib for the built-in corpus (data/sources.py)."""

import pytest
import yaml

from trimtab.config import dump_yaml, load_config
from trimtab.data import listing, sources

PRESETS = ("debug", "debug-moe", "debug-hybrid", "dense-1b")  # dense, MoE, a layer pattern, a large model


def _pure_python_emitter(*args, **kwargs):
    raise AssertionError("PyYAML's pure-Python emitter ran")


@pytest.mark.skipif(not yaml.__with_libyaml__, reason="PyYAML built without libyaml")
def test_config_yaml_is_the_text_safe_dump_writes_through_libyaml(monkeypatch):
    configs = [load_config(None, overrides={"preset": name}).to_dict() for name in PRESETS]
    expected = [yaml.safe_dump(config, sort_keys=False) for config in configs]
    monkeypatch.setattr(yaml.emitter.Emitter, "emit", _pure_python_emitter)
    assert [dump_yaml(config) for config in configs] == expected


def test_the_builtin_corpus_walks_the_stdlib_once_a_process(monkeypatch):
    first = sources.builtin_files()
    assert len(first[1]) > 500
    monkeypatch.setattr(listing.os, "walk", lambda *a, **k: pytest.fail("the stdlib was walked again"))
    assert sources.builtin_files() == first
