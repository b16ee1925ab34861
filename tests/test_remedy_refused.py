"""A rule's remedy whose parameters its action refuses (Control.request checks them: ConfigError) is journaled
as failed and the run goes on: a rollback asked with `lr_factor: 1.0` ("must be a number in (0, 1)") ended a
whole run with exit 2, the orchestrator's own mistake sinking the run it watches."""

import trimtab
from helpers import faulted
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.remedies import Remedy
from trimtab.rundir import read_decisions


def test_a_remedy_its_action_refuses_is_journaled_failed_and_training_goes_on(tmp_path, monkeypatch, capsys):
    plan = Policy.plan

    def refused(self, f, view):
        if f.rule == "lr":  # the stray LR writer's compensation, asked out of bounds
            return Remedy(action="scale_lr", params={"factor": -1.0}, reasoning="a rule's mistake")
        return plan(self, f, view)

    monkeypatch.setattr(Policy, "plan", refused)
    summary = trimtab.train(faulted(tmp_path / "run", ["lr_spike@5:30"], 10))
    # trained on to its end (the stray LR, left uncompensated, then stops it as unstable: exit 3), not ended at step 5
    assert summary["step"] == 10 and summary["exit_code"] != 2, summary["status"]
    failed = next(d for d in read_decisions(tmp_path / "run") if d["rule"] == "lr")
    assert failed["outcome"]["result"] == "failed" and "factor" in failed["outcome"]["error"]
    assert "lr: scale_lr failed, nothing changed" in capsys.readouterr().err
