"""The run's LR schedule across phases and length changes (training/schedule.py), and the
orchestrator's LR rule, which must leave every schedule the config asks for alone."""

import json
from types import SimpleNamespace

import pytest

import trimtab
from trimtab.config import OptimConfig, load_config, merge
from trimtab.errors import ConfigError
from trimtab.rundir import read_decisions
from trimtab.training.optim import lr_at
from trimtab.training.schedule import apply_lengths, note_withheld, phase_lr, reconcile

pytestmark = pytest.mark.usefixtures("one_thread")


def cfg(out, steps, sets=(), **overrides):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "log_every": 1},
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 10},
        "log": {"progress": False, "tensorboard": False},
    }
    return load_config(preset="debug", overrides=merge(base, overrides), sets=list(sets))


def logged(run, key="lr"):
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m[key] for m in lines if key in m}


def phases(*lengths, optim=None):
    optim = optim or OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4)
    out = [SimpleNamespace(start=0, steps=0, optim=optim) for _ in lengths]
    apply_lengths(out, list(lengths), 0)
    return out


# ------------------------------------------------------------------------------------ units


def test_an_extended_finished_phase_rewarms_from_its_final_lr_then_decays_anew():
    ps = phases(20)
    state = SimpleNamespace(step=20, phase=0, phase_steps=[20], length_delta=0, restarts=[])
    final = phase_lr(ps[0], 0, 19, [])
    (change,) = reconcile(state, ps, [40])
    assert state.restarts == [[0, 20, final]] and state.phase_steps == [40]
    assert "re-warm" in change["effect"] and (change["key"], change["old"], change["new"]) == (
        "train.max_steps",
        20,
        40,
    )
    apply_lengths(ps, [40], 0)
    lrs = [phase_lr(ps[0], 0, s, state.restarts) for s in range(40)]
    assert lrs[:20] == [lr_at(s, 20, ps[0].optim) for s in range(20)]  # the trained past is unchanged
    assert lrs[20] == pytest.approx(final + (1.0 - final) / 4)  # re-warms from where it ended
    assert lrs[23] == pytest.approx(1.0) and lrs[39] == pytest.approx(0.1, abs=0.01)  # peak, then decays anew


def test_the_live_planners_lr_projection_follows_a_rewarm():
    """RunView.pretrain_lr_if (the live planner's bound on an LR jump) of an extended pretraining:
    the re-warm segment's LR, where the original schedule's formula read the end of its decay."""
    from trimtab.training.view import RunView

    ps = phases(20)
    state = SimpleNamespace(step=20, phase=0, phase_steps=[20], length_delta=0, restarts=[], warm_behind=[])
    reconcile(state, ps, [40])
    apply_lengths(ps, [40], 0)
    state.step = 22
    view = RunView(SimpleNamespace(phases=ps, state=state), control=SimpleNamespace(request=None))
    assert view.pretrain_lr_if(40) == pytest.approx(phase_lr(ps[0], 0, 22, state.restarts))
    assert view.pretrain_lr_if(40) > lr_at(22, 40, ps[0].optim) + 0.2  # the formula without the re-warm


def test_a_length_change_before_the_end_stretches_the_schedule():
    ps = phases(20)
    state = SimpleNamespace(step=12, phase=0, phase_steps=[20], length_delta=0, restarts=[])
    (change,) = reconcile(state, ps, [40])
    assert state.restarts == [] and "stretches" in change["effect"]
    assert reconcile(state, ps, [40]) == []  # nothing changed since


def test_a_finished_phase_cannot_change_once_a_later_one_started():
    ps = phases(20, 10)
    state = SimpleNamespace(step=25, phase=1, phase_steps=[20, 10], length_delta=0, restarts=[])
    with pytest.raises(ConfigError, match="train.max_steps"):
        reconcile(state, ps, [30, 10])
    in_pretraining = SimpleNamespace(step=18, phase=0, phase_steps=[20, 10], length_delta=0, restarts=[])
    with pytest.raises(ConfigError, match="'train.max_steps' = 15 would end this phase before step 18"):
        reconcile(in_pretraining, ps, [15, 10])


