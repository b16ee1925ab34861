"""The orchestrator's parts on their own: monitors on synthetic sequences, the policy's ladder with
a fake view of the trainer, confidence, the journal, fault specs, ctl commands and Control's checks."""

import json
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import FakeTrainer
from trimtab.config import dump_config, load_config
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.errors import ConfigError
from trimtab.orchestrator import ctl
from trimtab.orchestrator.attribution import small_sample_sigma
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.divergence import Divergence
from trimtab.orchestrator.fault_specs import Fault, parse_fault, parse_faults
from trimtab.orchestrator.journal import Decision, Journal, describe
from trimtab.orchestrator.loss_spike import LossSpike
from trimtab.orchestrator.lr_rule import UnexplainedLR
from trimtab.orchestrator.moe_health import MoEHealth
from trimtab.orchestrator.monitors import Finding, GradExplosion, NonFinite, Rolling, StepMetrics
from trimtab.orchestrator.plateau import Plateau
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.resources import RESUME_PROBE, Fp16Overflow, MemoryPressure, OutOfMemory, Throughput
from trimtab.orchestrator.rules import build_monitors
from trimtab.orchestrator.trends import AboveStart
from trimtab.rundir import read_decisions
from trimtab.training import actions
from trimtab.training.actions import ACTIONS
from trimtab.training.control import Control
from trimtab.training.state import GAVE_UP


def metrics(
    step,
    loss=5.0,
    grad_norm=1.0,
    overflow=False,
    tokens_per_s=1000.0,
    progress=0.1,
    memory=None,
    lr=1e-3,
    lr_scale=1.0,
    scheduled_lr=None,
    micro_batch_tokens=0,
    rl=None,
):
    return StepMetrics(
        step=step,
        loss=loss,
        grad_norm=grad_norm,
        overflow=overflow,
        tokens_per_s=tokens_per_s,
        lr=lr,
        scheduled_lr=lr / lr_scale if scheduled_lr is None else scheduled_lr,
        lr_scale=lr_scale,
        progress=progress,
        memory_frac=memory,
        micro_batch_tokens=micro_batch_tokens,
        rows=[step],
        rl=rl,
    )


def feed(monitor, values, key="loss", start=1, **kw):
    """Observe one metric per value; returns the findings (None where nothing fired)."""
    return [monitor.observe(metrics(start + i, **{key: v}, **kw)) for i, v in enumerate(values)]


# ------------------------------------------------------------------------------------ monitors


def test_rolling_statistics():
    r = Rolling(4, [1.0, 2.0, 3.0])
    assert r.mean() == 2.0 and r.std() == pytest.approx(1.0) and r.median() == 2.0
    assert r.slope() == pytest.approx(1.0) and not r.full()
    r.add(4.0)
    r.add(5.0)  # the oldest value drops out
    assert list(r.values) == [2.0, 3.0, 4.0, 5.0] and r.full() and r.median() == 4.0


def test_nonfinite_flags_nan_and_inf():
    m = NonFinite(OrchestratorConfig())
    assert m.observe(metrics(1)) is None
    f = m.observe(metrics(2, loss=float("nan")))
    assert (f.rule, f.family, f.step, f.strength) == ("nonfinite", "instability", 2, 1.0)
    assert m.observe(metrics(3, grad_norm=float("inf"))).evidence["grad_norm"] == math.inf
    # fp16: an overflowing gradient is the GradScaler's (Fp16Overflow), a NaN loss is still flagged
    assert m.observe(metrics(4, grad_norm=float("inf"), overflow=True)) is None
    assert m.observe(metrics(5, loss=float("nan"), overflow=True)) is not None


def trend_at(steps, losses, step):
    """The loss a least-squares line against log(step) predicts at `step`, and its residual std."""
    slope, intercept = np.polyfit(np.log(steps), losses, 1)
    residuals = np.array(losses) - (intercept + slope * np.log(steps))
    return intercept + slope * math.log(step), math.sqrt((residuals**2).sum() / max(len(losses) - 2, 1))


def test_loss_spike_ceiling_follows_the_trend_and_flagged_values_stay_out():
    cfg = OrchestratorConfig()
    cfg.spike.window, cfg.spike.min_samples, cfg.spike.sigma, cfg.spike.min_rise = 10, 5, 2.5, 0.25
    m = LossSpike(cfg)
    assert feed(m, [5.0, 5.1, 4.9, 5.05]) == [None] * 4
    assert m.ceiling() == math.inf  # silent until min_samples
    assert m.observe(metrics(5, loss=4.95)) is None
    predicted, std = trend_at([1, 2, 3, 4, 5], [5.0, 5.1, 4.9, 5.05, 4.95], 6)
    assert 2.5 * std < 0.25 and m.ceiling() == pytest.approx(predicted + 0.25)  # min_rise wins over 2.5 sigma
    f = m.observe(metrics(6, loss=5.4))
    assert f.rule == "spike" and f.evidence["ceiling"] == pytest.approx(predicted + 0.25) and 0.6 <= f.strength <= 1
    assert m.ceiling() == pytest.approx(trend_at([1, 2, 3, 4, 5], [5.0, 5.1, 4.9, 5.05, 4.95], 7)[0] + 0.25)
    assert m.observe(metrics(7, loss=float("nan"))) is None and len(m.window) == 5  # the spike stayed out
    assert m.observe(metrics(8, loss=5.2)) is None and len(m.window) == 6
    # with a noisy window sigma wins
    m2 = LossSpike(cfg)
    feed(m2, [4.0, 6.0, 4.0, 6.0, 5.0])
    predicted, std = trend_at([1, 2, 3, 4, 5], [4.0, 6.0, 4.0, 6.0, 5.0], 6)
    assert m2.ceiling() == pytest.approx(predicted + 2.5 * std)


def test_a_steep_early_fall_keeps_the_spike_ceiling_tight():
    """Early training falls fast: a flat window's mean + 5 sigma sat above a jump from 4.90 to 6.49
    (the bad-data stretch auto missed); the trend's residuals keep the bar near the next loss."""
    cfg = OrchestratorConfig()
    m = LossSpike(cfg)  # window 50, min_samples 20, 5 sigma, min rise 0.25
    curve = [8.0 - 1.2 * math.log(s) + 0.03 * math.sin(7 * s) for s in range(1, 31)]
    assert feed(m, curve) == [None] * 30
    flat = Rolling(50, curve)
    assert flat.mean() + 5 * flat.std() > 6.49  # the old rule's bar
    assert m.ceiling() < curve[-1] + 0.5  # the trend's bar: a quarter nat above the fall's next step
    found = m.observe(metrics(31, loss=6.49))
    assert found is not None and found.rule == "spike" and found.evidence["predicted"] < 4.0


def test_grad_explosion_ceiling():
    cfg = OrchestratorConfig()
    cfg.grad.max_norm, cfg.grad.factor, cfg.grad.window, cfg.grad.min_samples = 100.0, 10.0, 10, 3
    m = GradExplosion(cfg)
    assert m.ceiling() == 100.0  # max_norm before min_samples
    f = m.observe(metrics(1, grad_norm=150.0))
    assert f.rule == "grad" and f.evidence["ceiling"] == 100.0 and math.isnan(f.evidence["mean"])
    assert feed(m, [1.0, 1.2, 0.8], key="grad_norm", start=2) == [None] * 3
    assert m.ceiling() == pytest.approx(10.0)  # factor x rolling mean, under max_norm
    assert m.observe(metrics(5, grad_norm=11.0)) is not None
    assert m.ceiling() == pytest.approx(10.0)
    assert m.observe(metrics(6, grad_norm=9.0)) is None
    assert m.observe(metrics(7, grad_norm=float("inf"))) is None  # NonFinite's business


def test_grad_norm_at_a_new_level_with_a_calm_loss_moves_the_baseline_instead_of_skipping_forever():
    # The README's mixture run: the norm jumped 0.35 -> ~12 and stayed, the loss flat; the window of
    # healthy norms never moved, so every later step was flagged and its update withheld.
    m = GradExplosion(OrchestratorConfig())
    assert feed(m, [0.35] * 30, key="grad_norm") == [None] * 30
    found = [m.observe(metrics(31 + i, grad_norm=g, loss=5.05)) for i, g in enumerate([12.0, 11.0, 13.0])]
    assert [f.rule for f in found] == ["grad", "grad", "grad_level"]
    assert found[2].family == "baseline" and found[2].evidence["norms"] == [12.0, 11.0, 13.0]
    assert m.ceiling() == pytest.approx(100.0)  # min(max_norm, 10 x the new mean 12)
    assert feed(m, [12.0, 10.5, 14.0], key="grad_norm", start=34, loss=5.0) == [None] * 3  # the updates pass


@pytest.mark.parametrize(
    "norms, losses",
    [
        ([12.0, 11.0, 13.0], [5.0, 6.5, 7.0]),  # the loss rises with it: an explosion, not a level
        ([12.0, 60.0, 13.0], [5.0, 5.0, 5.0]),  # no one level
        ([150.0, 150.0, 150.0], [5.0, 5.0, 5.0]),  # above max_norm: never a level
    ],
)
def test_a_rising_loss_an_erratic_norm_or_one_past_max_norm_is_never_taken_as_a_new_level(norms, losses):
    m = GradExplosion(OrchestratorConfig())
    feed(m, [0.35] * 30, key="grad_norm")
    found = [m.observe(metrics(31 + i, grad_norm=g, loss=v)) for i, (g, v) in enumerate(zip(norms, losses))]
    assert [f.rule for f in found] == ["grad"] * 3


def test_above_start_fires_after_patience_steps_above_the_first_loss_and_again_only_while_it_does_not_fall():
    m = AboveStart(OrchestratorConfig())
    assert feed(m, [6.25, 6.1, 6.0, 6.4, 6.45]) == [None] * 5  # within the 0.31-nat margin: noise
    found = feed(m, [7.0, 8.0, 9.0], start=6)
    assert found[:2] == [None, None] and found[2].rule == "above_start" and found[2].family == "instability"
    assert found[2].evidence["start"] == 6.25 and found[2].evidence["since"] == 6
    assert feed(m, [7.5, 7.4, 7.3], start=9) == [None] * 3  # falling since the cut: give it steps
    assert feed(m, [8.0, 8.1, 8.2], start=12)[2] is not None  # not falling: cut again
    assert feed(m, [6.0], start=15) == [None] and m.over == []


def test_a_resumed_run_probes_its_shrunk_micro_batch_soon_with_the_back_off_reset():
    cfg = OrchestratorConfig()
    m = OutOfMemory(cfg)
    m.configured, m.probe_after, m.clean = 1024, 800, 5  # shrunk, and one probe already failed
    m.ran_out([1, 80 << 30])
    m.resumed([1, 141 << 30])  # another machine, with more memory per device
    found = [m.observe(metrics(100 + i, micro_batch_tokens=256)) for i in range(RESUME_PROBE)]
    assert found[:-1] == [None] * (RESUME_PROBE - 1) and found[-1].evidence["target"] == 512
    assert m.probe_after == 2 * cfg.oom.probe_after  # the back-off starts over from the config's
    # the journal says what was seen: RESUME_PROBE clean steps in the new process, not probe_after
    assert found[-1].evidence["clean_steps"] == RESUME_PROBE and "since the run resumed" in found[-1].summary
    n = m.probe_after
    later = [m.observe(metrics(200 + i, micro_batch_tokens=256)) for i in range(n)]
    assert later[-1].evidence["clean_steps"] == n and "resumed" not in later[-1].summary


@pytest.mark.parametrize("saved_machine", [True, False])
def test_a_run_resumed_on_the_machine_it_ran_out_of_memory_on_probes_soon_with_its_back_off(saved_machine):
    """oom@11 halved the micro-batch and a probe failed since (back-off x2); killed at 45, resumed from 40's
    checkpoint on the same machine: the restart freed the old process's fragmentation, so the probe comes
    RESUME_PROBE steps after the resume (it waited out the twin's count: step 61 of 50 more, at half the
    micro-batch), and the back-off the failed probe learned there goes on. An unknown machine restarts it."""
    cfg = OrchestratorConfig()
    cfg.oom.probe_after = 50
    twin = OutOfMemory(cfg)
    twin.configured, twin.probe_after = 1024, 100  # one probe already failed here
    twin.ran_out([1, 64 << 30])
    twin.error(11, 1024, "out of memory", [])
    for step in range(12, 41):
        assert twin.observe(metrics(step, micro_batch_tokens=512)) is None
    saved = twin.state_dict()
    if not saved_machine:
        del saved["ran_out_on"]
    resumed = OutOfMemory(cfg)
    resumed.load_state_dict(saved)
    resumed.resumed([1, 64 << 30])
    mine = [resumed.observe(metrics(s, micro_batch_tokens=512)) for s in range(41, 41 + RESUME_PROBE)]
    assert mine[:-1] == [None] * (RESUME_PROBE - 1) and mine[-1].evidence["clean_steps"] == RESUME_PROBE
    assert "since the run resumed" in mine[-1].summary and mine[-1].evidence["target"] == 1024
    assert resumed.probe_after == (200 if saved_machine else 100)  # the next wait: back-off kept, or restarted


