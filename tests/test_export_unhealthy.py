"""`trimtab export` of a run whose newest checkpoint was saved while the run was not healthy (an
escalation under way): it exported it without a word, where a rollback would not have returned to
it. It still exports the newest (a person may want it), and says so, naming the newest healthy one."""

import dataclasses
import logging

from hf_helpers import write_run
from trimtab.checkpoint import save_checkpoint
from trimtab.config import load_config
from trimtab.hf.export import export_checkpoint
from trimtab.model import build_model


def _run(tmp_path, tokenizer, saves):
    model = build_model(dataclasses.replace(load_config(preset="debug").model, vocab_size=tokenizer.vocab_size))
    run = write_run(tmp_path / "run", model, tokenizer)  # step 0
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for step, good in saves:
        save_checkpoint(run, step, weights, {}, {"moe": {}, "mod": {}, "tokens": step, "good": good}, keep=9)
    return run


def test_an_unhealthy_newest_checkpoint_is_exported_with_the_healthy_one_named(tokenizer, tmp_path, caplog):
    run = _run(tmp_path, tokenizer, ((2, True), (4, False), (6, False)))
    with caplog.at_level(logging.WARNING):
        _, path = export_checkpoint(run, tmp_path / "hf")
    assert path.name == "step_000006"
    assert "checkpoint step 6, exported, was saved while the run was not healthy" in caplog.text
    assert "the newest healthy checkpoint is step 2: export it with --step" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        export_checkpoint(run, tmp_path / "hf4", step=4)  # asked for by step: the person chose it
        export_checkpoint(_run(tmp_path / "b", tokenizer, ((2, True),)), tmp_path / "hf2")
    assert "not healthy" not in caplog.text
