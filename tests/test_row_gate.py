"""The row gate (training/row_gate.py): a garbage row is left out of the update of the step that
first meets it, before the backward; clean rows, hard or of distinct tokens, are not."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trimtab.config import load_config
from trimtab.config.orchestrator import OrchestratorConfig, RowGateRule
from trimtab.errors import ConfigError
from trimtab.orchestrator import readings
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.outliers import OutlierRows, gate_finding, left_out_once, merged_into
from trimtab.orchestrator.policy import Policy
from trimtab.rundir import DECISIONS_FILE
from trimtab.training.loss import IGNORE_INDEX, cross_entropy_sum
from trimtab.training.row_gate import RowGate, distinct_shares, row_gate
from trimtab.training.runtime import RouterStats, RowLosses
from trimtab.training.setup import setup
from trimtab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

V, T = 64, 40


def test_distinct_shares_count_each_token_once_and_skip_ignored_targets():
    targets = np.array([[1, 2, 3, 4], [5, 5, 5, 6], [7, 8, IGNORE_INDEX, IGNORE_INDEX]])
    shares, counts = distinct_shares(targets)
    assert shares.tolist() == [1.0, 0.5, 1.0]
    assert counts.tolist() == [4, 4, 2]


def _gate(window_loss: float = 2.0) -> RowGate:
    """A gate whose reference holds rows at about `window_loss` nats (a small spread)."""
    gate = RowGate(RowGateRule(window=32, min_reference=8, min_targets=8), torch.device("cpu"))
    for _ in range(4):
        targets = torch.randint(0, 4, (8, T))  # few distinct tokens: never candidates
        gate.candidates(targets)
        losses = window_loss + 0.05 * torch.randn(8, 1).expand(8, T)
        gate.observe(losses.reshape(-1).clone(), targets)
    return gate


def _rows(hidden: torch.Tensor, targets: torch.Tensor, gate: RowGate) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """As the trainer runs the gate over a micro-batch (head: the identity, so hidden = logits):
    the rows scored, the targets trained on, the per-token losses recorded."""
    head = torch.eye(V)
    picked = gate.candidates(targets)
    trained = gate.mask(hidden, head, targets, picked)
    token_losses = torch.zeros(targets.numel())
    cross_entropy_sum(hidden, head, trained, token_losses=token_losses)
    gate.after(token_losses, targets, trained)
    return picked, trained, token_losses.view(targets.shape)


def _predicted(targets: torch.Tensor, scale: float) -> torch.Tensor:
    """Hidden states (= logits, the head the identity) that put `scale` on each target: text the
    model has learnt, at a loss that falls as `scale` grows (about 2 nats at 2.2 over 64 tokens)."""
    return torch.nn.functional.one_hot(targets, V).float() * scale


def test_a_row_of_distinct_tokens_scored_far_above_the_recent_rows_is_ignored_before_the_loss():
    """Row 0: distinct tokens scored uniform, ln 64 = 4.2 nats against a bar of 3 (garbage);
    row 1: distinct tokens predicted well (a clean list); row 2: few distinct tokens predicted
    at the reference's 2 nats (an ordinary row, scored beside them). Only row 0 is gated; its
    scored loss stands in the recorded losses, and it stays out of the reference."""
    torch.manual_seed(0)
    gate = _gate()
    targets = torch.stack([torch.randperm(V)[:T], torch.randperm(V)[:T], torch.randint(0, 3, (T,))])
    hidden = torch.zeros(3, T, V)
    hidden[1], hidden[2] = _predicted(targets[1], 20), _predicted(targets[2], 2.2)
    picked, trained, losses = _rows(hidden, targets, gate)
    assert picked == [0, 1] and gate.controls == [2]  # distinct enough to be scored; row 2 is not
    assert (trained[0] == IGNORE_INDEX).all()
    assert torch.equal(trained[1:], targets[1:])
    assert losses[0].mean().item() == pytest.approx(math.log(V), abs=1e-4)  # recorded as scored
    kept = gate.recent[~gate.recent.isnan()]
    assert kept.max().item() < 3.0  # not the gated row in the reference


def test_rows_of_random_tokens_under_a_nat_above_the_median_are_gated_text_scored_alike_is_not():
    """An imported model at ~5 nats over a 300-token vocabulary scores random tokens at ln 300 =
    5.7 or a little more: under a nat above its text, under the min_gap floor, and missed. Each
    row is scored against what random tokens would score under the model's own predictions:
    row 0 is random tokens (gated), row 1 a clean row at the same loss that the model predicts
    far better than random tokens (kept), rows 2-3 ordinary text at the reference's 5 nats."""
    torch.manual_seed(0)
    vocab = 300
    gate = RowGate(RowGateRule(window=32, min_reference=8, min_targets=8), torch.device("cpu"), vocab=vocab)
    for _ in range(4):
        targets = torch.randint(0, 4, (8, T))
        gate.candidates(targets)
        gate.observe((5.0 + 0.05 * torch.randn(8, 1).expand(8, T)).reshape(-1).clone(), targets)
    targets = torch.stack(
        [torch.randperm(vocab)[:T], torch.randperm(vocab - 10)[:T] + 10, *torch.randint(0, 4, (2, T))]
    )
    hidden = 0.3 * torch.randn(4, T, vocab)  # near-uniform predictions: random tokens at ~ln 300
    hidden[1, :, :10] += 4.0  # mass on ten other tokens: random tokens would score ~7 here,
    hidden[1, torch.arange(T), targets[1]] += 1.0  # its own ~5.7, as high as row 0's, yet far better
    hidden[2:, torch.arange(T).unsqueeze(0), targets[2:]] += 0.8  # ~5 nats, the reference's
    head = torch.eye(vocab)
    picked = gate.candidates(targets)
    trained = gate.mask(hidden, head, targets, picked)
    means = gate.scored[1].mean(1)
    assert 5.5 < means[0].item() < 6.0 and 5.5 < means[1].item() < 6.0  # both under a nat above the median
    assert (trained[0] == IGNORE_INDEX).all() and torch.equal(trained[1:], targets[1:])
    assert picked == [0, 1] and gate.controls == [2, 3]


