"""What a restart tells its user: a session that ended cleanly (completed, or stopped with its summary
written) and is resumed later, on another world, lost nothing; the wait before the new launch is idle
time, not time down, as goodput.json counts it. Torch-free: the hook's start alone, on a ledger."""

from types import SimpleNamespace
from typing import Any

from trimtab.data.position import data_position
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
    said: list[str] = []
    where = "epoch 0, row 1,234 of 10,000"
    run = SimpleNamespace(is_main=True, step=10, world=2, say=said.append, propose=proposed.append, data_position=where)
    restarts.Resilience(tmp_path).on_train_start(run)
    (finding,) = proposed
    evidence = finding.evidence
    assert evidence["kind"] == "resized" and evidence["ended"] == "completed" and evidence["down_s"] == 0
    assert abs(evidence["idle_s"] - 413.4) < 0.01
    assert "413.4 s idle" in finding.summary and " down" not in finding.summary
    # on another world the step no longer says where the data resumes: the line a person reads says it
    assert f"resumed at step 10 (data at {where}) on 2 ranks (was 1)" in finding.summary
    assert said == []  # the orchestrator's decision on the finding is its console line (one line an event)
    assert read_goodput(tmp_path)["seconds"]["down"] == 0
    reasoning = restart(finding).reasoning
    assert "ended cleanly (completed)" in reasoning and "launched again" in reasoning
    assert "torchrun's elastic agent" not in reasoning


class _Rank:
    """A rank's view whose data position counts its reads (an RL loader's state is a collective)."""

    def __init__(self, is_main: bool):
        self.is_main, self.step, self.world, self.reads = is_main, 10, 2, 0
        self.say = self.propose = lambda *_: None

    @property
    def data_position(self) -> str:
        self.reads += 1
        return "epoch 0, row 194 of 18,044"


def test_every_rank_reads_the_data_position_once_at_a_restart(tmp_path, monkeypatch):
    """torchrun --max-restarts 1, 2-rank `trimtab rl`, rank 1 killed at step 14: the restart hung in
    start-up until the watchdog (2 of 2 tries). Rank 0 alone read the loader's state for the incident's
    data position, twice, and the RL loader's state gathers every rank's batches ahead: a collective
    rank 1, waiting in the incident's broadcast, never joined. Every rank reads it once."""
    ledger = Ledger(tmp_path)
    ledger.open(1000.0, 0, 2, 0, 0.0)
    ledger.step(14, 1.0)  # no close: the session was lost
    monkeypatch.setattr(restarts, "process_started", lambda: 1100.0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    main, other = _Rank(is_main=True), _Rank(is_main=False)
    restarts.Resilience(tmp_path).on_train_start(main)
    restarts.Resilience(tmp_path).on_train_start(other)
    assert main.reads == other.reads == 1


def test_the_data_position_names_the_epoch_the_row_and_each_mixture_source():
    """The loader's state (data/batches.py state_dict) in words; a loader without rows (RL prompts) says nothing."""
    one = {"epoch": 1, "cursor": 1234, "n_rows": 10000, "parts": [{"epoch": 1, "cursor": 1234, "n_rows": 10000}]}
    assert data_position(one) == "epoch 1, row 1,234 of 10,000"
    mix = {
        "parts": [
            {"name": "code", "epoch": 0, "cursor": 5, "n_rows": 80},
            {"name": "web", "epoch": 2, "cursor": 0, "n_rows": 9},
        ]
    }
    assert data_position(mix) == "code: epoch 0, row 5 of 80; web: epoch 2, row 0 of 9"
    assert data_position({"prompts": 3}) == ""


def test_a_restart_past_a_corrupt_checkpoint_is_said_once_each_and_applied_with_the_data_position(tmp_path):
    """A session killed at step 12, resumed at step 10 past a corrupt step-12 checkpoint: each event was
    said twice (the hook's `[resilience]` line, then the decision's `[orchestrator]` line with the same
    summary); now once, by its decision. The restart decision's applied line names where the data
    resumes, as its summary does (it said "resumed at step 10 on 1 rank"). With the orchestrator off, the
    hook's own lines are the only ones, and say both events."""
    from trimtab.config.orchestrator import OrchestratorConfig
    from trimtab.orchestrator.core import Orchestrator
    from trimtab.rundir import write_json
    from trimtab.training.resume import CORRUPT, FALLBACK

    def resumed(journal: bool, mode: str = "auto") -> tuple[list[str], Orchestrator]:
        ledger = Ledger(tmp_path)
        ledger.open(1000.0, 0, 1, 0, 0.0)
        ledger.step(12, 1.0)
        ledger.write(force=True)  # no close(): killed
        refused = [{"checkpoint": "step_000012", "step": 12, "reason": "x/model.safetensors: corrupt", "kept_in": "y"}]
        (tmp_path / "checkpoints" / CORRUPT).mkdir(parents=True, exist_ok=True)
        write_json(tmp_path / "checkpoints" / CORRUPT / FALLBACK, {"refused": refused, "resumed_step": 10})
        orchestrator, said = Orchestrator(OrchestratorConfig(mode=mode), tmp_path / mode), []
        run = SimpleNamespace(is_main=True, step=10, world=1, say=said.append, data_position="epoch 0, row 320 of 789")
        run.propose = lambda finding: orchestrator.decide(run, finding)
        restarts.Resilience(tmp_path, journal=journal).on_train_start(run)
        return said, orchestrator

    said, orchestrator = resumed(journal=True)
    assert [line.split(":")[0] for line in said] == [
        "[orchestrator] step 10 restart",
        "[orchestrator] step 10 checkpoint_fallback",
    ]
    restart_decision = orchestrator.journal.decisions[0]
    assert "resumed at step 10 (data at epoch 0, row 320 of 789) on 1 rank" in restart_decision.summary
    assert restart_decision.applied == ["resumed at step 10 (data at epoch 0, row 320 of 789) on 1 rank"]
    assert orchestrator.journal.decisions[1].applied == ["resumed at step 10 on 1 rank"]  # its summary names no data
    # advise mode journals a resume as done (it was, before the decision): its one line said "not applied"
    said, _ = resumed(journal=True, mode="advise")
    assert len(said) == 2 and not any("not applied" in line for line in said), said
    said, _ = resumed(journal=False)
    assert [line.split(" ")[0] for line in said] == ["[resilience]", "[resilience]"] and "corrupt" in said[1]
