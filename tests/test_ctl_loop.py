"""A person's commands (`trimtab ctl`) through the real loop: each action of the adaptive API
that the orchestrator rarely takes on its own, with its effect checked in the trainer."""

import json

import pytest

import trimtab
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config
from trimtab.orchestrator import ctl
from trimtab.rundir import read_decisions
from trimtab.training.hooks import Hook


class Person(Hook):
    """Types `trimtab ctl RUN VERB ARGS` once at each given step. The job finds the file at its
    next metrics read (the end of the following step) and applies it after that step, so the
    effect shows in the step after: recorded in `seen[sent step]`."""

    def __init__(self, run_dir, script):
        self.run_dir, self.script, self.seen, self.sent = run_dir, dict(script), {}, {}

    def on_step_end(self, trainer, out):
        if out.step in self.script:  # once: steps repeat after a rollback
            verb, *args = self.script.pop(out.step)
            ctl.send(self.run_dir, ctl.parse_command(verb, args))
            self.sent[out.step + 2] = out.step
        if out.step in self.sent:
            self.seen[self.sent.pop(out.step)] = {
                "lr": out.lr,
                "scheduled": trainer.scheduled_lr,
                "clip": trainer.grad_clip,
                "lr_scale": trainer.lr_scale,
                "wd": trainer.weight_decay,
                "saved": trainer.last_saved,
            }


pytestmark = pytest.mark.usefixtures("one_thread")


def test_person_drives_every_knob_through_ctl(tmp_path):
    run = tmp_path / "r"
    cfg = load_config(
        preset="debug",
        overrides={
            "out": str(run),
            "train": {"max_steps": 30, "eval_every": 0, "batch_tokens": 1024},
            "data": {"max_bytes": 150_000},
            "checkpoint": {"every": 8},
            "log": {"progress": False, "tensorboard": False},
            "orchestrator": {"throughput": {"enabled": False}},
        },
    )  # timing-based: not reproducible under load
    script = {
        3: ("set-lr", "0.001"),
        5: ("grad-clip", "0.25"),
        7: ("weight-decay", "0.0"),
        10: ("emergency-lr",),
        12: ("checkpoint",),
        14: ("rollback", "8"),
        20: ("stop", "done"),
    }
    person = Person(run, script)
    summary = trimtab.train(cfg, hooks=[person])
    seen = person.seen
    # set-lr in the warm-up (debug's 10 steps): the LR it rises to, the schedule's shape kept below it
    assert seen[3]["lr_scale"] == pytest.approx(1e-3 / cfg.optim.lr, rel=1e-6)
    assert seen[3]["lr"] < 1e-3  # on its way up
    assert seen[5]["clip"] == 0.25 and seen[7]["wd"] == 0.0
    assert seen[10]["lr_scale"] == pytest.approx(seen[7]["lr_scale"] * 0.1)  # emergency-lr: x0.1
    assert seen[12]["saved"] == 13  # checkpoint: written at the step the command arrived
    assert summary["status"] == "stopped (done)" and summary["step"] == 21  # after the rollback to 8
    ds = read_decisions(run)
    assert [d["action"] for d in ds] == [
        "set_lr",
        "set_grad_clip",
        "set_weight_decay",
        "emergency_lr_reduction",
        "save_checkpoint",
        "rollback",
        "stop",
    ]
    assert all(d["mode"] == "manual" and d["applied"] for d in ds)
    assert ds[5]["applied"][0].startswith("rolled back from step 15 to step 8")
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["lr_scale"] == pytest.approx(seen[10]["lr_scale"])  # knobs survive the rollback
    state = json.loads((list_checkpoints(run)[-1] / "state.json").read_text())
    assert state["train"]["grad_clip"] == 0.25 and state["train"]["weight_decay"] == 0.0  # and a restart


class Knobs(Person):
    """A person, and the micro-batch and checkpointing each step ran with."""

    def __init__(self, run_dir, script):
        super().__init__(run_dir, script)
        self.ran = {}

    def on_step_end(self, trainer, out):
        super().on_step_end(trainer, out)
        self.ran[out.step] = (trainer.micro_batch_tokens, trainer.activation_checkpointing)


