"""A resume at a raised difficulty: build_rl_phase rebuilds the phase's data.seq_len from the config (the first
difficulty's rows), and load_state_dict restored only the loader, so the phase's rows (the OOM handler's smallest
micro-batch, training/control.py) were under one row of the raised difficulty's prompts again."""

import threading
from types import SimpleNamespace

from test_rl_batches import CharTokenizer
from test_rl_curriculum_async import solver
from trimtab.config.data import DataConfig
from trimtab.config.rl import RLConfig
from trimtab.rl.curriculum import set_difficulty
from trimtab.rl.phase import RLPhase, problems_of


def phase_and_loader() -> tuple[RLPhase, object]:
    rl = RLConfig(prompts="builtin:arithmetic:1", group_size=2, prompts_per_step=2, verifier_workers=1, held_out=0)
    cfg = SimpleNamespace(rl=rl, train=SimpleNamespace(seed=0, micro_batch_tokens=0))
    train, held = problems_of(cfg)
    phase = RLPhase("rl", 0, 10, DataConfig(seq_len=4 + rl.max_new_tokens), None, train, held, CharTokenizer(), 4)
    ours = phase.loader(cfg, 0)
    ours.policy = solver(threading.Event(), threading.Event())
    return phase, ours


def test_a_resume_at_a_raised_difficulty_keeps_the_phase_rows():
    (phase, ours), (again, resumed) = phase_and_loader(), phase_and_loader()
    try:
        set_difficulty(ours, 2, max_seq_len=64)
        assert phase.data.seq_len == ours.max_prompt_tokens + ours.cfg.max_new_tokens  # a raise widens its phase
        resumed.load_state_dict(ours.state_dict())
    finally:
        ours.close()
        resumed.close()
    assert resumed.difficulty == 2
    assert again.data.seq_len == resumed.max_prompt_tokens + resumed.cfg.max_new_tokens == phase.data.seq_len
