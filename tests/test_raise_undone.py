"""A person's LR raise the instability after it is blamed on (orchestrator/raised.py): debug trained at
optim.lr 1e-3, resumed without the --set (x3 at once), broke its weights; the first rollback replayed the
same steps at the same LR bit for bit (identical_steps all of them) before a second one cut it. The first
rollback after a raise undoes it."""

from types import SimpleNamespace

import pytest

from test_goodness_checkpoints import _orchestrator
from test_lr_too_high_floor import View
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.orchestrator.policy import Policy


class Broken(View):
    def probe_loss(self):
        return 6.5  # far worse than the last good checkpoint's 4.0: an earlier update broke the weights


def _spike(step: int) -> Finding:
    return Finding(rule="spike", family="instability", step=step, evidence={"loss": 6.0}, summary="", strength=0.8)


def _incident(policy: Policy, view: View, first: int) -> list:
    """Three spikes in a row: skip, skip, then the climb's diagnosis (the weights broken: roll back)."""
    remedies = []
    for step in range(first, first + 3):
        remedy = policy.plan(_spike(step), view)
        remedy.applied()
        remedies.append(remedy)
    return remedies


def _policy(raise_at: int | None) -> Policy:
    policy = Policy(OrchestratorConfig())
    policy.probe_baseline, policy.updated_at, policy.last_lr_change = 4.0, 40, 20
    if raise_at is not None:
        policy.person_raised(raise_at, 3.0, "optim.lr 0.001 -> 0.003 on resume at step 40")
    return policy


def test_the_first_rollback_after_a_persons_lr_raise_undoes_it():
    policy, view = _policy(raise_at=40), Broken(lr_scale=1.0, last_good=40)
    *skips, rollback = _incident(policy, view, 45)
    assert [r.action for r in skips] == ["skip_step", "skip_step"]
    assert rollback.action == "rollback" and rollback.params["lr_factor"] == pytest.approx(1 / 3)
    assert "raised x3 at step 40" in rollback.reasoning and "undo the raise" in rollback.reasoning
    assert policy.lr_debt == pytest.approx(1 / 3)  # owed: given back once quiet, on probation
    # answered: a later incident's rollback is judged as ever (no raise to undo twice)
    assert policy._undo_raise(view, 50) is None


def test_without_a_raise_or_long_after_it_the_rollback_keeps_the_lr():
    for policy in (_policy(raise_at=None), _policy(raise_at=40)):
        first = 45 if not policy.raised else 40 + OrchestratorConfig().escalation_window
        *_, rollback = _incident(policy, Broken(lr_scale=1.0, last_good=40), first)
        assert rollback.action == "rollback" and "lr_factor" not in rollback.params


def test_a_lowering_forgets_a_raise_and_a_rollback_shifts_it():
    policy = _policy(raise_at=40)
    policy.shift(5)
    assert policy.raised[0] == 35
    policy.person_raised(41, 0.5, "trimtab ctl scale_lr 0.5")
    assert policy.raised == []


def test_a_raise_far_too_high_is_cut_as_an_lr_too_high_is_not_undone_in_full():
    policy = _policy(raise_at=None)
    policy.person_raised(40, 30.0, "optim.lr 0.001 -> 0.03 on resume at step 40")
    *_, rollback = _incident(policy, Broken(lr_scale=1.0, last_good=40), 43)
    assert rollback.params["lr_factor"] == pytest.approx(0.1)  # above_start.lr_factor: the give-backs climb x2
    assert "above_start.lr_factor=0.1" in rollback.reasoning


def test_a_persons_ctl_scale_lr_above_1_is_a_raise(tmp_path):
    orchestrator, run = _orchestrator(tmp_path, probe=4.8)
    run.control = SimpleNamespace(request=lambda action, on_done, **p: None)  # queued: not applied yet
    orchestrator._manual(run, "scale_lr", {"factor": 2.0})
    assert orchestrator.policy.raised == []  # counted once applied: one the job refuses raised nothing
    run.control = SimpleNamespace(request=lambda action, on_done, **p: on_done("lr multiplier 1 -> 2"))
    orchestrator._manual(run, "scale_lr", {"factor": 2.0})
    assert orchestrator.policy.raised == [run.step, 2.0, "trimtab ctl scale_lr 2.0"]
