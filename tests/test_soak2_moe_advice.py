"""The MoE rule remembers a dead expert as re-initialised only when its remedy was applied. In
advise mode (or with the remedy demoted below orchestrator.min_confidence) nothing was done, yet
the expert dying again was journaled as "dead again after its re-init" and its pruning advised
(soak: debug-moe, orchestrator.mode=advise, moe.prune_dead on, a starved expert)."""

from types import SimpleNamespace

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator import remedies
from trimtab.orchestrator.moe_health import MoEHealth
from trimtab.orchestrator.monitors import StepMetrics

VIEW = SimpleNamespace(moe_knobs=lambda layer: {"n_experts": 8, "top_k": 2, "capacity_factor": 1.25})


def advice(apply: bool) -> list[tuple[str, bool]]:
    """Expert 5 of layer 1 starved for two spells; each dead finding planned by remedies.moe and
    applied (auto mode) or not (advice). Returns (action, revived_before) of each."""
    cfg = OrchestratorConfig()
    cfg.moe.window, cfg.moe.dead_patience, cfg.moe.prune_dead = 4, 4, True
    monitor, out = MoEHealth(cfg), []
    shares = [0.0 if e == 5 else 1 / 7 for e in range(8)]
    for step in range(8):
        f = monitor.observe(StepMetrics(step=step, loss=4.0, grad_norm=1.0, progress=0.5, moe=[(1, shares, 0.0, 2)]))
        if f is not None:
            remedy = remedies.moe(f, VIEW, cfg)
            out.append((remedy.action, f.evidence["revived_before"]))
            if apply:
                remedy.applied()
    return out


def test_advice_to_reinit_a_dead_expert_is_not_remembered_as_its_reinit():
    assert advice(apply=False) == [("reinit_expert", False), ("reinit_expert", False)]


def test_an_applied_reinit_is_remembered_and_a_second_death_prunes():
    assert advice(apply=True) == [("reinit_expert", False), ("prune_expert", True)]
