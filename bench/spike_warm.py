"""The loss-spike rule after the LR warm-up: false findings on fault-free runs and faults caught.

    python bench/spike_warm.py [--presets debug,debug-moe,debug-mod,debug-hybrid] [--seeds 0,1,2,3,4,5]
                                 [--steps 120] [--faults clean,weights_noise@25:2,bad_batch@25:4]
                                 [--mode auto] [--jobs 2] [--out /tmp/spike-warm] [--json PATH]

Each run is a real `python -m trimtab train` subprocess (OMP_NUM_THREADS=1), one per preset, seed
and fault ("clean": none), in a fresh directory. Per run: the spike findings (decisions.jsonl,
rule "spike", the early bar's too), the step of the first, whether one came at or after the
fault's step, and the final val_loss; a faulty run's against its preset and seed's clean run
when the grid holds it. Run it on the code before and after a change of the rule (the
SpikeRule comment and docs/orchestrator.md's spike paragraph hold the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_one(out: Path, preset: str, seed: int, fault: str, steps: int, mode: str) -> dict:
    """Train once; the run's spike findings and final val_loss."""
    name = f"{preset}-s{seed}-{fault.replace('@', '_').replace(':', '_')}-{mode}"
    run_dir = out / name
    cmd = [sys.executable, "-m", "trimtab", "train", "--preset", preset, "--out", str(run_dir)]
    cmd += ["--max-steps", str(steps), "--orchestrator", mode, "--set", "log.progress=false"]
    cmd += ["--set", f"train.seed={seed}", "--set", "train.log_every=1"]
    cmd += [] if fault == "clean" else ["--inject", fault]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {"preset": preset, "seed": seed, "fault": fault, "failed": proc.stderr[-400:]}
    decisions = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines() if line]
    spikes = [d["step"] for d in decisions if d.get("rule") == "spike"]
    at = int(fault.split("@")[1].split(":")[0]) if fault != "clean" else 0
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "preset": preset,
        "seed": seed,
        "fault": fault,
        "spikes": spikes,
        "caught": bool(at) and any(s >= at for s in spikes),
        "first": spikes[0] if spikes else None,
        "decisions": len(decisions),
        "val_loss": summary.get("val_loss"),
    }


def table(rows: list[dict]) -> str:
    clean = {(r["preset"], r["seed"]): r.get("val_loss") for r in rows if r["fault"] == "clean"}
    lines = ["preset        seed fault                 spikes (steps)         caught  val_loss  vs clean"]
    for r in rows:
        if "failed" in r:
            lines.append(f"{r['preset']:<13} {r['seed']:>4} {r['fault']:<21} FAILED {r['failed'][-120:]!r}")
            continue
        base = clean.get((r["preset"], r["seed"]))
        rel = f"{100 * (r['val_loss'] / base - 1):+.1f}%" if base and r["fault"] != "clean" else ""
        steps = ",".join(map(str, r["spikes"]))[:22]
        caught = "" if r["fault"] == "clean" else ("yes" if r["caught"] else "no")
        lines.append(
            f"{r['preset']:<13} {r['seed']:>4} {r['fault']:<21} {len(r['spikes']):>2} {steps:<19} "
            f"{caught:<7} {r['val_loss']:.4f}  {rel}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="debug,debug-moe,debug-mod,debug-hybrid")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--faults", default="clean", help="comma-separated --inject specs, 'clean' for none")
    ap.add_argument("--mode", default="auto", choices=["auto", "advise"])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/spike-warm"))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    grid = [(p, int(s), f) for p in a.presets.split(",") for s in a.seeds.split(",") for f in a.faults.split(",")]
    with ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(lambda g: run_one(a.out, *g, a.steps, a.mode), grid))
    print(table(rows))
    clean = [r for r in rows if r["fault"] == "clean" and "failed" not in r]
    faulty = [r for r in rows if r["fault"] != "clean" and "failed" not in r]
    print(f"clean runs with a spike finding: {sum(bool(r['spikes']) for r in clean)} / {len(clean)}")
    print(f"faults caught: {sum(r['caught'] for r in faulty)} / {len(faulty)}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