def test_probe_after_edited_between_sessions_takes_effect_with_the_back_off_kept():
    """orchestrator.oom.probe_after 50 -> 5 at a resume (journaled "in effect from this step"): the
    checkpointed 100 (50 doubled by a failed probe) won and the edit was ignored. Now the config's, doubled
    as the failure taught: the next probe after 10 steps; a checkpoint without probe_configured: the config's."""
    cfg = OrchestratorConfig()
    cfg.oom.probe_after = 50
    before = OutOfMemory(cfg)
    before.probe_after = 100
    saved = before.state_dict()
    cfg.oom.probe_after = 5
    after = OutOfMemory(cfg)
    after.load_state_dict(saved)
    assert (after.probe_after, after.probe_configured) == (10, 5)
    older = OutOfMemory(cfg)
    older.load_state_dict({k: v for k, v in saved.items() if k != "probe_configured"} | {"probe_after": 50})
    assert older.probe_after == 5
    kept = OutOfMemory(OrchestratorConfig())  # the config unchanged: the checkpoint's back-off stands
    kept.load_state_dict({**OutOfMemory(OrchestratorConfig()).state_dict(), "probe_after": 400})
    assert kept.probe_after == 400


def test_a_rollback_to_before_an_out_of_memory_error_keeps_what_it_taught(tmp_path):
    """The shrunk micro-batch is a knob a rollback keeps: the error that set it, where it happened
    and the count toward the probe stay with it (restored, a resume on that machine probed early)."""
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    oom = orchestrator.monitors["oom"]
    oom.configured = 1024
    saved = orchestrator.state_dict()  # before the error
    oom.ran_out([1, 64 << 30])
    oom.error(11, 1024, "out of memory", [])
    assert oom.observe(metrics(12, micro_batch_tokens=512)) is None
    orchestrator._load_monitors(saved, rollback=True)
    assert (oom.last, oom.ran_out_on, oom.clean) == (11, [1, 64 << 30], 1)
    orchestrator._load_monitors(saved)  # a resume from that checkpoint restores all of it, the knob too
    assert (oom.last, oom.ran_out_on) == (-1, [])


def test_moe_health_leaves_out_a_withheld_steps_routing():
    cfg = OrchestratorConfig()
    cfg.moe.window = 2
    m = MoEHealth(cfg)
    collapsed = [(1, [1.0, 0.0, 0.0, 0.0], 0.0, 1)]  # a bad batch's tokens all on expert 0
    for step in (1, 2, 3):
        assert m.observe(replace(metrics(step), moe=collapsed, skipped=True)) is None
    assert m.loads == {}
    assert m.observe(replace(metrics(4), moe=collapsed)) is None  # the window fills from kept steps only
    assert m.observe(replace(metrics(5), moe=collapsed)).evidence["kind"] == "collapse"


def test_throughput_findings_on_a_loaded_machine_are_rate_limited():
    cfg = OrchestratorConfig()
    m = Throughput(cfg)
    feed(m, [1000.0] * 20, key="tokens_per_s")
    slow = feed(m, [300.0] * 100, key="tokens_per_s", start=21)
    assert sum(f is not None for f in slow) == 1  # one line for the stretch, not one every 5 steps
    slower = feed(m, [100.0] * 10, key="tokens_per_s", start=121)  # halved again: worth a line
    assert sum(f is not None for f in slower) == 1
    later = feed(m, [300.0] * 10, key="tokens_per_s", start=131 + cfg.throughput.cooldown)
    assert sum(f is not None for f in later) == 1  # after the cooldown


def test_divergence_slope():
    cfg = OrchestratorConfig()
    cfg.divergence.window, cfg.divergence.min_rise = 5, 0.05
    m = Divergence(cfg)
    found = feed(m, [5.0, 5.1, 5.2, 5.3, 5.4])
    assert found[:4] == [None] * 4 and found[4] is not None
    f = found[4]
    assert f.rule == "divergence" and f.evidence["rise"] == pytest.approx(0.4)
    assert f.evidence["mean"] == pytest.approx(5.2) and len(m.window) == 0  # a fresh window after firing
    assert feed(Divergence(cfg), [5.0, 5.0, 5.0, 5.0, 5.0]) == [None] * 5
    assert feed(Divergence(cfg), [5.4, 5.3, 5.2, 5.1, 5.0]) == [None] * 5
    assert feed(Divergence(cfg), [5.0, 5.02, 5.04, 5.06, 5.08]) == [None] * 5  # rise 0.08 < 5% of 5.04
    # an objective that is no likelihood (RL's, 0 with no signal): no relative rise to judge
    assert feed(Divergence(cfg), [-0.04, -0.03, -0.02, -0.01, 0.0]) == [None] * 5


def test_divergence_is_not_drawn_by_the_noise_of_a_sound_run():
    """A fault-free debug-moe run of 500 steps (5.7 epochs, losses 1.5-2.0 a step-to-step spread of
    ~0.08) had its LR halved three times for rises of 5-6% that its noise drew. The rise must stand
    `sigma` standard errors clear of that noise too; a real climb of the same size, smooth, fires."""
    cfg = OrchestratorConfig()  # window 40, min_rise 5%, sigma 3
    noise = [0.08 * x for x in (1.1, -0.9, 0.4, -1.6, 0.9, -0.3, 1.4, -1.2, 0.2, -0.5)] * 4
    noisy = [1.6 + 0.1 * i / 39 + e for i, e in enumerate(noise)]  # rise ~0.1 (6%) under noise 0.08
    assert Rolling(40, noisy).slope() * 39 > 0.05 * sum(noisy) / 40  # past min_rise: the old rule fired
    assert feed(Divergence(cfg), noisy) == [None] * 40
    smooth = [1.6 + 0.1 * i / 39 + e / 8 for i, e in enumerate(noise)]  # the same rise, a tenth of the noise
    [*quiet, found] = feed(Divergence(cfg), smooth)
    assert quiet == [None] * 39 and found.evidence["rise_error"] < found.evidence["rise"] / 3


def test_plateau_variance():
    cfg = OrchestratorConfig()
    cfg.plateau.window, cfg.plateau.variance, cfg.plateau.max_progress = 5, 1e-3, 0.8
    flat = [4.0, 4.01, 3.99, 4.0, 4.005]
    found = feed(Plateau(cfg), flat, progress=0.5)
    assert found[:4] == [None] * 4 and found[4].rule == "plateau"
    assert found[4].evidence["variance"] == pytest.approx(Rolling(5, flat).std() ** 2)
    assert feed(Plateau(cfg), flat, progress=0.85) == [None] * 5  # late: that is convergence
    assert feed(Plateau(cfg), [4.0, 4.2, 3.9, 4.1, 3.8], progress=0.5) == [None] * 5


def test_throughput_median_and_patience():
    cfg = OrchestratorConfig()
    cfg.throughput.window, cfg.throughput.min_samples, cfg.throughput.factor, cfg.throughput.patience = 10, 3, 0.5, 2
    m = Throughput(cfg)
    assert feed(m, [1000.0, 1100.0, 900.0], key="tokens_per_s") == [None] * 3
    assert m.observe(metrics(4, tokens_per_s=400.0)) is None  # slow once
    assert m.observe(metrics(5, tokens_per_s=1000.0)) is None  # a normal step resets the count
    assert m.observe(metrics(6, tokens_per_s=400.0)) is None
    f = m.observe(metrics(7, tokens_per_s=300.0))
    assert f.rule == "throughput" and f.evidence["median"] == 1000.0 and f.strength == pytest.approx(0.7)
    assert sorted(m.window.values) == [900.0, 1000.0, 1000.0, 1100.0]  # slow steps stay out


def test_memory_pressure_patience():
    cfg = OrchestratorConfig()
    cfg.memory.threshold, cfg.memory.patience = 0.9, 2
    m = MemoryPressure(cfg)
    assert m.observe(metrics(1, memory=None)) is None
    assert m.observe(metrics(2, memory=0.95)) is None
    assert m.observe(metrics(3, memory=0.5)) is None  # resets
    assert m.observe(metrics(4, memory=0.95)) is None
    f = m.observe(metrics(5, memory=0.97))
    assert f.rule == "memory" and f.family == "memory" and f.evidence["threshold"] == 0.9
    assert m.observe(metrics(6, memory=0.97)) is None  # counting starts over after a finding


def test_fp16_overflow_count():
    cfg = OrchestratorConfig()
    cfg.fp16.window, cfg.fp16.max_overflows = 4, 2
    m = Fp16Overflow(cfg)
    assert m.observe(metrics(1, overflow=True)) is None
    assert m.observe(metrics(2, overflow=False)) is None
    f = m.observe(metrics(3, overflow=True))
    assert f.rule == "fp16" and f.evidence["overflows"] == 2 and len(m.window) == 0
    assert feed(Fp16Overflow(cfg), [True, False, False, False, True], key="overflow") == [None] * 5  # 4 apart
    # train.loss_scale.growth_interval 2: the scaler grows every 2 clean steps and overflows at each
    # growth that overshoots, 2 of 4 steps by design; a storm is max_overflows beyond those
    m = Fp16Overflow(cfg)
    m.growth_interval = 2
    assert feed(m, [True, False, True, False], key="overflow") == [None] * 4
    f = [m.observe(metrics(5 + i, overflow=True)) for i in range(4)][-1]
    assert f is not None and f.evidence["growth_overflows"] == 2 and f.evidence["overflows"] == 4


def test_build_monitors_respects_enabled():
    cfg = OrchestratorConfig()
    assert set(build_monitors(cfg)) == {
        "nonfinite",
        "above_start",
        "spike",
        "grad",
        "divergence",
        "plateau",
        "throughput",
        "memory",
        "fp16",
        "lr",
        "oom",  # the OOM path's retries and its probe back up live in a monitor too
        "rl_signal",  # silent outside `trimtab rl`: only an RL step carries its reading
        "rl_verifier",
        "rl_ratio",
        "rl_reward",
        "rl_entropy",
        "rl_length",
        "rl_hacking",
        "dpo_held_out",  # silent outside `trimtab dpo`: only a DPO evaluation carries its reading
    }  # moe: the orchestrator adds MoEHealth
    cfg.spike.enabled = cfg.plateau.enabled = False
    assert "spike" not in build_monitors(cfg) and "plateau" not in build_monitors(cfg)
    assert "nonfinite" in build_monitors(cfg)  # always watched


def test_monitor_state_round_trip_through_json():
    cfg = OrchestratorConfig()
    cfg.spike.min_samples, cfg.grad.min_samples, cfg.divergence.window, cfg.plateau.window = 5, 5, 6, 6
    cfg.throughput.min_samples, cfg.throughput.patience, cfg.memory.threshold = 3, 2, 0.5
    first = [
        metrics(
            s,
            loss=5 - 0.01 * s + 0.05 * (s % 3),
            grad_norm=1 + 0.1 * (s % 4),
            tokens_per_s=1000 + 10 * s,
            memory=0.6,
            overflow=s % 5 == 0,
        )
        for s in range(1, 16)
    ]
    then = [
        metrics(16, loss=9.0),
        metrics(17, grad_norm=500.0),
        metrics(18, tokens_per_s=100.0),
        metrics(19, tokens_per_s=100.0, memory=0.7),
    ] + [metrics(s, loss=4.8 + 0.05 * s, memory=0.7) for s in range(20, 30)]
    a = build_monitors(cfg)
    for m in first:
        for mon in a.values():
            mon.observe(m)
    state = json.loads(json.dumps({k: mon.state_dict() for k, mon in a.items()}))
    b = build_monitors(cfg)
    for k, mon in b.items():
        mon.load_state_dict(state[k])
    assert isinstance(b["spike"].window, Rolling) and b["spike"].window.values.maxlen == cfg.spike.window

    def run(monitors):
        out = []
        for m in then:
            out += [(m.step, f.rule, f.summary) for mon in monitors.values() if (f := mon.observe(m))]
        return out, monitors["spike"].ceiling(), monitors["grad"].ceiling()

    result = run(a)
    assert result == run(b)
    assert {rule for _, rule, _ in result[0]} >= {"spike", "grad", "throughput", "memory"}


