"""What a restart tells its user: a session that ended cleanly (completed, or stopped with its summary
written) and is resumed later, on another world, lost nothing; the wait before the new launch is idle
time, not time down, as goodput.json counts it. Torch-free: the hook's start alone, on a ledger."""

from types import SimpleNamespace
from typing import Any

from trimtab.orchestrator import restarts
from trimtab.orchestrator.remedies import restart
from trimtab.resilience.goodput import Ledger, read_goodput


def test_a_finished_run_resumed_on_another_world_later_is_idle_not_down(tmp_path, monkeypatch):
    """A completed 1-rank run resumed on 2 ranks 413 s later (a new launch, not torchrun's restart):
    the restart's evidence and summary say 413 s idle and 0 s down, as goodput does, and its
    reasoning names the clean end and the new launch (it said "413.4 s down" and "torchrun's elastic
    agent restarted the job")."""
    ledger = Ledger(tmp_path)
    ledger.open(1000.0, 0, 1, 0, 0.0)
    ledger.step(10, 1.0)
    ledger.close("completed")
    ended = ledger.session["beat"]
    monkeypatch.setattr(restarts, "process_started", lambda: ended + 413.4)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's first launch of the new job
    proposed: list[Any] = []
    run = SimpleNamespace(is_main=True, step=10, world=2, say=lambda line: None, propose=proposed.append)
    restarts.Resilience(tmp_path).on_train_start(run)
    (finding,) = proposed
    evidence = finding.evidence
    assert evidence["kind"] == "resized" and evidence["ended"] == "completed" and evidence["down_s"] == 0
    assert abs(evidence["idle_s"] - 413.4) < 0.01
    assert "413.4 s idle" in finding.summary and " down" not in finding.summary
    assert read_goodput(tmp_path)["seconds"]["down"] == 0
    reasoning = restart(finding).reasoning
    assert "ended cleanly (completed)" in reasoning and "launched again" in reasoning
    assert "torchrun's elastic agent" not in reasoning
