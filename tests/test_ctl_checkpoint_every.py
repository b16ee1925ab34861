"""A person's checkpoint interval (`trimtab ctl RUN checkpoint-every N`) holds: the checkpoint
interval rule takes it as its bound, in place of checkpoint.every (orchestrator/interval.py)."""

from types import SimpleNamespace

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.journal import person_decision

STEP_S, STALL_S = 0.5, 0.24  # a debug step and save on 2 shared CPU cores


def person_sets(orchestrator: Orchestrator, steps: int, at: int) -> None:
    """The person's command as Control reports it applied (people.py `_person_applied`)."""
    run = SimpleNamespace(say=lambda line: None, step=at)
    evidence, params = {"command": "set_checkpoint_every", "steps": steps}, {"steps": steps}
    reasoning, summary = "requested by a person (trimtab ctl)", f"set_checkpoint_every {steps}"
    decision = person_decision(
        orchestrator.journal.next_id(), at, "manual", evidence, reasoning, "set_checkpoint_every", params, summary
    )
    orchestrator.journal.add(decision)
    orchestrator._person_applied(run, decision, f"a checkpoint every {steps} steps", "", None)


def interval_decisions(orchestrator: Orchestrator, every: int, configured: int, at: int) -> list:
    """The rule's decisions at the next save, the run saving every `every` of `configured` steps."""
    run = SimpleNamespace(step=at, total_steps=40, checkpoint_every=every, world=1, say=lambda line: None)
    run.cfg = SimpleNamespace(checkpoint=SimpleNamespace(every=configured))
    run.control = SimpleNamespace(request=lambda *a, **k: None)
    orchestrator._checkpoint_interval(run, [STEP_S] * 8, STALL_S)
    return [d for d in orchestrator.journal.decisions if d.rule == "checkpoint_interval"]


def test_the_interval_rule_keeps_a_persons_shorter_interval(tmp_path):
    """debug, checkpoint.every 4, `ctl checkpoint-every 3` at step 15: the save at step 16 set it
    back to 4 ("Young's interval ... = 4 steps of 1.88 s (now every 3) -> a checkpoint every 4
    steps"), one step after the person's command. It stays 3, and a resume keeps it so."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    person_sets(orchestrator, 3, at=15)
    assert interval_decisions(orchestrator, every=3, configured=4, at=16) == []
    resumed = Orchestrator(OrchestratorConfig(), tmp_path)
    resumed.load_state_dict(orchestrator.state_dict())
    assert interval_decisions(resumed, every=3, configured=4, at=19) == []


def test_the_interval_rule_keeps_a_persons_longer_interval(tmp_path):
    """A person who saves less often than checkpoint.every (a slow disk) is not shortened back to it
    on a machine whose MTBF asks for no shorter interval."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    person_sets(orchestrator, 50, at=5)
    assert interval_decisions(orchestrator, every=50, configured=4, at=8) == []
