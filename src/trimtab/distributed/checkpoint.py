"""Checkpoints under torchrun: every rank writes its shards with torch.distributed.checkpoint
(DCP) into one temp directory, rank 0 commits; reading reshards to this run's world size and
mesh (docs/distributed.md, "Checkpoints")."""

from __future__ import annotations

import errno
import shutil
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trimtab.checkpoint import SHARDED, checkpoint_root, commit_checkpoint, digest_files, save_checkpoint
from trimtab.checkpoint_load import apply_structure, load_checkpoint, load_weights, read_sharded_weights, weight_names
from trimtab.distributed.group import active, attempt, cpu_group
from trimtab.errors import CheckpointError
from trimtab.model.upgrade import is_legacy, upgrade_optimizer, upgrade_weights
from trimtab.write_errors import write_error, writing


class BackgroundWrite:
    """fn(*args) in a daemon thread (a process that ends, or is killed, leaves at most an
    uncommitted temp directory, never a step_* one); result() joins it and raises its error."""

    def __init__(self, step: int, fn: Callable[..., Path], args: tuple[Any, ...]) -> None:
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Path], args: tuple[Any, ...]) -> None:
        try:
            with writing(checkpoint_root(args[0])):
                self._path = fn(*args)
        except BaseException as exc:  # raised in the training thread, at result()
            self._error = exc

    @property
    def done(self) -> bool:
        """Whether the write has ended (committed or failed), so waiting for it waits on no collective."""
        return not self._thread.is_alive()

    def result(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._path


GATE, GATES = "row_gate", "row_gate_by_rank"  # state.json's keys: the row gate's reference (training/row_gate.py)


def with_gates(state: dict[str, Any], gates: list[Any]) -> dict[str, Any]:
    """rank 0's state.json with every rank's row gate reference: each rank's is its own rows'
    (data-parallel ranks read different rows), and a resume that gave every rank rank 0's gated other
    rows than the run never stopped (bad rows on one rank: one of two garbage rows gated, then apart)."""
    return {**state, GATES: gates} if any(g is not None for g in gates) else state


def own_gate(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """The checkpoint's state with this rank's row gate reference as its `row_gate` (with_gates);
    on another world (resharded rows) rank r takes saved rank r mod the saved world: a reference of
    rows like its own. A checkpoint without them (one process, older) is left as it is."""
    gates = state.get(GATES)
    if not isinstance(gates, list) or not gates or gates[rank % len(gates)] is None:
        return state
    return {**state, GATE: gates[rank % len(gates)]}


class Checkpoints:
    """The checkpoint half of Parallel (world, rank, is_main, sharded, pipeline come from it)."""

    pipeline: Any = None

    written: Callable[[], None] | None = None  # in the writer, before the commit (the kill_in_save fault)
    _write: BackgroundWrite | None = None  # the checkpoint being written in the background
    _stager: Any = None  # its host copy's buffers, reused from save to save
    _group: Any = None  # the background writer's own gloo group: the training thread keeps its own

    def save(
        self,
        run_dir: Path,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        state: dict[str, Any],
        keep: int,
        protect: tuple[int, ...],
        before: Callable[[], None],
        background: bool = False,
    ) -> Path:
        """One process: model.safetensors + optim.pt. Data-parallel: every rank writes its shards
        (torch.distributed.checkpoint) into a temp dir; rank 0 writes optim.pt (every rank's RNG)
        and state.json, then renames. `before` runs first on every rank (hooks; they may fail).
        `background`: DCP's asynchronous save, as its thread mode does it: the state is copied to
        host memory here (all that stalls training), and a thread writes and commits it while
        training goes on; finish_save waits for it. The previous write is finished first, so one
        host copy exists at a time (its buffers reused: bounded memory)."""
        self.finish_save()
        if self.world == 1:
            before()
            # the names say which weight each moment belongs to under any later split (pipeline)
            optim = {"optimizer": optimizer.state_dict(), "param_names": param_names(model, optimizer), **extra}
            parts = (model.state_dict(), optim, state)
            if background:
                parts = self._stage(parts)
            return self._run(background, step, save_checkpoint, run_dir, step, *parts, keep, protect, self.written)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        self._agree_ok(attempt(before))
        # An optimizer before its first step (the initial checkpoint) has no state to save, and asking
        # DCP for it would initialise it with a zero-gradient step (AdamW's step count moves): skip it.
        fresh = not optimizer.state
        app = {"model": get_model_state_dict(model)}
        if not fresh:
            app["optim"] = get_optimizer_state_dict(model, optimizer, options=_by_parameter())
        parts = (app, {**extra, "fresh_optimizer": fresh}, state)
        if background:
            parts = self._stage(parts)
        group = self._writer_group() if background else cpu_group()
        return self._run(background, step, self._write_sharded, run_dir, step, *parts, keep, protect, group)

    def finish_save(self) -> Path | None:
        """Wait for the checkpoint being written in the background: its directory once committed
        (None: none was being written); a failed write's OSError is raised here."""
        write, self._write = self._write, None
        return None if write is None else write.result()

    def writing_in_background(self) -> bool:
        """Whether a background write is still under way (its collectives may wait on every rank)."""
        return self._write is not None and not self._write.done

    def _run(self, background: bool, step: int, fn: Callable[..., Path], *args: Any) -> Path:
        if not background:
            return fn(*args)
        self._write = BackgroundWrite(step, fn, args)
        return checkpoint_root(args[0]) / f"step_{step:06d}"

    def _stage(self, parts: tuple[Any, ...]) -> tuple[Any, ...]:
        """A host copy of every tensor in `parts` (nested dicts and lists; the rest deep-copied):
        what the background thread writes while training changes the originals."""
        from torch.distributed.checkpoint.staging import StateDictStager

        if self._stager is None:
            self._stager = StateDictStager(pin_memory=torch.cuda.is_available())
        return tuple(self._stager.stage({"part": part}, non_blocking=False)["part"] for part in parts)

    def _writer_group(self) -> Any:
        """A gloo group of its own for the background writer's collectives, made by every rank at
        its first background save (they all save at the same step)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.timeout_s))
        return self._group

    def _write_sharded(
        self,
        run_dir: Path,
        step: int,
        app: dict[str, Any],
        extra: dict[str, Any],
        state: dict[str, Any],
        keep: int,
        protect: tuple[int, ...],
        group: Any,
    ) -> Path:
        """Every rank's shards into a temp dir, rank 0's commit (collectives on `group`). A write
        that fails (a full disk) leaves no temp dir: every rank has agreed it failed, so none is
        writing there any more, and rank 0 removes it (as checkpoint.save_checkpoint does its own)."""
        tmp = checkpoint_root(run_dir) / f".tmp_step_{step:06d}_sharded"
        try:
            self._agree_ok(attempt(_fresh_dir, tmp) if self.is_main else None, group)
            self._agree_ok(attempt(_dcp_save, app, tmp / SHARDED, group), group)
            if self.written is not None:
                self.written()
            mine = digest_files(sorted((tmp / SHARDED).glob(f"__{self.rank}_*.distcp")), tmp)
            gathered = [None] * self.world if self.is_main else None
            dist.gather_object((mine, extra, state.get(GATE)), gathered, dst=0, group=group)
            error = None
            if self.is_main:
                digests = {name: d for files, _, _ in gathered for name, d in files.items()}
                rng = [e["rng"] for _, e, _ in gathered]
                state = with_gates(state, [g for _, _, g in gathered])
                # each rank's row gate tables (training/checkpointing.py _gate_tables), as its RNG
                by_rank = {"rng_by_rank": rng, "row_gate_by_rank": [e.get("row_gate") for _, e, _ in gathered]}
                error = attempt(
                    _commit_sharded, run_dir, step, tmp, {**extra, **by_rank}, state, keep, protect, digests
                )
            self._agree_ok(error, group)
        except OSError:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return checkpoint_root(run_dir) / f"step_{step:06d}"

    def _agree_ok(self, error: OSError | None, group: Any = None) -> None:
        """Raise the first failing rank's OSError on every rank, so the orchestrator's disk-full
        handling runs alike everywhere (and no rank waits in a collective the others left)."""
        failures = [None] * self.world
        mine = None if error is None else (error.errno or errno.EIO, error.strerror or str(error))
        dist.all_gather_object(failures, mine, group=group or cpu_group())
        first = next((f for f in failures if f is not None), None)
        if first is not None:
            raise OSError(*first)

    def read_checkpoint(self, path: Path) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any], dict[str, Any]]:
        """load_checkpoint for this world size: data-parallel ranks read their own shards later
        (load_weights, load_optimizer). No file is hashed again: rank 0 (one process: this one)
        verified this checkpoint when it chose it (from_main(latest_valid / find_checkpoint))."""
        weights, optim_state, state = load_checkpoint(path, full_weights=self.world == 1, verified=True)
        return weights, optim_state, own_gate(state, self.rank)

    def load_model(
        self, model: nn.Module, weights: dict[str, torch.Tensor] | None, state: dict[str, Any], path: Path
    ) -> None:
        """A checkpoint's model (read_checkpoint) into the (wrapped) model: its structure, then its
        weights; `weights` None: this run's shards are read from the sharded checkpoint directly,
        resharded to this world size."""
        apply_structure(model, state, path)
        if self.pipeline is not None:
            self.pipeline.hollow_others()  # a layer of another stage resized: its tensors go again
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        if weights is None and is_legacy(weight_names(path)):
            weights = read_sharded_weights(path)  # whole, to regroup its attention (model/upgrade.py)
        if weights is None:
            target = {"model": get_model_state_dict(model)}
            _dcp_load(target, path, cpu_group() if self.world > 1 else None)
            set_model_state_dict(model, target["model"])
        elif self.sharded:  # whole tensors (a one-process checkpoint) scattered into shards
            weights = upgrade_weights(weights, model.cfg)
            set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            load_weights(model, weights, path)

    def load_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, optim_state: dict[str, Any], path: Path
    ) -> None:
        """Optimizer state from either checkpoint format; also picks this rank's RNG state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        by_rank = optim_state.get("rng_by_rank")
        if by_rank:
            optim_state["rng"] = by_rank[self.rank] if self.rank < len(by_rank) else by_rank[0]
        gates = optim_state.get("row_gate_by_rank")
        if gates:  # this rank's row gate tables, as own_gate picks its reference
            optim_state["row_gate"] = gates[self.rank % len(gates)]
        native = optim_state.get("optimizer")  # a one-process checkpoint's
        if optim_state.get("fresh_optimizer") or (native is not None and not native["state"]):
            return  # saved before the first step: the optimizer just built is that state (see save)
        if is_legacy(weight_names(path)):
            if native is None:
                raise CheckpointError(
                    f"{path}: a sharded checkpoint from before trimtab grouped the attention projection; "
                    "its optimizer state cannot be resharded: start a new run from its weights "
                    f"(train.init_from: {path})"
                )
            native = upgrade_optimizer(native, param_names(model, optimizer), model.cfg)
        if "optimizer" not in optim_state:  # sharded: read this world size's shards
            options = _by_parameter() if _keyed_by_parameter(path) else None
            target = {"optim": get_optimizer_state_dict(model, optimizer, options=options)}
            _dcp_load(target, path, cpu_group() if self.world > 1 else None)
            set_optimizer_state_dict(model, optimizer, target["optim"], options=options)
        elif self.sharded:  # a one-process checkpoint: name its state by parameter, then shard it
            set_optimizer_state_dict(
                model,
                optimizer,
                _named_optim_state(model, optimizer, native, optim_state.get("param_names"), path),
                options=StateDictOptions(full_state_dict=True),
            )
        else:
            optimizer.load_state_dict(native)


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters' names, in the order optimizer.state_dict() numbers them."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _named_optim_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, native: dict[str, Any], names: list[str] | None, path: Path
) -> dict[str, Any]:
    """optimizer.state_dict() (parameters numbered in group order) keyed by parameter name, the
    form set_optimizer_state_dict takes, for the parameters this rank holds. The names are the
    checkpoint's own (saved since 2026-11-25); older ones are numbered as this model's optimizer
    is, which holds only for a model held whole."""
    held = param_names(model, optimizer)
    if names is None:
        if sum(len(g["params"]) for g in native["param_groups"]) != len(held):
            raise CheckpointError(
                f"{path}: a one-process checkpoint from before optimizer states were named cannot be split "
                "into pipeline stages; resume it once in one process (or under tp / fsdp), then under pp"
            )
        names = held
    mine = set(held)
    return {
        "state": {names[i]: v for i, v in native["state"].items() if names[i] in mine},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"] if names[i] in mine]} for g in native["param_groups"]
        ],
    }


