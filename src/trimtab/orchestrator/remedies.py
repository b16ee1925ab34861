"""The remedies of the families with one answer each (the policy's dispatch calls these):
memory and out-of-memory, throughput, Mixture-of-Experts health, Mixture-of-Depths quality, a
failed checkpoint save, and the run's length. Each reads the run through its view and returns a
Remedy; none acts (the orchestrator requests the action through Control).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trimtab.config import CHECKPOINTING
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.config.sparse import MoEConfig
from trimtab.orchestrator.monitors import Finding
from trimtab.resilience.elastic import node_count, node_of
from trimtab.training.state import GAVE_UP, NO_CHECKPOINT


@dataclass(kw_only=True)
class Remedy:
    """The policy's answer to a finding: an action of the table (training/actions.py), or "none"
    (log only), with its parameters and the reasoning the journal records. `commit` is what the
    policy remembers of it (a rung climbed, an LR cut owed, a rollback spent): run by the
    orchestrator only when the remedy is applied, so advice (advise mode, or confidence too low)
    leaves the policy as it was."""

    action: str
    params: dict[str, Any] = field(default_factory=dict)
    reasoning: str
    evidence: dict[str, Any] = field(default_factory=dict)  # what the policy measured itself (journaled)
    commit: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def applied(self) -> None:
        """The remedy was applied (auto mode, confident enough): the policy takes on its state."""
        if self.commit is not None:
            self.commit()


# At one row an out-of-memory error recomputes more (model/recompute.py): the next of
# CHECKPOINTING's modes, and why it helps.
def lr_cut(factor: float, view: Any, cfg: OrchestratorConfig) -> float | None:
    """The LR factor of a cut of `factor` that stops at orchestrator.min_lr_scale; None where the LR
    is at that floor already. Within float error of it: two cuts x0.1 leave 0.1 * 0.1 =
    0.010000000000000002, whose floor factor 0.9999999999999998 read as a cut, and rl_reward's third
    finding at lr 1e-2 rolled back from step 28 to 21 at "lr x1" (multiplier 0.01 -> 0.01), replaying
    7 steps to find the same fall and stop. The ladder's, too_high.py's and RL's rules all cut through it."""
    floor = cfg.min_lr_scale / max(view.lr_scale, 1e-12)
    return None if floor >= 1 - 1e-6 else max(factor, floor)


RECOMPUTE_WHY = {
    "selective": "selective checkpointing keeps each block's matmul and attention outputs and computes the cheap "
    "ops between them again in the backward: 0.6-0.75x the activation memory, no matmul run twice",
    "full": "full checkpointing keeps each block's input alone and runs its forward again in the backward: the "
    "least activation memory, about a third more compute a step",
}