def test_the_gate_stands_down_on_a_step_whose_ordinary_rows_stand_out_too():
    """A whole step unusual (a loss spike on a base64-heavy stretch, damaged weights): its ordinary
    rows stand far above the reference as one, and a row of distinct tokens scored as random
    tokens among them is the step's trouble, not bad data: nothing is gated. The same row in a
    step of ordinary rows at the reference is."""
    torch.manual_seed(0)
    garbage, text = torch.randperm(V)[:T], torch.randint(0, 4, (3, T))
    targets = torch.cat([garbage.unsqueeze(0), text])
    for scale, gated in ((0.0, False), (2.2, True)):  # ordinary rows at ln 64 = 4.2 (a spike), at 2 nats
        gate = _gate()
        hidden = torch.zeros(4, T, V)
        for r in (1, 2, 3):
            hidden[r] = _predicted(targets[r], scale)
        trained = gate.mask(hidden, torch.eye(V), targets, gate.candidates(targets))
        assert bool((trained[0] == IGNORE_INDEX).all()) is gated
        assert gate.controls == [1, 2, 3]


def test_nothing_is_gated_before_the_reference_holds_min_reference_rows():
    gate = RowGate(RowGateRule(min_reference=8, min_targets=8), torch.device("cpu"))
    assert gate.candidates(torch.randperm(V)[:T].unsqueeze(0)) == []


def test_the_gate_runs_in_auto_mode_only_and_its_keys_are_checked(tmp_path):
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path)})
    assert isinstance(row_gate(cfg, torch.device("cpu")), RowGate)
    for sets in (["orchestrator.mode=advise"], ["orchestrator.row_gate.enabled=false"]):
        assert row_gate(load_config(preset="debug", overrides={"out": str(tmp_path)}, sets=sets), "cpu") is None
    with pytest.raises(ConfigError, match="orchestrator.row_gate"):
        load_config(preset="debug", overrides={"out": str(tmp_path)}, sets=["orchestrator.row_gate.min_distinct=1.5"])


