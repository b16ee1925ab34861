"""Cluster faults under torchrun on CPU (lost ranks, hangs, a slow rank, flipped bits): goodput, ETTR projected.

    python bench/resilience.py [--preset debug] [--nproc 2] [--steps 60] [--dry-run]

Each scenario trains `--steps` steps of the preset on `--nproc` gloo processes (one torch thread
each) under `torchrun --standalone --max-restarts 3`, a checkpoint every `--every` steps, with one
fault class twice (on different ranks and steps), against the same run undisturbed. Reported per
scenario: the final loss and whether it is the undisturbed run's (to 1e-5: every row trained as
there), restarts, steps lost, the time to recover per incident (from the failure to training again:
down + start-up), the hang's stall, and ETTR (productive / wall over every session, goodput.json).
The hang is also run with the watchdog off, as plain torchrun runs it: the stalled collective
waits out the process group's timeout (`distributed.timeout_s`, set to `--pg-timeout`; torch's
default is 600 s); the flipped gradient bit (silent corruption in one rank's backward) with the
re-run of a flagged step off (`resilience.rerun`): the step's update is withheld instead.
Then a projection at scale (trimtab/plan/resilience.py): the Young interval and
the expected ETTR at 1,024 / 16,384 / 131,072 GPUs for `--scale-preset`, with the recovery time
assumed for a GPU cluster and with the one measured here. Results go to the "Resilience" section
of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import run_train  # bench/_measure.py
from trimtab.config import load_config
from trimtab.extras import installed
from trimtab.model.catalog import model_size
from trimtab.plan.memory import STATE_BYTES
from trimtab.plan.resilience import FT_STALL_S, RECOVERY_S, resilience_plan
from trimtab.rundir import read_decisions, read_json, read_jsonl, read_metrics

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Resilience: lost ranks, hangs, a slow rank, flipped bits (`bench/resilience.py`)"
SCALES = (1024, 16_384, 131_072)


def scenarios(steps: int, nproc: int) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (faults, extra --set): each fault class twice, on two ranks, after two checkpoints."""
    a, b = steps // 4 + 3, (3 * steps) // 4 - 2
    last = nproc - 1
    return {
        "undisturbed": ([], []),
        "rank killed (SIGKILL) x2": ([f"kill_rank@{a}:{last}", f"kill_rank@{b}:0"], []),
        "rank hung x2, watchdog": ([f"hang_rank@{a}:{last}", f"hang_rank@{b}:0"], ["resilience.min_timeout_s=5"]),
        "rank hung x1, watchdog off": ([f"hang_rank@{a}:{last}"], ["resilience.watchdog=off"]),
        "rank 3x slower": ([f"slow_rank@2:{last}:3"], []),
        "gradient bit flipped x2, rerun": ([f"grad_bitflip@{a}:{last}", f"grad_bitflip@{b}:0"], []),
        "gradient bit flipped x2, rerun off": (
            [f"grad_bitflip@{a}:{last}", f"grad_bitflip@{b}:0"],
            ["resilience.rerun=false"],
        ),
    }


def ft_scenarios(steps: int) -> dict[str, list[str]]:
    """name -> group 1's faults: torchft replica groups (resilience.ft), 2 groups of one process."""
    a, b = steps // 4 + 3, (3 * steps) // 4 - 2
    return {
        "torchft, 2 replica groups, undisturbed": [],
        "torchft, replica group killed (SIGKILL) x2, replaced": [f"sigkill@{a}", f"sigkill@{b}"],
    }


def heading(preset: str, nproc: int) -> str:
    """The section of BENCHMARKS.md: the default run's, or one of its own for another preset or
    process count (both kept)."""
    if (preset, nproc) == ("debug", 2):
        return HEADING
    return f"## Resilience on {nproc} processes, `{preset}` (`bench/resilience.py --preset {preset} --nproc {nproc}`)"


