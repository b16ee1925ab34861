"""The held-out micro-batches follow the training micro-batch after an out-of-memory heal: the
evaluation, the orchestrator's probe and its reference rows ran the start's larger micro-batches
after the orchestrator had halved the training ones (on a GPU they ran out of memory again: no
probe, failed evaluations). A re-split scores the same held-out targets, so val_loss stays the
same quantity across the shrink; a resume that restores the lowered budget splits them alike."""

import pytest
import torch

import trimtab
from test_mixture import rows_of
from test_orchestrator_loop import debug_cfg
from trimtab.data.batches import micro_batches
from trimtab.data.held_out import HeldOut
from trimtab.training.evaluation import mean_losses
from trimtab.training.hooks import Hook
from trimtab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

START, HEALED = 512, 256  # oom@3:300: a 512-token forward no longer fits, the halved 256 does


class HeldOutAtEachEval(Hook):
    """At each evaluation: its val_loss, and the same weights' val_loss over the held-out rows as
    split at the starting budget (the split before any shrink)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, float]] = []
        self.scoring = False  # its own scoring of the original split, which record_scoring leaves out

    def on_eval(self, run, metrics) -> None:
        trainer = run._t  # the test's way in: score the original split with the trainer's own scoring
        held: HeldOut = trainer.phases[0].eval_rows
        sums, sources, self.scoring = [], [], True
        for rows, indices, name in held.sets:
            for micro in micro_batches(rows, indices, START, held.pad_id):
                sums.append([float(trainer.score(micro).double()), micro.n_targets])
                sources.append(name)
        self.scoring = False
        self.seen.append((run.step, metrics["val_loss"], mean_losses(sums, sources)["val_loss"]))


def record_scoring(monkeypatch, hook: HeldOutAtEachEval | None = None) -> list[tuple[int, bool, int, int]]:
    """(step, in an evaluation, scored micro-batch's input positions, the loader's budget) of
    every held-out scoring: the evaluation's and the probe's (Trainer.score)."""
    real, scored = Trainer.score, []

    def score(self, micro):
        if not (hook and hook.scoring):
            scored.append((self.state.step, self.evaluating, micro.inputs.numel(), self.loader.micro_batch_tokens))
        return real(self, micro)

    monkeypatch.setattr(Trainer, "score", score)
    return scored


def run_cfg(out, steps):
    train = {"batch_tokens": 1024, "micro_batch_tokens": START, "eval_every": 2, "eval_tokens": 1024}
    return debug_cfg(
        out, steps=steps, faults=["oom@3:300"], data={"max_bytes": 60_000}, train=train, checkpoint={"every": 4}
    )


def test_eval_micro_batches_shrink_with_the_training_ones_and_val_loss_stays_the_same(tmp_path, monkeypatch):
    hook = HeldOutAtEachEval()
    scored = record_scoring(monkeypatch, hook)
    summary = trimtab.train(run_cfg(tmp_path / "r", 8), hooks=[hook])
    assert summary["exit_code"] == 0 and summary["step"] == 8
    before = [n for step, _, n, budget in scored if budget == START]
    assert max(before) > HEALED  # the start's held-out micro-batches were larger: the shrink is seen
    after = [(step, evaluating, n) for step, evaluating, n, budget in scored if budget == HEALED]
    assert any(evaluating for _, evaluating, _ in after) and any(not e for _, e, _ in after)  # evals, probes
    assert all(n <= HEALED for _, _, n in after), after
    assert [step for step, _, _ in hook.seen] == [2, 4, 6, 8]
    for step, val_loss, original in hook.seen:  # the same targets, the same weights: the same loss
        assert val_loss == pytest.approx(original, abs=1e-5), step


def test_a_resume_with_the_lowered_budget_evaluates_in_micro_batches_of_it(tmp_path, monkeypatch):
    trimtab.train(run_cfg(tmp_path / "r", 6))
    scored = record_scoring(monkeypatch)
    summary = trimtab.train(run_cfg(tmp_path / "r", 8))
    assert summary["exit_code"] == 0 and summary["step"] == 8
    evals = [(budget, n) for step, evaluating, n, budget in scored if evaluating]
    assert evals and all(budget == HEALED and n <= HEALED for budget, n in evals), evals


def test_a_held_out_split_keeps_its_rows_and_its_probe_at_any_budget(tokenizer):
    rows = rows_of(tokenizer, 12, 0)  # rows of up to 16 input positions
    held = HeldOut([(rows, list(range(10)), "")], 64, pad_id=0)
    probe, targets = held.probe_rows, sum(m.n_targets for m in held.micro)
    assert len(probe) > 1 and held.probe[0].rows == held.micro[0].rows  # the first micro-batch's rows
    for budget in (16, 32, 160, 64):
        held.at(budget)
        assert held.micro and all(m.inputs.numel() <= budget for m in held.micro)
        assert sorted(r for m in held.micro for r in m.rows) == list(range(10))  # the same rows, targets
        assert sum(m.n_targets for m in held.micro) == targets
        assert sorted(r for m in held.probe for r in m.rows) == sorted(probe)
    assert torch.equal(held.micro[0].inputs, held.probe[0].inputs)