# ------------------------------------------------------------------------------------ policy


@dataclass
class View:
    """What the policy reads from the run's view."""

    lr_scale: float = 1.0
    micro_batch_tokens: int = 1024
    min_micro_batch_tokens: int = 64
    activation_checkpointing: str = "off"
    has_good_checkpoint: bool = True
    bad_row_loss: float = 6.0  # what each row of the flagged steps scores (held-out rows: 5.0): 1 nat above,
    # an outlier to a climb's scoring (orchestrator.data.min_gap) but not to one spike's (rows.min_gap)
    probe: float | None = None  # the held-out probe's loss (None: no held-out data)
    last_good: int = 20  # the newest good checkpoint's step
    checkpoints: tuple[int, ...] = (0, 10, 20)  # the steps of the checkpoints kept
    total_steps: int = 1000

    def probe_loss(self):
        return self.probe

    def weights_finite(self):  # as RunView: the probe is NaN exactly when they are not
        return self.probe is None or not math.isnan(self.probe)

    def has_checkpoint(self, step):
        return any(c <= step for c in self.checkpoints)

    def row_losses(self, rows):
        return {r: self.bad_row_loss for r in rows}

    def held_out_row_losses(self, limit):
        return [4.9, 5.0, 5.1] * 4

    def row_parts(self, rows):
        return None  # one source

    def row_sources(self, rows):
        return {"corpus.txt": len(rows)}


def act(policy, f, view):
    """The policy's remedy for f, applied (as the orchestrator applies it in auto mode)."""
    remedy = policy.plan(f, view)
    remedy.applied()
    return remedy


def finding(step, rule="spike", family="instability", rows=None, strength=1.0):
    rows = rows if rows is not None else [step * 10, step * 10 + 1]
    evidence = {"retry": 1} if rule == "oom" else {}
    return Finding(rule=rule, family=family, step=step, evidence=evidence, summary="", strength=strength, rows=rows)


def test_a_second_rollback_to_the_same_checkpoint_goes_one_further_back():
    """The replay from step 20 met the trouble again before a newer good checkpoint: step 20's
    checkpoint holds the update that broke the run (the spike shows on the step after it)."""
    policy, view = Policy(OrchestratorConfig()), View()
    first = [act(policy, finding(s), view) for s in range(21, 27)][-1]
    assert first.action == "rollback" and first.params["to"] == "last_good"
    second = [act(policy, finding(s), view) for s in range(21, 27)][-1]
    assert second.action == "rollback" and second.params["to"] == 19  # the newest checkpoint at or before: 10
    assert "restore the one before it" in second.reasoning
    view.last_good = 30  # a newer good checkpoint since: back to last_good
    third = [act(policy, finding(s), view) for s in range(31, 37)][-1]
    assert third.params["to"] == "last_good"


def test_ladder_climbs_skip_lr_rollback_stop():
    policy, view = Policy(OrchestratorConfig()), View()
    plans = [act(policy, finding(s), view) for s in range(1, 7)]
    assert [p.action for p in plans] == ["skip_step", "skip_step", "scale_lr", "skip_step", "skip_step", "rollback"]
    assert plans[2].params == {"factor": 0.5}
    assert plans[5].params == {
        "to": "last_good",
        "skip_rows": sorted(r for s in range(1, 7) for r in (s * 10, s * 10 + 1)),
    }
    assert policy.ladder.rung == 0 and policy.ladder.rows == []  # starts over after a rollback
    view.lr_scale = 0.5
    for first in (7, 13):  # the same incident: no replay got clear of it
        assert [act(policy, finding(s), view).action for s in range(first, first + 6)] == [
            "skip_step",
            "skip_step",
            "scale_lr",
            "skip_step",
            "skip_step",
            "rollback",
        ]
    assert policy.rollbacks == 3  # max_rollbacks spent on one incident
    plans = [act(policy, finding(s), view) for s in range(19, 25)]
    assert [p.action for p in plans] == ["skip_step", "skip_step", "scale_lr", "skip_step", "skip_step", "stop"]
    assert "3 rollbacks used on one incident (orchestrator.max_rollbacks=3 per incident" in plans[-1].params["reason"]


def test_ladder_findings_outside_the_escalation_window_do_not_climb():
    cfg = OrchestratorConfig()
    cfg.escalation_window = 10
    policy = Policy(cfg)
    assert [act(policy, finding(s), View()).action for s in (1, 11, 21, 31, 41)] == ["skip_step"] * 5
    assert act(policy, finding(42), View()).action == "skip_step"
    assert act(policy, finding(43), View()).action == "scale_lr"  # 41, 42, 43 within 10 steps


def test_ladder_skips_the_lr_rung_at_the_floor_and_stops_without_a_checkpoint():
    policy = Policy(OrchestratorConfig())
    assert [act(policy, finding(s), View(lr_scale=0.015)).action for s in (1, 2, 3)] == [
        "skip_step",
        "skip_step",
        "rollback",
    ]  # 0.015 x 0.5 < min_lr_scale
    policy = Policy(OrchestratorConfig())
    plans = [act(policy, finding(s), View(lr_scale=0.015, has_good_checkpoint=False)) for s in (1, 2, 3)]
    assert plans[-1].action == "stop" and "no good checkpoint" in plans[-1].params["reason"]


def test_divergence_goes_straight_to_the_lr_rung():
    cfg = OrchestratorConfig()
    cfg.divergence.lr_factor = 0.3
    policy = Policy(cfg)
    plan = act(policy, finding(5, rule="divergence"), View())
    assert plan.action == "scale_lr" and plan.params == {"factor": 0.3}
    assert policy.lr_debt == 1.0  # a rising trend is the LR's doing: the cut is never given back


def test_quiet_resets_the_ladder_and_gives_the_lr_back():
    cfg = OrchestratorConfig()  # escalation_window 50, lr_restore_after 100
    policy = Policy(cfg)
    for s in (1, 2, 3):
        act(policy, finding(s), View())
    assert policy.ladder.rung == 1 and policy.lr_debt == 0.5
    view = View(lr_scale=0.5)
    assert policy.quiet(52, view) is None and policy.ladder.rung == 1
    assert policy.quiet(53, view) is None and policy.ladder.rung == 0
    assert policy.quiet(102, view) is None
    plan = policy.quiet(103, view)
    assert plan.action == "scale_lr" and plan.params == {"factor": 2.0} and policy.lr_debt == 0.5  # not yet applied
    plan.applied()
    assert policy.lr_debt == 1.0
    assert policy.quiet(300, View()) is None  # nothing left to give back


def test_a_short_runs_cut_is_given_back_within_it():
    """debug at 2x its LR, 80 steps: a cut at step 14 stayed to the end (val 4.868, off 4.582), since
    lr_restore_after (100) quiet steps never came. A short run waits an eighth of its steps, but no less than
    outcome_after (20: a 24-step test gave a x0.1 cut back 3 steps into the replay that had broken it)."""
    policy = Policy(OrchestratorConfig())
    for s in (1, 2, 3):
        act(policy, finding(s), View(total_steps=80))
    assert policy.quiet(22, View(lr_scale=0.5, total_steps=80)) is None
    back = policy.quiet(23, View(lr_scale=0.5, total_steps=80))
    assert back.params == {"factor": 2.0} and back.evidence["wait"] == 20 and "80 steps" in back.reasoning
    long = Policy(OrchestratorConfig())
    for s in (1, 2, 3):
        act(long, finding(s), View(total_steps=400))
    assert long.quiet(52, View(lr_scale=0.5, total_steps=400)) is None
    assert long.quiet(53, View(lr_scale=0.5, total_steps=400)).evidence["wait"] == 50


def test_a_failed_lr_restore_is_tried_once_more_then_keeps_the_cut():
    cfg = OrchestratorConfig()
    cfg.lr_restore_after = 10
    policy = Policy(cfg)
    for s in (1, 2, 3, 4, 5, 6):  # two LR rungs (x0.5 at 3), a rollback at 6
        act(policy, finding(s), View())
    for s in (7, 8, 9):
        act(policy, finding(s), View(lr_scale=0.5))
    assert policy.lr_debt == 0.25
    restore = policy.quiet(19, View(lr_scale=0.25))
    assert restore.params == {"factor": 2.0}  # gives half back
    restore.applied()
    for s in (25, 26, 27):  # instability returns after the give-back
        act(policy, finding(s), View(lr_scale=0.5))
    assert all(policy.quiet(s, View(lr_scale=0.25)) is None for s in range(28, 47))
    again = policy.quiet(47, View(lr_scale=0.25))  # once more, after twice the wait (give_back.py)
    assert again.params == {"factor": 2.0} and "the cut stays" in again.reasoning
    again.applied()
    for s in (50, 51, 52):  # and it returns again: the cut stays
        act(policy, finding(s), View(lr_scale=0.5))
    assert all(policy.quiet(s, View(lr_scale=0.25)) is None for s in range(53, 300))


def test_plateau_raise_is_bounded():
    cfg = OrchestratorConfig()  # plateau.window 50 -> 100-step cooldowns
    policy = Policy(cfg)
    act(policy, finding(10), View())  # instability at step 10
    assert act(policy, finding(100, "plateau", "plateau"), View()).action == "none"
    plan = act(policy, finding(200, "plateau", "plateau"), View())
    assert plan.action == "scale_lr" and plan.params == {"factor": 1.5}
    late = act(policy, finding(250, "plateau", "plateau"), View(lr_scale=1.5))
    assert late.action == "none" and "changed recently" in late.reasoning
    capped = act(policy, finding(400, "plateau", "plateau"), View(lr_scale=1.5))
    assert capped.action == "none" and "max_lr_scale" in capped.reasoning  # 2.25 > 2


def test_data_attribution_leaves_out_only_the_rows_that_score_as_outliers():
    policy, view = Policy(OrchestratorConfig()), View(probe=5.0)
    policy.probe_baseline = 5.0  # the model scores held-out data as at the last good checkpoint
    scores = {r: 6.0 if r % 4 == 0 else 5.05 for r in range(100)}  # under a lone spike's bar (rows.min_gap)
    view.row_losses = lambda rows: {r: scores[r] for r in rows}
    plans = [act(policy, finding(s, rows=list(range(10 * s, 10 * s + 10))), view) for s in (1, 2, 3)]
    assert [p.action for p in plans] == ["skip_step", "skip_step", "skip_data"]
    assert plans[2].params == {"rows": [r for r in range(10, 40) if r % 4 == 0]}  # 7 of 30, not all 30
    e = plans[2].evidence
    assert (e["rows_scored"], e["rows_outliers"], e["sources"]) == (30, 7, {"corpus.txt": 7})
    # 4 x MAD-std, widened for the fake view's 12 reference rows (attribution.py small_sample_sigma: 5.55)
    assert e["reference_rows"] == 12 and e["reference_median"] == 5.0
    assert e["threshold"] == pytest.approx(5.0 + small_sample_sigma(4, 12) * 1.4826 * 0.1)
    assert policy.ladder.rows == [] and policy.ladder.rung == 0


def test_a_lone_spikes_rows_far_above_held_out_ones_are_left_out_with_the_skip_and_the_next_watched():
    """The update gate withheld a loss spike's update: the weights scored the steps before well,
    so the step's rows are what changed. Skipped alone, the garbage rows came back in the next
    epoch, and the stretch's steps under the ceiling trained unseen (healing benchmark,
    bad_rows@60:8: 26 of 70 rows named). Rows a rows.min_gap above held-out ones go at once."""
    scores = {r: 9.0 if r % 4 == 0 else 5.05 for r in range(1000)}
    view = View()
    view.row_losses = lambda rows: {r: scores[r] for r in rows}
    policy = Policy(OrchestratorConfig())
    policy.data.record(60, list(range(600, 610)))  # as the orchestrator does before the policy plans
    plan = act(policy, finding(60, rows=list(range(600, 610))), view)
    assert plan.action == "skip_data" and plan.params == {"rows": [600, 604, 608]}
    # data.min_gap's bar (5.0 + 5.55 x 1.4826 x 0.1: 4 spreads widened for 12 reference rows), once one row is
    # above rows.min_gap's (5.0 + 1.5)
    assert "3 of the step's 10 rows lose more than 5.822" in plan.reasoning and "one above 6.500" in plan.reasoning
    assert policy.data.watch_until == 60 + OrchestratorConfig().data.watch_steps and policy.ladder.rung == 0
    watched = act(policy, finding(61, rows=list(range(610, 620))), view)  # the watch scores the step's rows
    assert watched.action == "skip_step"
    for evidence, state in (
        ({"rerun": {"verdict": "transient"}}, {}),  # a re-run that differed: a transient fault's (transient.py)
        ({}, {"lr_too_high_at": 58}),  # the LR found far too high: rows score high for the model's sake
        ({}, {"unstable_at": 55}),  # after an LR cut or a rollback: the model, not a row
    ):
        fresh, f = Policy(OrchestratorConfig()), finding(60, rows=list(range(600, 610)))
        f.evidence.update(evidence)
        for key, value in state.items():
            setattr(fresh, key, value)
        assert act(fresh, f, view).action == "skip_step", (evidence, state)
    hard = View(bad_row_loss=6.0)  # hard rows of text: 1 nat above held-out ones, none at rows.min_gap's bar
    assert act(Policy(OrchestratorConfig()), finding(60), hard).action == "skip_step"
    mixed = {r: 9.0 if r == 600 else 6.0 for r in range(600, 610)}  # blamed on one; judged at data.min_gap's bar
    view.row_losses = lambda rows: {r: mixed[r] for r in rows}
    assert act(Policy(OrchestratorConfig()), finding(60, rows=list(range(600, 610))), view).params["rows"] == list(
        range(600, 610)
    )


