"""A step whose rows the row gate leaves out, every one, takes no update (training/row_gate.py,
trainer.train_step): its objective is empty, its gradient zero, yet AdamW's momentum and weight
decay would still move the weights (bad_batch@5 on debug: at the warm-up's peak LR)."""

from __future__ import annotations

import torch

from trimtab.config import load_config
from trimtab.config.row_rules import RowGateRule
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.outliers import all_gated, gate_finding
from trimtab.training.hooks import Hook
from trimtab.training.loss import IGNORE_INDEX
from trimtab.training.setup import setup
from trimtab.training.trainer import Trainer


class SpikeCeiling(Hook):
    """The update gate's spike ceiling (orchestrator/core.py update_gate): a step's loss above `ceiling` withheld."""

    def __init__(self, ceiling: float) -> None:
        self.ceiling = ceiling

    def update_gate(self, run, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        return loss > self.ceiling


def _trainer(tmp_path, hooks: list[Hook] = ()) -> Trainer:
    sets = ["data.max_bytes=100000", "orchestrator.row_gate.min_distinct=0.95", "log.progress=false"]
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "run")}, sets=sets)
    return Trainer(setup(cfg), hooks)


def _garbage(trainer: Trainer, batch, rows: int | None = None) -> None:
    """The first `rows` rows of every micro-batch (all: None) turned to random tokens, and the gate
    made to gate each candidate (its statistics stubbed: tests/test_row_gate.py tests them)."""
    for micro in batch.micro:
        for r in range(micro.targets.shape[0] if rows is None else rows):
            garbage = torch.randperm(trainer.model.cfg.vocab_size)[: micro.targets.shape[1]]
            micro.targets[r] = torch.where(micro.targets[r] == IGNORE_INDEX, IGNORE_INDEX, garbage)
        micro.n_targets = int((micro.targets != IGNORE_INDEX).sum())
    batch.n_targets = sum(m.n_targets for m in batch.micro)
    gate = trainer.row_gate
    gate.judged = gate.cfg.min_reference
    gate.gated = lambda means, z, ordinary, ordinary_z: torch.ones_like(means, dtype=torch.bool)


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_a_step_all_of_gated_rows_takes_no_update_and_counts_as_withheld(tmp_path):
    torch.manual_seed(0)
    trainer = _trainer(tmp_path)
    trainer._after_step(trainer.train_step(trainer.loader.next_batch()))  # AdamW's moments hold a step now
    batch = trainer.loader.next_batch()
    _garbage(trainer, batch)
    before, count = _weights(trainer), [dict(s).get("step") for s in trainer.optimizer.state.values()]
    out = trainer.train_step(batch)
    assert out.row_losses[:, 2].sum().item() == sum(m.targets.shape[0] for m in batch.micro)  # every row gated
    for b, p in zip(before, trainer.model.parameters()):  # before: momentum and decay moved them all
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    assert bool(out.skipped)
    assert [dict(s).get("step") for s in trainer.optimizer.state.values()] == count  # no bias-correction drift
    trainer._after_step(out)
    assert trainer.state.step == 2 and trainer.state.warm_behind == [0, 1]  # the warm-up held back, as for a skip


def test_a_step_all_of_gated_rows_over_the_spike_ceiling_is_withheld_once_not_re_run(tmp_path):
    """Its loss is the garbage's own, over the spike ceiling by design, its gradient zero: a re-run computes
    the same nothing again (debug, bad_batch@18:4: 3 of the 4 steps re-run, grad norm 0 both times)."""
    torch.manual_seed(0)
    trainer = _trainer(tmp_path, [SpikeCeiling(ceiling=1.0)])  # every step's loss stands above 1 nat
    assert trainer.rerun
    batch = trainer.loader.next_batch()
    _garbage(trainer, batch)
    computed = []
    gradients = trainer._gradients
    trainer._gradients = lambda *a: computed.append(1) or gradients(*a)
    out = trainer.train_step(batch)
    assert len(computed) == 1 and out.rerun is None  # computed once
    assert bool(out.skipped) and out.withheld  # withheld, as the row gate's step (the warm-up held back)


def test_a_step_with_one_row_left_still_updates(tmp_path):
    torch.manual_seed(0)
    trainer = _trainer(tmp_path)
    batch = trainer.loader.next_batch()
    _garbage(trainer, batch, rows=1)
    before = _weights(trainer)
    out = trainer.train_step(batch)
    assert 0 < out.row_losses[:, 2].sum().item() < len(batch.rows)
    assert not bool(out.skipped)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


def test_a_spike_of_a_step_whose_rows_were_all_gated_is_journaled_as_the_gates_one_decision():
    """The step's loss is its gated rows' own: the gate's decision says what happened, the spike
    noted in it, not a spike's skip_data that scores the rows again and watches the next steps
    (debug, seed 1, bad_batch@20: 32 of 32 rows gated, journaled as rule spike)."""
    rows = list(range(8))
    losses = {r: (7.4, 64) for r in rows}
    m = StepMetrics(step=20, loss=7.4, grad_norm=0.0, rows=rows, row_losses=losses, gated_rows=rows, skipped=True)
    spike = Finding(rule="spike", family="instability", step=20, evidence={"loss": 7.4}, summary="loss 7.4", strength=1)
    gated = gate_finding(m, RowGateRule())
    assert all_gated(gated, m, [spike]) == []
    assert gated.evidence["spike"] == {"summary": "loss 7.4", "loss": 7.4}
    m.gated_rows = rows[:7]  # one row trained on: the spike's to answer (left_out_once keeps the rows once)
    partly = gate_finding(m, RowGateRule())
    assert all_gated(partly, m, [spike]) == [spike] and "spike" not in partly.evidence
