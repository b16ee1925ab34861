"""Communication per training step on CPU, per mesh, measured against the planner's analytical
volume (plan/traffic.py: step_traffic).

    python bench/comm.py [--preset debug-moe] [--warmup 2] [--steps 3]

Each mesh trains the preset in fp32 under torchrun (gloo, one thread per process). The steps after
the warm-up run under a TorchDispatchMode that sees every collective (torch.distributed's c10d
ops and the functional collectives DTensor and the all-to-all use) with its tensors and group;
each is converted to the bytes one rank sends in a ring of its group of n (NCCL's algorithms,
the planner's model): all-reduce 2 (n-1)/n S, all-gather (n-1)/n of the output, reduce-scatter
(n-1)/n of the input, all-to-all the rows for the other ranks, broadcast S from the root. A
functional all-to-all is expert-parallel, another functional collective tensor-parallel (DTensor:
the sequence-parallel gathers, the loss's vocabulary reductions), a c10d one data-parallel (FSDP2,
DDP, the experts' sum over their copies, trimtab's step sums); the few scalars of gradient norms
and agreement land where their op puts them.
Bytes are a count, not a timing: one run per mesh, no repetitions needed. Results go to the
"Communication volume" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import Contention

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Communication volume per step (`bench/comm.py`)"
DROPLESS = ["model.moe.capacity_factor=0"]
MESHES = {  # name: (processes, distributed section, other settings)
    "DDP x2": (2, {"strategy": "ddp"}, []),
    "FSDP2 x2": (2, {"strategy": "fsdp"}, []),
    "TP 2": (2, {"tp": 2}, []),
    "EP 2 (FSDP2 x2)": (2, {"ep": 2}, []),
    "EP 2 (FSDP2 x2), dropless": (2, {"ep": 2}, DROPLESS),
    "EP 2 x 2 expert copies, dropless": (4, {"ep": 2}, DROPLESS),
    "TP 2 x FSDP2 2": (4, {"tp": 2}, []),
    "TP 2 x EP 2, dropless": (4, {"tp": 2, "ep": 2}, DROPLESS),
    # a block's re-run in the backward gathers and exchanges again up to the last tensor its
    # backward needs (model/recompute.py keeps no collective's output), as full checkpointing's does
    "TP 2, full checkpointing": (2, {"tp": 2}, ["train.activation_checkpointing=full"]),
    "TP 2, selective checkpointing": (2, {"tp": 2}, ["train.activation_checkpointing=selective"]),
    "EP 2 (FSDP2 x2), dropless, selective checkpointing": (
        2,
        {"ep": 2},
        [*DROPLESS, "train.activation_checkpointing=selective"],
    ),
    "PP 2": (2, {"pp": 2}, []),
    "PP 2 x FSDP2 2": (4, {"pp": 2}, []),
}
# torchrun with its ranks forked from its agent, which imported torch and trimtab once (torchrun's own
# `--run-path --start-method fork`): a rank started as a fresh `python` spent ~3.4 s of CPU on imports
# (torch._dynamo: an optimizer's construction imports it), two to four a mesh. Bytes are a count:
# where a rank's imports happened changes none.
TORCHRUN = [
    sys.executable,
    "-c",
    "import torch._dynamo, trimtab.api; from torch.distributed.run import main; main()",
    "--run-path",
    "--start-method=fork",
]


# ------------------------------------------------------------------------ inside each process


def worker(config: dict, out: Path, warmup: int, steps: int) -> None:
    from trimtab.config import load_config
    from trimtab.training.hooks import Hook
    from trimtab.training.setup import setup
    from trimtab.training.trainer import Trainer

    torch.set_num_threads(1)

    class Measure(Hook):
        def __init__(self) -> None:
            self.mode = Collectives()

        def on_step_end(self, trainer, step_out) -> None:
            if step_out.step == warmup:
                self.mode.__enter__()
            elif step_out.step == warmup + steps:
                self.mode.__exit__(None, None, None)
                if trainer.rank == 0:
                    out.write_text(json.dumps(self.mode.sent))

    cfg = load_config(preset=config["preset"], overrides=config["overrides"], sets=config["sets"])
    Trainer(setup(cfg), hooks=[Measure()]).fit()


class Collectives(TorchDispatchMode):
    """Adds up the ring bytes this rank sends, by mesh dimension (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        space = func.namespace
        if space == "c10d":
            self._c10d(func._opname, args)
        elif space.startswith("_c10d_functional"):
            named = {a.name: v for a, v in zip(func._schema.arguments, args)} | (kwargs or {})
            self._functional(func._opname, named)
        return out

    def _c10d(self, op: str, args: tuple) -> None:
        if op in ("allreduce_", "broadcast_"):
            n, size = _group(args[1]).size(), sum(_bytes(t) for t in args[0])
            self.sent["dp"] += (2 * (n - 1) / n if op == "allreduce_" else 1.0) * size
        elif op in ("_allgather_base_", "_reduce_scatter_base_"):
            n = _group(args[2]).size()
            self.sent["dp"] += (n - 1) / n * _bytes(args[0] if op == "_allgather_base_" else args[1])
        elif op == "alltoall_base_":
            self.sent["dp"] += _others(args[1], args[4], _group(args[2]).rank())
        elif op == "send":  # pipeline stages, point to point
            self.sent["pp"] += sum(_bytes(t) for t in args[0])

    def _functional(self, op: str, args: dict) -> None:
        if "group_name" not in args:  # bookkeeping ops (wait_tensor, _wrap_tensor_autograd)
            return
        group = _resolve_process_group(args["group_name"])
        if op.startswith("all_to_all"):
            self.sent["ep"] += _others(args["input"], args["input_split_sizes"], group.rank())
            return
        n = group.size()
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather_into_tensor": n - 1, "reduce_scatter_tensor": (n - 1) / n}
        self.sent["tp"] += factor.get(op.rstrip("_"), 1.0) * _bytes(args["input"])


def _group(boxed) -> dist.ProcessGroup:
    return dist.ProcessGroup.unbox(boxed)  # c10d ops see the process group as a TorchScript object


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _others(t: torch.Tensor, splits: list[int] | None, rank: int) -> float:
    """Bytes of an all-to-all input that go to other ranks (all but this rank's own split)."""
    row = _bytes(t) / max(t.shape[0], 1)
    own = splits[rank] if splits else t.shape[0] // max(1, len(splits or [1]))
    return (t.shape[0] - own) * row


# ------------------------------------------------------------------------ the driver


def measure(preset: str, nproc: int, section: dict, sets: list[str], warmup: int, steps: int) -> dict[str, float]:
    overrides = {
        "train": {"max_steps": warmup + steps, "eval_every": 0, "precision": "fp32", "batch_tokens": 4096},
        "checkpoint": {"every": 0},
        "log": {"progress": False, "tensorboard": False},
        "distributed": section,
    }
    with tempfile.TemporaryDirectory() as tmp:
        overrides["out"] = str(Path(tmp) / "run")
        result = Path(tmp) / "sent.json"
        config = {"preset": preset, "overrides": overrides, "sets": sets}
        cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]
        cmd += [__file__, "--worker", json.dumps(config), str(result), str(warmup), str(steps)]
        # bench/ on the path: runpy does not put a script's folder there. One thread: an OpenMP pool
        # does not survive a fork.
        path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "bench")])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            raise SystemExit(done.stdout[-2000:] + done.stderr[-8000:])
        return {k: v / steps for k, v in json.loads(result.read_text()).items()}