def test_an_extension_too_short_for_a_full_rewarm_still_decays_to_the_new_end():
    """Extended by no more than warmup_steps + 1, the re-warm took every added step and the run
    ended at its peak LR; it is capped at a quarter of them, so the rest decays to the new end."""
    ps = phases(20)  # warmup 4, lr 1.0, min 0.1
    state = SimpleNamespace(step=20, phase=0, phase_steps=[20], length_delta=0, restarts=[])
    final = phase_lr(ps[0], 0, 19, [])
    (change,) = reconcile(state, ps, [28])
    apply_lengths(ps, [28], 0)
    lrs = [phase_lr(ps[0], 0, s, state.restarts) for s in range(20, 28)]
    assert lrs[-1] == pytest.approx(lr_at(7, 8, ps[0].optim, final, 2)) and lrs[-1] < 0.2  # the schedule's end
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # decays step by step after
    assert lrs[0] == pytest.approx(final + (1.0 - final) / 2) and lrs[1] == pytest.approx(1.0)  # a 2-step re-warm
    assert "over 2 steps" in change["effect"]  # 8 added: a quarter of them re-warm
    # under 4 added steps: too few to re-warm and decay, they go on at the LR the phase ended at
    short, state.step = phases(28), 28
    (change,) = reconcile(state, short, [30])
    apply_lengths(short, [30], 0)
    assert "go on at its final lr" in change["effect"]
    assert [phase_lr(short[0], 0, s, state.restarts) for s in (28, 29)] == [lrs[-1], lrs[-1]]


def test_a_phase_added_after_the_others_is_a_change():
    ps = phases(20, 10)
    state = SimpleNamespace(step=12, phase=0, phase_steps=[20], length_delta=0, restarts=[])
    (change,) = reconcile(state, ps, [20, 10])
    assert change == {"key": "finetune.steps", "old": 0, "new": 10, "effect": "a new phase after the others"}
    assert state.phase_steps == [20, 10] and state.restarts == []


def test_a_later_phase_not_started_yet_may_be_dropped_but_not_one_started():
    ps = phases(20)
    state = SimpleNamespace(step=12, phase=0, phase_steps=[20, 10], length_delta=0, restarts=[])
    (change,) = reconcile(state, ps, [20])
    assert (change["key"], change["old"], change["new"]) == ("finetune.steps", 10, 0)
    assert "had not started" in change["effect"] and state.phase_steps == [20]
    at_its_start = SimpleNamespace(step=20, phase=0, phase_steps=[20, 10], length_delta=0, restarts=[])
    assert reconcile(at_its_start, ps, [20])[0]["new"] == 0  # pretraining ended, finetuning not begun
    started = SimpleNamespace(step=25, phase=1, phase_steps=[20, 10], length_delta=0, restarts=[])
    with pytest.raises(ConfigError, match="'finetune.steps' changed from 10 to 0, but this run is already in that"):
        reconcile(started, ps, [20])


def test_updates_withheld_during_the_warm_up_hold_it_back():
    """debug with steps 3-4 withheld ended 0.2-0.3 nats above the clean run at step 40 (3 seeds): the
    warm-up counted steps, so the updates applied met LRs 2 steps ahead of them. It counts applied
    updates (Megatron-LM steps its scheduler only on a successful update); past it, the step's."""
    (p,) = phases(20)  # warm-up 4 steps to lr 1.0, cosine to 0.1 by step 20
    state = SimpleNamespace(phase=0, restarts=[], warm_behind=[])
    lrs = []
    for step in range(20):  # each step's LR as the trainer sets it, then its update judged
        lrs.append(phase_lr(p, 0, step, [], state.warm_behind))
        out = SimpleNamespace(step=step + 1, withheld=step in (1, 2, 9))  # 9: past the warm-up, not counted
        note_withheld(state, p, out)
    assert state.warm_behind == [0, 2]
    assert lrs[:5] == pytest.approx([0.25, 0.5, 0.5, 0.5, 0.75])  # steps 1, 2 withheld: 2 updates behind
    # its last update meets the step's schedule (1.0 held back, 0.991 the cosine's): the lower, then the step's
    assert lrs[5:] == pytest.approx([lr_at(s, 20, p.optim) for s in range(5, 20)])
    assert phase_lr(p, 0, 3, [], [7, 2]) == pytest.approx(1.0)  # another segment's count: not this one's
    cyclic = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, schedule="triangular", cycle_steps=5)
    assert lr_at(5, 40, cyclic, behind=2) == pytest.approx(0.1 * 4 / 4) and lr_at(4, 40, cyclic, behind=2) < 0.1


# ------------------------------------------------------------------------------------ through the loop


