"""A prompt file with one prompt longer than model.max_seq_len: refused naming its file and line,
and not "lower rl.max_new_tokens", which cannot make room when the prompt fills the context alone
(it was "rl.max_new_tokens=16 after a prompt of 202 tokens exceeds model.max_seq_len=128; lower
rl.max_new_tokens or shorten the prompts", with no word of which prompt)."""

import json

import pytest

from test_rl_batches import CharTokenizer
from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.rl.phase import build_rl_phase


def phase_of(tmp_path, prompts: list[str], max_new_tokens: int = 16):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "2"}) + "\n" for p in prompts))
    rl = {"enabled": True, "prompts": str(path), "held_out": 0, "max_new_tokens": max_new_tokens}
    cfg = load_config(preset="debug", overrides={"rl": rl, "train": {"max_steps": 2}})
    return path, lambda: build_rl_phase(cfg, CharTokenizer())


def test_a_prompt_longer_than_the_context_is_named_by_file_and_line(tmp_path):
    path, build = phase_of(tmp_path, ["1+1=", "1+" * 100 + "1="])  # 202 characters, max_seq_len 128
    with pytest.raises(ConfigError, match="fills model.max_seq_len=128 alone") as caught:
        build()
    assert f"({path}:2)" in str(caught.value) and "lower rl.max_new_tokens" not in str(caught.value)


def test_a_prompt_that_leaves_too_little_room_names_its_line_and_the_budget(tmp_path):
    path, build = phase_of(tmp_path, ["1+" * 60 + "1=", "1+1="], max_new_tokens=16)  # 122 + 16 > 128
    said = r"rl.max_new_tokens=16 after a prompt of 122 tokens \(.*:1\) exceeds"
    with pytest.raises(ConfigError, match=said) as caught:
        build()
    assert "lower rl.max_new_tokens to at most 6 or" in str(caught.value)  # the budget that fits: 128 - 122
