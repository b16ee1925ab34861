"""Fault injection: real failures, on purpose, through the real training loop.

    trimtab train ... --inject nan_loss@30 --inject oom@10:512        (or `faults:` in the config)

KIND@STEP[:PARAM][@rankR]; what fired is recorded in RUN_DIR/faults.json at once, so a transient
fault does not fire again after a rollback or a restart (the world, not the run, remembers it).
The record is a test instrument's bookkeeping and never ends the run: a write that fails (a full
disk) is said once and the whole record, kept in memory, is written again at the next firing.
A fault added to a resumed run at a step it has passed is said and not injected (its step ran
without it: firing it at the next step would test another step than the one asked for); one of
the PERSISTENT kinds is said and in force from the next step, as from any step after its own.
faults.json also keeps the run's faults ("specs": how a resume tells them from ones added since)
and those left out ("not_injected": spec -> the step the run resumed at).
The injector is a test instrument (training/instrument.py): it reads the run through its RunView
like any hook, and writes (weights, the expert bias, the training rows, the LR, the batch about to
run) only through the FaultHandle the Trainer hands it.
Under torchrun a fault fires on every rank, or with @rankR on rank R alone (faults.rankR.json
records it there), e.g. oom@10:512@rank1: one rank runs out of memory and all shrink together.
The kinds, what each does, and a spec's syntax (KINDS, each PARAM's default, the checks) are
orchestrator/fault_specs.py's.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trimtab.config import CHECKPOINTING
from trimtab.errors import ConfigError
from trimtab.orchestrator.fault_specs import Fault, late_faults, parse_faults
from trimtab.plan.memory import activation_bytes_per_token
from trimtab.resilience.elastic import leave_job, node_count, node_rank
from trimtab.rundir import read_json, write_json
from trimtab.training.instrument import FaultHandle, Instrument

if TYPE_CHECKING:
    from trimtab.data import StepBatch
    from trimtab.training.state import StepOutput
    from trimtab.training.view import RunView

SLOW_SECONDS = 0.25


def _on_node(fault: Fault) -> bool:
    """Whether this rank is on the node lose_node names (the last by default)."""
    return node_rank() == (node_count() - 1 if fault.param is None else int(fault.param))


class FaultInjector(Instrument):
    def __init__(self, specs: list[str], run_dir: Path):
        self.faults = parse_faults(specs)
        self.path = Path(run_dir) / "faults.json"
        self.record: dict[str, Any] = {"fired": {}, "poisoned": []}
        self.step = 0
        # faults firing in the current step's forward/backward, until it ends (an OOM retry of the
        # step calls on_step_start again: what was armed for the step fires on the retried rows)
        self._fire_nan: Fault | None = None
        self._fire_grad: Fault | None = None
        self._evaluation: Fault | None = None  # eval_error / eval_hang: the evaluation running is the fault's
        self._flip_grad = False  # grad_bitflip: one gradient element of this step's next backward
        # this step's backward reached _maybe_bad_grad (the gradients flow through the parameters:
        # not FSDP2's sharded ones)
        self._grad_hooked = False
        self._lr_factor: float | None = None  # lr_spike: still to apply in this step's first forward
        self._tokens = 0  # in the forward now running (oom compares it with its limit)
        self._forward_t0 = 0.0  # when the forward now running began (slow_rank)
        self.run: RunView | None = None
        self._save_failed = False  # a write of faults.json failed: said once, retried at each firing
        self._deferred: set[str] = set()  # grad_spike specs whose step had a zero gradient: said once each

    # ------------------------------------------------------------------ bookkeeping

    def on_train_start(self, run: RunView) -> None:
        if self.handle is None:
            raise RuntimeError("FaultInjector: no FaultHandle (the Trainer attaches one to each Instrument hook)")
        self.run = run
        rank, first = run.rank, self.path
        everyone = {f.spec for f in self.faults if f.rank is None}
        self.faults = [f for f in self.faults if f.rank is None or f.rank == rank]
        if rank:  # each rank remembers its own firings; rank 0 keeps the usual file
            self.path = self.path.with_name(f"faults.rank{rank}.json")
        if self.path.is_file():
            self.record = json.loads(self.path.read_text())
        elif rank and first.is_file():  # a rank new to the run (the world grew): what every rank met, it met
            record = json.loads(first.read_text())
            self.record = {**record, "fired": {k: v for k, v in record["fired"].items() if k in everyone}}
        self.faults = self._judge_late(run)
        self._corrupt(self.record["poisoned"])  # a resumed run's data is as bad as before
        model = self.handle.model
        off = activation_bytes_per_token(run.cfg, 2, "off")
        self._activation_share = {m: activation_bytes_per_token(run.cfg, 2, m) / off for m in CHECKPOINTING}
        # The OOM fires inside the first block's forward, where a real one would (activations),
        # after FSDP2 gathered the block: sized by the tokens the embedding just saw.
        model.tok_emb.register_forward_pre_hook(self._count_tokens)
        model.blocks[0].attn.register_forward_pre_hook(self._maybe_oom)
        self.handle.gate_rollouts(self._maybe_rollout_oom)
        model.tok_emb.register_forward_pre_hook(self._maybe_lr)
        model.tok_emb.register_forward_pre_hook(self._maybe_eval_fault)
        _loss_feed(model).register_forward_hook(self._maybe_nan_loss)
        model.tok_emb.register_forward_pre_hook(self._forward_starts)
        model.norm.register_forward_hook(self._maybe_slow_forward)
        for p in model.parameters():
            p.register_hook(self._maybe_bad_grad)
            if hasattr(p, "to_local"):  # FSDP2 fills a sharded parameter's .grad itself: no hook above fires
                p.register_post_accumulate_grad_hook(self._maybe_bad_shard)

    def check_run(self, model: torch.nn.Module, world: int, step: int, has_rows: bool, rl: bool) -> None:
        """The faults this run cannot take, refused (ConfigError) before the Trainer writes anything:
        api.train_or_raise calls it between setup and the Trainer, so a refused resume leaves its
        config.yaml and faults.json as they were (checked in on_train_start, the refused faults were
        already in both). `step`: the step the run resumes at (0: a fresh start); `has_rows`: the run
        trains on rows of tokens (not RL's prompts, DPO's pairs)."""
        # checked as a job starts: an elastic job resumed on fewer ranks has lost the ones that met theirs
        if not step and (outside := [f.spec for f in self.faults if f.rank is not None and f.rank >= world]):
            raise ConfigError(f"faults: {outside[0]} names a rank this job has not (ranks 0-{world - 1})")
        fired = (read_json(self.path) or {}).get("fired", {})  # a lost node's restart: its fault is spent
        unfired = [f for f in self.faults if f.kind == "lose_node" and not fired.get(f.spec)]
        if unfired and node_count() < 2:
            raise ConfigError(
                f"faults: {unfired[0].spec} needs a job of several nodes: torchrun --nnodes MIN:MAX "
                "(c10d rendezvous) with an agent per node"
            )
        layers = [i for i, _ in model.moe_layers()]
        moe_faults = [f for f in self.faults if f.kind in ("expert_collapse", "dead_expert")]
        if moe_faults and not layers:
            raise ConfigError(
                f"faults: {moe_faults[0].kind} needs a Mixture-of-Experts model (e.g. --preset debug-moe)"
            )
        elsewhere = [f for f in moe_faults if f.kind == "dead_expert" and f.param is not None and f.param not in layers]
        if elsewhere:
            raise ConfigError(f"faults: {elsewhere[0].spec} names no MoE layer (MoE layers: {layers})")
        corrupting = [f.spec for f in self.faults if f.kind in ("bad_batch", "bad_rows")]
        if corrupting and not has_rows:
            raise ConfigError(
                f"faults: {corrupting[0]} turns training rows of tokens to garbage; an RL or DPO run has none "
                "(its data are prompts or preference pairs): inject it into pretraining or finetuning"
            )
        generating = [f.spec for f in self.faults if f.kind == "rollout_oom"]
        if generating and not rl:  # its gate is never called: the fault would not fire, unsaid
            raise ConfigError(
                f"faults: {generating[0]} fails RL's generation of rollouts, and this run generates none (not "
                "`trimtab rl`); inject it into an RL run, or oom@STEP[:TOKENS] to fail a training step"
            )

    def _judge_late(self, run: RunView) -> list[Fault]:
        """The faults this session injects: those a resumed run added at a step it has passed are
        said (by the rank that holds them; rank 0 for every rank's) and, but for the PERSISTENT
        kinds, left out. Those kept are recorded, so a later resume knows them as the run's own."""
        kept, lines = late_faults(self.faults, self.record, run.step)
        for fault, line in lines:
            if fault.rank is not None or run.rank == 0:
                run.say(line)
            if fault not in kept:
                self.record.setdefault("not_injected", {})[fault.spec] = run.step
        self.record["specs"] = sorted(set(self.record.get("specs", [])) | {f.spec for f in kept})
        self._save()
        return kept

    def _due(self, fault: Fault) -> bool:
        """Whether `fault` fires at the current step; counts the firing."""
        fired = self.record["fired"].get(fault.spec, 0)
        if self.step < fault.step or fired >= fault.count:
            return False
        self.record["fired"][fault.spec] = fired + 1
        self._save()
        return True

    def _active(self, kind: str) -> Fault | None:
        """The persistent fault of this kind in force at the current step: the latest to start."""
        started = [f for f in self.faults if f.kind == kind and self.step >= f.step]
        return max(started, key=lambda f: f.step, default=None)

    def _first_due(self, kind: str) -> Fault | None:
        """A fault of this kind due now (each spec fires its own count), its firing counted."""
        return next((f for f in self.faults if f.kind == kind and self._due(f)), None)

    def _save(self) -> None:
        """The whole record into faults.json (atomic: a failed write leaves the file as it was)."""
        try:
            write_json(self.path, self.record, indent=None)
        except OSError as exc:
            if not self._save_failed and self.run is not None:
                self.run.say(
                    f"faults: could not write {self.path} ({exc}); training goes on and the record is written "
                    "again at the next firing (until then a restart may fire these faults again): free space on "
                    "the run directory's disk"
                )
            self._save_failed = True

    # ------------------------------------------------------------------ injection points

    def on_step_start(self, run: RunView, batch: StepBatch) -> None:
        self.step = run.step + 1  # the step about to run
        self._grad_hooked = False
        lr = self._active("lr_spike")
        self._lr_factor = lr.param if lr else None
        for fault in self.faults:
            if fault.kind in ("nan_loss", "inf_grad", "grad_spike") and self._due(fault):
                setattr(self, "_fire_nan" if fault.kind == "nan_loss" else "_fire_grad", fault)
            elif fault.kind in ("bad_batch", "bad_rows") and self._due(fault):
                rows = batch.rows if fault.kind == "bad_batch" else [r for r in batch.rows if r % 4 == 0]
                self.record["poisoned"] = sorted(set(self.record["poisoned"]) | set(rows))
                self._save()
                self._corrupt(rows)
            elif fault.kind == "grad_bitflip" and self._due(fault):
                self._flip_grad = True
            elif fault.kind == "bitflip" and self._due(fault):
                with torch.no_grad():  # a low mantissa bit of the first element: ~1e-4 relative, finite
                    first = next(_block_matrices(self.handle)).view(-1)[:1]
                    bits, bit = (torch.int32, 12) if first.element_size() == 4 else (torch.int16, 3)
                    first.view(bits).bitwise_xor_(1 << bit)
            elif fault.kind == "weights_nan" and self._due(fault):
                with torch.no_grad():
                    next(_block_matrices(self.handle))[:1].fill_(float("nan"))
            elif fault.kind == "weights_noise" and self._due(fault):
                self._add_noise(fault.param)
            elif fault.kind == "expert_collapse" and self._due(fault):
                for _, moe in self.handle.model.moe_layers():
                    moe.expert_bias[0] += fault.param
            elif fault.kind == "dead_expert" and self._due(fault):
                _starve(dict(self.handle.model.moe_layers()), fault)
            elif fault.kind == "slow" and self._due(fault):
                time.sleep(SLOW_SECONDS)
            elif fault.kind in ("sigterm", "sigkill", "kill_rank") and self._due(fault):
                os.kill(os.getpid(), signal.SIGTERM if fault.kind == "sigterm" else signal.SIGKILL)
            elif fault.kind == "lose_node" and self._due(fault) and _on_node(fault):
                leave_job()
            elif fault.kind == "hang_rank" and self._due(fault):
                while True:  # stopped for good: only the watchdog (or a person) ends it
                    time.sleep(3600)
        if self.record["poisoned"]:  # this step's micro-batches were cut before the rows went bad
            self.handle.reload_rows(batch, set(self.record["poisoned"]))

    def on_step_end(self, run: RunView, out: StepOutput) -> None:
        fault = self._fire_grad
        if fault is not None and fault.kind == "grad_spike" and not float(out.grad_norm):
            self._defer(run, fault)
        self._fire_nan = self._fire_grad = None  # the step ran: its faults are spent

    def _defer(self, run: RunView, fault: Fault) -> None:
        """grad_spike at a step whose gradient was zero (the pre-clip global norm: an RL step whose groups were all
        flat has no advantage) multiplied nothing: its firing is taken back, so it fires at the next step with a
        gradient, as grad_bitflip waits for an element to flip. It was recorded as fired and the run read healthy,
        so a run "tested" for the heal had met no fault."""
        self.record["fired"][fault.spec] -= 1
        self._save()
        if fault.spec not in self._deferred:
            self._deferred.add(fault.spec)
            run.say(
                f"faults: {fault.spec}: step {self.step}'s gradient was zero (in RL: every group flat), nothing to "
                "multiply; it fires at the next step with a gradient"
            )

    def _add_noise(self, scale: float) -> None:
        generator = torch.Generator().manual_seed(self.step)  # the same noise on every rank
        with torch.no_grad():
            for local in _block_matrices(self.handle):
                noise = torch.randn(local.shape, generator=generator).to(local.device, local.dtype)
                local.add_(noise * scale * local.float().std().to(local.dtype))

    def _corrupt(self, rows: list[int]) -> None:
        """The rows' tokens become garbage in the dataset itself (reproducibly per row), as bad data
        on disk would be: every later read sees it, the orchestrator's row scoring included."""
        data, vocab = self.handle.train_rows, self.handle.model.cfg.vocab_size
        for row in rows:
            data.replace(row, np.random.default_rng(row).integers(0, vocab, data.length(row) + 1))

    def _count_tokens(self, module: torch.nn.Module, args: tuple) -> None:
        self._tokens = args[0].numel()  # of the forward now running

    def _maybe_oom(self, module: torch.nn.Module, args: tuple) -> None:
        fault = self._active("oom")
        if fault is None or not module.training:
            return
        # what the forward's activations weigh, in tokens' worth without checkpointing (plan/memory.py)
        mode = self.handle.model.checkpointing
        tokens = self._tokens * self._activation_share[mode]
        limit = fault.param
        if limit is None:  # the size in use when the fault starts no longer fits, whatever it was
            limits = self.record.setdefault("oom_limit", {})
            if fault.spec not in limits:
                limits[fault.spec] = tokens - 1
                self._save()
            limit = limits[fault.spec]
        if tokens > limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected by {fault.spec}): a forward over {self._tokens} tokens "
                f"(activation checkpointing {mode}: {tokens:.0f} tokens' worth without it), more than {limit:.0f} fit"
            )

    def _maybe_rollout_oom(self, rows: int, version: int, evaluating: bool) -> None:
        """rollout_oom: a pass of RL's generation (outside evaluations) over more rows than fit,
        before it starts (the trainer's gate: asynchronous rollouts too, in their thread); the
        step is the one after the policy's `version` (rollouts are generated before their step).
        The generation's own version and kind, not the trainer's step and state now: a rollout
        thread reading those fired at step 8 in one run and 9 in its twin (max_staleness 2)."""
        started = [f for f in self.faults if f.kind == "rollout_oom" and version + 1 >= f.step]
        if not started or evaluating:
            return
        fault = max(started, key=lambda f: f.step)
        limits = self.record.setdefault("rollout_oom_limit", {})
        if fault.param is None and fault.spec not in limits:
            limits[fault.spec] = rows - 1
            self._save()
        limit = fault.param if fault.param is not None else limits[fault.spec]
        if rows > limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected by {fault.spec}): generating {rows} rows at once, "
                f"more than {int(limit)} fit"
            )

    def _maybe_eval_fault(self, module: torch.nn.Module, args: tuple) -> None:
        """eval_error / eval_hang, inside the trainer's evaluations only (not the orchestrator's
        probes): every forward of the first `count` evaluations at or after the fault's step. An
        evaluation at a step one already failed at (a rollback's replay, a resume) is another
        evaluation: the fault does not fire again (keyed by step, it failed every replay of it)."""
        if not self.run.evaluating:
            self._evaluation = None  # a training forward or a probe: the evaluation before is over
            return
        if self._evaluation is None:
            self._evaluation = self._evaluation_due(self.run.step)
        if self._evaluation is None:
            return
        if self._evaluation.kind == "eval_error":
            raise RuntimeError(f"injected by {self._evaluation.spec}: a record the model cannot take")
        time.sleep(self._evaluation.param)

    def on_eval_error(self, run: RunView, step: int, error: str) -> None:
        """The evaluation is over: the trainer's try again (the run's final one) is another
        evaluation, which the fault, keyed by step, has already failed."""
        self._evaluation = None

    def _evaluation_due(self, step: int) -> Fault | None:
        """The evaluation fault due for an evaluation beginning at `step`, its firing recorded."""
        at = self.record.setdefault("evaluations", {})
        for fault in self.faults:
            if fault.kind not in ("eval_error", "eval_hang") or step < fault.step:
                continue
            fired = at.setdefault(fault.spec, [])
            if step not in fired and len(fired) < fault.count:
                fired.append(step)
                self._save()
                return fault
        return None

    def _maybe_lr(self, module: torch.nn.Module, args: tuple) -> None:
        """lr_spike: the trainer set this step's LR before the forward; multiply it once."""
        if self._lr_factor is not None and module.training:
            self.handle.scale_optimizer_lr(self._lr_factor)
            self._lr_factor = None

    def _forward_starts(self, module: torch.nn.Module, args: tuple) -> None:
        self._forward_t0 = time.perf_counter()

    def _maybe_slow_forward(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        """slow_rank: this forward took factor x as long (a throttled device)."""
        fault = self._active("slow_rank")
        if fault is not None and module.training:
            time.sleep((fault.param - 1) * (time.perf_counter() - self._forward_t0))

    def _maybe_nan_loss(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if self._fire_nan is not None and module.training:
            return output * float("nan")
        return output

    def _maybe_bad_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self._grad_hooked = True
        if not self._flip_grad and self._fire_grad is None:
            return grad
        grad = grad.clone()  # an autograd hook returns the gradient to use: never write into autograd's
        self._spoil(grad)
        return grad

    def _maybe_bad_shard(self, param: torch.Tensor) -> None:
        """grad_bitflip, inf_grad and grad_spike under FSDP2, whose sharded parameters' gradients
        its reduce-scatter fills (no hook on the parameter fires): in this rank's shard, as
        accumulated (what this rank's clip and the orchestrator's gate read). A DTensor parameter
        whose gradient flowed through it (tensor parallelism alone) was hit by _maybe_bad_grad."""
        if param.grad is not None and not self._grad_hooked:
            self._spoil(param.grad.to_local())  # each reduce-scatter's (a micro-batch's, a re-run's)

    def _spoil(self, grad: torch.Tensor) -> None:
        """This step's gradient fault, in place: one bit flipped (once: the step's re-run computes
        it clean), every element x grad_spike's factor, or one element +inf."""
        if self._flip_grad:
            self._flip_grad = not _flip_top_exponent(grad.to_local() if hasattr(grad, "to_local") else grad)
            return
        fault = self._fire_grad
        if fault is None or not grad.numel():
            return
        with torch.no_grad():
            if fault.kind == "grad_spike":
                grad.mul_(fault.param)
            else:
                grad.view(-1)[0] = float("inf")

    def on_save_start(self, run: RunView) -> None:
        self.step = run.step
        fault = self._first_due("disk_full")
        if fault is not None:
            raise OSError(errno.ENOSPC, f"No space left on device (injected by {fault.spec})")
        if self._first_due("kill_in_save") is not None:
            self.handle.before_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))

    def on_checkpoint(self, run: RunView, path: Path) -> None:
        self.step = run.step
        fault = self._first_due("corrupt_checkpoint")
        if fault is not None:
            shards = sorted((path / "dcp").glob(f"__{run.rank}_*.distcp"))  # sharded: this rank's file
            target = path / "model.safetensors" if not shards else shards[0]
            if not target.is_file():
                return
            with open(target, "r+b") as fh:
                fh.truncate(target.stat().st_size // 2)


@torch.no_grad()
def _starve(layers: dict[int, torch.nn.Module], fault: Fault) -> None:
    """dead_expert: layer `fault.param`'s (default the first MoE layer's) last expert never selected."""
    moe = layers[min(layers) if fault.param is None else int(fault.param)]
    bias = moe.expert_bias
    bias[-1] = bias[:-1].min() - 1.0


def _loss_feed(model: torch.nn.Module) -> torch.nn.Module:
    """The module of this rank whose output nan_loss poisons: the final norm, which the loss reads;
    under pipeline parallelism a rank without the last stage has it hollowed (no parameters here)
    and never runs it, so its own last block, whose output flows on to the loss."""
    if next(model.norm.parameters(), None) is not None:
        return model.norm
    return [block for block in model.blocks if next(block.parameters(), None) is not None][-1]


def _flip_top_exponent(local: torch.Tensor) -> bool:
    """Flip the top exponent bit of `local`'s largest element in place (a gradient's, far below 1:
    x 2^128, finite, and the gradient norm overflows); False where it holds none (an empty shard)."""
    if not local.numel():
        return False
    at = int(local.abs().argmax())
    bits = local.view(-1)[at : at + 1].view(torch.int32 if local.element_size() == 4 else torch.int16)
    bits.bitwise_xor_(1 << (30 if local.element_size() == 4 else 14))
    return True


def _block_matrices(handle: FaultHandle) -> Iterator[torch.Tensor]:
    """The transformer blocks' weight matrices, each as this rank's local tensor (FSDP: its rows)."""
    for name, p in handle.model.named_parameters():
        if name.startswith("blocks.") and p.ndim == 2:
            yield p.to_local() if hasattr(p, "to_local") else p