# CI runs one cyclic schedule through the loop (8 s each); the shapes of all three are tests/test_optim.py's
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "schedule", ["triangular", pytest.param("triangular2", marks=SLOW), pytest.param("exp_range", marks=SLOW)]
)
def test_cyclic_schedules_are_never_cut_as_faults(tmp_path, schedule):
    """Each cycle restarts the LR x10 (min_lr_ratio 0.1): the config asks for it, so the LR rule
    stays silent and the applied LR is the schedule's, cycle after cycle (before the fix, every
    restart was cut and the cuts compounded: x0.028 after two cycles)."""
    run = tmp_path / "r"
    sets = [f"optim.schedule={schedule}", "optim.cycle_steps=5", "optim.warmup_steps=2"]
    trimtab.train(cfg(run, 32, sets))
    assert [d for d in read_decisions(run, abandoned=True) if d["rule"] != "throughput"] == []  # a busy host: log only
    optim = load_config(preset="debug", sets=sets).optim
    assert logged(run) == pytest.approx({s: lr_at(s - 1, 32, optim) for s in range(1, 33)})
    assert set(logged(run, "lr_scale").values()) == {1.0}


def test_extending_a_finished_run_rewarms_and_is_journaled_not_cut(tmp_path):
    run = tmp_path / "r"
    small = {"model": {"n_layers": 1}, "train": {"batch_tokens": 1024}}  # an LR schedule is not the model's size
    trimtab.train(cfg(run, 20, **small))
    first = logged(run)
    summary = trimtab.train(cfg(run, 40, **small))
    assert summary["status"] == "completed" and summary["steps_this_session"] == 20
    # no LR cut: one configuration change, the person's (throughput: a busy host may slow a few steps)
    (d,) = [d for d in read_decisions(run, abandoned=True) if d["rule"] != "throughput"]
    assert (d["rule"], d["mode"], d["step"], d["action"]) == ("config", "manual", 20, "set_total_steps")
    assert (d["evidence"]["old"], d["evidence"]["new"]) == (20, 40) and "re-warm" in d["reasoning"]
    lr = logged(run)
    assert all(lr[s] == first[s] for s in range(1, 21))  # the first session's curve is kept as it was
    peak = load_config(preset="debug").optim.lr
    # re-warm over 5 steps (warmup_steps 10, at most a quarter of the 20 added)
    assert "over 5 steps" in d["reasoning"]
    assert first[20] < lr[21] < lr[24] < peak * 1.001 and lr[25] == pytest.approx(peak)
    assert lr[40] < lr[35] < lr[30] < lr[27]  # then the cosine decays anew to the new end
    assert set(logged(run, "lr_scale").values()) == {1.0}


def test_an_unexplained_lr_is_still_caught_after_an_extension(tmp_path):
    run = tmp_path / "r"
    trimtab.train(cfg(run, 12))
    trimtab.train(cfg(run, 24, faults=["lr_spike@18:20"]))
    rules = [(d["rule"], d["step"]) for d in read_decisions(run, abandoned=True)]
    assert rules == [("config", 12), ("lr", 18), ("make_up", 23)]  # the withheld step 18 made up


def test_a_resumed_run_keeps_its_warm_up_held_back(tmp_path):
    """The count is the run's state: a run stopped after a withheld warm-up update and resumed
    applies the LRs the uninterrupted run does, held back alike."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    trimtab.train(cfg(whole, 8, faults=["grad_spike@3"]))
    trimtab.train(cfg(parts, 8, faults=["grad_spike@3", "sigterm@5"]))
    trimtab.train(cfg(parts, 8, faults=["grad_spike@3", "sigterm@5"]))
    lr = logged(whole)
    assert logged(parts) == lr and lr[4] == lr[3]  # step 3's update withheld: step 4 applies its LR


class _GroupLost:
    """resilience.ft's replica groups as the trainer sees them, one failing in step 2's commit."""

    def quorum(self, step):
        return False

    def commit(self, step):
        return step != 2

    def close(self):
        pass


def test_an_update_a_replica_group_withheld_holds_the_warm_up_back_too(tmp_path):
    """The gate's flag, read by the re-run (unflagged: not withheld), was taken for the step's,
    though a replica group's failed commit then withheld the update on every group."""
    from trimtab.api import built_in_hooks
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    config = cfg(tmp_path / "r", 3)
    trainer = Trainer(setup(config), hooks=built_in_hooks(config))
    trainer.replicas = _GroupLost()
    trainer.fit()
    assert trainer.state.warm_behind == [0, 1]