def memory(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """Memory pressure or an out-of-memory error: halve the micro-batch (twice the accumulation:
    the optimization batch stays the same); at one row, recompute more activations (oom.recompute)
    or stop; after a clean stretch, probe a larger one."""
    if f.evidence.get("kind") == "probe":
        return _probe(f)
    if f.evidence.get("kind") == "rollout_oom":
        return _rollout_oom(f, cfg)
    half = view.micro_batch_tokens // 2
    one_row = half < view.min_micro_batch_tokens
    if one_row and f.rule == "memory":
        return Remedy(
            action="none",
            reasoning="memory is nearly full but the micro-batch is already one row; logged for a person "
            "(an out-of-memory error would stop the run)",
        )
    heavier = CHECKPOINTING[CHECKPOINTING.index(view.activation_checkpointing) + 1 :]
    more = heavier[0] if one_row and cfg.oom.recompute and heavier else None
    if one_row and more is None:
        return _unsplittable(view)
    if f.rule == "oom" and f.evidence["retry"] > cfg.oom.max_retries:
        return Remedy(
            action="stop",
            params={"reason": f"out of memory after {cfg.oom.max_retries} retries", "exit_code": GAVE_UP},
            reasoning="the retry budget for one step is spent (orchestrator.oom.max_retries)",
        )
    if more is not None:
        return Remedy(
            action="set_activation_checkpointing",
            params={"mode": more},
            reasoning=f"out of memory with a micro-batch of one row ({view.micro_batch_tokens} tokens): "
            f"{RECOMPUTE_WHY[more]}; "
            "the gradients are the same bit for bit, and the same rows are retried",
        )
    why = (
        "out of memory: half the micro-batch with twice the accumulation keeps the optimization batch "
        "identical; the same rows are retried"
        if f.rule == "oom"
        else "memory is nearly full: a smaller micro-batch now avoids an out-of-memory crash later"
    )
    return Remedy(action="set_micro_batch_tokens", params={"tokens": half}, reasoning=why)


def _probe(f: Finding) -> Remedy:
    """After a clean stretch, try the lighter activation checkpointing or the larger micro-batch
    the rule proposes; one that runs out of memory is undone and the next probe waits twice as long."""
    if "target_checkpointing" in f.evidence:
        return Remedy(
            action="set_activation_checkpointing",
            params={"mode": f.evidence["target_checkpointing"]},
            reasoning="probe: lighter activation checkpointing recomputes less and is faster; if it runs out of "
            "memory the rule recomputes more again and the next probe waits twice as long",
        )
    return Remedy(
        action="set_micro_batch_tokens",
        params={"tokens": f.evidence["target"]},
        reasoning="probe: a larger micro-batch is faster; if it runs out of memory it is halved again "
        "and the next probe waits twice as long",
    )


def _unsplittable(view: Any) -> Remedy:
    """Out of memory at one row with nothing more to recompute: stop, saying what a person can change."""
    mode = view.activation_checkpointing
    return Remedy(
        action="stop",
        params={
            "reason": f"out of memory with a micro-batch of one row ({view.micro_batch_tokens} tokens) "
            f"and activation checkpointing {mode}; lower data.seq_len or the model size, "
            + ("set train.activation_checkpointing, " if mode != "full" else "")
            + "or use a device with more memory",
            "exit_code": GAVE_UP,
        },
        reasoning="the micro-batch cannot be split further"
        + (" and activations are already recomputed whole" if mode == "full" else ""),
    )


def _rollout_oom(f: Finding, cfg: OrchestratorConfig) -> Remedy:
    """RL's generation ran out of memory: generate the step's rollouts in halves (the same
    prompts and groups; the KV cache of half the rows at a time)."""
    rows, retry = f.evidence["generation_rows"], f.evidence["retry"]
    if retry > cfg.oom.max_retries or rows <= 1:
        why = f"after {cfg.oom.max_retries} retries" if rows > 1 else "generating one row at a time"
        return Remedy(
            action="stop",
            params={
                "reason": f"out of memory generating rollouts {why}; lower rl.max_new_tokens or the model size",
                "exit_code": GAVE_UP,
            },
            reasoning="the generation batch cannot be split further, or the retry budget "
            "(orchestrator.oom.max_retries) is spent",
        )
    return Remedy(
        action="set_generation_rows",
        params={"at_once": rows // 2},
        reasoning="out of memory in generation: half the rows at a time holds half the KV cache; the step's "
        "prompts and groups stay the same, only generated in more passes",
    )


def throughput(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    return Remedy(
        action="none",
        reasoning="throughput fell well below its recent median; logged for a person (a slower node, "
        "thermal throttling, I/O stalls or memory swapping)",
    )


def disk(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """A failed save: free space and retry; the trainer tries again at the next steps (checkpointing.py
    _owe_save), noted; when a whole checkpoint interval after the first failure the saves still fail,
    stop before more work is at risk (the newest checkpoint on disk is the resume point).
    Only a full disk (or quota) is met by deleting: a checkpoint folder made read-only failed with
    EPERM, and older checkpoints were deleted "to free space" and the fix named was "free space"."""
    full = f.evidence.get("errno") in (errno.ENOSPC, errno.EDQUOT)
    if f.evidence["failures"] <= 1:
        return Remedy(
            action="save_checkpoint",
            params={"keep": 1} if full else {},
            reasoning="keep training and keep what was trained: delete older checkpoints (never the last good "
            "one) to free space, then retry the save once"
            if full
            else "keep training and keep what was trained: retry the save once (the error is no lack of "
            "space, so no checkpoint is deleted)",
        )
    since = f.evidence.get("failing_since", f.step)
    if f.step - since < f.evidence.get("every", 0):  # one constant reasoning: the journal folds the retries
        return Remedy(
            action="none",
            reasoning="the save failed again: tried again at the next steps, the wait doubling up to a quarter "
            "of the checkpoint interval, until the saves have failed for a whole interval (then the run stops)",
        )
    last = f.evidence["last_saved"]
    if full:
        fix = f"free space in {view.run_dir}"
    elif f.evidence.get("errno") in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"make {view.run_dir / 'checkpoints'} writable (its permissions or attributes, a read-only mount)"
    else:
        fix = f"check the storage under {view.run_dir}"
    return Remedy(
        action="stop",
        params={
            "reason": f"no checkpoint could be written since step {last} ({f.step - last} steps at risk, "
            f"{f.evidence['failures']} saves failed: {f.evidence['error']}); {fix} and "
            f"re-run the same command to resume from step {last}",
            "exit_code": NO_CHECKPOINT,
        },
        reasoning="the save failed again after its retry: training on would put ever more "
        "work at risk of a crash; stop now, losing nothing that is on disk",
    )


def mod(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """Mixture-of-Depths: the loss rose as the capacity fell, so the capacity goes back."""
    value = min(1.0, round(f.evidence["restore_to"], 4))
    layer = f.evidence.get("layer")  # None: every MoD layer fell from the same capacity
    if layer is not None:  # the layers fell from different capacities: each gets its own back
        target = view.mod_capacities()[layer][1]
        return Remedy(
            action="set_mod_capacity",
            params={"value": value, "layer": layer},
            reasoning=f"the loss rose as soon as fewer tokens went through the MoD blocks: give MoD layer {layer} "
            f"back the capacity it had before the fall (target {target:g} -> {value:g}; the other layers keep "
            "their own)",
        )
    targets = sorted({target for _, target in view.mod_capacities().values()})
    return Remedy(
        action="set_mod_capacity",
        params={"value": value},
        reasoning=f"the loss rose as soon as fewer tokens went through the MoD blocks: give them back the "
        f"capacity they had before the fall (targets {', '.join(f'{t:g}' for t in targets)} -> {value:g} "
        "in every MoD layer)",
    )


def ranks(n: int) -> str:
    """`n` ranks in words ("1 rank", "2 ranks"): the journal's restart lines."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def straggler(f: Finding, cfg: OrchestratorConfig) -> Remedy:
    """A rank persistently slower than the others: logged; with `straggler.exclude` in an elastic
    job of several nodes, the job restarts without its node (`_exclude`)."""
    slow = "every rank waits for the slowest at each collective, so the job runs at its speed"
    excluded, why = _exclude(f.evidence["ranks"], cfg.straggler.exclude, "orchestrator.straggler.exclude", slow)
    return excluded or Remedy(
        action="none",
        reasoning=f"{slow}; named for a person (a throttled or failing device, a noisy neighbour, a slow link): "
        f"not excluded, {why} (docs/resilience.md)",
    )


def transient(f: Finding, cfg: OrchestratorConfig) -> Remedy:
    """A transient fault: the re-run's update was applied (the step trained as if nothing happened);
    a suspect device (a rank faulted `rerun.suspect_after` times), with `rerun.exclude` in an
    elastic job of several nodes, has its node left out (`_exclude`)."""
    applied = (
        "the same weights on the same rows must give the same loss and gradient, and did not: the first "
        "computation was wrong (a flipped bit in a device's memory or arithmetic, a flaky link), not the data; "
        "the re-run's update was applied, so the step trains as if nothing happened (Megatron-LM's rerun"
    )
    suspects = f.evidence.get("suspects", [])
    if not suspects:
        return Remedy(action="rerun_step", params={"step": f.step}, reasoning=applied + "; docs/resilience.md)")
    named = ("rank " if len(suspects) == 1 else "ranks ") + ", ".join(map(str, suspects))
    faulty = f"{applied}); {named} computed a step wrong again and again"
    excluded, why = _exclude(suspects, cfg.rerun.exclude, "orchestrator.rerun.exclude", faulty)
    return excluded or Remedy(
        action="rerun_step",
        params={"step": f.step},
        reasoning=f"{faulty}: named a suspect device for a person to check (docs/resilience.md); not excluded, {why}",
    )


def _exclude(bad: list[int], allowed: bool, key: str, because: str) -> tuple[Remedy | None, str]:
    """An exclude_node remedy for the node of the `bad` ranks, where `allowed` (the config `key`)
    and the job is elastic with several nodes and the ranks on one node, never node 0 (in the usual
    launch its agent hosts the rendezvous, which would end with it); else None and why not."""
    nodes = sorted({node_of(r) for r in bad})
    if allowed and node_count() > 1 and len(nodes) == 1 and nodes[0] > 0:
        remedy = Remedy(
            action="exclude_node",
            params={"node": nodes[0]},
            reasoning=f"{because}: save, end node {nodes[0]}'s agent and ranks, and let torchrun's elastic agents "
            f"resume on the other nodes from that checkpoint, each step still training the same rows ({key}; "
            "docs/resilience.md)",
        )
        return remedy, ""
    if not allowed:
        return None, f"{key} is off"
    if node_count() < 2:
        return None, "no other node to go on with"
    return None, "the ranks are on node 0 (the rendezvous' host in the usual launch) or on several nodes"


def restart(f: Finding) -> Remedy:
    """A session lost (a rank killed, hung or crashed) and the job restarted by torchrun's elastic
    agent: done before this decision; it records the resume and why (docs/resilience.md)."""
    e = f.evidence
    why = {
        "hang": "its watchdog ended the stalled section instead of waiting out the collective timeout, and wrote "
        f"every rank's stack ({e.get('stacks')})",
        "lost_rank": "the other ranks' collectives failed with it",
        "lost_job": "no rank failed alone (none left the error of a failed collective): the job ended whole, by "
        "its nodes or network, the run directory's storage or a kill from outside (the scheduler, a person, the "
        "OOM killer)",
        "lost_process": "it left no exit record (killed: SIGKILL, the OOM killer, or its machine gone)",
        "lost_unknown": "its ranks left no record (resilience.watchdog off: no beats, no exit records), so what "
        "ended it is not known (resilience.watchdog auto or on records it)",
        "lost_elsewhere": "its ranks' records (ranks/, hangs/) stayed in the run directory it ran in: checkpoint.dir "
        "holds the checkpoints and the run's record, not them",
        "lost_node": "the other nodes' collectives failed with it, and the rendezvous went on without it",
        "crash": "its error ended the step on every rank",
        "resized": "the job saved and stopped for a new rendezvous",
        "excluded": "the orchestrator excluded its node (a straggler's or a suspect device's) after a checkpoint",
    }[e.get("kind", "lost_rank")]
    world = ranks(e["world_after"])
    if e["world_after"] != e["world_before"]:  # the global batch is the config's: each rank reads another share
        world += f" (was {e['world_before']}; every step still trains the same rows, split {e['world_after']} ways)"
    started = f"torchrun's elastic agent restarted the job on {world} and it"
    if e.get("kind") == "resized" and not e.get("restart", 1):  # no agent's restart: a new launch after a clean end
        why = f"the previous session ended cleanly ({e.get('ended') or 'its summary written'}): nothing was lost"
        started = f"launched again (by a person, a script or a scheduler) on {world}, the run"
    elif "TORCHELASTIC_RESTART_COUNT" not in os.environ and e["world_before"] == e["world_after"] == 1:
        why = why if e.get("kind", "lost_rank") != "lost_rank" else "the process ended without a word"
        if e.get("kind") == "crash":  # one process's error: its code or data, which a resume meets again
            why = "its error ended it (its traceback is on the console it ran in); unless its cause was fixed, the "
            why += "same steps meet it again"
        started = "started again (not by torchrun: by a person, a script or a scheduler), the run"
    elif not e.get("restart", 1):  # torchrun's first launch, or none: no agent restarted the lost job
        started = f"launched again (by a person, a script or a scheduler) on {world}, the run"
    return Remedy(
        action="resume",
        params={"step": e["resumed_step"], "world": e["world_after"]},
        reasoning=f"{why}; {started} resumed from the newest "
        f"valid checkpoint (step {e['resumed_step']}) with the data order continued exactly: the steps after it "
        f"({'' if e.get('step_exact', True) else 'at least '}{e['steps_lost']}) are trained again",
    )


def length(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """The live planner's run-length finding (orchestrator/planner.py): shorten or extend."""
    e = f.evidence
    if e["recommendation"] == "shorten":
        why = (
            f"the fitted loss curve L(D) = E + B / D^beta (Hoffmann et al. 2022's data term) predicts that "
            f"the last {e['total_steps'] - e['recommended_steps']} planned steps lower the loss by only "
            f"{e['loss_end'] - e['loss_recommended']:.3g}, within plan.tolerance={e['tolerance']:g} of the best "
            "allowed run: ending earlier saves the compute (the LR schedule compresses to the new end)"
        )
    else:
        why = (
            f"the fitted loss curve is still falling: {e['recommended_steps'] - e['total_steps']} more steps "
            f"are predicted to lower the loss by {e['loss_end'] - e['loss_recommended']:.3g}, more than "
            f"plan.tolerance={e['tolerance']:g}; bounded by plan.max_extend={e['max_extend']:g}"
        )
    return Remedy(action="set_total_steps", params={"steps": e["new_total"]}, reasoning=why)


def moe(f: Finding, view: Any, cfg: OrchestratorConfig) -> Remedy:
    """A MoEHealth finding (orchestrator/moe_health.py): revive, split, widen or rebalance."""
    rule, layer, kind = cfg.moe, f.evidence["layer"], f.evidence["kind"]
    knobs = view.moe_knobs(layer)
    if kind == "dead":
        expert = f.evidence["expert"]
        if f.evidence["revived_before"] and rule.prune_dead and knobs["n_experts"] > knobs["top_k"]:
            return Remedy(
                action="prune_expert",
                params={"layer": layer, "expert": expert},
                reasoning="the expert died again after a re-init: it only costs memory, so it goes",
                commit=f.commit,  # the rule remembers a prune or re-init only when applied
            )
        return Remedy(
            action="reinit_expert",
            params={"layer": layer, "expert": expert},
            reasoning="a dead expert is wasted capacity: a copy of the busiest expert (its router row, weights and "
            "selection bias, plus noise) shares the busiest's tokens (its optimizer moments restart from zero)",
            commit=f.commit,
        )
    if kind == "saturated":
        return Remedy(
            action="add_expert",
            params={"layer": layer, "source": f.evidence["busiest"]},
            reasoning="the busiest expert is saturated and tokens are dropped: split it in two "
            "(orchestrator.moe.add_experts is on)",
        )
    if kind == "drop":
        return _capacity(layer, knobs["capacity_factor"], rule.max_capacity)
    return _balance(f, layer, kind, knobs["balance_coef"], cfg, knobs.get("bias_lead", 0.0))


def _capacity(layer: int, factor: float, limit: float) -> Remedy:
    if not factor or factor * 1.25 > limit:
        return Remedy(
            action="none",
            reasoning="tokens are dropped but the capacity factor is at its limit (orchestrator.moe.max_capacity); "
            "logged for a person",
        )
    return Remedy(
        action="set_capacity_factor",
        params={"value": factor * 1.25, "layer": layer},
        reasoning="dropped tokens skip the expert layer: a larger capacity keeps them, at some compute",
    )


def _raised(evidence: dict, kind: str, coef: float, cfg: OrchestratorConfig) -> float:
    """The balance coefficient to raise to. Imbalance: x2 scaled by how far the busiest expert is over
    the bar (up to x4), doubled again per earlier balance finding on the layer in 4 windows (a raise
    that did not hold); collapse: x4. From 0 (no multiple of it helps) to MoEConfig's default (0.01), the
    strength the presets balance under: 0.001 first left the soak's layer at 3.3x fair share (debug-moe, 4
    experts top-1, temperature 0.1), then 0.002 40 steps later, still 3.3x. A coefficient a person set
    small on purpose (0.001, beside bias balancing) is raised from its own scale."""
    if kind == "collapse":
        factor = 4.0
    else:
        over = max(1.0, evidence.get("max_load", 0.0) / cfg.moe.imbalance)
        factor = min(4.0, 2.0 * over) * 2 ** evidence.get("strikes", 0)
    return min(cfg.moe.max_balance_coef, max(coef * factor, 1e-3) if coef > 0 else MoEConfig.balance_coef)


def _balance(f: Finding, layer: int, kind: str, coef: float, cfg: OrchestratorConfig, bias_lead: float) -> Remedy:
    """Imbalance: a larger balance coefficient. Collapse climbs: x4 the first time, then (an earlier
    balance finding in 4 windows, or the coefficient at its limit) a router reset; at once when the
    selection bias leads by 1 or more (probs lie in [0, 1]: it picks the expert whatever the router
    says, and no loss gradient reaches it, so a raise cannot hold). With top_k > 1 too, though the second
    choice still routes: sparing a reset while the train loss kept falling (it always does that early) lost
    on debug-moe, expert_collapse@6, 60 steps, seeds 0-3: mean val 4.841 against 4.797 reset (4.860 advised,
    4.775 clean; seed 0 4.817 against 4.672)."""
    target = _raised(f.evidence, kind, coef, cfg)
    if kind == "collapse" and (f.evidence["strikes"] or target <= coef or bias_lead >= 1):
        expert = f.evidence["busiest"]
        why = (
            f"its selection bias leads the next by {bias_lead:.3g}, 1 or more: it picks it whatever the router says"
            if bias_lead >= 1
            else f"after {f.evidence['strikes']} earlier balance finding(s) in {4 * cfg.moe.window} steps (or the "
            "balance coefficient is at its limit)"
        )
        return Remedy(
            action="reset_router",
            params={"layer": layer, "expert": expert},
            reasoning=f"the layer is collapsed onto expert {expert} ({why}): a balance loss "
            "moves router probabilities only, a saturated softmax passes it almost no gradient and the selection "
            "bias none, so re-centre the expert's router row and selection bias on the others' mean (its weights "
            "stay) and restart the row's AdamW moments",
            commit=f.commit,  # the rule gives an applied answer to a collapse a window (moe_health)
        )
    if target <= coef:
        return Remedy(
            action="none",
            reasoning=f"the load is {kind}d but the balance coefficient is at its limit "
            "(orchestrator.moe.max_balance_coef); logged for a person",
        )
    step = (
        f"it was {coef:g} (off): it starts at {target:g}"
        if coef <= 0
        else f"x{target / coef:.3g}, {coef:g} -> {target:g}"
        + (" (a collapse: x4, up to orchestrator.moe.max_balance_coef)" if kind == "collapse" else "")
    )
    return Remedy(
        action="set_balance_coef",
        params={"value": target, "layer": layer},
        reasoning=f"a stronger load-balancing loss pushes the router to spread tokens (Switch, GShard): {step}",
        commit=f.commit,  # a collapse's: as the reset's (moe_health)
    )