def test_clean_rows_and_sound_weights_leave_nothing_out_and_the_ladder_climbs():
    """A NaN forward (or numerically unstable steps): the rows score as held-out rows do, so none
    is left out (they were, all of them, before) and the ladder climbs to the LR cut instead."""
    policy, view = Policy(OrchestratorConfig()), View(probe=5.0, bad_row_loss=5.05)
    policy.probe_baseline = 5.0
    plans = [act(policy, finding(s, rule="nonfinite"), view) for s in (1, 2, 3)]
    assert [p.action for p in plans] == ["skip_step", "skip_step", "scale_lr"]
    assert policy.ladder.rows  # still held, for the attribution of a later rollback


def test_gradient_spikes_alone_on_sound_weights_are_skipped_once_before_the_lr_is_cut():
    """Three gradient-norm spikes in a row, their updates withheld: the loss never spiked, the
    held-out probe is sound and no row is an outlier, so the skipped updates did no harm. The LR
    was cut x0.5 for them (debug-mod, grad_spike at steps 40-43: 4.23 against 4.07 with the
    orchestrator off); now the climb is answered by a skip once, and as many again cut it. An
    incident with a loss spike in it climbs as before."""
    policy, view = Policy(OrchestratorConfig()), View(probe=5.0, bad_row_loss=5.05)
    policy.probe_baseline = 5.0
    plans = [act(policy, finding(s, rule="grad"), view) for s in range(40, 46)]
    assert [p.action for p in plans] == ["skip_step"] * 5 + ["scale_lr"]
    assert "the loss never spiked" in plans[2].reasoning and "keep the LR" in plans[2].reasoning
    mixed = Policy(OrchestratorConfig())
    mixed.probe_baseline = 5.0
    rules = ["grad", "spike", "grad"]
    plans = [act(mixed, finding(s, rule=r), view) for s, r in zip(range(40, 43), rules, strict=True)]
    assert [p.action for p in plans] == ["skip_step", "skip_step", "scale_lr"]


def test_withheld_spikes_with_a_worse_probe_mean_broken_weights_and_a_recurrence_cuts_the_lr():
    """Updates withheld, yet every new batch scores high and so do held-out rows: an update before
    the first spike broke the weights (a real debug run: 5.0 -> 7.8 at one step, then 7.4 on every
    batch). Roll back at once, keeping the rows and the LR (the breakage may have been transient);
    when the weights break again before the replay got clear of the breakage, the same steps at
    this LR break them: the rollback cuts the LR decisively (x0.1), given back on probation."""
    policy = Policy(OrchestratorConfig())
    policy.probe_baseline = 5.2
    plans = [act(policy, finding(s), View(probe=8.4, last_good=108)) for s in (120, 121, 122)]
    assert [p.action for p in plans] == ["skip_step", "skip_step", "rollback"]
    assert plans[2].params == {"to": "last_good", "skip_rows": []}  # the data stays
    assert "an earlier update broke the weights" in plans[2].reasoning and policy.lr_debt == 1.0
    policy.shift(122 - 108)  # rolled back to step 108; the same steps break the weights again
    replay = View(probe=8.4, last_good=108)
    assert all(policy.quiet(s, replay) is None for s in range(109, 119))
    again = [act(policy, finding(s), replay) for s in (119, 120, 121)][-1]
    assert again.params == {"to": "last_good", "skip_rows": [], "lr_factor": 0.1}
    assert "broke again before the replay got clear of the last breakage (step 122)" in again.reasoning
    assert "given back only after orchestrator.lr_restore_after quiet steps" in again.reasoning
    assert policy.lr_debt == 0.1 and policy.rollbacks == 2
    assert describe("rollback", again.params) == "roll back to last_good, lr x0.1"


def test_divergence_from_the_data_leaves_rows_out_and_from_the_lr_cuts_it():
    policy = Policy(OrchestratorConfig())
    policy.probe_baseline = 5.0
    bad = act(policy, finding(40, rule="divergence", rows=list(range(8))), View(probe=5.0))
    assert bad.action == "skip_data" and bad.params == {"rows": list(range(8))}
    clean = act(policy, finding(90, rule="divergence", rows=list(range(8))), View(probe=5.0, bad_row_loss=5.0))
    assert clean.action == "scale_lr" and clean.params == {"factor": 0.5}  # no row to blame: the LR is cut
    worse = Policy(OrchestratorConfig())
    worse.probe_baseline = 4.0  # the model itself got worse on held-out data: no data verdict at all
    assert act(worse, finding(40, rule="divergence"), View(probe=4.5)).action == "scale_lr"


def test_first_plateau_without_any_instability_raises_the_lr():
    policy = Policy(OrchestratorConfig())  # window 50
    plan = act(policy, finding(50, "plateau", "plateau"), View())
    assert plan.action == "scale_lr", plan.reasoning


def test_memory_and_oom_halve_the_micro_batch_then_recompute_more_then_stop():
    policy = Policy(OrchestratorConfig())
    plan = act(policy, finding(5, "oom", "memory"), View(micro_batch_tokens=1024))
    assert plan.action == "set_micro_batch_tokens" and plan.params == {"tokens": 512}
    plan = act(policy, finding(5, "memory", "memory"), View(micro_batch_tokens=128))
    assert plan.action == "set_micro_batch_tokens" and plan.params == {"tokens": 64}
    # at one row (half of 96 is less than a row of 64), an OOM checkpoints more: off, selective, full
    for mode, more in [("off", "selective"), ("selective", "full")]:
        plan = act(policy, finding(5, "oom", "memory"), View(micro_batch_tokens=96, activation_checkpointing=mode))
        assert plan.action == "set_activation_checkpointing" and plan.params == {"mode": more}
        assert "one row (96 tokens)" in plan.reasoning and "same bit for bit" in plan.reasoning
    stop = act(policy, finding(5, "oom", "memory"), View(micro_batch_tokens=64, activation_checkpointing="full"))
    assert stop.action == "stop" and "one row (64 tokens) and activation checkpointing full" in stop.params["reason"]
    cfg = OrchestratorConfig()
    cfg.oom.recompute = False  # the user keeps the step's speed: one row is the end
    stop = act(Policy(cfg), finding(5, "oom", "memory"), View(micro_batch_tokens=64))
    assert stop.action == "stop" and "set train.activation_checkpointing" in stop.params["reason"]
    spent = finding(5, "oom", "memory")
    spent.evidence["retry"] = 9  # past orchestrator.oom.max_retries (8): no more recompute either
    assert "after 8 retries" in act(policy, spent, View(micro_batch_tokens=64)).params["reason"]


def test_a_raised_checkpointing_is_probed_lighter_before_a_larger_micro_batch():
    """After an OOM made the run recompute more, the probe tries one step lighter first (full ->
    selective -> the configured off), each after a clean stretch twice the last, then the micro-batch."""
    from trimtab.orchestrator.resources import OutOfMemory

    cfg = OrchestratorConfig()
    cfg.oom.probe_after = 4
    monitor, policy = OutOfMemory(cfg), Policy(cfg)
    monitor.configured = 1024

    def first_probe(step: int, mode: str):
        for s in range(step, step + 100):
            f = monitor.observe(StepMetrics(step=s, loss=3.0, grad_norm=1.0, micro_batch_tokens=64, checkpointing=mode))
            if f is not None:
                return s, f

    (at, f), view = first_probe(1, "full"), View(micro_batch_tokens=64, activation_checkpointing="full")
    plan = act(policy, f, view)
    assert at == 4 and plan.action == "set_activation_checkpointing" and plan.params == {"mode": "selective"}
    at, f = first_probe(at + 1, "selective")
    assert at == 4 + 8 and act(policy, f, view).params == {"mode": "off"}  # the back-off doubled the wait
    at, f = first_probe(at + 1, "off")
    assert at == 12 + 16 and act(policy, f, view).params == {"tokens": 128}


def test_after_a_persons_micro_batch_the_probe_returns_to_theirs_not_the_configs():
    from trimtab.orchestrator.resources import OutOfMemory

    cfg = OrchestratorConfig()
    cfg.oom.probe_after = 2
    monitor = OutOfMemory(cfg)
    monitor.configured, monitor.configured_checkpointing = 1024, "off"
    monitor.set_by_person(micro_batch_tokens=256)
    monitor.set_by_person(checkpointing="selective")
    assert monitor.person_checkpointing == "selective"
    quiet = [
        monitor.observe(StepMetrics(step=s, loss=3.0, grad_norm=1.0, micro_batch_tokens=256, checkpointing="selective"))
        for s in range(1, 9)
    ]
    assert quiet == [None] * 8  # the person's own setting is not "lighter than configured"
    monitor.error(9, 256, "CUDA out of memory", [])  # the rule halves it to 128, then probes back to 256
    probes = [
        monitor.observe(StepMetrics(step=s, loss=3.0, grad_norm=1.0, micro_batch_tokens=128, checkpointing="selective"))
        for s in (10, 11)
    ]
    assert probes[0] is None and probes[1].evidence["target"] == 256


def test_memory_pressure_at_one_row_does_not_stop_a_healthy_run():
    plan = act(Policy(OrchestratorConfig()), finding(5, "memory", "memory"), View(micro_batch_tokens=64))
    assert plan.action == "none"


def test_fp16_and_throughput_remedies():
    cfg = OrchestratorConfig()
    cfg.fp16.lr_factor = 0.25
    policy = Policy(cfg)
    assert act(policy, finding(3, "fp16", "fp16"), View()).params == {"factor": 0.25}
    assert policy.last_lr_change == 3
    plan = act(policy, finding(4, "throughput", "throughput"), View())
    assert plan.action == "none" and plan.params == {}


def test_policy_state_round_trip_and_shift():
    policy = Policy(OrchestratorConfig())
    for s in (10, 11, 12, 13):
        act(policy, finding(s), View())
    state = json.loads(json.dumps(policy.state_dict()))
    other = Policy(OrchestratorConfig())
    other.load_state_dict(state)
    assert other.state_dict() == policy.state_dict()
    for s, action in [(14, "skip_step"), (15, "rollback")]:
        assert act(other, finding(s), View()).action == act(policy, finding(s), View()).action == action
    assert other.state_dict() == policy.state_dict()
    policy.shift(5)
    assert policy.ladder.last_step == 10 and policy.last_lr_change == 10  # counted in steps trained


# ------------------------------------------------------------------------------------ confidence, journal


def decision(id, step, rule, action, **kw):
    return Decision(
        **{
            "id": id,
            "step": step,
            "rule": rule,
            "evidence": {},
            "reasoning": "",
            "action": action,
            "params": {},
            "confidence": 0.5,
            "mode": "auto",
            **kw,
        }
    )


def test_confidence_is_strength_times_track_record(tmp_path):
    assert Policy.confidence(1.0, (0, 0)) == 0.75  # Beta(3, 1) prior
    assert Policy.confidence(0.8, (0, 0)) == 0.6
    assert Policy.confidence(1.0, (4, 4)) == pytest.approx(7 / 8, abs=1e-3)
    assert Policy.confidence(1.0, (0, 6)) == 0.3
    journal = Journal(tmp_path / "decisions.jsonl")
    for i, result in enumerate(["recovered", "not recovered", "not recovered", None]):
        journal.add(
            Decision(
                id=journal.next_id(),
                step=i,
                rule="spike",
                evidence={},
                reasoning="",
                action="skip_step",
                params={},
                confidence=0.5,
                mode="auto",
                outcome={"result": result} if result else None,
            )
        )
    journal.add(decision(journal.next_id(), 9, "grad", "skip_step", outcome={"result": "recovered"}))
    journal.add(decision(journal.next_id(), 12, "spike", "scale_lr", outcome={"result": "not recovered"}))
    assert journal.track_record("spike", "skip_step") == (1, 3) and journal.track_record("grad", "skip_step") == (1, 1)
    assert journal.track_record("plateau", "scale_lr") == (0, 0)
    assert journal.track_record("spike", "scale_lr") == (0, 1)  # per remedy: the skips' record is not its
    assert [d.id for d in journal.pending()] == [4]
    assert Policy.confidence(1.0, journal.track_record("spike", "skip_step")) < Policy.confidence(1.0, (0, 0))


