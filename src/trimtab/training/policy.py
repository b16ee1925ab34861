"""The Trainer's policy half: RL's and DPO's objectives on a micro-batch (rl/loss.py, rl/dpo.py),
their frozen reference, RL's policies that generate (the model trained, or for asynchronous
rollouts a copy of it: rl/engine.py) and its step counts summed over the data-parallel ranks.
A mixin of Trainer (training/trainer.py), whose state it reads; the loop calls it from
_forward_backward and hands its policies to the RL loader (Trainer._enter_phase).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from trimtab.data.batches import MicroBatch
from trimtab.model import build_model
from trimtab.rl.batches import Policy
from trimtab.rl.dpo import dpo_from_hidden
from trimtab.rl.loss import policy_from_hidden, response_positions, target_logprobs, temperatures_at
from trimtab.rl.preference import PairBatch
from trimtab.rl.reference import load_reference, reference_logprobs
from trimtab.rl.rollout import Rollout, generate
from trimtab.rl.step import PolicyMicroBatch, RolloutBatch
from trimtab.training.evaluation import LeftOff

SCORING_PAIRS = "the held-out pair scoring"  # a DPO evaluation's, left off at a stop signal (_left_off)
SCORING_ANSWERS = "the verifier's scoring of the held-out answers"  # an RL evaluation's


class PolicyTraining:
    """What a Trainer trains policies with (RL, DPO); `reference` and `behaviour` are its state."""

    def _policy_sum(
        self,
        hidden: torch.Tensor,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        micro: PolicyMicroBatch,
        batch: RolloutBatch,
    ) -> torch.Tensor:
        """A micro-batch of rollouts' summed clipped objective; its sums for the metrics go to
        the batch (the loader reads them at the log line)."""
        rl = self.cfg.rl
        on = {k: getattr(micro, k).to(self.device, non_blocking=True) for k in ("old_logprobs", "advantage", "weights")}
        here = replace(micro, **on)
        at = response_positions(micro.targets, self.device)  # the heads read the responses only
        # each response's own sampling temperature: a batch generated ahead was drawn before the
        # knob moved (rule rl_signal, `ctl rl-temperature`, a resume's rl.temperature)
        drawn_at = micro.temperature.to(self.device, non_blocking=True)
        temperature = temperatures_at(drawn_at, at, micro.targets.shape[1])
        ref = None
        if rl.kl_coef:  # the frozen starting policy's log-probabilities (rl/reference.py)
            ref = reference_logprobs(self._reference(), inputs, targets, temperature, at)
        terms = policy_from_hidden(
            hidden,
            self.model.lm_head.weight,
            targets,
            at,
            here,
            temperature,
            rl.eps_low,
            rl.eps_high,
            self.rl_entropy_coef,
            ref,
            rl.kl_coef,
            # the decoupled objective while rollouts may be stale: a bound raised by `ctl max-staleness`,
            # or lowered to 0 by rule rl_ratio with batches drawn under the old one still queued
            rl.behaviour_weight_cap if max(rl.max_staleness, self.rl_max_staleness) else None,
        )
        batch.terms.append(terms)
        return terms.objective

    def _dpo_sum(
        self, hidden: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, micro: MicroBatch, batch: PairBatch
    ) -> torch.Tensor:
        """A micro-batch of preference pairs' summed DPO loss against the reference (none for
        SimPO and ORPO); its sums for the metrics go to the batch."""
        at = response_positions(micro.targets, self.device)  # the heads read the responses only
        ref = reference_logprobs(self._reference(), inputs, targets, 1.0, at) if self.cfg.dpo.uses_reference else None
        terms = dpo_from_hidden(hidden, self.model.lm_head.weight, targets, ref, self.cfg.dpo, at)
        batch.terms.append(terms)
        return terms.objective

    def _reference(self) -> torch.nn.Module:
        """The frozen starting policy of RL's KL term and of DPO (rl/reference.py), loaded at
        first use from the step-0 checkpoint (a background write of it finished first)."""
        if self.reference is None:
            self.finish_save()
            key = "dpo" if self.cfg.dpo.enabled else "rl.kl_coef"
            self.reference = load_reference(self.cfg.model, self.cfg.run_dir, self.device, key)
        return self.reference

    @torch.no_grad()
    def _pair_logprobs(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A DPO evaluation's: the policy's and the reference's log-probability of each target [B, T]
        (the reference's None for a reference-free loss)."""
        self.model.eval()
        at = response_positions(targets, self.device)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with self.precision.autocast():
            # before each forward, as a generation's: it ran on (debug, 1,000 held-out pairs of ~100 tokens: 5.6 s)
            self._left_off(SCORING_PAIRS)
            policy = target_logprobs(self.forward(inputs), self.model.lm_head.weight, targets, at, 1.0)
            if not self.cfg.dpo.uses_reference:
                return policy, None
            self._left_off(SCORING_PAIRS)
            return policy, reference_logprobs(self._reference(), inputs, targets, 1.0, at)

    @property
    def rl_temperature(self) -> float:
        """RL's sampling temperature: the orchestrator's or a person's (rule rl_signal), else
        rl.temperature. Rollouts are drawn at it; the objective evaluates each at its own
        (Rollout.temperature), which a batch generated ahead drew before a change."""
        return self.state.rl_temperature or self.cfg.rl.temperature

    @property
    def rl_max_staleness(self) -> int:
        """Optimizer steps RL's rollouts may be behind now: the loader's bound (rule rl_ratio or
        `ctl max-staleness` may have moved it from rl.max_staleness, either way)."""
        return getattr(self.loader, "max_staleness", self.cfg.rl.max_staleness)

    @property
    def rl_entropy_coef(self) -> float:
        """RL's entropy bonus: the orchestrator's or a person's (rule rl_entropy), else rl.entropy_coef."""
        coef = self.state.rl_entropy_coef
        return self.cfg.rl.entropy_coef if coef is None else coef

    def _all_sum(self, values: list[float]) -> list[float]:
        """RL's step counts and DPO's figures summed over the data-parallel ranks (one small all-reduce)."""
        if self.dist.dp_world == 1:
            return values
        summed = self.dist.sum_over_ranks(torch.tensor(values, dtype=torch.float64, device=self.device))
        return summed.tolist()

    def _rollouts(self, prompts: list[list[int]], seed: int | None) -> list[Rollout]:
        """The RL phase's policy: responses to `prompts` from the model being trained
        (rl/rollout.py), sampled from `seed`, or greedy (None: an evaluation's)."""
        return self._generate(self.model, prompts, seed, self.rl_temperature, self.state.step)

    def _policy_snapshot(self) -> tuple[Policy, int]:
        """Asynchronous RL's policy for a batch generated ahead (rl/engine.py): the weights as
        they are now in a model of their own (the trainer's go on changing while the rollout
        thread generates), and their version. max_staleness + 2 such models are kept in turn:
        at most max_staleness + 1 batches are queued, so the oldest is free when reused. While
        the ring grows (a run's start, a resume) the new copy is the one used: the oldest then
        may still be generating a queued batch (its weights were overwritten under it after a
        resume, and the resumed run was not the uninterrupted one)."""
        copies = self.behaviour
        bound = max(self.cfg.rl.max_staleness, getattr(self.loader, "max_staleness", 0))  # `ctl max-staleness`
        if len(copies) < bound + 2:
            frozen = build_model(self.cfg.model).to(self.device).eval().requires_grad_(False)
        else:
            frozen = copies.pop(0)
        copies.append(frozen)
        frozen.load_moe_state(self.model.moe_state())  # surgery may have changed the experts
        frozen.load_mod_state(self.model.mod_state())
        frozen.set_step(self.state.step)
        frozen.load_state_dict(self.model.state_dict())
        temperature, version = self.rl_temperature, self.state.step
        return lambda prompts, seed: self._generate(frozen, prompts, seed, temperature, version), version

    def _generate(
        self, model: torch.nn.Module, prompts: list[list[int]], seed: int | None, temperature: float, version: int
    ) -> list[Rollout]:
        rl = self.cfg.rl
        # an evaluation generates on the trainer's model in its own thread; a rollout thread, on a copy
        evaluation = self.evaluating and model is self.model
        if self.rollout_gate is not None:  # fault injection (rollout_oom), in the generating thread
            self.rollout_gate(len(prompts), version, evaluation)
        generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        with self.precision.autocast():  # thread-local: entered in the thread that generates
            return generate(
                model,
                prompts,
                rl.max_new_tokens,
                self.tok.eos_id,
                temperature=temperature if seed is not None else 0.0,
                top_p=rl.top_p,
                generator=generator,
                version=version,
                record_routing=rl.routing_replay and seed is not None,  # for the objective's forward
                interrupt=self._left_off if evaluation else None,
            )

    def _left_off(self, during: str = "the held-out generation") -> None:
        """Before each forward of an evaluation's generation or pair scoring, and each round of its verifications
        (rl/rewards.py): a stop signal leaves it off for the stop's save, as a held-out loss's after its
        micro-batch (training/evaluation.py); it ran on to its end (an RL run's held-out generation, debug, 1,956
        prompts x 48 tokens and 4 samples: the save 17 s after SIGTERM)."""
        if stop := self.dist.signalled():
            raise LeftOff(f"{stop}: left off for the stop's save during {during}")
