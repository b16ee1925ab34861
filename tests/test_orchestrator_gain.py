"""An LR too high by less than above_start's loss line needs: the updates' gain (training/gain.py)
over a phase's first steps shows them overshooting, and the rule cuts the LR from the start."""

import pytest
import torch

import trimtab
from test_orchestrator_loop import debug_cfg, final_weights, train_lines
from trimtab.config import OrchestratorConfig, load_config
from trimtab.errors import ConfigError
from trimtab.model import build_model
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.too_high import _too_high_factor
from trimtab.orchestrator.trends import AboveStart
from trimtab.rundir import read_decisions
from trimtab.training.gain import GainProbe, grad_dot_weights
from trimtab.training.hooks import Hook

pytestmark = pytest.mark.usefixtures("one_thread")


class _Batch:
    def __init__(self, micro):
        self.micro, self.n_targets = micro, sum(int(m[1].numel()) for m in micro)


def _probe(model, batch_tokens):
    def score(micro):
        inputs, targets = micro
        logits = model(inputs)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    return GainProbe(model, score, lambda t: t, torch.device("cpu")), score


def _gain_of_one_sgd_step(preset: str, lr: float) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The measured gain of one plain SGD step on a tiny model, with its MoE load and the RNG
    state before and after the probe."""
    torch.manual_seed(0)
    cfg = load_config(preset=preset, sets=["model.vocab_size=96"])
    model = build_model(cfg.model)
    model.train()
    inputs, targets = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    probe, score = _probe(model, 32)
    batch = _Batch([(inputs, targets)])
    loss = score((inputs, targets)) / batch.n_targets
    loss.backward()
    probe.before()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    loads = [layer.load.clone() for _, layer in model.moe_layers()]
    rng = torch.get_rng_state()
    gain = probe.after(batch, loss.detach())
    for (_, layer), load in zip(model.moe_layers(), loads):
        assert torch.equal(layer.load, load)  # update_bias reads it: the probe's forward adds nothing
    assert torch.equal(torch.get_rng_state(), rng)
    return float(gain), loads, rng


def test_grad_dot_weights_sums_every_parameters_dot_product():
    a, b = torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([3.0]))
    a.grad, b.grad = torch.tensor([0.5, -1.0]), torch.tensor([2.0])
    assert grad_dot_weights([a, b]).item() == pytest.approx(0.5 - 2.0 + 6.0)
    assert grad_dot_weights([torch.nn.Parameter(torch.ones(2))]).item() == 0.0


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
def test_a_small_step_delivers_what_its_gradient_promised_and_a_huge_one_overshoots(preset):
    small, _, _ = _gain_of_one_sgd_step(preset, 1e-3)
    huge, _, _ = _gain_of_one_sgd_step(preset, 300.0)
    assert 0.9 < small < 1.1  # first order is exact as the step shrinks
    assert huge < 0.4


def _metrics(step, gain, loss=5.0):
    return StepMetrics(step=step, loss=loss, grad_norm=1.0, update_gain=gain)


def test_above_start_fires_on_a_median_gain_under_min_gain_only_over_the_first_steps():
    cfg = OrchestratorConfig()
    sound = AboveStart(cfg)
    assert sound.wants_gain(1)
    assert all(sound.observe(_metrics(s, 0.75)) is None for s in range(1, 16))
    assert not sound.wants_gain(16) and sound.wants_gain(15)
    over = AboveStart(cfg)
    gains = [0.9, 0.2, 0.15, 0.8, 0.1, 0.2, 0.3]  # median 0.2: two sound steps among them change nothing
    findings = [over.observe(_metrics(s, g)) for s, g in enumerate(gains, 1)]
    assert findings[:-1] == [None] * 6 and findings[-1] is not None
    f = findings[-1]
    assert f.rule == "above_start" and f.evidence["gain"] == pytest.approx(0.2) and f.evidence["since"] == 1
    assert over.fired  # the gradient-norm check follows, as after a loss above its start
    assert over.observe(_metrics(8, None)) is None and over.observe(_metrics(9, float("nan"))) is None


def test_the_cut_for_a_small_overshoot_is_the_square_root_of_lr_factor():
    cfg = OrchestratorConfig()
    mon = AboveStart(cfg)
    f = [mon.observe(_metrics(s, 0.35)) for s in range(1, 8)][-1]
    assert _too_high_factor(f, 0.1) == pytest.approx(0.1**0.5)
    f.evidence["gain"] = 0.25
    assert _too_high_factor(f, 0.1) == pytest.approx(0.1)
    del f.evidence["gain"]  # the loss above its start: always decisive
    assert _too_high_factor(f, 0.1) == pytest.approx(0.1)


def test_gain_steps_shorter_than_its_window_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="orchestrator.above_start.gain_steps"):
        load_config(preset="debug", sets=["orchestrator.above_start.gain_steps=3"])
    load_config(preset="debug", sets=["orchestrator.above_start.gain_steps=0"])  # off


class _Gains(Hook):
    def __init__(self, measure):
        self.measure, self.gains = measure, []

    def measure_gain(self, run):
        return self.measure

    def on_step_end(self, run, out):
        self.gains.append(None if out.update_gain is None else float(out.update_gain))


ROUTED = {
    "moe": {"layer_pattern": ["dense", "moe"], "moe": {"n_experts": 4, "top_k": 2, "bias_update_rate": 0.01}},
    "mod": {"layer_pattern": ["dense", "mod"], "mod": {"capacity": 0.5, "warmup_steps": 2}},
}


@pytest.mark.parametrize("routed", ["moe", "mod"])
def test_measuring_the_gain_changes_nothing_in_the_run(tmp_path, routed):
    """Weights and losses bit-identical with and without the second scoring (MoE load, routing,
    RNG put back), and every measured gain finite."""
    runs = {}
    for measure in (False, True):
        hook = _Gains(measure)
        cfg = debug_cfg(tmp_path / str(measure), steps=6, orchestrator={"mode": "off"}, model=ROUTED[routed])
        trimtab.train(cfg, hooks=[hook])
        runs[measure] = (hook.gains, [m["loss"] for m in train_lines(tmp_path / str(measure))])
        runs[measure] += (final_weights(tmp_path / str(measure)),)
    assert runs[False][0] == [None] * 6 and all(0 < g < 2 for g in runs[True][0]), runs[True][0]
    assert runs[False][1] == runs[True][1]
    assert all(torch.equal(v, runs[True][2][k]) for k, v in runs[False][2].items())


def test_an_lr_30x_too_high_is_cut_from_the_start_though_the_loss_stays_under_its_start(tmp_path):
    """30x the preset's LR (which the loss line never sees on debug): the first steps' updates
    overshoot, the run restarts from step 0 at a cut LR; at the preset's LR no such finding. 21 steps: a
    run of 20 or fewer is cut without the rollback (too_high.py SHORT_RUN, tests/test_lr_given_back.py)."""
    run = tmp_path / "hot"
    trimtab.train(debug_cfg(run, steps=21, optim={"lr": 0.09}))
    first = read_decisions(run)[0]
    assert (first["rule"], first["action"]) == ("above_start", "rollback"), first
    assert first["evidence"]["gain"] < 0.3 and first["params"]["lr_factor"] == pytest.approx(0.1)
    assert "to step 0" in first["applied"][0] and "overshoot" in first["reasoning"]
    sound = tmp_path / "sound"
    trimtab.train(debug_cfg(sound, steps=16))
    assert not [d for d in read_decisions(sound) if d["rule"] == "above_start"]


def test_after_a_finding_a_dying_gradient_cuts_again_only_while_the_loss_stalls():
    """The follow-up judges the gradient norm only with the loss: a sound LR after a cut lets the
    gradient norm fall from a random start's while the loss keeps falling (small: 2.0 -> 0.8 by
    step 50), which is no stall; an LR still too high holds the loss flat."""
    cfg = OrchestratorConfig()
    for losses, fires in (([5.0 - 0.02 * s for s in range(60)], False), ([5.1] * 60, True)):
        mon = AboveStart(cfg)
        mon.fired = True
        found = [
            mon.observe(StepMetrics(step=s + 1, loss=loss, grad_norm=1.0 if s < 10 else 0.3))
            for s, loss in enumerate(losses)
        ]
        assert any(f is not None and "warm_grad_norm" in f.evidence for f in found) == fires