def test_journal_round_trip_with_nan_evidence(tmp_path):
    journal = Journal(tmp_path / "decisions.jsonl")
    d = decision(
        1,
        7,
        "nonfinite",
        "skip_step",
        evidence={"loss": float("nan"), "grad_norm": float("inf")},
        reasoning="why",
        confidence=0.75,
        family="instability",
        summary="loss nan",
    )
    journal.add(d)
    (line,) = read_decisions(tmp_path)
    assert line["step"] == 7 and math.isnan(line["evidence"]["loss"]) and line["evidence"]["grad_norm"] == math.inf
    other = Journal(tmp_path / "other.jsonl")
    other.load_state_dict(json.loads(json.dumps(journal.state_dict(), default=str)))
    assert other.decisions[0].console_line() == d.console_line()
    assert (tmp_path / "other.jsonl").is_file() and read_decisions(tmp_path / "nowhere") == []
    assert (
        "[advise: not applied]"
        in decision(2, 1, "r", "scale_lr", params={"factor": 0.5}, confidence=1, mode="advise").console_line()
    )
    assert describe("rollback", {"to": "last_good", "skip_rows": [1, 2]}) == "roll back to last_good, skip 2 rows"
    assert describe("set_micro_batch_tokens", {"tokens": 512}) == "micro-batch 512 tokens"


def test_the_oom_probe_and_its_failure_above_the_size_a_decision_set_do_not_count_against_it():
    """A resumed run probes a larger micro-batch 10 steps in, within the halving's outcome window:
    the probe, and its out-of-memory error at the larger size, are not the halving failing."""
    from trimtab.orchestrator.outcomes import same_trouble

    halved = decision(1, 15, "oom", "set_micro_batch_tokens", params={"tokens": 512}, family="memory")

    def oom(kind, tokens):
        evidence = {"kind": kind, "micro_batch_tokens": tokens}
        return Finding(rule="oom", family="memory", step=31, evidence=evidence, summary="", strength=1.0)

    assert not same_trouble(halved, oom("probe", 512)) and not same_trouble(halved, oom("oom", 1024))
    assert same_trouble(halved, oom("oom", 512)) and same_trouble(halved, oom("oom", 256))


def test_rows_left_out_fail_only_when_the_same_rows_come_back():
    """The watch through a long bad stretch leaves out each step's rows: the next step's other bad
    rows judged each decision "not recovered", the track record fell below min_confidence and the
    stretch's last rows were only advised out (healing benchmark, bad_batch@15:15: 4 advised)."""
    from trimtab.orchestrator.outcomes import same_trouble

    for rule, family in (("data", "data"), ("spike", "instability"), ("rows", "data")):
        left_out = decision(1, 16, rule, "skip_data", params={"rows": [1, 2]}, family=family)
        later = Finding(rule="data", family=family, step=17, evidence={"rows": [3]}, summary="", strength=1.0)
        assert not same_trouble(left_out, later), rule
        later.evidence["rows"] = [2, 3]
        assert same_trouble(left_out, later), rule
    spike = Finding(rule="spike", family="instability", step=17, evidence={}, summary="", strength=1.0, rows=[2])
    assert same_trouble(decision(1, 16, "spike", "skip_step", family="instability"), spike)  # a skip: any spike


def test_a_resume_after_a_rollback_gives_new_decisions_new_ids(tmp_path):
    """Decision 2 abandoned by a rollback, 3 taken after it; a resume from a checkpoint holding
    1 and 3 gives the next decision id 4 (it gave 3 again: two decisions, one outcome track)."""
    journal = Journal(tmp_path / "decisions.jsonl")
    for i in (1, 2, 3):
        journal.add(decision(i, 10 * i, "spike", "skip_step"))
    kept = [d for d in journal.state_dict() if d["id"] != 2]
    journal.load_state_dict(kept)  # the rollback's: 2 abandoned
    resumed = Journal(tmp_path / "decisions.jsonl")
    resumed.load_state_dict(kept)
    assert resumed.next_id() == 4 and [d["id"] for d in read_decisions(tmp_path, abandoned=True)] == [1, 2, 3]


# ------------------------------------------------------------------------------------ fault specs


