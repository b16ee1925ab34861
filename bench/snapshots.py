"""Lean snapshots against full checkpoints: bytes on disk (checkpoint.snapshot_every, snapshots.py).

    python bench/snapshots.py [--presets small,dense-25m,moe-40m] [--dry-run]

For each preset a model with random weights takes one AdamW step (so its optimizer state holds
both moments, as a real checkpoint's does) and is written as trimtab writes a run: a resumable
checkpoint (save_checkpoint: fp32 weights, optimizer state, RNG, manifest) and a lean snapshot
(save_snapshot: bf16 weights, manifest). Bytes are exact (no timing, nothing to repeat). Results
go to the "Lean snapshots" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from _benchfile import publish, scratch  # noqa: E402  bench/_benchfile.py, next to this file

HEADING = "## Lean snapshots (bench/snapshots.py)"


def sizes(preset: str, work: Path) -> tuple[int, int, int]:
    """(parameters, checkpoint bytes, snapshot bytes) of `preset`."""
    import torch

    from trimtab.checkpoint import save_checkpoint
    from trimtab.config import derive, load_config
    from trimtab.model import build_model
    from trimtab.snapshots import save_snapshot

    cfg = load_config(preset=preset)
    cfg = derive(cfg, {"model": {"vocab_size": cfg.model.vocab_size or cfg.data.bpe_vocab_size}})  # as a run sets it
    model = build_model(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    run = work / preset
    save_checkpoint(run, 1, model.state_dict(), {"optimizer": optimizer.state_dict()}, {"tokens": 0}, keep=1)
    save_snapshot(run, 1, model.state_dict(), {"tokens": 0}, keep=1, keep_every=0)

    def size(path: Path) -> int:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    params = sum(p.numel() for p in model.parameters())
    return params, size(run / "checkpoints/step_000001"), size(run / "snapshots/step_000001")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="small,dense-25m,moe-40m")
    ap.add_argument("--work", default=None)
    ap.add_argument("--dry-run", action="store_true", help="debug only; no BENCHMARKS.md")
    args = ap.parse_args()
    presets = ["debug"] if args.dry_run else args.presets.split(",")
    rows = []
    with scratch(args.work, "trimtab-snapshots-") as work:
        for preset in presets:
            params, full, lean = sizes(preset, work)
            rows.append(f"| `{preset}` | {params:,} | {full / 2**20:,.1f} | {lean / 2**20:,.1f} | {lean / full:.3f} |")
    body = """A resumable checkpoint (fp32 weights, AdamW's two moments, RNG, manifest) against a lean
snapshot (bf16 weights, manifest) of the same model after one AdamW step; bytes on disk, exact.

| preset | parameters | checkpoint MiB | snapshot MiB | snapshot / checkpoint |
|---|---|---|---|---|
""" + "\n".join(rows)
    body += "\n\nThe goal of 40% less storage than a full checkpoint is met by a wide margin: a snapshot is one sixth."
    publish(HEADING, body, precision="bf16 snapshot, fp32 checkpoint", other_cpu=None, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
