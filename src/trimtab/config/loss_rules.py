"""The orchestrator's instability rules on the loss and the gradient (orchestrator.spike, grad,
above_start, divergence: orchestrator/monitors.py, trends.py and divergence.py), and their checks. Apart from
config/orchestrator.py (OrchestratorConfig holds them, as it holds config/rl_rules.py's and
config/row_rules.py's) so that each module stays one family of rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trimtab.config.checks import Section, _check, _positive

if TYPE_CHECKING:
    from trimtab.config.orchestrator import OrchestratorConfig


@dataclass
class SpikeRule(Section):
    """Loss above the trend of its window (a line against log(step)) + max(sigma x residual std,
    min_rise)."""

    enabled: bool = True
    # healthy steps; once min_samples of them follow the phase's LR warm-up (the steps its scheduled LR
    # rose), the line is fitted from the warm-up's last step on: the warm-up's bend is no line in
    # log(step) and inflated the residuals. The bar over the clean loss at steps 20-30, median of 24
    # fault-free 120-step runs (debug, debug-moe, debug-mod, debug-hybrid; seeds 0-5): 0.60-0.71 ->
    # 0.23-0.30 nats, at 40-50 0.77-0.84 -> 0.48 (a window past the warm-up by 60). Still no finding on
    # those runs (the closest step used 81% of the allowed rise, 79% before); debug-moe 40 steps,
    # weights_noise@25:2 (4.79 -> 5.44): missed under 5.654, val 4.978; caught under 5.017, 4.820 = clean.
    # debug-hybrid weights_noise@25:2 and @40:2 (120 steps): missed -> caught, +4.3% / +4.7% -> +0.0%
    window: int = 50
    # silent until the window holds this many steps: 10 is enough for the trend and catches bad
    # data that starts in the warm-up (clean runs of every debug preset, 3 seeds: no finding)
    min_samples: int = 10
    sigma: float = 5.0
    min_rise: float = 0.25  # nats above the rolling mean
    # A Mixture-of-Depths layer's capacity that moves by more than this between two steps (a person's `trimtab
    # ctl RUN mod-capacity`, the MoD rule giving capacity back, a phase's config) makes another model:
    # the window restarts (the update gate's bar off until it fills), and a rise it costs is the MoD
    # rule's to judge. debug-mod cut 0.5 -> 0.02 at step 30 (loss 4.7 -> 5.1-5.4): read as spikes, updates
    # withheld, the LR cut x0.125 and three rollbacks kept the cut (a person's setting outlives a
    # rollback), val 6.04; the window restarted, the MoD rule gave 0.5 back at step 33. A capacity
    # warm-up moves (1 - target) / mod.warmup_steps a step: 0.167 from 1.0 to 0.5 over 3 steps.
    capacity_jump: float = 0.2
    # Over a phase's first `early_steps` steps the trend is no bar yet (too few samples, and the
    # warm-up's steep fall inflates its residuals): a loss above the phase's lowest healthy one by
    # max(early_sigma x the standard deviation of the last `early_window` step-to-step changes,
    # early_min_rise) is a spike too (from 3 healthy steps on; 0 steps: off). Over steps 1-30 of 33
    # fault-free 120-step runs (debug, debug-moe, debug-mod, debug-hybrid; seeds 1-4; default and
    # 1024-token batches) the largest rise was 5.6 spreads (debug-hybrid, seed 4, 1024 tokens: 0.66
    # nats at step 18, spread 0.12), most under 4. A 10-step run warms up over 9 steps, and its
    # loss can overshoot as the LR reaches its peak: the tests' fault-free DDP run (debug, fp32,
    # 150 KB) rose 0.36 nats, 10.7 spreads (0.034), at step 9, and fell 0.51 at step 10. The
    # spread of a few changes of a steady fall measures how even the fall is, not how far one
    # update can overshoot, so the bar is 13 spreads: bad_batch@10 on debug rose 24, weights_noise
    # 17 (@8:3) and 20 (@12:3); @5:10 (8.4, from 3 changes) passes under it. Off by default (0; 25
    # turns it on): the rise alone cannot tell an overshoot from damage. A fault-free 24-step debug
    # run (fp32, 60 KB) rose 0.84 nats at step 9 (49 spreads; bad_batch@10 rose 0.81), which the run
    # falls back from by itself (4.998 at step 15); judged a spike, its steps withheld held the loss
    # above the bar, the data rule left rows out of steps 10-19, and three rollbacks gave up (the next
    # step is now judged from the withheld step's own loss: one withheld step). Still off: a debug run
    # (seed 1, 40 steps, fp32, 60 KB) overshot 1.9 nats at step 10, and the early answer rolled back
    # with the LR x0.1 for good (ladder._rollback reads it as wrecked weights): val 5.618 against 4.513.
    early_steps: int = 0
    # The early bar over a phase that starts from trained weights (a finetune phase, train.init_from;
    # 0: early_steps alone): their loss starts steady, without a fresh model's warm-up overshoot.
    # debug 20 steps -> finetune 20 (400 prompt/response rows), bad_batch@28 (the phase's 8th step):
    # missed at 0, val +3.4% (4.928 vs 4.767); caught at 25, +1.4% (4.835). init_from that run's step 20,
    # bad_batch@8: 2.394 missed, 2.191 caught (2.142 clean). Clean, 25 on: no finding (finetune seeds
    # 1-4 and one whose loss jumps 2 nats at the switch; init_from seeds 1, 2, 1234).
    trained_early_steps: int = 25
    early_window: int = 8  # step-to-step changes
    early_sigma: float = 13.0
    early_min_rise: float = 0.15  # nats


@dataclass
class GradRule(Section):
    """Pre-clip gradient norm above max_norm, or above factor x its rolling mean. A new level is
    not an explosion: `rebase_after` steps in a row over the ceiling, under max_norm, within
    `rebase_spread` of each other and with a loss that does not rise (rebase_loss_rise), start the
    window afresh."""

    enabled: bool = True
    max_norm: float = 100.0
    factor: float = 10.0
    window: int = 50
    min_samples: int = 20
    rebase_after: int = 3  # 0: never follow a new level
    rebase_spread: float = 3.0  # largest / smallest norm of those steps
    rebase_loss_rise: float = 0.25  # nats over the healthy steps' mean loss that still counts as not rising


@dataclass
class AboveStartRule(Section):
    """The loss above where the phase started (its first step's loss, the untouched weights') by
    max(margin, rel_margin x it) for `patience` steps in a row: training made the model worse
    than doing nothing, from the first steps on, before any window fills. The LR is the cause
    (a finetuning LR typed for pretraining, a slipped exponent): cut it x lr_factor, again while
    the loss does not fall, and never give the cut back. Once it fired, also while the gradient
    norm's median over `window` steps falls under `collapse` x its first `window` steps' (an LR
    still too high holds the model at a level where the gradient dies away) while the loss stalls
    (its median over the last window fell by less than `stall` of the window's before). Over the phase's
    first `gain_steps` steps, also when the updates' gain (the share of the loss decrease their
    gradient promised that they delivered on their own batch; a forward more on each of those
    steps) has a median under `min_gain` over `gain_window` steps: the updates overshoot. 0 turns
    that measurement off; raise it to cover a long LR warm-up. And once the LR is warmed up, when
    the loss stalls within `unigram_margin` of the training data's unigram entropy: the model
    stays blind to context, as an LR a few times too high holds it."""

    enabled: bool = True
    margin: float = 0.25  # nats
    rel_margin: float = 0.05  # of the starting loss
    patience: int = 3
    lr_factor: float = 0.1
    window: int = 10  # steps
    collapse: float = 0.6  # of the first window's median gradient norm
    stall: float = 0.02  # ... while the loss's median fell by less than this share over the last window
    gain_steps: int = 15  # steps
    gain_window: int = 7  # steps
    min_gain: float = 0.4
    # once the LR is warmed up: the loss stalled at or within this share under the training data's
    # unigram entropy (the model blind to context) is an LR too high too; 0 turns it off
    unigram_margin: float = 0.05


@dataclass
class DivergenceRule(Section):
    """The least-squares line through the last `window` losses rises by min_rise of its mean, and by
    `sigma` standard errors of that rise (the noise of the losses about the line)."""

    enabled: bool = True
    window: int = 40
    min_rise: float = 0.05  # fraction of the window's mean loss
    sigma: float = 3.0  # standard errors of the fitted rise (0: the fraction alone)
    lr_factor: float = 0.5


def check_loss_rules(o: OrchestratorConfig) -> None:
    """The loss and gradient rules' checks (their windows: OrchestratorConfig.validate)."""
    _check(o.spike.min_samples >= 2, "orchestrator.spike.min_samples", "must be >= 2")
    _check(o.spike.early_steps >= 0, "orchestrator.spike.early_steps", "must be >= 0 (0: off)")
    _check(o.spike.trained_early_steps >= 0, "orchestrator.spike.trained_early_steps", "must be >= 0 (0: off)")
    _check(o.spike.early_window >= 2, "orchestrator.spike.early_window", "must be >= 2")
    _positive(o.spike, "orchestrator.spike", "early_sigma", "early_min_rise")
    _check(o.divergence.window >= 4, "orchestrator.divergence.window", "must be >= 4")
    _check(0 < o.divergence.lr_factor < 1, "orchestrator.divergence.lr_factor", "must be in (0, 1)")
    _check(o.divergence.sigma >= 0, "orchestrator.divergence.sigma", "must be >= 0 (0: min_rise alone)")
    _check(0 < o.above_start.lr_factor < 1, "orchestrator.above_start.lr_factor", "must be in (0, 1)")
    _positive(o.above_start, "orchestrator.above_start", "patience", "window")
    _check(0 < o.above_start.collapse < 1, "orchestrator.above_start.collapse", "must be in (0, 1)")
    _check(0 <= o.above_start.stall < 1, "orchestrator.above_start.stall", "must be in [0, 1)")
    _positive(o.above_start, "orchestrator.above_start", "gain_window")
    _check(0 < o.above_start.min_gain < 1, "orchestrator.above_start.min_gain", "must be in (0, 1)")
    _check(0 <= o.above_start.unigram_margin < 1, "orchestrator.above_start.unigram_margin", "must be in [0, 1)")
    _check(
        o.above_start.gain_steps == 0 or o.above_start.gain_steps >= o.above_start.gain_window,
        "orchestrator.above_start.gain_steps",
        f"must be 0 (off) or at least gain_window ({o.above_start.gain_window})",
    )