def test_parse_fault_valid_specs():
    assert parse_fault("nan_loss@30") == Fault("nan_loss", 30, 1.0, "nan_loss@30")
    assert parse_fault(" oom@10:512 ").param == 512.0 and parse_fault("oom@10").param is None  # the size in use
    assert parse_fault("grad_spike@5").param == 1000.0 and parse_fault("lr_spike@5").param == 10.0
    assert parse_fault("bad_batch@3:4").count == 4 and parse_fault("lr_spike@3:50").count == 1
    assert [f.kind for f in parse_faults(["slow@1:2", "disk_full@8"])] == ["slow", "disk_full"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("melt@3", "unknown fault 'melt'"),
        ("nan_loss", "must look like KIND@STEP[:PARAM]"),
        ("nan_loss@-1", "must look like KIND@STEP[:PARAM]"),
        ("nan_loss@x", "must look like KIND@STEP[:PARAM]"),
        ("oom@3:lots", "must be a number"),
        ("lr_spike@3:0", "needs a positive number"),
        ("nan_loss@3:1.5", "needs a whole number of firings"),
        ("slow@3:-2", "needs a whole number of firings"),
    ],
)
def test_parse_fault_errors(spec, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_fault(spec)
    with pytest.raises(ConfigError, match=r"^faults\[1\]: "):
        parse_faults(["nan_loss@1", spec])


# ------------------------------------------------------------------------------------ Control


def test_control_validates_parameters_when_asked():
    control = Control(trainer=None)
    with pytest.raises(ConfigError, match="emergency_lr_reduction: 'factor' must be a number in \\(0, 1\\)"):
        control.request("emergency_lr_reduction", factor=1.0)
    with pytest.raises(ConfigError, match="emergency_lr_reduction"):
        control.request("emergency_lr_reduction", factor=2.0)
    for action, params in [
        ("scale_lr", {"factor": 0}),
        ("scale_lr", {"factor": -1}),
        ("scale_lr", {}),
        ("scale_lr", {"factor": "2"}),
        ("set_lr", {"value": 0.0}),
        ("set_micro_batch_tokens", {"tokens": 0}),
        ("set_grad_clip", {"value": -1}),
        ("set_weight_decay", {}),
        ("rollback", {"to": "yesterday"}),
        ("rollback", {"to": -3}),
    ]:
        with pytest.raises(ConfigError, match=action):
            control.request(action, **params)
    with pytest.raises(ConfigError, match="unknown action 'fly'"):
        control.request("fly")
    assert control._queue == []  # nothing bad was queued
    control.request("emergency_lr_reduction")
    control.request("emergency_lr_reduction", factor=0.5)
    control.request("rollback", to=12)
    assert [(a, p) for a, p, _ in control._queue] == [
        ("emergency_lr_reduction", {"factor": 0.1}),
        ("emergency_lr_reduction", {"factor": 0.5}),
        ("rollback", {"to": 12}),
    ]
    done = []
    control.request("skip_step", on_done=done.append)
    assert control.skip_next and done == ["the next update will be withheld"]
    # every action a person can take has a ctl verb (skip_data is the orchestrator's own: it names rows)
    assert set(ACTIONS) - {"skip_data"} == {a.name for a in actions.VERBS.values()} - {
        "pause_rule",
        "resume_rule",
        "set_mode",
    }


def test_control_applies_in_order_and_reports():
    trainer = SimpleNamespace(
        state=SimpleNamespace(lr_scale=1.0, step=5),
        cfg=None,
        request_stop=lambda reason, exit_code=0: setattr(trainer, "stopped", reason),
    )
    control = Control(trainer)
    lines = []
    control.request("scale_lr", on_done=lines.append, factor=0.5)
    control.request("emergency_lr_reduction", on_done=lines.append)
    control.request("stop", on_done=lines.append, reason="enough")
    assert control.apply() == lines == ["lr multiplier 1 -> 0.5", "lr multiplier 0.5 -> 0.05", "stopping: enough"]
    assert trainer.state.lr_scale == pytest.approx(0.05) and trainer.stopped == "enough"
    assert control.apply() == []


# ------------------------------------------------------------------------------------ trimtab ctl


def test_parse_command_valid():
    assert ctl.parse_command("scale-lr", ["0.5"]) == {"action": "scale_lr", "params": {"factor": 0.5}}
    assert ctl.parse_command("emergency-lr", []) == {"action": "emergency_lr_reduction", "params": {}}
    assert ctl.parse_command("rollback", []) == {"action": "rollback", "params": {}}
    assert ctl.parse_command("rollback", ["40"]) == {"action": "rollback", "params": {"to": 40}}
    assert ctl.parse_command("micro-batch", ["512"])["params"] == {"tokens": 512}
    assert ctl.parse_command("pause-rule", ["nonfinite"])["params"] == {"rule": "nonfinite"}
    assert ctl.parse_command("mode", ["advise"]) == {"action": "set_mode", "params": {"mode": "advise"}}
    assert ctl.parse_command("stop", []) == {"action": "stop", "params": {}}
    assert set(actions.RULE_NAMES) == {"nonfinite", "end", *OrchestratorConfig.RULES}


@pytest.mark.parametrize(
    "verb, args, message",
    [
        ("fly", [], "unknown ctl action 'fly'"),
        ("scale-lr", [], "usage: trimtab ctl RUN_DIR scale-lr FACTOR"),
        ("scale-lr", ["0.5", "1"], "usage: trimtab ctl RUN_DIR scale-lr FACTOR"),
        ("skip-step", ["now"], "usage: trimtab ctl RUN_DIR skip-step"),
        ("scale-lr", ["half"], "FACTOR must be a number, got 'half'"),
        ("micro-batch", ["1.5"], "TOKENS must be a whole number"),
        ("rollback", ["yesterday"], "TO must be a step number"),
        ("scale-lr", ["-1"], "ctl scale-lr: 'factor' must be a number in \\(0, inf\\)"),
        ("pause-rule", ["spikes"], "ctl pause-rule: unknown rule 'spikes'"),
        ("mode", ["on"], "ctl mode: unknown mode 'on'"),
    ],
)
def test_parse_command_errors(verb, args, message):
    with pytest.raises(ConfigError, match=message):
        ctl.parse_command(verb, args)


def test_send_and_take_commands(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        ctl.send(tmp_path, {"action": "stop"})
    (tmp_path / "config.yaml").write_text("{}")
    first = ctl.send(tmp_path, ctl.parse_command("scale-lr", ["0.5"]), queue=True)  # no job runs here
    second = ctl.send(tmp_path, {"action": "stop", "params": {}}, queue=True)
    (tmp_path / "control" / "9999999999999999999-1.json").write_text("not json")
    assert first.parent == tmp_path / "control" and first.name < second.name
    taken = ctl.take_commands(tmp_path)
    assert taken == [
        (first.name, {"action": "scale_lr", "params": {"factor": 0.5}}),
        (second.name, {"action": "stop", "params": {}}),
        ("9999999999999999999-1.json", None),
    ]
    assert ctl.take_commands(tmp_path) == [] and not list((tmp_path / "control").iterdir())
    ctl.answer(tmp_path, first.name, "no")
    assert (tmp_path / "control" / f"{first.stem}.error").read_text() == "no\n"


def test_a_command_for_a_layer_of_another_kind_is_refused_when_sent(tmp_path):
    """mod-capacity for a MoE layer, add-expert for a MoD one: refused at once by the run's
    config.yaml, naming the layers of that kind (the job only journaled them as failed)."""
    dump_config(load_config(preset="debug-hybrid"), tmp_path / "config.yaml")  # dense, moe, mod, moe+mod
    for verb, args, message in (
        ("mod-capacity", ["0.25", "1"], "layer 1 of .* is moe; its Mixture-of-Depths layers are \\[2, 3\\]"),
        ("add-expert", ["2"], "layer 2 of .* is mod; its MoE layers are \\[1, 3\\]"),
        ("balance-coef", ["0.1", "7"], "layer 7 of .* is not there"),
    ):
        with pytest.raises(ConfigError, match=message):
            ctl.send(tmp_path, ctl.parse_command(verb, args), queue=True)
    for verb, args in (("mod-capacity", ["0.25", "3"]), ("add-expert", ["3"]), ("mod-capacity", ["0.25"])):
        ctl.send(tmp_path, ctl.parse_command(verb, args), queue=True)
    assert len(ctl.take_commands(tmp_path)) == 3


@pytest.mark.parametrize(
    "command",
    [
        {"action": "scale_lr", "params": {"factor": 0.5, "bogus": 1}},
        {"action": "scale_lr", "params": "0.5"},
        {"action": "stop", "params": ["x"]},
    ],
)
def test_malformed_command_files_are_answered_not_fatal(tmp_path, command):
    (tmp_path / "config.yaml").write_text("{}")
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    trainer = FakeTrainer(tmp_path)
    ctl.send(tmp_path, command, queue=True)
    orchestrator._take_commands(trainer)
    trainer.control.apply()
    assert len(list((tmp_path / "control").glob("*.error"))) == 1
    assert trainer.state.lr_scale == 1.0


def test_commands_are_applied_and_journaled_as_manual(tmp_path):
    (tmp_path / "config.yaml").write_text("{}")
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    trainer = FakeTrainer(tmp_path)
    for verb, args in [
        ("scale-lr", ["0.5"]),
        ("pause-rule", ["spike"]),
        ("mode", ["advise"]),
        ("pause-rule", ["grad"]),
        ("resume-rule", ["spike"]),
    ]:
        ctl.send(tmp_path, ctl.parse_command(verb, args), queue=True)
    ctl.send(tmp_path, {"action": "resume_rule", "params": {"rule": "bogus"}}, queue=True)
    orchestrator._take_commands(trainer)
    trainer.control.apply()
    assert trainer.state.lr_scale == 0.5 and orchestrator.mode == "advise" and orchestrator.paused == {"grad"}
    ds = read_decisions(tmp_path)
    assert [(d["action"], d["mode"], d["step"]) for d in ds] == [
        ("scale_lr", "manual", 3),
        ("pause_rule", "manual", 3),
        ("set_mode", "manual", 3),
        ("pause_rule", "manual", 3),
        ("resume_rule", "manual", 3),
    ]
    assert ds[0]["applied"] == ["lr multiplier 1 -> 0.5"] and ds[-1]["applied"] == ["paused rules: grad"]
    (error,) = (tmp_path / "control").glob("*.error")
    assert "unknown rule 'bogus'" in error.read_text()
    # paused rules and mode are orchestrator state: they survive a checkpoint
    state = json.loads(json.dumps(orchestrator.state_dict()))
    again = Orchestrator(OrchestratorConfig(), tmp_path)
    again.load_state_dict(state)
    assert again.paused == {"grad"} and again.mode == "advise" and len(again.journal.decisions) == 5


# ------------------------------------------------------------------------------------ config


def test_orchestrator_config_validation():
    for key, value in [
        ("mode", "sometimes"),
        ("lr_cut", 1.0),
        ("min_confidence", 1.5),
        ("divergence.window", 3),
        ("plateau.lr_factor", 0.9),
        ("oom.max_retries", 0),
        ("throughput.factor", 1.0),
        ("memory.threshold", 0.0),
    ]:
        with pytest.raises(ConfigError, match=f"orchestrator.{key}"):
            load_config(preset="debug", overrides={"orchestrator": _nested(key, value)})
    cfg = load_config(preset="debug", overrides={"orchestrator": {"mode": "off"}}, sets=["orchestrator.spike.sigma=3"])
    assert cfg.orchestrator.mode == "off" and cfg.orchestrator.spike.sigma == 3.0


def _nested(key, value):
    out = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


@pytest.mark.parametrize("how", ["set", "yaml"])
def test_mode_off_from_set_or_yaml(tmp_path, how):
    if how == "set":
        cfg = load_config(preset="debug", sets=["orchestrator.mode=off"])
    else:
        path = tmp_path / "run.yaml"
        path.write_text("preset: debug\norchestrator:\n  mode: off\n")
        cfg = load_config(path)
    assert cfg.orchestrator.mode == "off"


def test_unexplained_lr_flags_the_optimizer_lr_not_the_schedule_or_the_multiplier():
    cfg = OrchestratorConfig()
    monitor = UnexplainedLR(cfg)
    warmup = [1e-4, 2e-4, 3e-4, 3e-4]  # the schedule itself, whatever its shape, is explained
    assert [monitor.observe(metrics(i, lr=v)) for i, v in enumerate(warmup, 1)] == [None] * 4
    assert monitor.observe(metrics(5, lr=3e-3, scheduled_lr=3e-3)) is None  # a cyclic schedule restarting x10
    assert monitor.observe(metrics(6, lr=3e-3 * 10, lr_scale=10.0)) is None  # a person's scale-lr 10
    assert monitor.ceiling() == pytest.approx(3.0)  # applied / (schedule x multiplier)
    found = monitor.observe(metrics(7, lr=3e-3, scheduled_lr=3e-4))  # the optimizer applies x10 the schedule
    assert found.rule == "lr" and found.evidence["ratio"] == pytest.approx(10) and found.evidence["explained"] == 1
    assert monitor.observe(metrics(8, lr=3e-3, scheduled_lr=3e-4)) is None  # the departure is answered once
    plan = Policy(cfg).plan(found, None)
    assert plan.action == "scale_lr" and plan.params["factor"] == pytest.approx(0.1)


def test_after_rows_were_left_out_the_next_steps_rows_are_watched():
    """A bad stretch rarely ends where it was caught: for data.watch_steps steps each new step's
    rows are scored, the watch extends while it keeps finding bad ones, and then it ends."""
    from trimtab.orchestrator.attribution import DataAttribution

    data, view = DataAttribution(OrchestratorConfig()), View()  # watch_steps 10
    scores = {r: 9.0 if r % 4 == 0 else 5.0 for r in range(1000)}
    view.row_losses = lambda rows: {r: scores[r] for r in rows}
    for step in range(1, 6):
        data.record(step, [10 * step + i for i in range(4)])

    def step(n, rows):  # as the orchestrator does: record the step's rows, then watch them
        data.record(n, rows)
        return data.watch(view, replace(metrics(n), rows=rows), n - 1)  # the last update applied

    assert step(6, [60, 61]) is None  # nothing left out yet: no watch
    bad, _ = data.score(view, data.since(3))
    assert bad == [32, 40, 52, 60] and data.watch_until == -1  # scored, not yet left out (it may be advice)
    data.watch_more()  # left out (the decision was applied)
    assert data.watch_until == 16  # the newest step remembered + 10
    found = step(12, [120, 121, 122])
    assert found.family == "data" and found.evidence["rows"] == [120] and data.watch_until == 22
    assert step(13, [131, 133]) is None  # clean rows: no finding
    assert step(23, [240]) is None  # the watch is over
    data.shift()  # a rollback: remembered steps and the watch start over
    assert data.since(0) == [] and data.watch_until == -1


def test_make_up_waits_for_quiet_caps_and_credits_what_a_rollback_replays():
    from trimtab.config.orchestrator import MakeUpRule
    from trimtab.orchestrator.make_up import MakeUp
    from trimtab.orchestrator.make_up import remedy as make_up_remedy

    owed = MakeUp(MakeUpRule(quiet_steps=3, max_fraction=0.05))  # at most 5 of 100 steps

    def step(n, skipped=False, unstable=-1):
        return owed.observe(StepMetrics(step=n, loss=1.0, grad_norm=1.0, skipped=skipped), unstable, 100, 100)

    assert [step(n, skipped=True, unstable=n) for n in (10, 11)] == [None, None]
    assert step(12, unstable=11) is None and step(13, unstable=11) is None  # not quiet long enough
    f = step(14, unstable=11)
    assert (f.evidence["withheld"], f.evidence["extend"], f.evidence["new_total"]) == (2, 2, 102)
    owed.rolled_back(10)  # step 11 is trained again: the step made up for it is a credit
    assert (owed.made, owed.credit) == ([10], 1)
    for n in range(20, 26):
        step(n, skipped=True, unstable=n)
    f = step(29, unstable=25)  # 6 withheld, 1 paid by the credit; the run grew by 2 already: 3 left of the cap of 5
    assert (f.evidence["withheld"], f.evidence["credit"], f.evidence["extend"]) == (6, 1, 3)
    assert owed.credit == 0 and owed.made == [10, 20, 21, 22, 23] and owed.refused == [24, 25]
    step(40, skipped=True)
    capped = step(43)
    assert capped.evidence["extend"] == 0 and owed.state_dict()["owed"] == []
    assert make_up_remedy(capped, None, OrchestratorConfig()).action == "none"  # the cap is reached: said, not done
    assert step(44) is None  # nothing owed: nothing to say
    short = MakeUp(MakeUpRule(quiet_steps=1))  # 10% of 9 steps: not one step to spare, so not a word
    assert short.observe(StepMetrics(step=3, loss=1.0, grad_norm=1.0, skipped=True), 3, 9, 9) is None
    assert short.observe(StepMetrics(step=5, loss=1.0, grad_norm=1.0), 3, 9, 9) is None and not short.owed


def test_a_suspect_device_is_named_and_its_node_left_out_only_where_allowed(monkeypatch):
    """Transient faults counted per rank: the second on rank 3 names it a suspect; with
    orchestrator.rerun.exclude in an elastic job of 2 nodes of 2 ranks, its node (1) is left out;
    never node 0, never when the setting is off."""
    from trimtab.orchestrator import remedies
    from trimtab.orchestrator.transient import rerun_finding

    verdict = {"verdict": "transient", "loss": [2.0, 2.0], "grad_norm": [1e38, 1.0], "ranks": [3]}
    faults, reproducible = {}, {}
    first = rerun_finding(7, verdict, reproducible, faults, suspect_after=2)
    second = rerun_finding(9, verdict, reproducible, faults, suspect_after=2)
    assert first.evidence["suspects"] == [] and second.evidence["suspects"] == [3] and faults == {"3": 2}
    assert "rank 3 2 times in this run: a suspect device" in second.summary
    cfg = load_config(None).orchestrator
    assert remedies.transient(first, cfg).action == "rerun_step"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    named = remedies.transient(second, cfg)
    assert named.action == "rerun_step" and "orchestrator.rerun.exclude is off" in named.reasoning
    cfg = load_config(None, overrides={"orchestrator": {"rerun": {"exclude": True}}}).orchestrator
    excluded = remedies.transient(second, cfg)
    assert excluded.action == "exclude_node" and excluded.params == {"node": 1}
    on_node_0 = rerun_finding(11, {**verdict, "ranks": [1]}, reproducible, {"1": 1}, suspect_after=2)
    assert remedies.transient(on_node_0, cfg).action == "rerun_step"  # rank 1 is on node 0


def test_groups_that_teach_nothing_turn_on_dynamic_sampling_then_raise_the_temperature_to_its_ceiling():
    """rl_signal: the share of groups with one reward for all responses, averaged over the
    window; at the threshold dynamic sampling turns on, then the temperature rises by the
    factor, then stops at the ceiling."""
    from types import SimpleNamespace

    from trimtab.orchestrator.rl_health import NoLearningSignal
    from trimtab.orchestrator.rl_remedies import remedy

    cfg = OrchestratorConfig()
    cfg.rl_signal.window, cfg.rl_signal.threshold = 3, 0.75
    mon = NoLearningSignal(cfg)
    assert mon.observe(metrics(1)) is None  # not an RL step
    shares = [0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    found = [mon.observe(metrics(i + 1, rl={"flat_groups": v})) for i, v in enumerate(shares)]
    # means of three: .5 .5 .67 below 0.75, then .83 at step 6; a fresh window: 1.0 at step 9
    assert [f is not None for f in found] == [False] * 5 + [True, False, False, True]
    assert found[5].rule == "rl_signal" and found[5].evidence["flat_groups"] == pytest.approx(5 / 6)
    assert found[5].strength == pytest.approx(2 / 3) and found[8].strength == 1.0
    first = remedy(found[5], SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=False), cfg)
    assert (first.action, first.params) == ("set_dynamic_sampling", {"value": "on"})
    raised = remedy(found[5], SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True), cfg)
    assert (raised.action, raised.params) == ("set_rl_temperature", {"value": 1.25})
    capped = remedy(found[5], SimpleNamespace(rl_temperature=1.4, rl_dynamic_sampling=True), cfg)
    assert capped.params == {"value": 1.5}
    said = remedy(found[5], SimpleNamespace(rl_temperature=1.5, rl_dynamic_sampling=True), cfg)
    assert said.action == "none" and "rl.group_size" in said.reasoning
    # groups flat because solved (every response at the best reward): dynamic sampling, as DAPO
    # does for them, but never warmer sampling, which would only unlearn them
    learnt = NoLearningSignal(cfg)
    found = [learnt.observe(metrics(i + 1, rl={"flat_groups": 1.0, "solved_groups": 0.9})) for i in range(3)]
    assert found[2].evidence["solved_groups"] == pytest.approx(0.9)
    first = remedy(found[2], SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=False), cfg)
    assert first.action == "set_dynamic_sampling"
    then = remedy(found[2], SimpleNamespace(rl_temperature=1.0, rl_dynamic_sampling=True), cfg)
    assert then.action == "none" and "solved" in then.reasoning
    # groups flat because the verifier fails (scored 0 whatever the response): rl_verifier's to
    # say, not a signal that sampling brings back; once it verifies again, flat groups are found
    broken = NoLearningSignal(cfg)
    failing = {"flat_groups": 1.0, "verifications": (64, 60, 0)}  # 94% failed: past rl_verifier's threshold
    assert [broken.observe(metrics(i + 1, rl=failing)) for i in range(4)] == [None] * 4
    state = broken.state_dict()
    assert "failing" not in state and state["failed"] == [60 / 64] * 3  # a config value is not state
    verified = {"flat_groups": 1.0, "verifications": (64, 0, 0)}
    found = [broken.observe(metrics(i + 5, rl=verified)) for i in range(3)]
    assert [f is not None for f in found] == [False, False, True]


