"""A run over a prompt (or pair) file resumed with another rl.held_out (dpo.held_out): the count
trained on changes, and the refusal names the held-out key beside the file's. It had said
"rl.prompts now has 180; resume with the same prompts" over the very same file."""

import pytest

from test_dpo import tokens
from test_rl_batches import CharTokenizer
from trimtab.config.dpo import DPOConfig
from trimtab.config.rl import RLConfig
from trimtab.errors import DataError
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.preference import PairLoader
from trimtab.rl.tasks import Problem


def prompts(n: int, spec: str) -> RolloutLoader:
    cfg = RLConfig(prompts=spec, group_size=2, prompts_per_step=2, verifier_workers=1)
    problems = [Problem(f"q{i}", "x") for i in range(n)]  # a file's, less its held-out ones
    return RolloutLoader(problems, CharTokenizer(), cfg, 64, seed=0, max_prompt_tokens=4)


def test_a_prompt_files_other_held_out_count_is_named_on_resume():
    state = prompts(190, "tasks.jsonl").state_dict()  # rl.held_out 10 of 200
    with pytest.raises(DataError, match="rl.prompts, less the rl.held_out held out, now has 180; resume with the same "
                       "rl.prompts and rl.held_out"):  # fmt: skip
        prompts(180, "tasks.jsonl").load_state_dict(state)
    with pytest.raises(DataError, match="had 190 prompts but rl.prompts now has 180; resume with the same prompts"):
        prompts(180, "builtin:arithmetic").load_state_dict(state)  # its held-out split is by hash, not by count


def test_a_pair_files_other_held_out_count_is_named_on_resume():
    state = PairLoader(tokens(10), [], DPOConfig(pairs="pairs.jsonl"), 1000, seed=0, pad_id=0).state_dict()
    again = PairLoader(tokens(9), [], DPOConfig(pairs="pairs.jsonl"), 1000, seed=0, pad_id=0)
    with pytest.raises(DataError, match="dpo.pairs, less the dpo.held_out held out, now has 9; resume with the same "
                       "dpo.pairs and dpo.held_out"):  # fmt: skip
        again.load_state_dict(state)
