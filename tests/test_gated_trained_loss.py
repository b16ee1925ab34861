"""Rows the row gate left out of a step's update (training/row_gate.py) stand in its loss as scored,
but the step is judged on the rows it trained: the update's gain (training/gain.py), the update
gate's ceilings and the loss the monitors read (orchestrator/readings.py)."""

from types import SimpleNamespace

import pytest
import torch

import trimtab
from test_orchestrator_loop import debug_cfg
from trimtab.config import load_config
from trimtab.data import IGNORE_INDEX
from trimtab.data.batches import MicroBatch, StepBatch
from trimtab.model import build_model
from trimtab.orchestrator.readings import step_metrics
from trimtab.training.gain import GainProbe
from trimtab.training.hooks import Hook
from trimtab.training.loss import cross_entropy_sum
from trimtab.training.runtime import RowLosses

pytestmark = pytest.mark.usefixtures("one_thread")


def _gain_with_a_gated_twin(lr: float) -> float:
    """One plain SGD step on a tiny model over two rows, the second (gated) a copy of the first: its
    gradient trained the first row only, so scoring the copy again doubles the change measured."""
    torch.manual_seed(0)
    model = build_model(load_config(preset="debug", sets=["model.vocab_size=96"]).model)
    model.train()
    inputs = torch.randint(0, 96, (1, 16)).repeat(2, 1)
    targets = torch.randint(0, 96, (1, 16)).repeat(2, 1)
    micro = MicroBatch(inputs, targets, 32, [7, 9])
    batch = StepBatch([micro], 32, 32, [7, 9])

    def score(m: MicroBatch) -> torch.Tensor:
        return cross_entropy_sum(model(m.inputs), model.lm_head.weight, m.targets)

    trained = targets.clone()
    trained[1] = IGNORE_INDEX
    rows = RowLosses([7, 9], torch.device("cpu"), gated=True)
    token_losses = rows.buffer(targets)
    (cross_entropy_sum(model(inputs), model.lm_head.weight, trained, token_losses=token_losses) / 32).backward()
    token_losses.view(2, 16)[1] = token_losses.view(2, 16)[0].detach()  # the gated copy's score, as recorded
    rows.add([7, 9], token_losses.detach(), targets, torch.tensor([0.0, 1.0]))
    loss = token_losses.detach().sum() / 32  # the step's loss holds the gated row's score
    probe = GainProbe(model, score, lambda t: t, torch.device("cpu"))
    probe.before()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return float(probe.after(batch, loss, rows))


def test_the_gain_of_a_step_with_rows_gated_is_scored_on_the_rows_it_trained():
    """debug at 10x the LR, bad_rows@10:4: step 10 read -0.41 with its 10 gated rows scored again after the
    update (steps 3-9 0.27-0.56), and a gated step's gain was not counted: a bad-rows run at an LR far too
    high kept it. Scored on the trained rows, a small step delivers what its gradient promised (with the
    gated copy scored again: 2)."""
    assert 0.9 < _gain_with_a_gated_twin(1e-3) < 1.1


def test_the_trained_loss_leaves_the_gated_rows_out_and_is_the_loss_itself_without():
    rows = RowLosses([1, 2, 3], torch.device("cpu"), gated=True)
    targets = torch.zeros(3, 4, dtype=torch.long)
    rows.add([1, 2, 3], torch.tensor([1.0] * 4 + [2.0] * 4 + [9.0] * 4), targets)
    loss = torch.tensor(4.0)
    assert rows.trained(loss) is loss or float(rows.trained(loss)) == 4.0  # none gated: the step's loss
    rows.values[2, 2] = 1.0  # the third row gated
    assert float(rows.trained(loss)) == pytest.approx(1.5)
    rows.values[:, 2] = 1.0  # every row gated: nothing trained, judged on what it scored
    assert float(rows.trained(loss)) == 4.0
    assert float(RowLosses([1], torch.device("cpu")).trained(loss)) == 4.0  # no gate


def test_the_monitors_read_the_loss_of_the_rows_trained():
    """A step's loss with a quarter of it garbage the gate left out (scored 9) read 6.17 where its trained
    rows scored 5.43 (debug at 10x, bad_rows@10:4): the spike, divergence and above_start rules read that."""
    run = SimpleNamespace(total_steps=10, activation_checkpointing="off", world=1, row_parts=lambda rows: None)
    batch = SimpleNamespace(n_tokens=256, rows=[1, 2, 3, 4])
    out = SimpleNamespace(step=3, lr=1e-3, scheduled_lr=1e-3, lr_scale=1.0, micro_batch_tokens=256, changes=0)
    out.phase, out.batch, out.moe, out.mod, out.skip_by = 0, batch, None, None, ""
    host = [[5.0 * 64, 64, 0], [5.5 * 64, 64, 0], [6.0 * 64, 64, 0], [9.0 * 64, 64, 1]]
    values = {"loss": 6.375, "grad_norm": 1.0, "skipped": False, "overflow": False, "mod": None}
    values |= {"mod_layers": None, "moe": None, "rows": host, "gain": None}
    m = step_metrics(run, out, values, 1.0, None, {})
    assert m.gated_rows == [4] and m.loss == pytest.approx(5.5)
    values["rows"] = [[v[0], v[1], 1] for v in host]  # every row gated: withheld, judged on what it scored
    assert step_metrics(run, out, values, 1.0, None, {}).loss == 6.375


class _Seen(Hook):
    """Each step's (last computation's) loss as the update gate saw it, reported loss, rows and gain."""

    def __init__(self) -> None:
        self.gate, self.steps = 0.0, {}

    def measure_gain(self, run) -> bool:
        return True

    def update_gate(self, run, loss, grad_norm):
        self.gate = float(loss)
        return None

    def on_step_end(self, run, out) -> None:
        self.steps[out.step] = (self.gate, float(out.loss), out.row_losses.tolist(), float(out.update_gain))


def test_a_step_with_garbage_gated_is_gated_and_measured_on_the_rows_it_trained(tmp_path):
    """debug at 10x the LR, bad_rows@10:1: a quarter of step 10's rows random tokens, gated. The update gate
    compares the loss of the rows trained with its ceilings (the garbage's scores put the step's 0.6-0.9 nats
    higher), and the step's gain is the update's on them (-0.41 with the garbage scored again after it)."""
    seen = _Seen()
    faults, data = ["bad_rows@10:1"], {"max_bytes": 400_000}
    trimtab.train(
        debug_cfg(tmp_path, 10, faults=faults, train={"batch_tokens": 2048}, optim={"lr": 0.03}, data=data),
        hooks=[seen],
    )
    gate, loss, rows, gain = seen.steps[10]
    assert [r for r in rows if r[2] > 0], "the garbage was not gated"
    kept = [r for r in rows if r[2] == 0]
    trained = sum(r[0] for r in kept) / sum(r[1] for r in kept)
    assert gate == pytest.approx(trained, rel=1e-4) and gate < loss - 0.3
    assert all(g == pytest.approx(s, rel=1e-6) for g, s, _, _ in list(seen.steps.values())[:9])  # none gated
    gains = [g for _, _, _, g in list(seen.steps.values())[2:9]]
    assert min(gains) - 0.2 < gain < max(gains) + 0.2, (gain, gains)