def test_a_rollbacks_replay_of_the_flat_groups_rl_signal_acted_on_does_not_warm_the_sampling_again():
    """Rule rl_reward's rollback puts the temperature rl_signal raised back; the windows restored
    with the weights held most of that finding's steps, and the replay's first steps are the same
    rollouts (same weights, RNG, temperature): the rule fired again at once, undoing the restore.
    Now the replay up to the finding's step is not evidence again; a recurrence past it is found."""
    import json

    from trimtab.orchestrator.rl_health import NoLearningSignal

    cfg = OrchestratorConfig()
    cfg.rl_signal.window, cfg.rl_signal.threshold = 3, 0.75
    mon = NoLearningSignal(cfg)
    flat = {"flat_groups": 1.0}
    assert [mon.observe(metrics(s, rl={"flat_groups": 0.5})) for s in (1, 2, 3)] == [None] * 3
    saved = json.loads(json.dumps(mon.state_dict()))  # the step-3 checkpoint's
    found = [mon.observe(metrics(s, rl=flat)) for s in (4, 5)]
    assert found[0] is None and found[1] is not None  # (.5 + 1 + 1) / 3 at step 5: warmer sampling
    kept = {k: getattr(mon, k) for k in getattr(mon, "KEPT_ON_ROLLBACK", ())}  # as Orchestrator._load_monitors
    mon.load_state_dict(saved)
    for key, value in kept.items():
        setattr(mon, key, value)
    replay = [mon.observe(metrics(s, rl=flat)) for s in (4, 5, 6, 7, 8)]
    assert [f is not None for f in replay] == [False, False, False, False, True]  # a window past step 5
    assert replay[-1].evidence["flat_groups"] == 1.0


def test_solved_groups_earned_the_full_reward_with_every_response():
    from trimtab.rl.step import solved

    assert solved([[1, 1], [0, 0], [1, 0]], 1.0) == 1  # flat at 0 is stuck, a mixed group is neither
    assert solved([[0.5, 0.5], [0.5, 0.5]], 1.0) == 0  # every response at a partial credit: stuck
    assert solved([[1, 1], [1, 1]], 1.0) == 2 and solved([], 1.0) == 0
    assert solved([[0.5, 0.5]], 0.5) == 1  # a verifier whose full score is 0.5 (rl.full_reward)


def test_an_entropy_collapse_before_the_task_is_learned_gets_a_bonus_then_a_lower_lr():
    """rl_entropy: the window's entropy against the phase's first window's; not while the reward
    says the task is solved; the bonus starts at coef, doubles to the ceiling, then the LR halves."""
    from types import SimpleNamespace

    from trimtab.orchestrator.rl_health import EntropyCollapse
    from trimtab.orchestrator.rl_remedies import remedy

    cfg = OrchestratorConfig()
    cfg.rl_entropy.window, cfg.rl_entropy.threshold = 2, 0.25
    mon = EntropyCollapse(cfg)
    step = lambda i, entropy, reward: mon.observe(metrics(i, rl={"entropy": entropy, "reward": reward}))  # noqa: E731
    assert mon.observe(metrics(1)) is None  # not an RL step
    # the start: 2.0 nats; then 1.0 (50%), then 0.3 with the reward at 0.95 (solved), then at 0.2
    found = [step(i + 1, e, r) for i, (e, r) in enumerate([(2, 0.1), (2, 0.1), (1, 0.1), (1, 0.1), (0.3, 0.95)])]
    found += [step(6, 0.3, 0.95), step(7, 0.3, 0.2)]
    assert [f is not None for f in found] == [False] * 6 + [True]
    f = found[-1]
    assert f.rule == "rl_entropy" and f.evidence["start_entropy"] == 2.0
    assert f.evidence["entropy"] == pytest.approx(0.3) and f.evidence["reward"] == pytest.approx(0.575)
    assert f.strength == pytest.approx(0.5 + 0.5 * (1 - 0.3 / 0.5))
    ladder = [remedy(f, SimpleNamespace(rl_entropy_coef=c, lr_scale=1.0), cfg) for c in (0.0, 0.01, 0.04, 0.05)]
    assert [(r.action, r.params) for r in ladder] == [
        ("set_entropy_bonus", {"value": 0.01}),
        ("set_entropy_bonus", {"value": 0.02}),
        ("set_entropy_bonus", {"value": 0.05}),  # capped at max_coef
        ("scale_lr", {"factor": cfg.lr_cut}),
    ]


def test_a_nan_entropy_is_no_collapse():
    """rl_entropy: rollouts of non-finite weights (weights_nan through `trimtab rl`) read entropy NaN; it
    compared as below the start and turned the bonus on, which outlived the nonfinite rule's rollback."""
    from trimtab.orchestrator.rl_health import EntropyCollapse

    cfg = OrchestratorConfig()
    cfg.rl_entropy.window = 2
    mon = EntropyCollapse(cfg)
    nan = float("nan")
    course = [(2.0, 0.1), (nan, 0.0), (2.0, 0.1), (nan, 0.0), (nan, nan), (1.9, 0.1), (nan, 0.0), (nan, 0.0)]
    found = [mon.observe(metrics(i + 1, rl={"entropy": e, "reward": r})) for i, (e, r) in enumerate(course)]
    assert found == [None] * 8
    assert mon.start == [2.0]  # the starting policy's finite step alone (step 1: synchronous RL)
    collapse = [mon.observe(metrics(9 + i, rl={"entropy": 0.1, "reward": 0.1})) for i in range(2)]
    assert collapse[0] is None and collapse[1].evidence["entropy"] == pytest.approx(0.1)  # a real one is found


def test_responses_grown_into_the_budget_get_the_soft_penalty_a_wider_one_a_rollback_then_a_stop():
    """rl_length: the window's share of truncated responses against the starting policy's (step 1's);
    the soft penalty over a quarter of the budget, then half, then once back to the policy that drew the last
    rollouts whose share cut stood within `rise` of the start's (the penalty kept), where the replay runs away again
    back there with a lower LR, then the run stops (exit 3: cut responses graded unfinished teach nothing; a note
    before, and a runaway left at 100% cut through step 30 ended with exit 0); the filter is not a step
    of it (it would leave the cut responses, and the penalty's gradient, out). Once is the open
    incident's rollbacks, not the run's: the Policy counts them (test_rl_reward.py)."""
    from types import SimpleNamespace

    from trimtab.orchestrator.rl_remedies import remedy
    from trimtab.orchestrator.rl_rollouts import LengthRunaway

    cfg = OrchestratorConfig()
    cfg.rl_length.window, cfg.rl_length.threshold = 2, 0.5
    mon = LengthRunaway(cfg)
    shares = [0.0, 0.25, 0.25, 0.5, 0.75, 1.0, 0.0]
    found = [
        mon.observe(metrics(i + 1, rl={"truncated": v, "response_tokens": 4 + 8 * v})) for i, v in enumerate(shares)
    ]
    # the start: step 1's 0; means of two from step 2: .25, .375, .625 at step 5; a fresh window, .5 at step 7,
    # whose last step ends again: the runaway turns, no finding (a rollback's restored window fired on it)
    assert [f is not None for f in found] == [False] * 4 + [True, False, False]
    assert found[4].evidence == {
        "truncated": 0.625,
        "start_truncated": 0.0,
        "response_tokens": 9.0,
        "start_response_tokens": 4.0,
        "window": 2,
        "short_step": 2,  # step 4's 0.5 is more than `rise` (0.25) above the start's 0: step 3's were drawn by 2
        "times": 1,  # windows in a row found, since step 1's responses ended
    }
    # step 7's responses ended: the count starts again (1 at step 8), and goes on while none end (2 at step 10)
    later = [mon.observe(metrics(i, rl={"truncated": 1.0, "response_tokens": 12.0})) for i in range(8, 12)]
    assert [f.evidence["times"] if f else None for f in later] == [1, None, 2, None]
    every_one_cut = LengthRunaway(cfg)  # a budget every response fills from the start: the run's design
    assert not any(every_one_cut.observe(metrics(i, rl={"truncated": 1.0, "response_tokens": 2.0})) for i in range(9))

    def view(filtering: bool, buffer: int, first: int = 0) -> SimpleNamespace:  # first: the oldest checkpoint kept
        return SimpleNamespace(
            rl_overlong=(filtering, buffer), rl_max_new_tokens=16, has_checkpoint=lambda s: s >= first, lr_scale=1.0
        )

    ladder = [remedy(found[4], view(*knobs), cfg) for knobs in ((False, 0), (True, 4), (False, 8))]
    assert [(r.action, r.params) for r in ladder] == [
        ("set_overlong_penalty", {"tokens": 4}),
        ("set_overlong_penalty", {"tokens": 8}),
        ("rollback", {"to": 2}),
    ]
    again = remedy(found[4], view(False, 8), cfg, rollbacks=1)  # the replay ran away again: a lower LR
    assert (again.action, again.params) == ("rollback", {"to": 2, "lr_factor": cfg.lr_cut})
    # the incident's all spent: a note while the penalty may yet teach ending (a replay at x0.25 ran to the budget
    # 8 steps and ended again), a stop once found `patience` windows in a row (a note before, and exit 0 at 100% cut)
    waits = remedy(found[4], view(False, 8), cfg, rollbacks=cfg.max_rollbacks)
    assert waits.action == "none" and "orchestrator.rl_length.patience" in waits.reasoning
    persisted = replace(found[4], evidence={**found[4].evidence, "times": cfg.rl_length.patience})
    used_up = remedy(persisted, view(False, 8), cfg, rollbacks=cfg.max_rollbacks)
    assert (used_up.action, used_up.params["exit_code"]) == ("stop", GAVE_UP)
    assert "after a rollback in this incident" in used_up.reasoning
    reason = used_up.params["reason"]
    assert "rl.max_new_tokens (16)" in reason and "orchestrator.max_rollbacks=3" in reason
    assert reason.endswith("the better policy is the checkpoint at or before step 2")
    gone = remedy(persisted, view(False, 8, first=3), cfg)  # short_step 2's checkpoint (and every older) pruned
    assert gone.action == "stop" and "no checkpoint at or before step 2 is left" in gone.params["reason"]
    assert gone.params["reason"].endswith("no checkpoint holds the policy of step 2")
    cfg.max_rollbacks = 0
    assert remedy(persisted, view(False, 8), cfg).action == "stop"