def _garbage_step(tmp_path, hooks=()) -> tuple[Trainer, object, object]:
    """A debug trainer whose first batch's first row is random tokens and whose gate's reference
    holds recent rows at 1 nat (the bar is 2; an untrained model scores ~6): the gate gates it
    (its statistics stubbed: the reference's bar alone)."""
    sets = ["data.max_bytes=100000", "orchestrator.row_gate.min_distinct=0.95", "log.progress=false"]
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "run")}, sets=sets)
    trainer = Trainer(setup(cfg), hooks=[hook(cfg) for hook in hooks])
    batch = trainer.loader.next_batch()
    micro = batch.micro[0]
    garbage = torch.randperm(trainer.model.cfg.vocab_size)[: micro.targets.shape[1]]
    micro.targets[0] = torch.where(micro.targets[0] == IGNORE_INDEX, IGNORE_INDEX, garbage)
    micro.n_targets = int((micro.targets != IGNORE_INDEX).sum())
    batch.n_targets = sum(m.n_targets for m in batch.micro)
    trainer.row_gate.recent.fill_(1.0)
    trainer.row_gate.judged = trainer.row_gate.cfg.min_reference
    # an untrained model scores its text as random tokens, where the gate stands down (RowGate.gated,
    # tested above on its own): here a candidate above the reference's bar is gated, the trainer's part tested
    gate = trainer.row_gate
    gate.gated = lambda means, z, ordinary, ordinary_z: means > gate.threshold()
    return trainer, batch, micro


def test_the_trainer_leaves_a_gated_row_out_of_the_gradient_and_reports_its_loss(tmp_path):
    """A garbage row in a real step: the step's gradient is the one without that row's targets,
    and its row loss is the loss it scored (the rows rule judges it as any row)."""
    trainer, batch, micro = _garbage_step(tmp_path)

    def gradients() -> tuple[torch.Tensor, RowLosses, torch.Tensor]:
        trainer.optimizer.zero_grad(set_to_none=True)
        rows = RowLosses(batch.rows, trainer.device, gated=trainer.row_gate is not None)
        loss, _ = trainer._forward_backward(batch, RouterStats(trainer.model, trainer.device), rows)
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]), rows, loss

    gated, rows, loss = gradients()
    summed, count, flag = rows.values[rows.place[micro.rows[0]]].tolist()
    assert count == micro.n_targets - (micro.targets[1:] != IGNORE_INDEX).sum().item()
    assert summed / count > 5.0  # its loss as scored, not 0
    assert flag == 1.0 and rows.values[:, 2].sum().item() == 1.0  # marked gated, and only it
    # the step's loss is its rows' (the gated one's as scored), not its objective's: a step all
    # of garbage would report 0 and bend the loss trend the other rules watch
    assert loss.item() == pytest.approx(rows.values[:, 0].sum().item() / batch.n_targets, rel=1e-5)
    trainer.row_gate = None
    original = micro.targets.clone()
    micro.targets[0] = IGNORE_INDEX  # the same step with the row's targets ignored by hand
    without, _, _ = gradients()
    micro.targets.copy_(original)
    torch.testing.assert_close(gated, without)


def test_a_gated_row_is_journaled_as_one_decision_and_left_out_for_the_run(tmp_path):
    """The gate's intervention is the orchestrator's decision like any other: journaled with the
    row, its loss and why, read with the step's row losses (no read of its own), and applied (the
    row left out of later epochs)."""
    trainer, batch, micro = _garbage_step(tmp_path, hooks=[lambda cfg: Orchestrator(cfg.orchestrator, cfg.run_dir)])
    orchestrator = trainer.hooks[-1]
    orchestrator.on_train_start(trainer.view)
    orchestrator.on_step_end(trainer.view, trainer.train_step(batch))
    gated = [d for d in orchestrator.journal.decisions if d.rule == "row_gate"]
    assert len(gated) == 1, [d.summary for d in orchestrator.journal.decisions]
    d = gated[0]
    row = micro.rows[0]
    assert (d.action, d.params, d.mode, d.step) == ("skip_data", {"rows": [row]}, "auto", 1)
    assert d.evidence["gated"] and d.evidence["losses"][str(row)] > 5.0
    assert d.summary.startswith("1 row gated before the update") and "row gate already left them out" in d.reasoning
    trainer.control.apply()
    assert row in trainer.loader.skipped
    assert [json.loads(line)["rule"] for line in (trainer.cfg.run_dir / DECISIONS_FILE).read_text().splitlines()] == [
        "row_gate"
    ]


