"""RunView: what a hook sees of a running job, read only.

Hooks (the orchestrator, the live planner, fault injection, a user's own) receive this view, never
the Trainer: figures read from the run (numbers, copies), reads of the model that write nothing
(row_losses, probe_loss, moe_knobs, ...), and `control` (training/control.py Requests), the one way
to change anything: every intervention goes through the action table and the loop applies it at
its points. The view hands out no model, optimizer or training rows, and refuses attribute
writes. Fault injection, which must write to make faults, has its own handle
(training/instrument.py FaultHandle).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from trimtab.checkpoint import find_checkpoint
from trimtab.config import RunConfig
from trimtab.data.batches import micro_batches, padding
from trimtab.data.position import data_position
from trimtab.data.quality import Flagged
from trimtab.data.repeats import REPEATED, row_repeat_share
from trimtab.distributed.group import all_max, highest_scores
from trimtab.hardware import is_oom
from trimtab.training import scoring
from trimtab.training.control import Control, Requests
from trimtab.training.evaluation import error_line, held_out
from trimtab.training.optim import state_tensors
from trimtab.training.schedule import phase_lr

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer

T = TypeVar("T")


class RunView:
    __slots__ = ("_t", "_told", "control")

    def __init__(self, trainer: Trainer, control: Control):
        object.__setattr__(self, "_t", trainer)
        object.__setattr__(self, "control", Requests(control))  # request() only: the loop applies
        object.__setattr__(self, "_told", set())  # the reads whose out-of-memory skip the console was told of

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"the run view is read-only (setting {name!r}): change the run with run.control.request(action, ...)"
        )

    # ------------------------------------------------------------------ the run

    @property
    def cfg(self) -> RunConfig:
        """The resolved config, read-only (setting a field raises; changes go through control)."""
        return self._t.cfg

    @property
    def run_dir(self) -> Path:
        return self._t.cfg.run_dir

    @property
    def device(self) -> torch.device:
        return self._t.device

    @property
    def rank(self) -> int:
        return self._t.dist.rank

    @property
    def world(self) -> int:
        return self._t.dist.world

    @property
    def replicated(self) -> bool:
        """Under torchrun, every rank holds the whole model (DDP: no FSDP, tensor, expert or pipeline split)."""
        return self._t.dist.world > 1 and not self._t.dist.sharded

    def weight_checksum(self) -> int:
        """An exact checksum of this rank's weights: their bits as integers, summed (order-free, so
        replicas that hold the same weights agree bit for bit; one flipped bit changes it)."""
        sums = []
        for p in self._t.model.parameters():
            local = (p.to_local() if hasattr(p, "to_local") else p).detach().contiguous()
            bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[local.element_size()]
            sums.append(local.view(bits).sum(dtype=torch.int64))
        return int(torch.stack(sums).sum()) if sums else 0

    @property
    def work_s(self) -> float:
        """Seconds of this rank's own work, its steps' starts to their agreement points (0 alone:
        distributed/work_clock.py)."""
        return self._t.dist.work.seconds

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints and writes files (every rank decides alike: the metrics are reduced)."""
        return self._t.dist.is_main

    @property
    def evaluating(self) -> bool:
        """Inside the trainer's evaluation (its forwards are the held-out loss's)."""
        return self._t.evaluating

    @property
    def step(self) -> int:
        """Optimizer steps done (a rollback moves it back)."""
        return self._t.state.step

    @property
    def data_position(self) -> str:
        """Where the next batch's rows come from, in words (data/position.py); "" for a loader without one."""
        state = getattr(self._t.loader, "state_dict", dict)()
        return data_position(state) if isinstance(state, dict) else ""

    @property
    def mod_layer_capacities(self) -> list[float] | None:
        """Each Mixture-of-Depths layer's capacity now, in layer order, as a step's metrics give them (None: no
        MoD, or pipeline stages: each holds other layers, and every rank must gate alike)."""
        routers = [router.capacity for _, router in self._t.model.mod_layers()] if self._t.dist.pipeline is None else []
        return routers or None

    @property
    def tokens(self) -> int:
        return self._t.state.tokens

    @property
    def total_steps(self) -> int:
        return self._t.total_steps

    @property
    def progress(self) -> float:
        return self._t.state.step / max(self._t.total_steps, 1)

    @property
    def phase(self) -> int:
        return self._t.state.phase

    @property
    def train_state(self) -> dict[str, Any]:
        """A copy of the checkpointed training state (step, tokens, knobs, schedule)."""
        return copy.deepcopy(vars(self._t.state))

    @property
    def stopping(self) -> bool:
        """A stop was asked for (by a signal, a person or the orchestrator): the loop ends after this step."""
        return bool(self._t.stop_reason)

    @property
    def config_changes(self) -> list[dict[str, Any]]:
        """Phase lengths a person changed when resuming (training/schedule.py reconcile); a copy."""
        return copy.deepcopy(self._t.config_changes)

    def say(self, line: str) -> None:
        """One line on the console, above the progress bar."""
        self._t.say(line)

    def decided(self, decision: dict[str, Any]) -> None:
        """Tell every hook of a decision just journaled (Hook.on_decision); the orchestrator's
        journal calls this, so trackers follow decisions without reading decisions.jsonl."""
        self._t._call("on_decision", decision)

    def propose(self, finding: Any) -> None:
        """Hand the orchestrator a finding of another hook's (the live planner's run length): the
        loop delivers it to every hook's on_finding after this step's hooks, before it applies
        Control, so no hook calls another."""
        self._t.findings.append(finding)

    # ------------------------------------------------------------------ reads of the model (no writes)

    def moe_top_k(self) -> dict[int, int]:
        """Each MoE layer's experts per token: layer index -> top_k."""
        return {i: layer.top_k for i, layer in self._t.model.moe_layers()}

    def moe_knobs(self, layer: int) -> dict[str, float]:
        """A MoE layer's live settings: n_experts, top_k, capacity_factor, router_temperature, balance_coef;
        and bias_lead, how far the highest selection bias (expert_bias) stands over the next highest."""
        moe = dict(self._t.model.moe_layers())[layer]
        keys = ("n_experts", "top_k", "capacity_factor", "router_temperature", "balance_coef")
        top = moe.expert_bias.float().topk(2).values.tolist() if moe.n_experts > 1 else [0.0, 0.0]
        return {**{k: getattr(moe, k) for k in keys}, "bias_lead": top[0] - top[1]}

    def mod_capacities(self) -> dict[int, tuple[float, float]]:
        """Each Mixture-of-Depths layer's (current capacity, target): they differ during warm-up."""
        return {i: (r.capacity, r.target) for i, r in self._t.model.mod_layers()}

    def row_losses(self, rows: list[int]) -> dict[int, float]:
        """Each of these training rows' mean loss per target on the current weights (data
        attribution: which rows of a bad stretch are bad). {} in an RL or DPO phase: its rows
        are prompts and preference pairs, with no loss of their own that would single out bad
        data (a policy objective is scaled by advantages, a pair's by its margin). Under data
        parallelism each rank scores the rows it trained (data/batches.py Owners) on its own copy
        of them, in as many forwards as every other rank; all learn every score."""
        t = self._t
        phase = t.phases[t.state.phase]
        if phase.train_rows is None or not rows:
            return {}
        rank, world, pad = t.dist.dp_rank, t.dist.dp_world, t.tok.pad_id
        shares = t.loader.trained_by.split(phase.train_rows, list(rows), t.data_shard[0] - rank, world)
        mine = micro_batches(phase.train_rows, shares[rank], t.loader.micro_batch_tokens, pad)
        # the same count on every rank, even were their maps of who trained what to differ
        rounds = int(max(all_max([float(len(mine))])))
        forwards = mine + [padding(phase.train_rows, rows[0], pad)] * (rounds - len(mine))
        scored = self._unless_oom(
            "scoring training rows",
            lambda: scoring.row_losses(t.model, t.forward, t.precision, forwards, t.device),
            None,
        )
        if scored is None:  # out of memory on some rank: on every rank
            return {}
        order = [r for share in shares for r in share]
        at = {r: i for i, r in enumerate(order)}
        values = [-math.inf] * len(order)  # not this rank's: the highest over the ranks is its owner's
        for r, loss in zip((r for m in mine for r in m.rows), scored):
            values[at[r]] = loss
        # each row's score the same on every rank (NaN as inf); a row no rank scored is left out
        return {r: v for r, v in zip(order, highest_scores(values)) if v > -math.inf}

    def held_out_row_losses(self, limit: int = 64, part: str | None = None) -> list[float]:
        """Up to `limit` held-out rows' mean losses, scored as row_losses scores: the reference, a
        sample spread over the whole held-out split (HeldOut.reference), not val_loss's first rows.
        `part`: that mixture source's held-out rows alone (row_parts' names); [] when its eval split
        holds no row (a small source's)."""
        t = self._t
        rows = held_out(t)
        micro = rows.reference(limit, part) if rows is not None else []
        scored = self._unless_oom(
            "scoring held-out rows", lambda: scoring.row_losses(t.model, t.forward, t.precision, micro, t.device), []
        )
        return highest_scores(scored[:limit])  # the same reference on every rank, as row_losses

    def row_sources(self, rows: list[int]) -> dict[str, int]:
        """Where these training rows came from: source -> number of rows."""
        return scoring.sources_of(self._t.phases[self._t.state.phase].train_rows, list(rows))

    def row_repeats(self, rows: list[int]) -> dict[int, float]:
        """Those of these training rows that are a handful of tokens repeated, each with its share of
        targets in its few commonest tokens (data/repeats.py row_repeat_share, REPEATED or more: a run
        of one character, a table of zeros), read from the host's rows; {} in an RL or DPO phase."""
        train = self._t.phases[self._t.state.phase].train_rows
        if train is None:
            return {}
        shares = {}
        for r in rows:
            tokens, mask = train.get(r)
            shares[r] = row_repeat_share(tokens[1:][mask[1:].astype(bool)])  # its targets, as collate builds them
        return {r: share for r, share in shares.items() if share >= REPEATED}

    def row_parts(self, rows: list[int]) -> dict[int, str] | None:
        """Each training row's mixture source, by its name (data.mix[i].name: the loader numbers a
        mixture's rows source after source); None with one source, and in an RL or DPO phase."""
        loader = self._t.loader
        names, base = getattr(loader, "names", []), getattr(loader, "base", None)
        if len(names) < 2 or base is None:
            return None
        return {r: names[int(base.searchsorted(r, side="right")) - 1] for r in rows}

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: uniform guesses over it score ln(vocab_size) nats a token."""
        return self._t.cfg.model.vocab_size

    def context_free_loss(self) -> float | None:
        """This phase's training targets' unigram entropy in nats, the loss of a model blind to
        context, where the data rewards context (training/setup.py Phase.context_free_loss), from a
        sample of its rows, read once; None where it does not, and in an RL or DPO phase."""
        return getattr(self._t.phases[self._t.state.phase], "context_free_loss", None)

    def garbage_rows(self) -> list[Flagged]:
        """The documents the data screen flagged and kept in this phase's training data
        (data.garbage_filter=warn), per source, with the training rows at least half theirs
        (data/quality.py Flagged); [] for none, and in an RL or DPO phase. Copies."""
        phase = self._t.phases[self._t.state.phase]
        return copy.deepcopy(getattr(phase, "flagged", []))

    def weights_finite(self) -> bool:
        """Whether every weight, floating buffer and optimizer moment is finite (optim.state_tensors, as a
        save checks), on every rank (one fused host read and, with more than one rank, one all-reduce: every
        rank must ask, as for probe_loss). No forward: cheap enough for every non-finite step."""
        t = self._t
        return t.dist.all_finite([x for part in state_tensors(t.model, t.optimizer).values() for x in part])

    def probe_loss(self) -> float | None:
        """The model's loss on one held-out micro-batch, now (a host read): tells a broken model
        from bad training data. NaN whenever a weight or a moment is not finite, which a loss need not show
        (torch's CPU flash-attention kernel gives a query with a NaN weight a zero output, not NaN:
        a NaN row in the first query projection left the loss finite); else None without held-out
        data (RL and DPO: their objectives move a held-out text's loss, so none is compared), or
        when scoring it ran out of memory (on any rank: the ranks agree before they average)."""
        t = self._t
        if not self.weights_finite():
            return math.nan
        rows = held_out(t)
        if rows is None or not rows.probe:
            return None
        # the same rows at any budget (HeldOut.probe): the baseline a good checkpoint measured
        # stays comparable after an out-of-memory heal splits them smaller
        micro = rows.probe

        def summed() -> torch.Tensor:
            t.model.eval()
            return torch.stack([t.score(m).float() for m in micro]).sum()

        # this rank's sum alone inside the guard: averaging is a collective that a rank which ran
        # out of memory never reaches, so the others would wait in it for the watchdog
        local = self._unless_oom("scoring the held-out probe", summed, None)
        return None if local is None else t.dist.mean_over_ranks(local).item() / max(sum(m.n_targets for m in micro), 1)

    def _unless_oom(self, what: str, read: Callable[[], T], empty: T) -> T:
        """read(), or `empty` when it ran out of memory on any rank (they agree, so all decide
        alike): the orchestrator's looking must never end the run, and no probe or no scores is
        what its callers already take as nothing to compare. Said on the console once per read.
        The run is left exactly as it was (scoring.untouched): a read must not change training."""
        t, error, value = self._t, "", empty
        try:
            # FSDP2: this rank's failure joins the others' all-gathers
            with t.dist.completing_forward(), scoring.untouched(t.model, t.device):
                value = read()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_oom(exc):
                raise
            error = error_line(exc)
        # the failed read's tensors are freed with its traceback above; the cache returns them to the device
        if not (error := t.dist.first_error(error)):
            return value
        if t.device.type == "cuda":
            torch.cuda.empty_cache()
        if what not in self._told:
            self._told.add(what)
            t.say(
                f"out of memory {what} at step {t.state.step} ({error}): skipped, the run goes on "
                "(said once; if it recurs, lower train.eval_tokens or train.micro_batch_tokens)"
            )
        return empty

    # ------------------------------------------------------------------ knobs

    @property
    def lr_scale(self) -> float:
        return self._t.state.lr_scale

    @property
    def scheduled_lr(self) -> float:
        """The configured schedule's LR for the step running (or, between steps, the next), before
        the multiplier: what the config and the journal explain."""
        return self._t.scheduled_lr()

    @property
    def set_lr_level(self) -> float:
        """The configured LR a person's `ctl set-lr` replaces: the step's, in a warm-up its top (schedule.py)."""
        return self._t.set_lr_level()

    @property
    def applied_lr(self) -> float:
        """The LR the optimizer holds now: what the update applies."""
        return self._t.optimizer.param_groups[0]["lr"]

    def pretrain_lr_if(self, steps: int) -> float:
        """The next step's schedule LR if pretraining were `steps` long (a length change's jump)."""
        phase = copy.copy(self._t.phases[0])
        phase.steps = steps  # through phase_lr: its re-warm segments too (an ended pretraining extended)
        return phase_lr(phase, 0, self._t.state.step, self._t.state.restarts, self._t.state.warm_behind)

    @property
    def grad_clip(self) -> float:
        return self._t.control.grad_clip()

    @property
    def weight_decay(self) -> float:
        """The decayed parameter group's weight decay, as the optimizer holds it."""
        return self._t.optimizer.param_groups[0]["weight_decay"]

    @property
    def checkpoint_every(self) -> int:
        """Steps between checkpoints now (the knob a decision set, else checkpoint.every)."""
        return self._t.control.checkpoint_every()

    @property
    def micro_batch_tokens(self) -> int:
        return self._t.loader.micro_batch_tokens

    @property
    def activation_checkpointing(self) -> str:
        """off | selective | full: what each block keeps for its backward now."""
        return self._t.model.checkpointing

    @property
    def rl_temperature(self) -> float:
        """RL's sampling temperature now (the knob a decision set, else rl.temperature)."""
        return self._t.rl_temperature

    @property
    def rl_difficulty(self) -> int:
        """The built-in RL task's digits now: a raise's (kept across a rollback, rl_control.py), else the loader's
        (0: a prompt file's task, or no RL phase)."""
        return self._t.state.rl_difficulty or getattr(self._t.loader, "difficulty", 0)

    @property
    def rl_max_staleness(self) -> int:
        """Optimizer steps RL's rollouts may be behind now (a decision's, else rl.max_staleness)."""
        return getattr(self._t.loader, "max_staleness", self._t.cfg.rl.max_staleness)

    @property
    def rl_generation_rows(self) -> int:
        """Rows RL generates at a time now: a decision's, else a whole step's (under data
        parallelism, this rank's share of its prompts: the first halving halves what it holds)."""
        loader = self._t.loader
        rl = self._t.cfg.rl
        share = -(-rl.prompts_per_step // getattr(loader, "world", 1))
        return getattr(loader, "generation_rows", 0) or share * rl.group_size

    @property
    def rl_entropy_coef(self) -> float:
        """RL's entropy bonus now (the knob a decision set, else rl.entropy_coef)."""
        return self._t.rl_entropy_coef

    @property
    def rl_overlong(self) -> tuple[bool, int]:
        """RL's overlong filter and penalty buffer now (a decision's, else the rl section's)."""
        rl = self._t.cfg.rl
        loader = self._t.loader
        return getattr(loader, "overlong_filter", rl.overlong_filter), getattr(
            loader, "overlong_buffer", rl.overlong_buffer
        )

    @property
    def rl_max_new_tokens(self) -> int:
        return self._t.cfg.rl.max_new_tokens

    @property
    def rl_dynamic_sampling(self) -> bool:
        """Whether RL drops flat groups and draws more now (a decision's, else rl.dynamic_sampling)."""
        return bool(getattr(self._t.loader, "dynamic_sampling", self._t.cfg.rl.dynamic_sampling))

    @property
    def rl_verifier_timeout(self) -> float:
        """Seconds an RL verification may take now (the knob a decision set, else rl.verifier_timeout_s)."""
        loader = self._t.loader
        return getattr(loader, "verifier_timeout_s", self._t.cfg.rl.verifier_timeout_s)

    @property
    def configured_micro_batch_tokens(self) -> int:
        """The budget the config starts with (train.micro_batch_tokens, or the whole step when auto)."""
        return self._t.cfg.train.micro_budget

    @property
    def batch_tokens(self) -> int:
        return self._t.loader.batch_tokens

    @property
    def min_micro_batch_tokens(self) -> int:
        """One full row: a smaller budget cannot split a step any further."""
        return self._t.phases[self._t.state.phase].data.seq_len

    @property
    def rollbacks(self) -> int:
        return self._t.state.rollbacks

    # ------------------------------------------------------------------ checkpoints and data

    @property
    def save_seconds(self) -> float:
        """How long the newest save stalled training (this rank's), read in on_checkpoint."""
        return self._t.save_seconds

    @property
    def last_good(self) -> int:
        """Step of the newest checkpoint this session marked good (-1: none yet)."""
        return self._t.last_good

    @property
    def last_saved(self) -> int:
        """Step of the newest checkpoint this session wrote or resumed from (-1: none yet)."""
        return self._t.last_saved

    @property
    def has_good_checkpoint(self) -> bool:
        """Whether a verified checkpoint marked good exists (reads the files: ask only when needed)."""
        return find_checkpoint(self._t.cfg.run_dir, "last_good") is not None

    def has_checkpoint(self, step: int) -> bool:
        """Whether a valid checkpoint at or before `step` exists (reads the files: ask only when needed)."""
        return find_checkpoint(self._t.cfg.run_dir, max(0, step)) is not None

    @property
    def pretrain(self) -> dict[str, Any]:
        """The pretraining phase's length, configured length, warm-up and unique training tokens
        (the live planner's inputs)."""
        phase = self._t.phases[0]
        return {
            "steps": phase.steps,
            "configured_steps": self._t.cfg.train.max_steps,
            "warmup_steps": phase.optim.warmup_steps,
            "dataset_tokens": phase.train_rows.n_tokens if phase.train_rows is not None else 0,  # RL: prompts
        }
