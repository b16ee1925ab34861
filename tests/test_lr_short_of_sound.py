"""An LR still too high after the first cut, by less than the 7-step gain bar sees: debug-mod at 20x
its preset's LR, gain 0.21, was cut x0.1 to 2x, whose replay's first 15 gains (median 0.67; windows
of 7 all over min_gain 0.4) and gradient norm (0.72x its first steps', no stall) drew no rule, and it
ended 4.22 against 3.98 clean (150 steps). After a cut, the replay's median gain is held to a sound LR's (0.75-0.8)."""

from test_lr_too_high_floor import View
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.policy import Policy
from trimtab.orchestrator.trends import AboveStart

# measured update gains of steps 1-15 (advise mode, seed 1234): debug-mod at 2x, debug-hybrid at 1x its preset's LR
TWICE = [0.981, 0.943, 0.549, 0.787, 0.81, 0.616, 0.528, 0.659, 0.727, 0.245, 0.214, 0.772, 0.888, 0.667, 0.481]
SOUND = [1.009, 1.0, 0.802, 0.739, 0.805, 0.853, 0.863, 0.826, 0.781, 0.705, 0.67, 0.699, 0.772, 0.708, 0.718]


# measured steps 1-15 of debug finetuned (train.init_from) from a 60-step run at its preset's LR, seed 1:
# median 0.64 (steps 1-7: 0.43); seed 2's steps 1-7 (median 0.397, cut x0.316) with their losses
FINETUNE = [0.525, 0.168, 0.548, 0.312, 0.185, 0.801, 0.432, 0.464, 0.639, 0.669, 0.717, 0.657, 0.739, 0.784, 0.715]
FINETUNE_2 = [0.319, 0.068, 0.703, 0.337, 0.397, 0.444, 0.528]
LOSSES_2 = [4.053, 4.377, 4.224, 4.255, 4.128, 4.208, 4.124]


def _findings(gains: list[float], fired: bool, losses: list[float] | None = None, unigram: float | None = None) -> list:
    mon = AboveStart(OrchestratorConfig())
    mon.fired = fired  # a cut for an LR far too high earlier in the phase (kept across its rollback)
    mon.unigram = unigram  # the data's unigram entropy: a start under it is trained weights'
    start = 6.24 if unigram is None else 4.11
    losses = losses or [start - 0.08 * s for s in range(len(gains))]  # falling, under the start: no other finding
    metrics = [
        StepMetrics(step=s + 1, loss=x, grad_norm=0.8, update_gain=g) for s, (x, g) in enumerate(zip(losses, gains))
    ]
    return [f for f in map(mon.observe, metrics) if f is not None]


def test_a_replay_short_of_a_sound_lrs_gain_is_cut_again_by_half():
    (found,) = _findings(TWICE, fired=True)
    assert found.step == 15 and found.evidence["gain"] == 0.667 and found.evidence["since"] == 1
    remedy = Policy(OrchestratorConfig()).plan(found, View(lr_scale=0.1))
    assert remedy.action == "rollback" and remedy.params["to"] == 0
    assert remedy.params["lr_factor"] == 0.5  # 2x -> 1x (half a decade, to 0.63x, ended 4.12 against 3.98 clean)
    assert "still too high" in remedy.reasoning and "0.67" in remedy.reasoning


def test_a_sound_gain_after_a_cut_draws_nothing_and_without_one_both_ways_are_judged():
    assert _findings(SOUND, fired=True) == []  # debug-hybrid at its preset's LR: median 0.78
    (found,) = _findings(TWICE, fired=False)  # never cut: its median (0.667) and lower quartile (0.528) judged
    assert "steady_gain" in found.evidence and "sound_gain" not in found.evidence  # test_lr_uneven_gain.py


def test_a_finetunes_gains_at_a_sane_lr_draw_nothing():
    """Trained weights' first updates (Adam's state fresh) overshoot at a sane LR; the gain bars are a young model's."""
    assert _findings(FINETUNE_2, fired=False, losses=LOSSES_2, unigram=5.26) == []  # was cut x0.316
    assert _findings(FINETUNE, fired=True, unigram=5.26) == []  # after a cut at 10x: was halved to 0.5x
    (found,) = _findings(FINETUNE_2, fired=False, losses=[x + 2 for x in LOSSES_2], unigram=5.26)  # a young model's
    assert found.step == 7 and found.evidence["gain"] == 0.397


# debug at 10x its preset's LR, seed 2: cut x0.316 at step 7 (rollback to 0), its replay's steps 1-8 measured at
# x0.316; a spike's rollback to step 8 cut x0.1, and steps 9-15 measured at x0.0316 (median 0.80). Judged together
# (median 0.66) the phase's 15 gains cut x0.0316 again and capped its give-back there: 4.667 against 4.153.
MIXED = [0.712, 0.51, 0.447, 0.664, 0.62, 0.561, 0.73, 0.636, 0.886, 0.909, 0.558, 0.659, 0.936, 0.799, 0.684]


def test_only_the_gains_measured_at_the_lr_judged_count():
    mon = AboveStart(OrchestratorConfig())
    mon.fired = True
    scales = [0.316] * 8 + [0.0316] * 7
    metrics = [
        StepMetrics(step=s + 1, loss=6.24 - 0.08 * s, grad_norm=0.8, update_gain=g, lr_scale=x)
        for s, (g, x) in enumerate(zip(MIXED, scales))
    ]
    assert [f for f in map(mon.observe, metrics) if f is not None] == []
    assert mon.sound_at == 0.0316  # the 7 measured at it: median 0.80, sound
    assert len(_findings(MIXED, fired=True)) == 1  # the same gains at one LR: short of sound (0.66)
