"""orchestrator.make_up makes up the updates the update gate withheld from bad steps; one a skip_step asked
for is its asker's, a person's (`trimtab ctl skip-step`) or a hook's, and the step that withholds it says who
(StepOutput.skip_by), not the step after the command."""

import pytest

import trimtab
from test_goodness_checkpoints import _nan, _orchestrator
from test_orchestrator_units import metrics
from trimtab.training.hooks import Hook


class SkipAt(Hook):
    """A user's hook that withholds the update of the step after `step` (run.control)."""

    def __init__(self, step):
        self.step, self.seen = step, {}

    def on_step_end(self, run, out):
        self.seen[out.step] = getattr(out, "skip_by", None)  # who withheld its update
        if out.step == self.step:
            run.control.request("skip_step")


def _ten_steps(tmp_path, hook, **sections):
    """debug, 10 steps, `hook` among the run's hooks; the run's summary."""
    return trimtab.train(
        preset="debug",
        out=str(tmp_path / "r"),
        hooks=[hook],
        train={"max_steps": 10, "eval_every": 0, "batch_tokens": 1024},
        data={"max_bytes": 150_000},
        log={"progress": False, "tensorboard": False, "report": False},
        **sections,
    )


@pytest.mark.usefixtures("one_thread")
def test_a_hooks_skip_is_not_made_up(tmp_path):
    """debug, a user hook's skip_step at step 1 of 10: its update withheld (step 2) was made up, 10 -> 11,
    journaled as "the update gate withheld 1 update(s)". A hook's skip is its own, as a person's."""
    hook = SkipAt(1)
    summary = _ten_steps(tmp_path, hook)
    decisions = tmp_path / "r" / "decisions.jsonl"
    assert summary["status"] == "completed" and summary["skipped_steps"] == 1
    assert max(hook.seen) == 10 and not (decisions.exists() and "make_up" in decisions.read_text())
    assert hook.seen[2] == "hook" and set(hook.seen.values()) == {"", "hook"}  # the step says who withheld it


def test_a_persons_skip_withheld_on_a_rollbacks_replay_is_theirs_and_the_gates_after_is_made_up(tmp_path):
    """debug, `ctl skip-step` taken at step 10 with weights_nan@10's rollback to step 5: the replay's step 6
    was withheld by the person's skip and made up (30 -> 31), the person's step read as 11, the one after
    the command. The step that withheld it says whose it was."""
    orchestrator, run = _orchestrator(tmp_path, probe=4.8)
    run.total_steps = 120
    orchestrator._manual(run, "skip_step", {})  # at step 9
    orchestrator.last_step, run.step = 9, 5
    orchestrator.on_rollback(run, {})  # a rollback applied before the skip's step
    replayed = metrics(6)
    replayed.skipped, replayed.skip_by, run.step = True, "person", 6
    orchestrator._observe(run, replayed)
    for step in range(7, 10):
        run.step = step
        orchestrator._observe(run, metrics(step, loss=4.9))
    _nan(orchestrator, run, 10)  # the gate's own, at the step after the command
    for step in range(11, 17):
        run.step = step
        orchestrator._observe(run, metrics(step, loss=4.9))
    made = orchestrator.journal.decisions[-1]
    assert (made.rule, made.params["steps"]) == ("make_up", 121)
    assert made.evidence["withheld_steps"] == [10] and made.evidence["person_skips"] == [6]
    assert made.evidence["hook_skips"] == [] and run.requests[0] == ("skip_step", {"by": "person"})


class SkipAndRollBack(Hook):
    """A skip_step and a rollback to step 5 asked at step 8 (a person's skip with the orchestrator's rollback)."""

    def __init__(self):
        self.seen, self.lines = [], []

    def on_step_end(self, run, out):
        self.seen.append((out.step, getattr(out, "skip_by", None)))
        if out.step == 8 and len(self.seen) == 8:
            run.control.request("skip_step", by="person")
            run.control.request("rollback", to=5, on_done=self.lines.append)


@pytest.mark.usefixtures("one_thread")
def test_a_skip_that_comes_with_a_rollback_withholds_no_replayed_step(tmp_path):
    """debug, a skip-step taken with a rollback: the step it was to withhold (9) is not trained on the branch
    the rollback restores, and it withheld the replay's first (6), a step nobody judged. Dropped, and said."""
    hook = SkipAndRollBack()
    summary = _ten_steps(tmp_path, hook, checkpoint={"every": 5})
    assert summary["status"] == "completed" and summary["skipped_steps"] == 0
    assert [s for s, _ in hook.seen][8:] == [6, 7, 8, 9, 10] and {by for _, by in hook.seen} == {""}
    assert "the skip-step asked with it is dropped" in hook.lines[0]
