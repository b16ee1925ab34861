"""Refusals of the built-in task's difficulty: a prompt too long at rl.prompts builtin:arithmetic:DIGITS named
rl.max_new_tokens ("lower it to at most 1" at 99 digits: a response too short to answer), where the digits are
what to lower; and a configured difficulty above orchestrator.rl_signal.max_difficulty stopped as learned in words
that read as if the ceiling were the configured one."""

from types import SimpleNamespace

import pytest

from test_rl_batches import CharTokenizer
from test_rl_curriculum import SAMPLING, cfg, steps
from trimtab.config.rl import RLConfig
from trimtab.errors import ConfigError
from trimtab.orchestrator.rl_health import NoLearningSignal
from trimtab.orchestrator.rl_remedies import remedy
from trimtab.rl.phase import build_rl_phase


def test_a_builtin_task_too_long_names_the_digits_that_fit():
    rl = RLConfig(prompts="builtin:arithmetic:30", held_out=0, max_new_tokens=8)
    run = SimpleNamespace(
        rl=rl, train=SimpleNamespace(max_steps=1, epochs=0, seed=0), model=SimpleNamespace(max_seq_len=40)
    )
    with pytest.raises(ConfigError) as refused:
        build_rl_phase(run, CharTokenizer())
    words = str(refused.value)
    # CharTokenizer: a token a character, "a+b=" with 2 x digits + 2 characters (and its specials) in 40 - 8 tokens
    assert "builtin:arithmetic:30" in words and "max_seq_len=40" in words
    fits = int(words.split("rl.prompts=builtin:arithmetic:")[1].split()[0])
    assert 10 <= fits <= 15
    assert "lower rl.max_new_tokens" not in words


class Counting(CharTokenizer):
    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str, specials: bool = False) -> list[int]:
        self.encoded += 1
        return super().encode(text, specials)


def test_the_refusal_measures_samples_not_the_whole_task_at_every_difficulty():
    """builtin:arithmetic:99 took ~70 s to refuse on a loaded host: the whole task encoded (100,000 prompts), then
    2,048 a difficulty of the search, then the whole task at the digits that fit. Now the longest in characters of a
    sample's, so one whole task (the sure fit): ~210,000 encodes -> ~100,400 here, the same words."""
    rl = RLConfig(prompts="builtin:arithmetic:30", held_out=0, max_new_tokens=8)
    run = SimpleNamespace(
        rl=rl, train=SimpleNamespace(max_steps=1, epochs=0, seed=0), model=SimpleNamespace(max_seq_len=40)
    )
    tok = Counting()
    with pytest.raises(ConfigError, match=r"at 30 digits has prompts of 62 tokens.*builtin:arithmetic:15 \(the most"):
        build_rl_phase(run, tok)
    assert tok.encoded < 110_000


def test_a_configured_difficulty_above_the_ceiling_says_both():
    c = cfg()
    most = c.rl_signal.max_difficulty
    above = steps(NoLearningSignal(c), 1, 2, solved=1.0, difficulty=most + 2)[-1]
    stop = remedy(above, SAMPLING, c)
    assert stop.action == "stop"
    assert f"{most + 2} digits" in stop.params["reason"] and f"max_difficulty={most}" in stop.params["reason"]
