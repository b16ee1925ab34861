"""The RL phase's loader: prompts drawn in a seeded order, a group of responses to each from the
policy being trained, their rewards, advantages and behaviour log-probabilities, cut into
micro-batches the trainer's loop trains like any other step (training/trainer.py: the objective
is rl/loss.py's where a micro-batch carries a policy's fields).

`RolloutLoader` is the loop's loader for an RL phase: the same protocol as data/batches.py's
BatchLoader (next_batch, regroup after an OOM, skip_rows after a rollback, metrics,
state_dict), so the orchestrator heals RL steps as it heals pretraining ones. Its state is the
order's position and the draws made: the sampling generator of a step is seeded from the run's
seed and the draw count, so a resumed run generates exactly what the uninterrupted one did.

Shape legend: B sequences in a micro-batch, T its longest prompt + response - 1.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from trimtab.config.rl import RLConfig
from trimtab.data.arithmetic import SOURCE, digits_of
from trimtab.data.batches import IGNORE_INDEX
from trimtab.data.tokenizer import TextTokenizer
from trimtab.errors import DataError
from trimtab.hardware import is_oom
from trimtab.rl import curriculum, replay
from trimtab.rl.engine import RolloutQueue
from trimtab.rl.loss import advantages, normaliser, token_weights
from trimtab.rl.order import EpochOrder, Ordered, fingerprint
from trimtab.rl.rewards import VerifierPool, taken
from trimtab.rl.rollout import Rollout
from trimtab.rl.step import (
    SUMS,
    TERMS,
    PolicyMicroBatch,
    RolloutBatch,
    batch_from_state,
    batch_state,
    fill_failed,
    flat,
    overlong_penalty,
    pass_at_k,
    solved,
    step_figures,
)
from trimtab.rl.tasks import Problem

# prompts, a sampling seed (None: greedy) -> one rollout each
Policy = Callable[[list[list[int]], int | None], list[Rollout]]
# a policy generating from the weights as they are now, in the rollout thread, and their version
Snapshot = Callable[[], tuple[Policy, int]]
Sum = Callable[[list[float]], list[float]]  # host numbers summed over the data-parallel ranks
HELD_OUT_DRAW = 999_983  # the held-out samples' seed offset: no training draw's (those count from 0)
TOLD = 8  # distinct verifier errors said on the log, a run (a verifier raising alike every time: once)
log = logging.getLogger(__name__)


@dataclass
class _Logged:
    """What metrics() reads of a step's batch, as a checkpoint keeps it (host numbers)."""

    sums: dict[str, float]
    staleness: float
    totals: dict[str, float]

    @classmethod
    def of(cls, batch: Any) -> _Logged:
        """A batch's (or a _Logged's) figures; a host read a tensor, at a save."""
        floats = lambda d: {k: float(v) for k, v in d.items()}  # noqa: E731
        return cls(floats(batch.sums), float(batch.staleness), floats(batch.totals))