def _dcp_save(app: dict[str, Any], where: Path, group: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(app, checkpoint_id=str(where), process_group=group)
    except CheckpointException as exc:  # a BaseException: make a failed write an OSError
        failures = [write_error(e, where) for e, _ in exc.failures.values()]
        first = next((e for e in failures if e is not None), None)
        code = getattr(first, "errno", None) or errno.EIO
        raise OSError(code, f"sharded checkpoint write failed: {first or exc}") from exc


def _by_parameter() -> Any:
    """The optimizer's state and param-group settings keyed by parameter name. Keyed by group
    index, pipeline stages wrote the same keys for their different groups, one stage's were kept,
    and a resume on stages met a group without lr or betas (KeyError: 'betas')."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _keyed_by_parameter(path: Path) -> bool:
    """Whether a sharded checkpoint keys its optimizer by parameter (_by_parameter), as written
    since; older ones key the param groups by index, and are read as written."""
    import re

    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(Path(path) / SHARDED)).read_metadata().state_dict_metadata
    return not any(re.match(r"optim\.param_groups\.\d+\.", k) for k in keys)


def _dcp_load(target: dict[str, Any], path: Path, group: Any) -> None:
    """Read `target`'s tensors in place; a failed read (raised on every rank) is a CheckpointError naming the
    directory: a rollback puts back what it had (training/restore_point.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    single = group is None and not active()
    with warnings.catch_warnings():  # in one process: "assuming the intent is to load in a single process": it is
        if single:
            warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(target, checkpoint_id=str(Path(path) / SHARDED), process_group=group, no_dist=single)
        except CheckpointException as exc:  # a BaseException, as in _dcp_save
            rank, (first, _) = next(iter(exc.failures.items()))
            raise CheckpointError(
                f"{Path(path) / SHARDED}: unreadable on rank {rank} ({type(first).__name__}: {first})"
            ) from exc


def _fresh_dir(path: Path) -> None:
    """`path` empty, and no other sharded write's temp dir left (one a killed writer left: its
    space is what a disk still full needs); one save is written at a time (Checkpoints.save)."""
    for stale in path.parent.glob(".tmp_step_*_sharded"):
        shutil.rmtree(stale, ignore_errors=True)
    path.mkdir(parents=True)


def _commit_sharded(
    run_dir: Path,
    step: int,
    tmp: Path,
    extra: dict[str, Any],
    state: dict[str, Any],
    keep: int,
    protect: tuple[int, ...],
    digests: dict[str, Any],
) -> None:
    with writing(tmp):
        torch.save(extra, tmp / "optim.pt")
    commit_checkpoint(run_dir, step, tmp, state, keep, protect, digests)