def _gated_metrics(step: int = 7) -> StepMetrics:
    """A step of 12 rows at ~4 nats but rows 3 and 5, gated at 6.5 and 7 (read: the third column)."""
    rows = list(range(12))
    host = [[4.0 * 64, 64, 0.0] for _ in rows]
    host[3], host[5] = [6.5 * 64, 64, 1.0], [7.0 * 64, 64, 2.0]  # 2: two ranks gated row 5 (summed)
    losses = readings.row_means(rows, host)
    gated = readings.gated_rows(rows, host)
    return StepMetrics(step=step, loss=4.5, grad_norm=1.0, rows=rows, row_losses=losses, gated_rows=gated)


def test_a_steps_gated_rows_are_planned_into_one_skip_data_that_says_the_update_left_them_out():
    m = _gated_metrics()
    assert m.gated_rows == [3, 5] and m.row_losses[3] == (6.5, 64)
    assert readings.gated_rows(m.rows, [[1.0, 2.0]] * 12) == []  # no gate: two columns
    f = gate_finding(m, RowGateRule())
    assert (f.rule, f.family, f.evidence["rows"], f.evidence["gated"]) == ("row_gate", "data", [3, 5], True)
    assert f.evidence["losses"] == {"3": 6.5, "5": 7.0} and f.evidence["step_median"] == 4.0
    assert f.summary == "2 rows gated before the update: 3 (6.50), 5 (7.00) against the step's median 4.00"
    view = SimpleNamespace(vocab_size=512)  # ln 512 = 6.24 nats
    remedy = Policy(OrchestratorConfig()).plan(f, view)
    assert (remedy.action, remedy.params) == ("skip_data", {"rows": [3, 5]})
    assert "already left them out of this step's update" in remedy.reasoning and "rest of the run" in remedy.reasoning
    assert gate_finding(StepMetrics(step=1, loss=4.0, grad_norm=1.0), RowGateRule()) is None
    # an LR 100x too high (healing benchmark, lr_too_high): step 6's rows at a median of 9.55, above the
    # 6.24 of random guesses, and one clean row at 10.69 was gated and left out for the run
    f.evidence["step_median"] = 9.55
    broken = Policy(OrchestratorConfig()).plan(f, view)
    assert broken.action == "none" and "worse than random tokens" in broken.reasoning


def test_a_gated_row_is_left_out_once_whatever_else_names_it():
    """The rows rule leaves the gate's rows to its decision (neither named nor suspects to name
    later); the data watch's decision takes them in; a spike's decision that leaves them out
    already keeps them, noted, and the gate's names only the others."""
    m = _gated_metrics()

    def rows_rule() -> OutlierRows:
        rule = OutlierRows(OrchestratorConfig())
        rule.reference().extend([0.0] * 200)  # rows measured from their step's median (outliers.py)
        rule.suspects, rule.due = {"5": 2.5}, {"5": 9}  # row 5 seen ungated before, an outlier then
        return rule

    rule = rows_rule()
    assert rule.observe(m) is None and rule.suspects == {} and rule.due == {}
    rule, m.gated_rows = rows_rule(), []
    assert rule.observe(m).evidence["rows"] == [5] and list(rule.suspects) == ["3"]  # without the gate

    m.gated_rows = [3, 5]
    watched = Finding(rule="data", family="data", step=7, evidence={"rows": [5, 9]}, summary="", strength=1.0)
    assert merged_into(watched, [gate_finding(m, RowGateRule())]) == []
    assert watched.evidence["rows"] == [5, 9, 3] and watched.evidence["row_gate"]["rows"] == [3, 5]

    class Journal:
        decisions = [
            SimpleNamespace(id=1, step=6, action="skip_data", mode="auto", params={"rows": [3]}, evidence={}),
            SimpleNamespace(id=2, step=7, action="skip_data", mode="advise", params={"rows": [3]}, evidence={}),
            SimpleNamespace(id=3, step=7, action="skip_data", mode="auto", params={"rows": [5, 8]}, evidence={}),
        ]
        write = staticmethod(lambda: None)

    f = left_out_once(gate_finding(m, RowGateRule()), Journal)
    assert f.evidence["rows"] == [3] and f.summary.endswith("; 1 of them left out already by decision #3")
    assert Journal.decisions[2].evidence["row_gate"]["rows"] == [5] and not Journal.decisions[1].evidence
    m.gated_rows = [5]
    assert left_out_once(gate_finding(m, RowGateRule()), Journal) is None


