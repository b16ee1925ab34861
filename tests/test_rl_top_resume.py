"""The ceiling a curriculum raise found (RolloutLoader.top_difficulty, each batch's `top`: rl/curriculum.py) is
the loader's state: it was missing from the checkpoint, so a resumed run lost it and rule rl_signal raised past
the ceiling again (a failed decision each window) where the uninterrupted run stopped."""

import threading
from types import SimpleNamespace

import pytest

from test_rl_batches import CharTokenizer
from test_rl_curriculum_async import solver
from trimtab.config.rl import RLConfig
from trimtab.errors import ConfigError
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.curriculum import set_difficulty
from trimtab.rl.phase import problems_of


def loader() -> RolloutLoader:
    rl = RLConfig(prompts="builtin:arithmetic:1", group_size=2, prompts_per_step=2, verifier_workers=1, held_out=0)
    train, held = problems_of(SimpleNamespace(rl=rl, train=SimpleNamespace(seed=0)))
    ours = RolloutLoader(train, CharTokenizer(), rl, 0, seed=0, max_prompt_tokens=4, held_out=held)
    ours.policy = solver(threading.Event(), threading.Event())
    return ours


def test_the_ceiling_found_survives_a_resume():
    ours, resumed = loader(), loader()
    try:
        with pytest.raises(ConfigError):
            set_difficulty(ours, 2, max_seq_len=6)  # the next digit does not fit: the ceiling is 1
        ours.next_batch()
        resumed.load_state_dict(ours.state_dict())
        assert resumed.top_difficulty == ours.top_difficulty == 1
        a, b = ours.next_batch(), resumed.next_batch()
    finally:
        ours.close()
        resumed.close()
    assert b.health["top_difficulty"] == a.health["top_difficulty"] == 1
    assert [r.tokens for r in b.rollouts] == [r.tokens for r in a.rollouts]


def test_a_raise_lengthens_the_phase_rows():
    """After a raise the phase's data.seq_len (the OOM handler's smallest micro-batch, training/control.py) stayed
    the first difficulty's: 4 + 2 tokens, under one row of the 2-digit prompts ("12+34=": 6 + 2)."""
    from trimtab.config.data import DataConfig
    from trimtab.rl.phase import RLPhase
    from trimtab.training.rl_control import RLKnobs

    ours = loader()
    phase = RLPhase("rl", 0, 1, DataConfig(seq_len=4 + ours.cfg.max_new_tokens), None, [], [], ours.tok, 4)
    ours.on_difficulty = lambda: phase.fit(ours)  # as RLPhase.loader wires it
    t = SimpleNamespace(loader=ours, cfg=SimpleNamespace(model=SimpleNamespace(max_seq_len=64)))
    t.phases, t.state = [phase], SimpleNamespace(phase=0, rl_difficulty=None)
    try:
        RLKnobs._set_rl_difficulty(SimpleNamespace(_trainer=t), 2)
    finally:
        ours.close()
    assert ours.max_prompt_tokens >= 6
    assert phase.data.seq_len == ours.max_prompt_tokens + ours.cfg.max_new_tokens