def quiet_run(every: int) -> list[str]:
    """The --set lines every scenario shares: no console, report or evaluation, fp32, a metrics
    line a step, a checkpoint every `every` steps."""
    return [
        "log.progress=false",
        "log.tensorboard=false",
        "log.report=false",
        "train.eval_every=0",
        "train.log_every=1",
        "train.precision=fp32",
        f"checkpoint.every={every}",
    ]


def run(preset: str, nproc: int, steps: int, every: int, pg_timeout: int, faults: list[str], sets: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        launcher.append("--max-restarts=3")
        base = [
            *quiet_run(every),
            f"distributed.timeout_s={pg_timeout}",
            "orchestrator.straggler.window=3",
            "orchestrator.straggler.patience=2",
        ]
        args = ["--preset", preset, "--max-steps", str(steps)]
        args += [a for s in base + sets for a in ("--set", s)] + [a for f in faults for a in ("--inject", f)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        done = run_train(args, out, f"{preset} {faults}", launcher, ROOT, env)
        ledger = read_json(out / "goodput.json") or {"incidents": []}
        decisions = read_decisions(out)
        return {
            "wall_s": time.perf_counter() - t0,
            "loss": [m for m in done["metrics"] if "loss" in m][-1]["loss"],
            "goodput": done["summary"]["goodput"],
            "incidents": ledger["incidents"],
            "stragglers": [d for d in decisions if d["rule"] == "straggler"],
            "reruns": [d["step"] for d in decisions if d["rule"] == "rerun"],
            "withheld": [d["step"] for d in decisions if d["action"] == "skip_step"],
            "other_cpu": done["other_cpu"],
        }


def run_ft(preset: str, steps: int, every: int, faults: list[str]) -> dict:
    """Two torchft replica groups (resilience.ft, one process each) and a Lighthouse; group 1
    gets `faults` and is started again after each death, as a scheduler would. With no faults
    the Lighthouse waits for both (min_replicas 2): the undisturbed pair; with faults it forms a
    quorum of whoever is there (min_replicas 1), so group 0 may take its first steps alone."""
    os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse logs every quorum at info
    from torchft._torchft import LighthouseServer

    from _measure import Contention

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1 if faults else 2, join_timeout_ms=200)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    sets = [
        *quiet_run(every),
        "resilience.ft.enabled=true",
        "resilience.ft.groups=2",
        f"resilience.ft.lighthouse={lighthouse.address()}",
    ]

    def command(out: Path, group: int, injected: list[str]) -> list[str]:
        args = ["--preset", preset, "--max-steps", str(steps), "--out", str(out)]
        args += [a for s in [*sets, f"resilience.ft.replica_group={group}"] for a in ("--set", s)]
        return [sys.executable, "-m", "trimtab", "train", *args, *[a for f in injected for a in ("--inject", f)]]

    with tempfile.TemporaryDirectory() as tmp, Contention() as busy:
        g0, g1 = Path(tmp) / "group0", Path(tmp) / "group1"
        t0 = time.perf_counter()
        survivor = subprocess.Popen(command(g0, 0, []), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deaths = []
        for _ in range(len(faults) + 1):
            done = subprocess.run(command(g1, 1, faults), env=env, capture_output=True, text=True)
            if done.returncode == 0:
                break
            deaths.append(time.time())
        _, err = survivor.communicate()
        wall = time.perf_counter() - t0
        lighthouse.shutdown()
        if survivor.returncode or done.returncode:
            sys.exit(f"torchft groups failed (exit {survivor.returncode}, {done.returncode}):\n{err[-3000:]}")
        metrics = [m for m in read_metrics(g0) if "loss" in m]
        summary, quorum = read_json(g0 / "summary.json"), read_jsonl(g1 / "quorum.jsonl")
        healed = [r["time"] for r in quorum if r.get("healed")]
        withheld = [r["step"] for r in read_jsonl(g0 / "quorum.jsonl") if r.get("withheld")]
        typical = statistics.median(m["step_time"] for m in metrics)
        same = [m for m in read_metrics(g1) if "loss" in m][-1]["loss"] == metrics[-1]["loss"]
    return {
        "wall_s": wall,
        "loss": metrics[-1]["loss"],
        "groups_agree": same,
        "goodput": summary["goodput"],
        "replacements": len(deaths),
        "withheld": withheld,
        # from a group's death to its replacement training again with the healed state
        "rejoin_s": [min(t for t in healed if t > d) - d for d in deaths],
        # what a death cost the group that kept going: its withheld step (work thrown away, made up
        # at the end) and anything it waited beyond a typical step
        "stall_s": [max(m["step_time"], typical) for m in metrics if m["step"] in withheld],
        "other_cpu": busy.other,
    }


def table(results: dict[str, dict], steps: int) -> str:
    clean = results["undisturbed"]["loss"]
    rows = [
        "| scenario | final loss | = undisturbed | restarts | steps lost | recover (s) | stall (s) | ETTR | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "replacements" in r:  # torchft replica groups: the group that kept going
            same = abs(r["loss"] - clean) <= 1e-5 * abs(clean)
            note = f"; withheld at steps {', '.join(map(str, r['withheld']))}" if r["withheld"] else ""
            note += "" if r["groups_agree"] else "; GROUPS DIFFER"
            rows.append(
                f"| {name}{note} | {r['loss']:.6f} | {'yes' if same else 'no'} | {r['replacements']} | 0 | "
                f"{_list(r['rejoin_s'])} | {_list(r['stall_s'])} | {r['goodput']['ettr']:.1%} | {r['wall_s']:.1f} |"
            )
            continue
        incidents = r["incidents"]
        recover = [i["recover_s"] for i in incidents if "recover_s" in i]
        stalls = [i["stalled_s"] for i in incidents if "stalled_s" in i]
        same = abs(r["loss"] - clean) <= 1e-5 * abs(clean)
        named = f"; named at step {r['stragglers'][0]['step']}" if r["stragglers"] else ""
        named += f"; transient, re-run at steps {', '.join(map(str, r['reruns']))}" if r["reruns"] else ""
        named += f"; update withheld at steps {', '.join(map(str, r['withheld']))}" if r["withheld"] else ""
        rows.append(
            f"| {name}{named} | {r['loss']:.6f} | {'yes' if same else 'NO'} | {len(incidents)} | "
            f"{sum(i['steps_lost'] for i in incidents)} | {_list(recover)} | {_list(stalls)} | "
            f"{r['goodput']['ettr']:.1%} | {r['wall_s']:.1f} |"
        )
    return "\n".join(rows)


def projection(preset: str, recover_measured: float | None, ft_stall: float | None) -> str:
    size = model_size(load_config(preset=preset), None)
    state = size.total * (STATE_BYTES["weights"] + STATE_BYTES["optimizer"])
    rows = [
        "| GPUs | MTBF (h) | recovery (s) | synchronous save: interval (min), ETTR "
        "| asynchronous save: interval (min), ETTR | per-step FT, asynchronous saves: ETTR |",
        "|---|---|---|---|---|---|",
    ]
    recoveries = [RECOVERY_S] + ([recover_measured] if recover_measured else [])
    for n in SCALES:
        for recovery in recoveries:
            measured = recovery != RECOVERY_S and ft_stall is not None
            plan = resilience_plan(n, state, recovery_s=recovery, ft_stall_s=ft_stall if measured else FT_STALL_S)
            cells = [f"{s.interval_s / 60:.1f}, **{s.ettr:.1%}**" for s in plan.strategies]
            ft = f"**{plan.strategies[2].ettr:.1%}**"
            rows.append(f"| {n:,} | {plan.mtbf_h:.2f} | {recovery:.1f} | {cells[0]} | {cells[1]} | {ft} |")
    return "\n".join(rows)


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values) if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every")
    ap.add_argument("--pg-timeout", type=int, default=60, help="distributed.timeout_s (torch's default: 600)")
    ap.add_argument("--scale-preset", default="dense-70b", help="the model of the projection at scale")
    ap.add_argument("--dry-run", action="store_true", help="tiny: 12 steps, three scenarios, no BENCHMARKS.md")
    args = ap.parse_args()
    steps, every = (12, 4) if args.dry_run else (args.steps, args.every)
    chosen = scenarios(steps, args.nproc)
    if args.dry_run:
        chosen = {k: v for k, v in chosen.items() if k.startswith(("undisturbed", "rank killed", "rank 3x"))}
    results = {}
    for name, (faults, sets) in chosen.items():
        print(f"{name} ...", flush=True)
        results[name] = run(args.preset, args.nproc, steps, every, args.pg_timeout, faults, sets)
    ft = ft_scenarios(steps)
    if args.dry_run:
        ft = {k: v for k, v in ft.items() if "killed" in k}
    for name, faults in ft.items() if installed("torchft") else ():
        print(f"{name} ...", flush=True)
        results[name] = run_ft(args.preset, steps, every, faults)
    recover = [i["recover_s"] for r in results.values() for i in r.get("incidents", []) if "recover_s" in i]
    measured = statistics.median(recover) if recover else None
    ft_stalls = [x for r in results.values() for x in r.get("stall_s", [])]
    ft_stall = statistics.median(ft_stalls) if ft_stalls else None
    body = (
        f"`{args.preset}`, {args.nproc} gloo processes (one thread each) under `torchrun --standalone "
        f"--max-restarts 3`, {steps} steps, a checkpoint every {every}; the process group's timeout "
        f"{args.pg_timeout} s. Recover: from the lost session's end (its last sign of life) to training "
        "again, restart and resume included; stall: how long the hung section ran before the watchdog ended it "
        "(timeout: 5x the longest run of that section, at least `resilience.min_timeout_s`, here 5 s). Without "
        "the watchdog a hang lasts the process group's timeout and the stopped rank, which ignores torchrun's "
        "SIGTERM, is killed 30 s later: the wall column shows the cost. ETTR: productive / wall over "
        "every session; on a model this small the start-up (imports, data, the first step) is most of a run, "
        "so compare the scenarios with the undisturbed row, not with a cluster's figures. The torchft rows "
        "(`resilience.ft`, when torchft is installed) are two replica groups of one process each and a "
        "Lighthouse, no torchrun: the row is the group that kept going (one session; its ETTR over its own "
        "wall); restarts: group 1's replacements (the same command run again, as a scheduler would), recover: "
        "from a death to the replacement training again with the state it received live, stall: the withheld "
        "step's time (its work thrown away, the step made up at the end) for the group that went on. "
        "Its final loss is not the undisturbed "
        "one by design: the steps the groups trained apart (a group alone, a withheld step) train other rows; "
        "the undisturbed pair trains exactly as the undisturbed torchrun run.\n\n"
        + table(results, steps)
        + f"\n\nProjection at scale for `{args.scale_preset}` (trimtab/plan/resilience.py: Llama 3's failure "
        "rate, Young's interval, first-order ETTR; a synchronous save writes at 1 GB/s per GPU up to 1 TB/s in "
        "all, an asynchronous one stalls for the copy to host memory at 25 GB/s; recovery "
        f"{RECOVERY_S:.0f} s assumed for a GPU cluster"
        + (f", and the {measured:.1f} s measured above" if measured else "")
        + f"; per-step FT: replica groups of 8 GPUs, a failure costing the others {FT_STALL_S:.0f} s (assumed)"
        + (f", {ft_stall:.1f} s with the measured recovery (measured above)" if ft_stall is not None else "")
        + " and its own group its recovery, no work redone"
        + "). Set beside Llama 3 (> 90% at 16,384) and ByteRobust (97% at 9,600).\n\n"
        + projection(args.scale_preset, measured, ft_stall)
    )
    publish(
        heading(args.preset, args.nproc),
        body,
        precision="fp32",
        other_cpu=[r["other_cpu"] for r in results.values()],
        dry_run=args.dry_run,
    )


if __name__ == "__main__":
    main()