def test_a_persons_micro_batch_and_checkpointing_are_not_probed_back(tmp_path):
    """The OOM rule's probe returns a lighter setting toward the configured one after a clean
    stretch; a person's own (`ctl micro-batch`, `ctl checkpointing`) is the setting from then on,
    over a resume too: it used to be doubled and lightened back after `probe_after` steps."""
    run = tmp_path / "r"

    def cfg(steps):
        sets = {"train": {"max_steps": steps, "eval_every": 0, "batch_tokens": 1024, "micro_batch_tokens": 1024}}
        return load_config(
            preset="debug",
            overrides={
                "out": str(run),
                **sets,
                "data": {"max_bytes": 150_000},
                "log": {"progress": False, "tensorboard": False},
                "orchestrator": {"throughput": {"enabled": False}, "oom": {"probe_after": 3}},
            },
        )

    person = Knobs(run, {2: ("micro-batch", "256"), 3: ("checkpointing", "full")})
    assert trimtab.train(cfg(12), hooks=[person])["status"] == "completed"
    assert all(person.ran[s] == (256, "full") for s in range(6, 13)), person.ran
    again = Knobs(run, {})
    assert trimtab.train(cfg(20), hooks=[again])["status"] == "completed"  # resumed at 12
    assert set(again.ran.values()) == {(256, "full")}, again.ran
    ds = read_decisions(run)
    assert not [d for d in ds if d["rule"] == "oom"]  # no probe
    assert [d["action"] for d in ds if d["rule"] == "manual"] == [
        "set_micro_batch_tokens",
        "set_activation_checkpointing",
    ]


def test_a_persons_setting_lost_with_a_killed_process_is_applied_again_at_its_step(tmp_path):
    """`ctl --queue scale-lr 0.5` applied at step 6, then SIGKILL at step 9 before a checkpoint
    kept it: the resume from step 5 applies it again at step 6 (journaled as that), and the run
    ends with the weights of one killed only before the command."""
    from safetensors.torch import load_file

    from helpers import FAST, trimtab_cli

    def train(run, *kills):  # FAST: no evaluations or TensorBoard (not read here), the small corpus slice
        args = ["train", "--preset", "debug", "--out", str(run), "--max-steps", "12", "--set", "checkpoint.every=5"]
        return trimtab_cli([*args, *FAST, *(f"--inject=sigkill@{k}" for k in kills)], tmp_path)

    for run, kills in ((tmp_path / "once", (7,)), (tmp_path / "twice", (7, 9))):
        assert train(run, *kills).returncode != 0  # killed at step 7: resumes from 5
        ctl.send(run, ctl.parse_command("scale-lr", ["0.5"]), queue=True)
        while (done := train(run, *kills)).returncode != 0:  # the second: killed at step 9, from 5 again
            assert len(read_decisions(run)) < 20, done.stderr[-2000:]
    manual = [d for d in read_decisions(tmp_path / "twice", abandoned=True) if d["rule"] == "manual"]
    assert [(d["step"], bool(d.get("abandoned"))) for d in manual] == [(6, True), (6, False)]
    assert manual[1]["evidence"]["again"] == manual[0]["id"] and "applied again on resume" in manual[1]["reasoning"]
    restarts = [d for d in read_decisions(tmp_path / "twice") if d["rule"] == "restart"]
    assert restarts and all("started again (not by torchrun" in d["reasoning"] for d in restarts)
    a, b = (load_file(tmp_path / r / "checkpoints/step_000012/model.safetensors") for r in ("once", "twice"))
    assert all(a[k].equal(b[k]) for k in a)


def test_lost_commands_are_settings_to_apply_again_and_one_time_ones_to_say():
    dropped = [
        {"id": 4, "rule": "manual", "action": "rollback", "params": {}},
        {"id": 3, "rule": "manual", "action": "set_grad_clip", "params": {"value": 0.5}},
        {"id": 2, "rule": "spike", "action": "skip_step", "params": {}},  # the orchestrator's: its rules decide again
        {"id": 5, "rule": "manual", "action": "scale_lr", "params": {"factor": 0.5}},
        # failed (total-steps in the finetune phase): nothing changed, so nothing to apply again
        {
            "id": 6,
            "rule": "manual",
            "action": "set_total_steps",
            "params": {"steps": 50},
            "outcome": {"result": "failed"},
        },
        {"id": 7, "rule": "manual", "action": "rollback", "params": {}, "outcome": {"result": "failed"}},
    ]
    again, once = ctl.lost_commands(dropped)
    assert [d["id"] for d in again] == [3, 5] and [d["id"] for d in once] == [4]