def test_the_gates_reference_goes_into_the_checkpoint_and_a_resume_takes_it(tmp_path):
    """Everything stateful is in the checkpoint: a resume or a rollback began the gate's reference
    empty (no row gated for min_reference rows: a resumed run parted from the one never stopped).
    The ring comes back oldest first, the next row written over its oldest, as the saved one."""
    import json

    import trimtab
    from test_trainer import debug_cfg

    gate = _gate()
    for _ in range(3):  # 44 rows into a ring of 32: it wrapped
        targets = torch.randint(0, 4, (4, T))
        gate.candidates(targets)
        gate.observe((3.0 + torch.rand(4, 1).expand(4, T)).reshape(-1).clone(), targets)
    again = RowGate(gate.cfg, torch.device("cpu"))
    again.load_state_dict(json.loads(json.dumps(gate.state_dict())))
    for g in (gate, again):  # the same rows from here on: the same reference at every point
        targets = torch.randint(0, 4, (8, T))
        g.candidates(targets)
        g.observe((4.0 + torch.arange(8.0).view(8, 1).expand(8, T)).reshape(-1).clone(), targets)
    assert sorted(gate.recent.tolist()) == sorted(again.recent.tolist()) and gate.judged == again.judged == 52
    assert again.threshold().item() == gate.threshold().item()
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=4, checkpoint={"every": 4}))
    saved = json.loads((run / "checkpoints" / "step_000004" / "state.json").read_text())["row_gate"]
    assert saved["judged"] > 0 and sum(v is not None for v in saved["recent"]) == min(saved["judged"], 512)
    # its token-frequency tables a tensor in optim.pt, not JSON lists in state.json (0.8 MB at 128K tokens x 2)
    tables = torch.load(run / "checkpoints" / "step_000004" / "optim.pt", weights_only=True)["row_gate"]
    assert "frequencies" not in saved and tables.shape[0] == len(saved["sources"]) == 1 and tables.sum() > 0
    resumed = Trainer(setup(debug_cfg(run, steps=8, checkpoint={"every": 4})))  # (4 of 4: finished)
    resumed.resume(run / "checkpoints" / "step_000004", {})
    assert resumed.row_gate.judged == saved["judged"] and np.array_equal(
        resumed.row_gate.unigram.frequencies, tables.numpy()
    )
    assert sorted(v for v in resumed.row_gate.recent.tolist() if v == v) == sorted(v for v in saved["recent"] if v)


@pytest.mark.parametrize("how", ["pause-rule row_gate", "mode advise"])
def test_a_person_turns_the_gate_off_mid_run_through_the_orchestrator(tmp_path, how):
    """`trimtab ctl RUN pause-rule row_gate` or `ctl RUN mode advise` stopped the gate's journal, not
    the gate: rows went on being left out of updates with no decision to show it. The trainer asks
    its hooks (Hook.gates_rows) before each step's gate; the orchestrator says no while paused or
    not in auto mode."""
    trainer, batch, micro = _garbage_step(tmp_path, hooks=[lambda cfg: Orchestrator(cfg.orchestrator, cfg.run_dir)])
    orchestrator = trainer.hooks[-1]
    orchestrator.on_train_start(trainer.view)
    if how == "mode advise":
        orchestrator.mode = "advise"
    else:
        orchestrator.paused.add("row_gate")
    rows = RowLosses(batch.rows, trainer.device, gated=True)
    trainer._forward_backward(batch, RouterStats(trainer.model, trainer.device), rows)
    assert rows.values[:, 2].sum().item() == 0  # nothing gated
    orchestrator.mode, orchestrator.paused = "auto", set()
    rows = RowLosses(batch.rows, trainer.device, gated=True)
    trainer._forward_backward(batch, RouterStats(trainer.model, trainer.device), rows)
    assert rows.values[rows.place[micro.rows[0]], 2].item() == 1.0  # back on: the garbage row gated
