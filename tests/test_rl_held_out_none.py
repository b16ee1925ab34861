"""A prompt file too small for a held-out split (under 10 lines: at most a tenth is held out) with
rl.held_out asked for: the run evaluated nothing and rule rl_hacking watched nothing, and it said
not a word (found running `trimtab rl` on a one-prompt file with train.eval_every=2)."""

import json
import logging

from test_rl_batches import CharTokenizer
from trimtab.config import load_config
from trimtab.rl.phase import build_rl_phase


def build(tmp_path, lines: int, held_out: int):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(lines)))
    rl = {"enabled": True, "prompts": str(path), "held_out": held_out, "max_new_tokens": 4}
    return build_rl_phase(load_config(preset="debug", overrides={"rl": rl, "train": {"max_steps": 2}}), CharTokenizer())


def test_a_file_too_small_to_hold_any_out_says_the_run_has_no_held_out_evaluation(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trimtab.rl.phase"):
        phase = build(tmp_path, 9, 64)
    assert phase.held_out == [] and len(phase.problems) == 9
    said = [r.getMessage() for r in caplog.records if r.name == "trimtab.rl.phase"]
    assert len(said) == 1 and "rl.held_out=64" in said[0] and "has 9 line(s)" in said[0]
    assert "no held-out evaluation" in said[0] and "10 or more lines, or set rl.held_out=0" in said[0]


def test_a_file_that_holds_fewer_out_than_asked_says_how_many(tmp_path, caplog):
    """dpo.pairs said so (dpo_phase.py); rl.prompts held 6 of the default 64 out of a 60-line file unsaid, and rule
    rl_hacking judged a fall over those 6."""
    with caplog.at_level(logging.WARNING, logger="trimtab.rl.phase"):
        assert len(build(tmp_path, 60, 64).held_out) == 6  # a tenth of 60
    said = [r.getMessage() for r in caplog.records if r.name == "trimtab.rl.phase"]
    assert len(said) == 1 and "rl.held_out=64" in said[0] and "holds out 6 of its 60 prompts" in said[0]


def test_a_file_that_holds_out_what_was_asked_or_a_run_that_asks_for_none_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trimtab.rl.phase"):
        assert len(build(tmp_path, 100, 10).held_out) == 10  # the cap (a tenth) not reached
        assert build(tmp_path, 9, 0).held_out == []  # asked for none
    assert [r for r in caplog.records if r.name == "trimtab.rl.phase"] == []
