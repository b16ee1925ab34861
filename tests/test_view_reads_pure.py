"""RunView's reads of the model (row_losses, held_out_row_losses, probe_loss) change nothing of
the run: a scoring forward ran in eval mode and left the model there, and overwrote the MoE and
Mixture-of-Depths layers' last-forward state. A hook may read inside a step (update_gate), before
the re-run of a flagged step (resilience.rerun), whose forward then ran in eval mode: MoE
dropless and without its auxiliary losses, MoD by its predictor, so the update applied came from
another computation and the run trained differently for a read."""

import json

import pytest
import torch
from safetensors.torch import load_file

from trimtab.api import train
from trimtab.checkpoint import list_checkpoints
from trimtab.training.hooks import Hook

pytestmark = pytest.mark.usefixtures("one_thread")

PRESETS = ["debug-moe", "debug-mod"]
STEPS = 6


def reads(run) -> None:
    run.row_losses([0, 1, 2])
    run.held_out_row_losses(4)
    run.probe_loss()


def model_state(trainer) -> list:
    """What a read could leave changed: every module's mode, the routed layers' last-forward
    state, the buffers and the random number generator."""
    model = trainer.model
    routed = [layer for _, layer in model.moe_layers()] + [router for _, router in model.mod_layers()]
    return [
        [m.training for m in model.modules()],
        [(id(layer.aux_loss), {k: id(v) for k, v in layer.stats.items()}) for layer in routed],
        [b.clone() for b in model.buffers()],
        torch.get_rng_state(),
    ]


def same(a: list, b: list) -> bool:
    buffers = all(torch.equal(x, y) for x, y in zip(a[2], b[2]))
    return a[0] == b[0] and a[1] == b[1] and buffers and torch.equal(a[3], b[3])


class Checks(Hook):
    """Compares the model's state before and after the reads, inside a step and after it."""

    def __init__(self) -> None:
        self.compared: list[bool] = []

    def _check(self, run) -> None:
        before = model_state(run._t)  # the test's way in: the live model, which the view hands no hook
        reads(run)
        self.compared.append(same(before, model_state(run._t)))

    def update_gate(self, run, loss, grad_norm):
        self._check(run)
        return None

    def on_step_end(self, run, out) -> None:
        self._check(run)


class FlagsAndReads(Hook):
    """Flags the first computation of every other step (the trainer re-runs it, then applies the
    re-run's update: its own gate passes) and, where `read`, reads the model at every gate and
    every step's end."""

    def __init__(self, read: bool) -> None:
        self.read, self.gated = read, set()

    def update_gate(self, run, loss, grad_norm):
        if self.read:
            reads(run)
        step = run.step + 1
        if step % 2 or step in self.gated:
            return None
        self.gated.add(step)
        return torch.ones((), dtype=torch.bool, device=loss.device)

    def on_step_end(self, run, out) -> None:
        if self.read:
            reads(run)


def run(preset: str, out, hooks: list) -> tuple[list, dict]:
    cfg = {"max_steps": STEPS, "batch_tokens": 512, "micro_batch_tokens": 256, "eval_tokens": 512}
    cfg |= {"eval_every": 3, "log_every": 1, "precision": "fp32"}
    train(
        preset=preset,
        out=str(out),
        hooks=hooks,
        train=cfg,
        data={"max_bytes": 60_000},
        orchestrator={"mode": "off"},
        checkpoint={"every": 100},
        log={"progress": False, "tensorboard": False},
    )
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [(m.get("step"), m.get("loss"), m.get("val_loss")) for m in lines if "loss" in m or "val_loss" in m]
    return curve, load_file(str(list_checkpoints(out)[-1] / "model.safetensors"))


@pytest.mark.parametrize("preset", PRESETS)
def test_reads_leave_the_model_its_mode_its_routing_state_and_the_rng_as_they_were(tmp_path, preset):
    hook = Checks()
    run(preset, tmp_path / "r", [hook])
    assert len(hook.compared) >= 2 * STEPS and all(hook.compared), hook.compared


@pytest.mark.parametrize("preset", PRESETS)
def test_a_run_that_reads_trains_bit_for_bit_as_one_that_does_not(tmp_path, preset):
    quiet_curve, quiet = run(preset, tmp_path / "quiet", [FlagsAndReads(read=False)])
    read_curve, read = run(preset, tmp_path / "read", [FlagsAndReads(read=True)])
    assert any(v is not None for _, _, v in quiet_curve)  # evaluated: the eval curve is compared too
    assert read_curve == quiet_curve
    assert quiet.keys() == read.keys() and all(torch.equal(quiet[k], read[k]) for k in quiet)