class RolloutLoader(Ordered):
    """An RL phase's steps (see the module docstring); `policy` is set by the trainer."""

    interrupt: Callable[[], None] | None = None  # the trainer's: raises at a stop signal, held-out scoring left off

    def __init__(
        self,
        problems: list[Problem],
        tok: TextTokenizer,
        cfg: RLConfig,
        micro_batch_tokens: int,
        seed: int,
        max_prompt_tokens: int,
        held_out: list[Problem] | None = None,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.problems, self.tok, self.cfg, self.seed = problems, tok, cfg, seed
        # data parallelism: each rank answers every world-th prompt drawn; the step's counts and
        # normaliser are every rank's, summed by the trainer's all_sum (Trainer._all_sum)
        self.rank, self.world = rank, world
        self.all_sum: Sum = lambda values: values
        # asynchronously: the rollout thread's sums, on a group of their own (distributed/group.py
        # side_sum), and every rank's batches generated ahead gathered into the checkpoint (a
        # collective: every rank saves)
        self.side_sum: Sum = lambda values: values
        self.gather: Callable[[Any], list[Any]] = lambda value: [value]
        self.held_out = held_out or []  # answered greedily at each evaluation (evaluate)
        # a step's size in tokens, as the OOM handler bounds a micro-batch by (its prompts' at most)
        self.batch_tokens = cfg.prompts_per_step * cfg.group_size * (max_prompt_tokens + cfg.max_new_tokens)
        self.max_prompt_tokens = max_prompt_tokens
        # the built-in task's digits (rl/curriculum.py: rule rl_signal raises them once it is learned); 0: a file's
        self.difficulty = digits_of(cfg.prompts) or 0
        # the difficulty a raise past which did not fit model.max_seq_len (rl/curriculum.py; 0: none found)
        self.top_difficulty = 0
        # told each difficulty set, a resume's included: its phase's rows widened to the longer prompts (RLPhase.loader)
        self.on_difficulty: Callable[[], None] = lambda: None
        # train.micro_batch_tokens, 0 (auto) the whole step (not train.batch_tokens: pretraining's);
        # an OOM handler may lower it between steps
        self.micro_batch_tokens = micro_batch_tokens or self.batch_tokens
        self.policy: Policy | None = None  # the trainer's model generating (Trainer._enter_phase)
        self.snapshot: Snapshot | None = None  # asynchronous rollouts' policies (rl.max_staleness)
        self._queue: RolloutQueue[RolloutBatch] | None = None  # the batches generating ahead
        self._scoring = threading.Lock()  # the rollout thread and an evaluation share the verifiers
        self.version = 0  # the newest snapshot's (the policy being trained, asynchronously)
        self.generation_rows = 0  # rows generated in one pass (0: all at once; an OOM halves it)
        self.max_staleness = cfg.max_staleness  # rule rl_ratio may lower it (set_max_staleness)
        items = fingerprint((p.prompt, p.answer) for p in problems)
        builtin = cfg.prompts.startswith(SOURCE)  # its problems are drawn from train.seed
        split = "" if builtin else "rl.held_out"  # a file's held-out prompts are split off it (rl/phase.py)
        self.order = EpochOrder(len(problems), seed, "prompts", "rl.prompts", items, seeded=builtin, split=split)
        self.draws = 0  # the sampling draws made (each draw's seed counts from it)
        self._pool: VerifierPool | None = None
        self._held_out_pool: VerifierPool | None = None  # rl.held_out_reward's, when it differs
        self._window: list[RolloutBatch] = []  # the steps since metrics() was read
        # this step's verifications so far: scored, failed, timed out, and the groups' mean verifier
        # scores summed and squared (rule rl_reward's: the overlong penalty is not the verifier's)
        self._scored = [0, 0, 0, 0.0, 0.0]
        self._slowest = 0.0  # this step's longest verification that gave a verdict (rule rl_verifier)
        self._failed: Exception | None = None  # this rank's generation error, until every rank hears it (_sum)
        self._error, self._told = "", set()  # this step's last verifier error; the errors said on the log
        # seconds a verification may run (rule rl_verifier raises it): each scoring reads it
        self.verifier_timeout_s = cfg.verifier_timeout_s
        self.dynamic_sampling = cfg.dynamic_sampling  # rule rl_signal may turn it on
        # rule rl_length may turn the filter on, then the soft penalty (its buffer in tokens)
        self.overlong_filter, self.overlong_buffer = cfg.overlong_filter, cfg.overlong_buffer

    def next_batch(self) -> RolloutBatch:
        """A step's batch: generated now by the policy being trained, or with rl.max_staleness
        eta taken from the batches generated ahead, eta steps before (rl/engine.py)."""
        eta = self.max_staleness
        if self._queue is not None and self._queue.depth != eta:  # lowered: the batches ahead are too stale
            self._queue.close()
            self._queue = None
        if not eta:
            batch = self._produce(self.policy, self.dynamic_sampling, self.overlong_buffer, self.all_sum)
        else:
            self._queue = self._queue or RolloutQueue(eta)
            batch = self._queue.next(self._job)  # queues one batch from this step's policy
            batch.staleness = self.version - sum(r.version for r in batch.rollouts) / len(batch.rollouts)
        self._window.append(batch)
        return self.regroup(batch)

    def _job(self) -> Callable[[], RolloutBatch]:
        """A batch to generate in the rollout thread, from the weights and knobs as they are now."""
        policy, self.version = self.snapshot()
        dynamic, buffer = self.dynamic_sampling, self.overlong_buffer
        return lambda: self._produce(policy, dynamic, buffer, self.side_sum)

    def _produce(self, policy: Policy, dynamic_sampling: bool, overlong_buffer: int, all_sum: Sum) -> RolloutBatch:
        """_draw; one that raised (out of memory: the orchestrator halves the passes and the trainer
        asks again) gives its prompts and sampling seeds back, so the retry draws the same ones
        (they were left out of the epoch before; asynchronously, the batch queued behind it takes
        them, and the failed one draws the next)."""
        mark = self.order.state_dict(), self.draws, list(self._scored), self._slowest
        try:
            return self._draw(policy, dynamic_sampling, overlong_buffer, all_sum)
        except BaseException:
            self.order.load_state_dict(mark[0], "rl")
            self.draws, self._scored, self._slowest = mark[1:]  # the retry counts its own verifications
            raise

    def _draw(self, policy: Policy, dynamic_sampling: bool, overlong_buffer: int, all_sum: Sum) -> RolloutBatch:
        """prompts_per_step prompts, group_size responses to each, scored. With
        rl.dynamic_sampling (DAPO), groups whose rewards are all equal (no advantage, no
        gradient) are dropped and more prompts drawn in their place, up to rl.resample_rounds
        times; a step that finds none with a signal trains what it drew (nothing to learn)."""
        cfg, G, P = self.cfg, self.cfg.group_size, self.cfg.prompts_per_step
        drawn = self._groups(P, policy, overlong_buffer)
        groups = drawn
        if dynamic_sampling:  # every rank's groups with a signal counted: all ranks draw alike
            groups = [g for g in drawn if not flat(g[2])]
            for _ in range(cfg.resample_rounds):
                kept = int(self._sum(all_sum, [len(groups)])[0])
                if kept >= P:
                    break
                more = self._groups(P - kept, policy, overlong_buffer)
                drawn += more
                groups += [g for g in more if not flat(g[2])]
            groups = groups or drawn[-max(P // self.world, 1) :]
        rollouts = [r for _, group, _ in groups for r in group]
        rewards = [x for _, _, scores in groups for x in scores]
        adv = advantages(torch.tensor(rewards).view(-1, G), cfg.baseline).view(-1).tolist()
        rows = [problem for problem, _, _ in groups for _ in range(G)]
        n_tokens = sum(len(r.prompt) + len(r.tokens) - 1 for r in rollouts)
        (verified, failures, timeouts, score, score_sq), self._scored = self._scored, [0, 0, 0, 0.0, 0.0]
        slowest, self._slowest = self._slowest, 0.0
        error, self._error = self._error, ""
        local = {
            "groups": len(drawn),
            "flat": sum(flat(g[2]) for g in drawn),
            "solved": solved([g[2] for g in drawn], self.cfg.full_reward),
            "verified": verified,
            "reward": sum(x for g in drawn for x in g[2]),
            "score": score,
            "score_sq": score_sq,
            "temperature": sum(r.temperature for g in drawn for r in g[1]),
            "failures": failures,
            "timeouts": timeouts,
            "rollouts": len(rollouts),
            "entropy": sum(r.entropy for r in rollouts),
            "truncated": sum(r.truncated for r in rollouts),
            "tokens": sum(len(r.tokens) for r in rollouts),
        }
        # each rank's longest verdict in a slot of its own, so the one sum carries their maximum (summed, the
        # times of 8 ranks read as a verifier 8x slower, and rule rl_verifier took hangs for a slow check)
        slots = [slowest if r == self.rank else 0.0 for r in range(self.world)]
        summed = self._sum(all_sum, [*(local[k] for k in SUMS), *slots])
        sums, slowest = dict(zip(SUMS, summed)), max(summed[len(SUMS) :])
        fields = {"verifier_error": error, "overlong_buffer": overlong_buffer, "slowest": slowest}
        fields |= {"dynamic_sampling": dynamic_sampling, "difficulty": self.difficulty, "top": self.top_difficulty}
        return RolloutBatch([], 0, n_tokens, rows, None, rollouts, adv, rewards, sums, **fields)

    def _sum(self, all_sum: Sum, values: list[float]) -> list[float]:
        """all_sum(values), told whether any rank's generation (or scoring) failed since the last
        sum: then every rank raises here together, the failing one its own error, the others an
        out-of-memory error where it was one (so all generate in smaller passes, the
        orchestrator's decision the same on every rank and journaled once), else a RuntimeError.
        One rank raising alone left the others waiting in this sum: an out-of-memory error on
        one rank was handled by it alone, unjournaled, its generation passes no longer its
        peers'; any other error would hang the job."""
        failed, self._failed = self._failed, None
        oom = failed is not None and is_oom(failed)
        *summed, ooms, errors = all_sum([*values, int(oom), int(failed is not None and not oom)])
        if failed is not None:
            raise failed
        if errors:
            raise RuntimeError("another rank failed generating or scoring its rollouts: its log names the error")
        if ooms:
            raise torch.OutOfMemoryError(
                "out of memory generating rollouts on another rank: every rank generates in smaller passes"
            )
        return summed

    def _groups(self, n: int, policy: Policy, buffer: int) -> list[tuple[int, list[Rollout], list[float]]]:
        """`n` prompts drawn (every rank draws the same), this rank's share of them (every
        world-th) answered group_size times and scored: (problem, responses, rewards)."""
        G = self.cfg.group_size
        chosen = [self.order.next() for _ in range(n)][self.rank :: self.world]
        prompts = [self.tok.encode(self.problems[i].prompt, specials=True) for i in chosen]
        # each draw's sampling seed, a rank's own: a resumed run draws alike
        seed = self.seed * 1_000_003 + self.draws + (self.rank << 32)
        self.draws += 1
        if not chosen or self._failed is not None:
            return []
        try:
            rollouts = self._generate(policy, [p for p in prompts for _ in range(G)], seed)
            rewards, events = self._score(rollouts, [self.problems[i].answer for i in chosen for _ in range(G)])
            rewards = fill_failed(rewards, {e["index"] for e in events}, G)  # no verdict: no advantage
        except Exception as exc:  # under torchrun, raised on every rank at the step's next sum (_sum)
            if self.world == 1:
                raise
            self._failed = exc
            return []
        scores = [sum(rewards[k * G : (k + 1) * G]) / G for k in range(len(chosen))]  # the verifier's, a group
        budget = self.cfg.max_new_tokens
        rewards = [r + overlong_penalty(len(ro.tokens), budget, buffer) for r, ro in zip(rewards, rollouts)]
        timeouts = sum(e["kind"] == "timeout" for e in events)
        for event in (e for e in events if e["kind"] != "timeout"):
            self._error = event["detail"]
            self._tell(event, self.problems[chosen[event["index"] // G]], "rl.reward", "no reward: its advantage is 0")
        counts = (len(rollouts), len(events), timeouts, sum(scores), sum(x * x for x in scores))
        self._scored = [a + b for a, b in zip(self._scored, counts)]
        return [(i, rollouts[k * G : (k + 1) * G], rewards[k * G : (k + 1) * G]) for k, i in enumerate(chosen)]

    def _tell(self, event: dict[str, Any], problem: Problem, key: str, effect: str) -> None:
        """Say a verifier's error on the log, once a distinct error (TOLD at most, a run)."""
        detail = event["detail"]
        if len(self._told) >= TOLD or detail in self._told:
            return
        self._told.add(detail)
        at = f" ({problem.where})" if problem.where else ""
        spec = self.cfg.reward if key == "rl.reward" else self.cfg.held_out_reward
        log.warning(
            "%s's verifier failed on a response to prompt %r%s (%s): %s; fix the verifier (%s %s) for such responses",
            key,
            problem.prompt[:80],
            at,
            effect,
            detail,
            key,
            spec,
        )

    def _generate(self, policy: Policy, rows: list[list[int]], seed: int | None) -> list[Rollout]:
        """One response a row, generation_rows rows a pass; each pass after the first samples
        from a seed of its own (the same seed twice would draw the same responses; None: greedy)."""
        every = self.generation_rows or len(rows)
        seeds = [None if seed is None else seed + (i << 48) for i in range(len(rows))]
        return [r for i, at in enumerate(range(0, len(rows), every)) for r in policy(rows[at : at + every], seeds[i])]

    def _score(
        self, rollouts: list[Rollout], answers: list[str], held_out: bool = False
    ) -> tuple[list[float], list[dict[str, Any]]]:
        """Each response's reward, and the verifications that failed (timed out or raised: 0);
        held-out responses by rl.held_out_reward's verifier where it names another."""
        cfg, timeout = self.cfg, self.verifier_timeout_s
        if self._pool is None:
            self._pool = VerifierPool(cfg.reward, cfg.verifier_workers, timeout, cfg.verifier_retries)
        pool = self._pool
        if held_out and cfg.held_out_reward not in ("", cfg.reward):
            if self._held_out_pool is None:
                spec, workers, retries = cfg.held_out_reward, cfg.verifier_workers, cfg.verifier_retries
                self._held_out_pool = VerifierPool(spec, workers, timeout, retries, key="rl.held_out_reward")
            pool = self._held_out_pool
        eos = self.tok.eos_id
        with taken(self._scoring, self.interrupt if held_out else None):
            pool.timeout_s = timeout  # the knob as it is now
            texts = [self.tok.decode([t for t in r.tokens if t != eos]) for r in rollouts]
            scored = pool.score(texts, answers, self.interrupt if held_out else None)
        if not held_out:  # the training verifications' (rule rl_verifier's evidence)
            self._slowest = max(self._slowest, scored.slowest)
        return scored.rewards, scored.events

    def evaluate(self) -> dict[str, float]:
        """The held-out prompts answered greedily by the policy, scored: the mean reward and
        pass@1 (the share whose reward is full); with rl.held_out_samples n, also n responses a
        prompt sampled at the run's temperature and pass@k for k = 2, 4, .. up to n (the same
        sampling seed at every evaluation, so their course is the policy's, not the draw's);
        {} without held-out prompts."""
        if not self.held_out:
            return {}
        prompts = [self.tok.encode(p.prompt, specials=True) for p in self.held_out]
        answers = [p.answer for p in self.held_out]
        rewards, failures = self._score(self._generate(self.policy, prompts, None), answers, held_out=True)
        # said as the training verifier's are: a held-out reward of 0 read as the policy's, not the verifier's
        key = "rl.held_out_reward" if self.cfg.held_out_reward not in ("", self.cfg.reward) else "rl.reward"
        for event in (e for e in failures if e["kind"] != "timeout"):
            self._tell(event, self.held_out[event["index"]], key, "scored 0 in the held-out reward")
        figures = {
            "rl/held_out_reward": sum(rewards) / len(rewards),
            "rl/held_out_pass@1": sum(r >= 1.0 for r in rewards) / len(rewards),
            "rl/held_out_verifier_failures": float(len(failures)),
            "rl/held_out_n": float(len(rewards)),  # pass@1's count of problems: rule rl_hacking's test of a fall
        }
        n = self.cfg.held_out_samples
        if n >= 2:
            rows, seed = [p for p in prompts for _ in range(n)], self.seed * 1_000_003 + HELD_OUT_DRAW
            sampled = self._generate(self.policy, rows, seed)
            scores, _ = self._score(sampled, [a for a in answers for _ in range(n)], held_out=True)
            right = [sum(r >= 1.0 for r in scores[i * n : (i + 1) * n]) for i in range(len(prompts))]
            k = 2
            while k <= n:
                figures[f"rl/held_out_pass@{k}"] = sum(pass_at_k(n, c, k) for c in right) / len(right)
                k *= 2
        return figures

    def regroup(self, batch: RolloutBatch) -> RolloutBatch:
        """The step's sequences cut into micro-batches of the current budget: longest first,
        filled while rows x the first (longest) one's width fit micro_batch_tokens. With
        rl.overlong_filter the responses cut at the budget are left out (DAPO's overlong
        filtering: a cut response's reward says nothing of its answer)."""
        cfg, rollouts = self.cfg, batch.rollouts
        width = [len(r.prompt) + len(r.tokens) - 1 for r in rollouts]  # input positions
        trained = [i for i, r in enumerate(rollouts) if not (self.overlong_filter and r.truncated)]
        trained = trained or list(range(len(rollouts)))  # every response cut: trained as they are
        groups: list[list[int]] = []
        for i in sorted(trained, key=lambda i: -width[i]):
            if groups and (len(groups[-1]) + 1) * width[groups[-1][0]] <= self.micro_batch_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        batch.micro = [self._collate(batch, group) for group in groups]
        if not batch.normaliser:  # every rank's responses: each rank's share of the step's gradient
            local = normaliser([len(rollouts[i].tokens) for i in trained], cfg.aggregation, cfg.max_new_tokens)
            batch.normaliser = self.all_sum([local])[0] if self.world > 1 else local
        batch.n_targets = batch.normaliser
        return batch

    def _collate(self, batch: RolloutBatch, group: list[int]) -> PolicyMicroBatch:
        """The step's rollouts `group` (their indices in `batch`) as one micro-batch."""
        rollouts = [batch.rollouts[i] for i in group]
        width = max(len(r.prompt) + len(r.tokens) - 1 for r in rollouts)
        inputs = torch.full((len(rollouts), width), self.tok.pad_id, dtype=torch.long)
        targets = torch.full((len(rollouts), width), IGNORE_INDEX, dtype=torch.long)
        old = torch.zeros(len(rollouts), width)
        for b, r in enumerate(rollouts):
            seq, start = r.prompt + r.tokens, len(r.prompt) - 1  # the first response token's input position
            inputs[b, : len(seq) - 1] = torch.tensor(seq[:-1])
            targets[b, start : start + len(r.tokens)] = torch.tensor(r.tokens)
            old[b, start : start + len(r.tokens)] = torch.tensor(r.logprobs)
        cfg = self.cfg
        weights = token_weights(targets != IGNORE_INDEX, cfg.aggregation)
        # its part of the step's normaliser (their sum is the step's): the share the trainer
        # weights this micro-batch's auxiliary losses and router statistics by
        n = int(normaliser([len(r.tokens) for r in rollouts], cfg.aggregation, cfg.max_new_tokens))
        advantage = torch.tensor([batch.advantage[i] for i in group])
        experts, depth = replay.collate_rollouts(rollouts, width)
        temperature, rows = torch.tensor([r.temperature for r in rollouts]), [batch.rows[i] for i in group]
        return PolicyMicroBatch(inputs, targets, n, rows, old, advantage, weights, experts, temperature, depth)

    def drop_ahead(self) -> None:
        """Drop the batches generated ahead (rl.max_staleness), after the one generating now has finished: the
        next step generates them again, from the policy and the problems as they are then."""
        if self._queue is not None:
            self._queue.close()
            self._queue = None

    def close(self) -> None:
        """End the rollout thread and the verifier pool's processes (the run is over, or a
        rollback builds the loader anew)."""
        self.drop_ahead()
        for pool in (self._pool, self._held_out_pool):
            if pool is not None:
                pool.close()
        self._pool = self._held_out_pool = None

    def metrics(self) -> dict[str, float]:
        """The RL figures over the steps since the last read (one host read of the objective's sums)."""
        window, self._window = self._window, []
        if not window:
            return {}
        sums = {k: sum(b.sums.get(k, 0) for b in window) for k in SUMS}  # an older checkpoint's: no "solved"
        figures = step_figures(sums)
        out = {
            "rl/reward": figures["reward"],
            "rl/zero_variance_groups": figures["flat_groups"],
            "rl/solved_groups": figures["solved_groups"],
            "rl/groups_drawn": sums["groups"] / len(window),
            "rl/response_tokens": figures["response_tokens"],
            "rl/entropy": figures["entropy"],  # nats a response token
            "rl/truncated": figures["truncated"],
            "rl/verifier_failures": float(sums["failures"]),
        }
        if self.difficulty:  # the built-in task's, a curriculum's knob (rl/curriculum.py)
            out["rl/difficulty"] = float(self.difficulty)
        # a run that is or was asynchronous: the live bound (`ctl max-staleness` may raise it over
        # rl.max_staleness), the config's (rule rl_ratio may lower it to 0: logged as 0), or a
        # window whose batches were generated ahead before a person's bound fell back to 0
        if self.max_staleness or self.cfg.max_staleness or any(b.staleness for b in window):
            out["rl/staleness"] = sum(b.staleness for b in window) / len(window)
        trained = [b for b in window if b.totals]
        for key in TERMS:  # each step's weighted mean over its response tokens, then over the steps
            if trained and key in trained[0].totals:  # a term the objective has
                share = sum(float(b.totals[key]) / max(float(b.totals["weight"]), 1e-12) for b in trained)
                out[f"rl/{'clip_fraction' if key == 'clipped' else key}"] = share / len(trained)
        if trained:
            out["rl/ratio_max"] = max(float(b.totals["ratio_max"]) for b in trained)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The order's position, the draws made and the figures of the steps not logged yet;
        asynchronously, also the batches generated ahead (waited for first: their draws move the
        position)."""
        ahead = [batch_state(b) for b in self._queue.ahead()] if self._queue else []
        queued = {"ahead_ranks": self.gather(ahead)} if self.world > 1 else {"ahead": ahead}  # each rank's own
        queued["max_staleness"] = self.max_staleness if self._queue else 0  # ahead may hold fewer (a failure)
        logged = [asdict(_Logged.of(b)) for b in self._window]  # every rank's figures already (all_sum, settle)
        queued["difficulty"] = self.difficulty  # the problems drawn from (a curriculum's: an exact resume)
        # the ceiling found (each batch's `top`): without it a resumed run raised past it again, journaled as failed
        queued["top"] = self.top_difficulty
        return {**queued, "version": self.version, "draws": self.draws, "log_window": logged, **self.order.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken (at its difficulty: rl/curriculum.py)."""
        # older checkpoints: the configured difficulty; a file's task (0) on either side: the order names the change
        if self.difficulty and state.get("difficulty") and state["difficulty"] != self.difficulty:
            curriculum.set_difficulty(self, state["difficulty"])
        self.order.load_state_dict(state, "RL")
        self.seed, self.draws = state["seed"], state["draws"]
        self.top_difficulty = state.get("top", 0)  # older checkpoints: none found
        # the next log line averages the steps since the last one, as without the stop
        self._window = [_Logged(**w) for w in state.get("log_window", [])]
        self.version = state.get("version", 0)
        ranks = state.get("ahead_ranks")
        if ranks is not None and len(ranks) != self.world:
            raise DataError(
                f"the checkpoint's RL run generated batches ahead on {len(ranks)} ranks, this one has {self.world}: "
                "resume on as many ranks (each rank's rollouts are its own), or with rl.max_staleness=0 from a "
                "checkpoint of a synchronous run"
            )
        ahead = ranks[self.rank] if ranks is not None else state.get("ahead")
        if ahead:
            saved = state.get("max_staleness", len(ahead))  # older checkpoints: as many as it generated ahead
            if self.max_staleness != saved:
                raise DataError(
                    f"the checkpoint's RL run generated batches {saved} steps ahead (rl.max_staleness) "
                    f"but rl.max_staleness is now {self.max_staleness}; resume with the same setting"
                )
            self._queue = RolloutQueue(self.max_staleness)
            self._queue.restore([batch_from_state(b) for b in ahead])
