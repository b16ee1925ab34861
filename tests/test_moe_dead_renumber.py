"""The MoE rule's memory of re-initialised experts follows them through a prune: the experts
above a pruned one move down an index, and the one that moves into its place was never revived
(before, it inherited the pruned expert's record and was pruned at its first death)."""

from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.moe_health import MoEHealth
from trimtab.orchestrator.monitors import StepMetrics


def starve(n, dead):
    """Load shares over n experts with the experts in `dead` getting nothing."""
    live = [e for e in range(n) if e not in dead]
    return [0.0 if e in dead else 1 / len(live) for e in range(n)]


def deaths(monitor, start, steps, n, dead):
    """Feeds `steps` steps of layer 1 starving `dead`; returns the dead findings' (expert, revived_before)."""
    out = []
    for step in range(start, start + steps):
        m = StepMetrics(step=step, loss=4.0, grad_norm=1.0, progress=0.5, moe=[(1, starve(n, dead), 0.0, 2)])
        f = monitor.observe(m)
        if f is not None and f.evidence["kind"] == "dead":
            out.append((f.evidence["expert"], f.evidence["revived_before"]))
            f.commit()  # auto mode: the remedy is applied (Remedy.applied runs the finding's commit)
    return out


def test_after_the_rules_prune_the_expert_moving_into_its_place_is_revived_first():
    cfg = OrchestratorConfig()
    cfg.moe.window, cfg.moe.dead_patience, cfg.moe.prune_dead = 4, 4, True
    monitor = MoEHealth(cfg)
    # expert 5 dies (revived), then expert 2 dies twice: revived, then proposed for pruning
    assert deaths(monitor, 0, 4, 8, {5}) == [(5, False)]
    assert deaths(monitor, 4, 4, 8, {2}) == [(2, False)]
    assert deaths(monitor, 8, 4, 8, {2}) == [(2, True)]
    # pruned: 7 experts; index 2 now holds the former expert 3, index 4 the former (revived) 5
    assert deaths(monitor, 12, 4, 7, {2}) == [(2, False)]
    assert deaths(monitor, 16, 4, 7, {4}) == [(4, True)]


def test_a_shrink_the_rule_did_not_propose_forgets_who_was_revived():
    cfg = OrchestratorConfig()
    cfg.moe.window, cfg.moe.dead_patience = 4, 4
    monitor = MoEHealth(cfg)
    assert deaths(monitor, 0, 4, 8, {2}) == [(2, False)]
    assert deaths(monitor, 4, 4, 7, {2}) == [(2, False)]  # a person pruned some expert: unknown which


def test_a_layer_with_as_many_experts_as_top_k_is_not_collapsed_and_its_dead_expert_is_not_left_pruning():
    """n_experts == top_k: every token goes to every expert, each taking 1 / top_k, the most one
    can; that was a collapse at every window (debug-moe with n_experts=top_k=2 journaled a balance
    raise, then router resets, all "not recovered"). An expert dead again after its re-init cannot
    be pruned there (remedies.moe re-inits it): no prune is left waiting, and the finding says so."""
    cfg = OrchestratorConfig()
    cfg.moe.window, cfg.moe.dead_patience, cfg.moe.prune_dead = 4, 4, True
    monitor = MoEHealth(cfg)

    def feed(start, shares):
        found = [
            monitor.observe(StepMetrics(step=s, loss=4.0, grad_norm=1.0, progress=0.5, moe=[(1, shares, 0.0, 2)]))
            for s in range(start, start + 4)
        ]
        for f in found:
            if f is not None and f.commit is not None:
                f.commit()  # auto mode: the remedy is applied
        return found

    assert feed(0, [0.5, 0.5]) == [None] * 4
    found = [f for f in feed(4, [1.0, 0.0]) + feed(8, [1.0, 0.0]) if f is not None]
    assert [(f.evidence["kind"], f.evidence["revived_before"], f.evidence["prunable"]) for f in found] == [
        ("dead", False, False),
        ("dead", True, False),
    ]
    assert monitor.pruning == {} and "not pruned" in found[1].summary
