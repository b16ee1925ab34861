"""DPO's held-out split of a file under 10 pairs holds none (at most a tenth of a file is held out,
data/arithmetic.py split_held_out): the run says so, naming the file, its count and the fix, as RL's
prompt files do (rl/phase.py problems_of), instead of evaluating nothing silently."""

from __future__ import annotations

import json
import logging

from trimtab.config import load_config
from trimtab.rl.dpo_phase import pairs_of


def _pairs(tmp_path, n: int) -> str:
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"What is {i}+{i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _split(tmp_path, n: int, held_out: int = 64):
    sets = [f"dpo.pairs={_pairs(tmp_path, n)}", f"dpo.held_out={held_out}"]
    return pairs_of(load_config(preset="debug", overrides={"out": str(tmp_path / "run")}, sets=sets))


def test_a_pairs_file_too_small_to_hold_any_out_is_warned_of(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trimtab.rl.dpo_phase"):
        train, held, _ = _split(tmp_path, 5)
    assert (len(train), held) == (5, [])
    (message,) = [r.getMessage() for r in caplog.records if r.name == "trimtab.rl.dpo_phase"]
    assert "dpo.held_out=64" in message and "pairs.jsonl" in message and "5 pair(s)" in message
    assert "10 or more" in message and "dpo.held_out=0" in message


def test_no_warning_when_the_split_holds_pairs_or_none_are_asked_for(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trimtab.rl.dpo_phase"):
        train, held, _ = _split(tmp_path, 20, held_out=2)  # asking more than a tenth is said (test_dpo_held_out_rule)
        assert (len(train), len(held)) == (18, 2)
        _split(tmp_path, 5, held_out=0)
    assert not [r for r in caplog.records if r.name == "trimtab.rl.dpo_phase"]