@pytest.mark.parametrize("staleness", [0.0, 1.0])
def test_a_runaway_begun_in_the_start_window_rolls_back_to_the_policy_whose_responses_still_ended(staleness):
    """rl_length's target, as measured (tests/test_rl_train.py's task on an AVX512-bf16 Xeon): 0%, 2%, 59% cut at
    steps 1-3, then all. Every step of the start window was the target, and the checkpoint of step 3 (whose next
    rollouts were 98% cut) was no policy that ended: the replay stayed at the budget. The target is the policy
    that drew step 2's rollouts (step 1's weights; a step before for rollouts a step stale), kept from pruning
    while the share stays risen. The baseline is the starting policy's rollouts (step 1's; a step stale, steps 1-2),
    not the first window's: that one held the runaway's start (20% at window 3) and found it at step 6, not 4."""
    from types import SimpleNamespace

    from trimtab.orchestrator.rl_rollouts import LengthRunaway
    from trimtab.orchestrator.saves import SaveGuard

    cfg = OrchestratorConfig()
    cfg.rl_length.window = 3
    mon = LengthRunaway(cfg)
    shares = [0.0, 0.016, 0.594, 0.984, 1.0, 0.969]
    rl = lambda v: {"truncated": v, "response_tokens": 8 * v, "staleness": staleness}  # noqa: E731
    found = [mon.observe(metrics(i + 1, rl=rl(v))) for i, v in enumerate(shares)]
    at = 4 + int(staleness)  # the first full window after the start: steps 2-4 (3-5 a step stale)
    assert [f is not None for f in found] == [i + 1 == at for i in range(6)]
    assert found[at - 1].evidence["start_truncated"] == pytest.approx(0.008 * staleness)
    assert found[at - 1].evidence["short_step"] == 1 - staleness
    saves = SimpleNamespace(mode="auto", paused=set(), monitors={"rl_length": mon})
    assert SaveGuard.kept_checkpoints(saves, SimpleNamespace(step=6)) == (1 - staleness,)
    mon.observe(metrics(7, rl=rl(0.0)))  # ending again: nothing kept past pruning
    assert SaveGuard.kept_checkpoints(saves, SimpleNamespace(step=7)) == ()


def test_a_held_out_reward_falling_as_the_training_reward_rises_rolls_back_to_the_best_then_stops():
    """rl_hacking: judged at evaluations, against the best held-out reward and the training
    reward at it; a fall inside `drop`, or with the training reward flat, is not counted."""
    from trimtab.orchestrator.rl_held_out import RewardHacking
    from trimtab.orchestrator.rl_remedies import remedy

    cfg = OrchestratorConfig()
    cfg.rl_hacking.window, cfg.rl_hacking.patience, cfg.rl_hacking.drop = 2, 2, 0.1
    mon = RewardHacking(cfg)

    def evaluation(step: int, train: float, held_out: float):
        for i in range(2):
            assert mon.observe(metrics(step - 1 + i, rl={"reward": train})) is None
        return mon.observe_eval(step, 0, held_out)

    # best 0.5 at step 2 (training 0.2); then a fall within noise, a fall with a flat training
    # reward, and two falls with it rising: the second of those fires
    found = [evaluation(2, 0.2, 0.5), evaluation(4, 0.3, 0.45), evaluation(6, 0.2, 0.3)]
    found += [evaluation(8, 0.4, 0.35), evaluation(10, 0.6, 0.2)]
    assert [f is not None for f in found] == [False] * 4 + [True]
    f = found[-1]
    assert f.rule == "rl_hacking" and f.evidence["best_step"] == 2 and f.evidence["best_held_out_reward"] == 0.5
    assert f.evidence["train_reward"] == pytest.approx(0.6) and f.evidence["train_reward_at_best"] == pytest.approx(0.2)
    kept = SimpleNamespace(lr_scale=1.0, has_checkpoint=lambda s: s >= 0)
    first = remedy(f, kept, cfg)
    assert (first.action, first.params) == ("rollback", {"to": 2, "lr_factor": cfg.lr_cut})
    # the best's checkpoint and every older one gone (never saved, or pruned): a rollback there failed ("failed: no
    # checkpoint") and the run hacked on; a stop that names it
    gone = remedy(f, SimpleNamespace(lr_scale=1.0, has_checkpoint=lambda s: s > 2), cfg)
    assert (gone.action, gone.params["exit_code"]) == ("stop", GAVE_UP)
    assert "no checkpoint at or before step 2 is left (a larger checkpoint.keep" in gone.params["reason"]
    again = [evaluation(12, 0.7, 0.2), evaluation(14, 0.8, 0.1)]
    assert again[0] is None and again[1].evidence["times"] == 2
    assert remedy(again[1], kept, cfg, rollbacks=1).action == "stop"  # within the incident


def test_the_held_out_rules_best_checkpoints_are_kept_past_pruning():
    """rl_hacking's and dpo_held_out's rollback targets, their best held-out readings, are kept past
    checkpoint.keep as rl_reward's and rl_length's are: DPO's best loss is not the trainer's best evaluation (its
    accuracy), nor rl_hacking's best count its best reward; pruned, the rollback found an older checkpoint or
    none."""
    from trimtab.orchestrator.dpo_health import PreferenceFall
    from trimtab.orchestrator.rl_held_out import RewardHacking
    from trimtab.orchestrator.saves import SaveGuard

    cfg = OrchestratorConfig()
    hacking, dpo = RewardHacking(cfg), PreferenceFall(cfg)
    saves = SimpleNamespace(mode="auto", paused=set(), monitors={"rl_hacking": hacking, "dpo_held_out": dpo})
    assert SaveGuard.kept_checkpoints(saves, SimpleNamespace(step=1)) == ()  # nothing evaluated yet
    hacking.observe_eval(10, 0, 0.5, solved=8, n=16)
    hacking.observe_eval(20, 0, 0.4, solved=9, n=16)  # a lower mean reward, more problems solved
    dpo.observe_eval(10, 0, 0.6, accuracy=0.7)
    dpo.observe_eval(20, 0, 0.65, accuracy=0.8)  # the best accuracy (the trainer's best), not the best loss
    assert SaveGuard.kept_checkpoints(saves, SimpleNamespace(step=30)) == (10, 20, 10)
    saves.paused = {"rl_hacking", "dpo_held_out"}
    assert SaveGuard.kept_checkpoints(saves, SimpleNamespace(step=30)) == ()


def test_a_verifier_that_fails_gets_longer_or_is_said():
    """rl_verifier: the window's failed share of verifications; timeouts raise the timeout by the
    factor up to the ceiling, a verifier that raises is said for a person."""
    from types import SimpleNamespace

    from trimtab.orchestrator.rl_remedies import remedy
    from trimtab.orchestrator.rl_verifier import VerifierFailures

    cfg = OrchestratorConfig()
    cfg.rl_verifier.window, cfg.rl_verifier.threshold = 2, 0.25
    mon = VerifierFailures(cfg)
    assert mon.observe(metrics(1)) is None  # not an RL step
    steps = [(8, 1, 1), (8, 2, 2), (8, 4, 4), (8, 0, 0), (8, 0, 0), (8, 8, 1)]
    found = [mon.observe(metrics(i + 1, rl={"verifications": v})) for i, v in enumerate(steps)]
    # shares over two steps: 3/16 below, then 6/16 at step 3; a fresh window: 0, then 8/16 at step 6
    assert [f is not None for f in found] == [False, False, True, False, False, True]
    assert found[2].evidence == {"failed": 6, "timeouts": 6, "scored": 16, "share": 0.375, "window": 2}
    raised = remedy(found[2], SimpleNamespace(rl_verifier_timeout=10.0), cfg)
    assert (raised.action, raised.params) == ("set_verifier_timeout", {"value": 20.0})
    capped = remedy(found[2], SimpleNamespace(rl_verifier_timeout=120.0), cfg)
    assert capped.action == "none" and "max_timeout_s" in capped.reasoning
    broken = remedy(found[5], SimpleNamespace(rl_verifier_timeout=10.0), cfg)  # 1 timeout of 8 failures
    assert broken.action == "none" and "fix rl.reward's verifier" in broken.reasoning
    # every verification raising: the error named, and the run stops (nothing can be learned)
    error = "KeyError: 'answer'"
    steps = [(8, 8, 0), (8, 7, 0)]
    found = [mon.observe(metrics(i + 7, rl={"verifications": v, "verifier_error": error})) for i, v in enumerate(steps)]
    assert found[0] is None and found[1].evidence == {**found[1].evidence, "failed": 15, "error": error}
    stopped = remedy(found[1], SimpleNamespace(rl_verifier_timeout=10.0), cfg)
    assert stopped.action == "stop" and stopped.params["exit_code"] == GAVE_UP
    assert error in stopped.params["reason"] and "before step 7" in stopped.params["reason"]
    cfg.rl_verifier.stop_share = 1.0  # 15 of 16: said, not stopped
    assert remedy(found[1], SimpleNamespace(rl_verifier_timeout=10.0), cfg).action == "none"


# ------------------------------------------------------------------ faults added to a resumed run


def test_a_fault_added_before_the_resume_step_is_said_and_not_injected():
    from trimtab.orchestrator.fault_specs import late_faults

    faults = parse_faults(["nan_loss@5:2@rank1", "nan_loss@13", "lr_spike@3:5", "sigterm@12", "eval_error@4"])
    record = {"fired": {"sigterm@12": 1}, "poisoned": [], "specs": ["eval_error@4", "sigterm@12"]}
    kept, lines = late_faults(faults, record, 12)
    assert [f.spec for f in kept] == ["nan_loss@13", "lr_spike@3:5", "sigterm@12", "eval_error@4"]
    assert [(f.spec, line) for f, line in lines] == [
        (
            "nan_loss@5:2@rank1",
            "faults: nan_loss@5:2@rank1 is before this run's step 12 (it resumed there): not injected; to inject it "
            "now, give a later step (nan_loss@13:2@rank1)",
        ),
        ("lr_spike@3:5", "faults: lr_spike@3:5 starts before this run's step 12: in force from step 13 on"),
    ]
    assert late_faults(faults, {"fired": {}}, 0) == (faults, [])  # a fresh run: every fault is its own


def test_a_faults_json_from_before_specs_knows_the_faults_it_saw_at_work():
    from trimtab.orchestrator.fault_specs import late_faults

    faults = parse_faults(["nan_loss@5", "eval_error@4", "oom@2", "weights_nan@3"])
    record = {"fired": {"nan_loss@5": 1}, "evaluations": {"eval_error@4": [10]}, "oom_limit": {"oom@2": 99.0}}
    kept, lines = late_faults(faults, record, 12)
    assert [f.spec for f in kept] == ["nan_loss@5", "eval_error@4", "oom@2"]
    assert [f.spec for f, _ in lines] == ["weights_nan@3"]


def test_the_injector_of_a_resumed_run_does_not_fire_nor_record_a_fault_its_step_passed(tmp_path):
    """nan_loss@5 added to a run resumed at step 12 used to fire at step 13 and be recorded as
    fired; now it is said, recorded as not injected, and a later fault still fires at its step."""
    from trimtab.orchestrator.faults import FaultInjector

    injector = FaultInjector(["nan_loss@5", "nan_loss@14"], tmp_path)
    said: list[str] = []
    injector.faults = injector._judge_late(SimpleNamespace(step=12, rank=0, say=said.append))
    assert said == [
        "faults: nan_loss@5 is before this run's step 12 (it resumed there): not injected; to inject it now, "
        "give a later step (nan_loss@13)"
    ]
    batch = SimpleNamespace(rows=[])
    injector.on_step_start(SimpleNamespace(step=12), batch)  # step 13
    assert injector._fire_nan is None
    injector.on_step_start(SimpleNamespace(step=13), batch)  # step 14
    assert injector._fire_nan is not None and injector._fire_nan.spec == "nan_loss@14"
    record = json.loads((tmp_path / "faults.json").read_text())
    assert record["fired"] == {"nan_loss@14": 1}
    assert record["not_injected"] == {"nan_loss@5": 12} and record["specs"] == ["nan_loss@14"]
    # resumed again later: nan_loss@14 is the run's own (fired), nan_loss@5 is said again, not injected
    again = FaultInjector(["nan_loss@5", "nan_loss@14"], tmp_path)
    again.record = record
    said.clear()
    assert [f.spec for f in again._judge_late(SimpleNamespace(step=20, rank=0, say=said.append))] == ["nan_loss@14"]
    assert len(said) == 1 and said[0].startswith("faults: nan_loss@5 is before this run's step 20")


def test_a_resumed_run_with_a_fault_added_at_a_passed_step_trains_on_clean(tmp_path, capsys):
    """The repro: a run stopped at step 6, resumed with nan_loss@3 added, trained on without it
    (no NaN step, nothing journaled for it), and the console said why."""
    import trimtab
    from test_trainer import debug_cfg

    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=10, faults=["sigterm@6"], train={"batch_tokens": 1024}))
    capsys.readouterr()
    summary = trimtab.train(debug_cfg(run, steps=10, faults=["sigterm@6", "nan_loss@3"], train={"batch_tokens": 1024}))
    assert summary["step"] == 10
    assert "faults: nan_loss@3 is before this run's step 6 (it resumed there): not injected" in capsys.readouterr().err
    record = json.loads((run / "faults.json").read_text())
    assert record["fired"] == {"sigterm@6": 1} and record["not_injected"] == {"nan_loss@3": 6}
    assert not [d for d in read_decisions(run) if d["rule"] == "nonfinite"]
