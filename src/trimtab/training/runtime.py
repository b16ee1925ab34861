"""Small runtime pieces of the trainer: the log window, device reads, RNG state, MoE step stats
(signals: training/services/signals.py)."""

from __future__ import annotations

import math
import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from trimtab.data import IGNORE_INDEX


@dataclass
class LogWindow:
    """Per-step values since the last log line, read from the device once per log interval."""

    losses: list = field(default_factory=list)
    norms: list = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    skips: list = field(default_factory=list)
    gains: list = field(default_factory=list)  # the steps' update gains, where measured (training/gain.py)

    def read(self) -> tuple[list[float], list[float], int]:
        """Losses, grad norms and the count of skipped updates: one device read for the window."""
        if not self.losses:
            return [], [], 0
        n = len(self.losses)
        flat = read_scalars(self.losses + self.norms + self.skips)
        return flat[:n], flat[n : 2 * n], int(sum(flat[2 * n :]))


def read_scalars(values: list) -> list[float]:
    """0-d tensors (any device) and numbers as floats, with a single device-to-host copy."""
    return [float(v) for v in to_host(list(values))]


def to_host(tree: Any) -> Any:
    """`tree` (dicts, lists and tuples of tensors, numbers, bools and None) with every tensor read
    to the host in one device-to-host copy: a 0-d tensor becomes a float, a larger one a (nested)
    list of floats. Keeps the metrics path at one sync however many values a step reports."""
    tensors: list[torch.Tensor] = []

    def collect(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
        elif isinstance(node, dict):
            for value in node.values():
                collect(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                collect(value)

    collect(tree)
    if not tensors:
        return tree
    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    flat = torch.cat([t.detach().float().reshape(-1).to(device) for t in tensors]).cpu()
    pieces = iter(flat.split([t.numel() for t in tensors]))
    shapes = iter(t.shape for t in tensors)

    def rebuild(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            piece, shape = next(pieces), next(shapes)
            return piece.item() if not shape else piece.view(shape).tolist()
        if isinstance(node, dict):
            return {key: rebuild(value) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(rebuild(value) for value in node)
        return node

    return rebuild(tree)


class MoEStepStats:
    """Router telemetry of every MoE layer summed over one step's micro-batches, on device (no
    host sync): assignments per expert, and the target-weighted mean dropped fraction, router
    entropy and balance loss."""

    def __init__(self, layers: list, device: torch.device) -> None:
        self.layers = layers  # [(layer index, MoE)]
        self.counts = [torch.zeros(moe.n_experts, device=device) for _, moe in layers]
        self.means = torch.zeros(len(layers), 3, device=device) if layers else None

    def add(self, share: float, only: range | None = None) -> None:
        """After a micro-batch's forward; `share` is its fraction of the step's targets; `only`:
        the layers that forward ran (a pipeline stage's), else all."""
        for j, (i, moe) in enumerate(self.layers):
            if only is not None and i not in only:
                continue
            st = moe.stats
            self.counts[j] += st["tokens_per_expert"]
            self.means[j] += share * torch.stack([st["dropped"], st["entropy"], st["balance_loss"]]).float()

    def as_dict(self) -> dict[str, Any]:
        return {"layers": [i for i, _ in self.layers], "counts": self.counts, "means": self.means}


class RouterStats:
    """One step's telemetry of the model's routed layers, on device: MoEStepStats for the MoE
    layers, and per Mixture-of-Depths layer the target-weighted mean capacity, predictor
    accuracy and gate."""

    def __init__(self, model, device: torch.device) -> None:
        self.moe = MoEStepStats(model.moe_layers(), device) if model.moe_layers() else None
        self.mod_layers = model.mod_layers()
        # no allocation per step for a model without MoD
        self.mod = torch.zeros(len(self.mod_layers), 3, device=device) if self.mod_layers else None

    def add(self, share: float, only: range | None = None) -> None:
        """After a micro-batch's forward; `share` is its fraction of the step's targets; `only`:
        the layers that forward ran (a pipeline stage's), else all."""
        if self.moe is not None:
            self.moe.add(share, only)
        for j, (i, router) in enumerate(self.mod_layers):
            if only is not None and i not in only:
                continue
            st = router.stats
            self.mod[j] += share * torch.stack([st["capacity"], st["predictor_acc"], st["gate"]]).float()

    def moe_dict(self) -> dict[str, Any] | None:
        return self.moe.as_dict() if self.moe is not None else None

    def mod_dict(self) -> dict[str, Any] | None:
        return {"layers": [i for i, _ in self.mod_layers], "means": self.mod} if self.mod_layers else None


class RowLosses:
    """One step's loss per dataset row, on device: [R, 2] (summed loss, target count) at each
    row's place in the step's `rows` (every rank's, so an all-reduce sum gathers them under data
    parallelism; a row twice in one step sums into one place). The orchestrator's outlier-row
    rule reads the means; they come from the training forward itself, so watching every row
    costs one [B * T] write per micro-batch, not a second pass. With `gated` (the row gate runs,
    training/row_gate.py) a third column counts the rows the gate left out of the update: summed
    over the ranks it stays > 0 where any rank gated the row, and it is read with the rest (the
    orchestrator journals them: no read of its own)."""

    def __init__(self, rows: list[int], device: torch.device, gated: bool = False) -> None:
        self.place: dict[int, int] = {}
        for i, row in enumerate(rows):
            self.place.setdefault(row, i)
        self.values = torch.zeros(len(rows), 3 if gated else 2, device=device)

    def buffer(self, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's per-token loss buffer, fp32 [B * T], for cross_entropy_sum to fill."""
        return torch.zeros(targets.numel(), dtype=torch.float32, device=targets.device)

    def add(
        self, rows: list[int], token_losses: torch.Tensor, targets: torch.Tensor, gated: torch.Tensor | None = None
    ) -> None:
        """After a micro-batch's loss: its rows' summed losses and target counts (targets [B, T]),
        and with a gated column the gate's 0/1 per row ([B], on device; None: none gated)."""
        index = torch.tensor([self.place[r] for r in rows], device=self.values.device)
        counted = (targets != IGNORE_INDEX).sum(1).float()  # [B]
        summed = token_losses.view(targets.shape).sum(1)  # [B]
        columns = [summed, counted]
        if self.values.shape[1] == 3:
            columns.append(torch.zeros_like(counted) if gated is None else gated.float())
        self.values.index_add_(0, index, torch.stack(columns, 1))

    def left_out(self, rows: list[int]) -> torch.Tensor | None:
        """Which of a micro-batch's `rows` the gate left out of the update ([B] bool, on device; every
        rank's verdict once reduce_step summed the column); None without a gated column (no gate)."""
        if self.values.shape[1] < 3:
            return None
        index = torch.tensor([self.place[r] for r in rows], device=self.values.device)
        return self.values[index, 2] > 0

    def gated_loss(self) -> torch.Tensor | None:
        """The gated rows' summed scored loss (0-d, on device; it stands in the step's loss, training/row_gate.py),
        None without a gated column."""
        if self.values.shape[1] < 3:
            return None
        return (self.values[:, 0] * (self.values[:, 2] > 0)).sum()

    def trained(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss over the rows the update trained (0-d, on device): their targets' mean where
        the gate left some out (`loss`, the step's, holds the gated rows' scores), else `loss` itself, as
        where it left out every row (nothing trained: the step's withheld and judged on what it scored)."""
        if self.values.shape[1] < 3:
            return loss
        kept = (self.values[:, 2] == 0).float()
        count = (self.values[:, 1] * kept).sum()
        mean = (self.values[:, 0] * kept).sum() / count.clamp(min=1)
        return torch.where((self.values[:, 2] > 0).any() & (count > 0), mean.to(loss.dtype), loss)

    def all_gated(self) -> torch.Tensor | None:
        """Whether the gate left out every row with targets (0-d bool, on device; summed over the
        ranks once reduce_step ran, so every rank reads the same): the step's objective is empty, its
        gradient zero, yet AdamW would still move the weights by its momentum and decay them. None
        without a gated column (no gate)."""
        if self.values.shape[1] < 3:
            return None
        gated = self.values[:, 2] > 0
        return (gated | (self.values[:, 1] == 0)).all() & gated.any()


def mod_metrics(mod: dict[str, Any]) -> dict[str, float]:
    """Log-line figures per Mixture-of-Depths layer (one device read)."""
    out: dict[str, float] = {}
    for layer, values in zip(mod["layers"], mod["means"].tolist()):
        for key, value in zip(("capacity", "predictor_acc", "gate"), values):
            out[f"mod/{layer}/{key}"] = value
    return out


def moe_metrics(moe: dict[str, Any]) -> dict[str, float | list[int]]:
    """Log-line figures per MoE layer from one step's telemetry (one device read): assignments
    per expert (a list: metrics.jsonl only, TensorBoard takes scalars), load coefficient of
    variation, busiest expert's load over the fair share, experts with no token, dropped
    fraction, router entropy, balance loss."""
    host = to_host({"counts": moe["counts"], "means": moe["means"]})
    out: dict[str, float | list[int]] = {}
    for layer, counts, means in zip(moe["layers"], host["counts"], host["means"]):
        total, fair = sum(counts) or 1.0, 1.0 / len(counts)
        load = [c / total for c in counts]
        mean = sum(load) / len(load)
        figures = {
            "load_cv": math.sqrt(sum((x - mean) ** 2 for x in load) / len(load)) / fair,
            "max_load": max(load) / fair,
            "idle_experts": float(sum(c == 0 for c in counts)),
            **dict(zip(("dropped", "entropy", "balance_loss"), means)),
        }
        out[f"moe/{layer}/tokens_per_expert"] = [int(c) for c in counts]
        out.update({f"moe/{layer}/{key}": value for key, value in figures.items()})
    return out


def peak_rss_mb() -> float:
    """This process's peak resident set, MB: Linux's VmHWM, the high-water mark of its own memory
    map. Not ru_maxrss there: Linux carries a parent's resident set at fork into the child's
    ru_maxrss across exec, so a run started by a large process (a notebook, a benchmark that
    trained in-process) would report the parent's size. Elsewhere ru_maxrss (KiB on Linux and
    the BSDs, bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
