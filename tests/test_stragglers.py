"""The straggler rule names a slow rank once a slow stretch, and again only once it reads markedly
slower than when named: a first reading on a loaded host (confidence under min_confidence, advice
only) must not be the stretch's only finding."""

from types import SimpleNamespace

import pytest
import torch

from trimtab.config import OrchestratorConfig
from trimtab.config.distributed import DistributedConfig
from trimtab.distributed import Parallel, parallel, work_clock
from trimtab.orchestrator import stragglers
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.stragglers import Stragglers, unjudged
from trimtab.training.oom import OomRecovery


def _windows(monkeypatch, mon, computes):
    """Each of `computes` ([rank 0's, rank 1's] seconds a step) gathered at the end of one window."""
    findings = []
    for step, per_rank in enumerate(computes, 1):
        monkeypatch.setattr(stragglers, "all_gather_floats", lambda mine, c=per_rank: [[x] for x in c])
        for _ in range(mon.cfg.window):
            f = mon.observe(step * mon.cfg.window, 0.0)
        findings.append(f)
    return findings


def test_a_rank_read_slower_by_half_again_is_named_again(monkeypatch):
    mon = Stragglers(OrchestratorConfig())
    # a loaded host reads the slow rank at 0.71x the fastest for three windows, then as it is (0.1x)
    found = _windows(monkeypatch, mon, [[0.10, 0.14]] * 3 + [[0.10, 1.0]] * 4)
    named = [f for f in found if f is not None]
    assert [f.evidence["ranks"] for f in named] == [[1], [1]]
    assert named[0].strength == pytest.approx(1 - 0.10 / 0.14) and named[1].strength == pytest.approx(0.9)
    assert found.index(named[1]) == 3  # the first window that read it slower by half: no patience again


def test_a_rank_as_slow_as_when_named_is_not_named_again_until_it_recovers(monkeypatch):
    mon = Stragglers(OrchestratorConfig())
    found = _windows(monkeypatch, mon, [[0.10, 0.2]] * 6 + [[0.10, 0.10]] + [[0.10, 0.2]] * 3)
    assert [i for i, f in enumerate(found) if f is not None] == [2, 9]  # recovered at 6: a new stretch


def test_the_named_scores_survive_a_resume_and_an_older_checkpoints_list_reads(monkeypatch):
    mon = Stragglers(OrchestratorConfig())
    _windows(monkeypatch, mon, [[0.10, 0.2]] * 3)
    again = Stragglers(OrchestratorConfig())
    again.load_state_dict(mon.state_dict())
    assert again.named == {1: 0.5} and again.strikes == mon.strikes
    old = Stragglers(OrchestratorConfig())
    old.load_state_dict({"strikes": {"1": 3}, "named": [1], "best": [0.1, 0.2]})
    assert old.named == {1: old.cfg.threshold}


def test_a_ranks_compute_is_its_work_before_the_agreement_point_not_its_waits_for_the_others(monkeypatch):
    """A fast rank's step: 0.1 s of its own work, then 0.5 s waiting in agree() and 0.9 s in DDP's
    gradient all-reduce for a slow peer. Its compute is the 0.1 s: the step less agree()'s wait
    (1.0 s, the old measure) read a rank 30x slower at 0.62x this one's speed."""
    now = [0.0]
    monkeypatch.setattr(work_clock.time, "perf_counter", lambda: now[0])

    def waits(values):  # the peer arrives 0.5 s later
        now[0] += 0.5
        return values

    monkeypatch.setattr(parallel, "all_max", waits)
    rank = Parallel(DistributedConfig(), torch.device("cpu"), world=2, rank_=0)
    mon, gathered = Stragglers(OrchestratorConfig()), []
    monkeypatch.setattr(stragglers, "all_gather_floats", lambda mine: gathered.append(mine) or [mine, [1.0]])
    for step in range(1, mon.cfg.window + 1):
        rank.step_starts()
        now[0] += 0.1  # data, forwards
        rank.agree()
        now[0] += 0.9  # the last backward, waiting in the gradient all-reduce
        mon.observe(step, rank.work.seconds)
    assert gathered == [[pytest.approx(0.1)]]


def test_a_step_retried_after_an_out_of_memory_error_counts_the_retrys_own_work(monkeypatch):
    """A peer runs out of memory: this rank's first attempt (0.1 s of forwards) ends in agree(),
    the retry's forwards take another 0.1 s before its agree(). Both attempts are this rank's own
    work (0.2 s); the retry's went uncounted (0.1 s), so the rank that retried read faster than it is."""
    now = [0.0]
    monkeypatch.setattr(work_clock.time, "perf_counter", lambda: now[0])
    told = iter([[1, 0], [0, 0]])  # agree(): a peer's out-of-memory error, then none
    monkeypatch.setattr(parallel, "all_max", lambda values: next(told))
    rank = Parallel(DistributedConfig(), torch.device("cpu"), world=2, rank_=0)

    def train_step(batch):
        now[0] += 0.1  # data, forwards
        rank.agree()
        now[0] += 0.9  # the last backward, the update
        return SimpleNamespace()

    loader = SimpleNamespace(micro_batch_tokens=1024, regroup=lambda batch: batch)
    trainer = SimpleNamespace(
        train_step=train_step,
        dist=rank,
        device=torch.device("cpu"),
        loader=loader,
        model=SimpleNamespace(checkpointing=False),
        hooks=["orchestrator"],
        _hook=lambda hook, name, exc, batch: True,
        # the OOM rule halves it
        control=SimpleNamespace(apply=lambda mid_step=False: setattr(loader, "micro_batch_tokens", 512)),
        _discard_gradients=lambda: now.__setitem__(0, now[0] + 0.05),  # not work: between the attempts
        _call=lambda name, batch: None,
        stop_reason="",
    )
    rank.step_starts()
    assert OomRecovery._step_with_oom_retry(trainer, "rows", 0.0) is not None
    assert rank.work.seconds == pytest.approx(0.2)


def test_under_sharded_parallelism_the_rule_gathers_nothing_and_says_it_cannot_judge(tmp_path, monkeypatch):
    """FSDP2, tensor or pipeline parallelism put collectives inside the forwards and backwards, so a
    fast rank's work before the agreement point holds its waits for a slow one (tp=2, slow_rank@3:1:10:
    both ranks read alike). The rule does not gather there (a gather would be a collective only some
    layouts reach), and the start says why, naming the key."""
    monkeypatch.setattr(stragglers, "all_gather_floats", lambda mine: pytest.fail("gathered under tp=2"))
    cfg = OrchestratorConfig()
    cfg.straggler.window = 1
    orch = Orchestrator(cfg, tmp_path)
    orch.read_every = 1000  # only the rules judged at each step
    dist = DistributedConfig(tp=2)
    said: list[str] = []
    cfgs = SimpleNamespace(distributed=dist)
    run = SimpleNamespace(world=2, replicated=False, is_main=True, total_steps=9, work_s=1.0, cfg=cfgs, say=said.append)
    for step in (1, 2):
        orch.on_step_end(run, SimpleNamespace(step=step, rerun=None))
    assert said == [unjudged(dist, 2)]  # once a session
    assert "tensor parallelism (distributed.tp=2)" in said[0] and "orchestrator.straggler.enabled=false" in said[0]