def analytical(preset: str, nproc: int, section: dict, sets: list[str]) -> dict[str, float]:
    from trimtab.config import load_config
    from trimtab.plan.traffic import step_traffic

    sets = [*sets, "train.batch_tokens=4096"] + [f"distributed.{k}={v}" for k, v in section.items()]
    return step_traffic(load_config(preset=preset, sets=sets), nproc, precision="fp32")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="debug-moe")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="the DDP x2 mesh only, 1 + 1 steps; print only")
    args = ap.parse_args()
    meshes = dict(list(MESHES.items())[:1]) if args.dry_run else MESHES
    if args.dry_run:
        args.warmup, args.steps = 1, 1
    rows = []
    with Contention() as busy:  # bytes are a count, not a timing: the share is recorded, it moves nothing
        for name, (nproc, section, sets) in meshes.items():
            got = measure(args.preset, nproc, section, sets, args.warmup, args.steps)
            want = analytical(args.preset, nproc, section, sets)
            rows.append((name, got, want))
            print(name, {k: round(v / 1e6, 3) for k, v in got.items()}, {k: round(v / 1e6, 3) for k, v in want.items()})
    publish(HEADING, report(rows, args), precision="fp32", other_cpu=busy.other, dry_run=args.dry_run)


def report(rows: list, args: argparse.Namespace) -> str:
    lines = [
        f"`{args.preset}` (4 layers, 2 of them MoE: 8 experts, top-2), fp32, 4,096-token steps in 1,024-token "
        f"micro-batches; mean of {args.steps} steps after {args.warmup} of warm-up, rank 0. MB one rank sends per "
        "step, measured (every collective seen by a dispatch mode, counted as ring bytes: module docstring) / "
        "the planner's model (`plan.traffic.step_traffic`, the formulas `trimtab plan` ranks layouts with), and "
        "their ratio.",
        "",
        "| mesh | pipeline | tensor parallel | expert parallel | data parallel |",
        "|---|---|---|---|---|",
    ]
    for name, got, want in rows:
        cells = []
        for dim in ("pp", "tp", "ep", "dp"):
            g, w = got.get(dim, 0.0) / 1e6, want.get(dim, 0.0) / 1e6
            cells.append(f"{g:.3f} / {w:.3f} ({g / w:.2f})" if w else f"{g:.3f} / -")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Where they differ, and why: with a capacity factor (1.25 here) the dropped assignments never travel, so "
        "expert-parallel traffic falls below the dropless model by the drop rate (high early in training); "
        "dropless, it is the model's up to the routing's imbalance. FSDP2 keeps the root (embedding, final norm, "
        "head) gathered from forward to backward, which the model counts twice. Tensor-parallel traffic includes "
        "the loss's vocabulary-parallel reductions and the gradient-norm scalars, a few KB. Pipeline: rank 0 is "
        "the first stage and sends activations only (point-to-point sends); its data-parallel column holds the tied "
        "embedding's gradient summed with the last stage, and under FSDP2 the weights gathered forward per "
        "micro-batch but backward and reduce-scattered once a step (pipelining defers both to the last backward), "
        "which the model now counts that way. Checkpointing (full or selective): a block's re-run in the backward "
        "gathers and exchanges again up to the last tensor its backward needs, 3 of a layer's 4 tensor-parallel "
        "collectives (not the reduce-scatter after w2) and both all-to-alls; the model had counted the 6 "
        "collectives of a whole forward for full checkpointing, 25% more than it moves, and was corrected by this "
        "measurement.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
