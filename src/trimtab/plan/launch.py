"""Cluster launch files from a plan (`trimtab plan --gpus N --emit slurm|k8s`, docs/planner.md):
the layout the planner chose (mesh, micro-batch, checkpointing) as a Slurm batch script or a
Kubeflow PyTorchJob, each starting torchrun's elastic agent on every node (c10d rendezvous, a
few restarts: a lost rank restarts the job from its newest checkpoint, docs/resilience.md) with
the asynchronous checkpoint interval of the plan's resilience section (Young's). The Slurm
script queues its job again when the time limit's SIGTERM stopped the run before its end (it
saved): Slurm's own --requeue restarts a job after a node failure or a preemption, not then. The
same stop after a rank failed (torchrun's agent SIGTERMs the others) is queued again only when the
run saved a newer checkpoint: a failure that recurs does not loop (docs/resilience.md).

A stop on SIGTERM finishes the step and saves, which for a large model on few GPUs takes minutes,
while torchrun's agent, signalled too (by Slurm, or as the pod's first process by Kubernetes), kills
its workers 30 s after forwarding the signal (torch.distributed.run --shutdown-timeout, its
default): the save was cut, no checkpoint of the last steps and no summary, so no requeue. Both
files give the stop the time the plan estimates for it (stop_s): torchrun's --shutdown-timeout,
Slurm's warning before the time limit (--signal) and the pod's terminationGracePeriodSeconds.

The files are a start, not a cluster's whole policy: the partition, the image, the volume for the
run directory and the account are the site's; each is a marked line to edit.
"""

from __future__ import annotations

import math
import shlex

from trimtab.config import dump_yaml
from trimtab.errors import ConfigError
from trimtab.plan.memory import STATE_BYTES
from trimtab.plan.report import Plan
from trimtab.plan.resilience import resilience_plan

EMITS = ("slurm", "k8s")
PORT = 29500  # torchrun's rendezvous port on the first node
MAX_RESTARTS = 3
AGENT_GRACE_S = 30  # torchrun's wait from forwarding a SIGTERM to its SIGKILL (--shutdown-timeout's default)
STOP_SAFETY = 2.0  # over the stop's estimate: the plan's bandwidths and step time are assumptions
SLURM_LEAD_S = 120  # the least warning before the time limit (--signal=TERM@); Slurm may send it 60 s early
MARGIN_S = 30  # after the agent's wait: its own exit (and the Slurm script's requeue)
SLURM_EARLY_S = 60  # Slurm checks its signals' times about once a minute: the warning may come this much early
MAX_IDLE_REQUEUES = 3  # requeues in a row of a job whose run saved no newer checkpoint (start-up longer than --time)


def launch_file(plan: Plan, emit: str, config: str | None, run_dir: str = "") -> tuple[str, str]:
    """(file name, text) of the `emit` launch file for `plan` (`run_dir`: the config's, runs/PRESET if none)."""
    if plan.layout is None or plan.layout.best is None:
        raise ConfigError("plan --emit needs a layout that fits: name the GPU (--gpu H100) and enough --gpus")
    if emit == "slurm":
        return "launch.sbatch", _slurm(plan, config, run_dir or f"runs/{plan.preset}")
    if emit == "k8s":
        return "launch.yaml", _k8s(plan, config)
    raise ConfigError(f"plan --emit {emit}: one of {', '.join(EMITS)}")


def _nodes(plan: Plan) -> tuple[int, int]:
    """(nodes, GPUs a node) the layout runs on."""
    layout = plan.layout
    per_node = min(layout.gpus, layout.gpus_per_node)
    return -(-layout.gpus // per_node), per_node


def _asynchronous_every(plan: Plan) -> int | None:
    """The checkpoint interval in steps the resilience section proposes for asynchronous saves (None: none)."""
    strategies = {s.name: s for s in plan.resilience.strategies} if plan.resilience else {}
    if "asynchronous save" not in strategies or not plan.resilience.step_s:
        return None
    return max(1, round(strategies["asynchronous save"].interval_s / plan.resilience.step_s))


def _train_args(plan: Plan, config: str | None) -> list[str]:
    """`trimtab train`'s arguments: the config (or preset) and the layout's settings, with the
    checkpoint interval the resilience section proposes for asynchronous saves."""
    args = [config] if config else ["--preset", plan.preset]
    sets = plan.layout.best.settings()
    every = _asynchronous_every(plan)
    if every is not None:
        sets += ["checkpoint.asynchronous=true", f"checkpoint.every={every}"]
    return args + [word for s in sets for word in ("--set", s)]


def stop_s(plan: Plan) -> int:
    """Seconds a SIGTERM's stop may take: up to two steps (under torchrun the ranks stop at the step
    where they next agree), a background write still in flight (asynchronous saves: the stop waits for
    it) and the run's last save, always synchronous, each write of the weights and AdamW state at the
    plan's assumed bandwidths (plan/resilience.py), x STOP_SAFETY; never below torchrun's own wait."""
    state = plan.model.total * (STATE_BYTES["weights"] + STATE_BYTES["optimizer"])
    strategies = {s.name: s for s in resilience_plan(plan.layout.gpus, state).strategies}
    write = strategies["synchronous save"].stall_s  # the whole write, every device at its assumed bandwidth
    writes = 2 if _asynchronous_every(plan) is not None else 1
    return max(AGENT_GRACE_S, math.ceil(STOP_SAFETY * (2 * plan.layout.best.step_s + writes * write)))


def _torchrun(nodes: int, per_node: int, endpoint: str, job_id: str, grace_s: int) -> list[str]:
    return [
        "torchrun",
        f"--nnodes={nodes}",
        f"--nproc_per_node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job_id}",
        f"--max-restarts={MAX_RESTARTS}",
        f"--shutdown-timeout={grace_s}",  # the wait for a SIGTERM's stop-and-save before SIGKILL
        "-m",
        "trimtab",
        "train",
    ]


def _shell(words: list[str]) -> str:
    """A command line: words naming a shell variable double-quoted (expanded), the rest quoted."""
    return " ".join(f'"{w}"' if "$" in w else shlex.quote(w) for w in words)


# The sbatch script's shell helpers (no plan values in them): the newest checkpoint's step and the
# job's time left.
_SLURM_HELPERS = """\
newest() {  # the newest checkpoint's step by its directory name (0: none), as rundir.newest_step reads it
    { ls "$RUN_DIR/checkpoints" 2>/dev/null || true; } | sed -n 's/^step_0*\\([0-9][0-9]*\\)$/\\1/p' | sort -n |
        tail -n 1
}
end_s() {  # the job's end, seconds since the epoch: scontrol's EndTime, else SLURM_JOB_END_TIME; empty: unknown
    local end
    end=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.*EndTime=\\([0-9][-0-9T:]*\\).*/\\1/p' |
        head -n 1 || true)
    if [ -n "$end" ] && date -d "$end" +%s 2>/dev/null; then return 0; fi
    # Slurm's own, set when the job started (a --time changed since is missed): the last resort
    echo "${SLURM_JOB_END_TIME:-}" | grep -E '^[0-9]+$' || true
}
left_s() {  # seconds to the job's time limit: squeue's %L ([days-]hours:minutes:seconds), else from its end
    # time (no squeue on the node, or it failed: the time-limit stop was taken for a rank failure); empty: unknown
    local left end
    left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | awk -F'[-:]' '/^[0-9]+(-[0-9]+)?(:[0-9]+)+$/ {
        split("1 60 3600 86400", k, " "); for (i = NF; i > 0; i--) s += $i * k[NF - i + 1]; print s }' || true)
    if [ -z "$left" ]; then
        end=$(end_s)
        [ -z "$end" ] || left=$((end - $(date +%s)))
    fi
    echo "$left"
}
"""


def _slurm_requeue(lead: int) -> str:
    """The sbatch script's tail after srun: whether to queue the stopped job again (comments inside)."""
    return f"""requeue=0
IDLE="$RUN_DIR/.slurm-requeues"
if [ "$RUN_DIR/summary.json" -nt "$STARTED" ] && grep -q '"status": "stopped (SIGTERM' "$RUN_DIR/summary.json"; then
    left=$(left_s || true)
    idle=$(awk -v job="$SLURM_JOB_ID" '$1 == job {{ print $2 }}' "$IDLE" 2>/dev/null || true)
    if [ "$(newest)" -gt "${{START_STEP:-0}}" ]; then
        requeue=1 idle=0
    elif [ -n "$left" ] && [ "$left" -le {lead + SLURM_EARLY_S} ] && [ "${{idle:-0}}" -lt {MAX_IDLE_REQUEUES} ]; then
        requeue=1 idle=$((${{idle:-0}} + 1))
    elif [ -n "$left" ] && [ "$left" -le {lead + SLURM_EARLY_S} ]; then
        echo "trimtab: stopped at the time limit with no checkpoint newer than step ${{START_STEP:-0}}" \\
            "after {MAX_IDLE_REQUEUES} requeues in a row: not queued again (give it a longer --time)"
    else
        echo "trimtab: stopped by SIGTERM with ${{left:-unknown}} s left and no checkpoint newer than step" \\
            "${{START_STEP:-0}}: a rank failed (torchrun stopped the others; its error is above), not queued again"
    fi
fi
rm -f "$STARTED"
if [ "$requeue" = 1 ]; then
    echo "$SLURM_JOB_ID $idle" > "$IDLE"
    echo "trimtab: stopped before the time limit, not finished: requeued to resume from its checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
fi
"""


def _slurm(plan: Plan, config: str | None, run_dir: str) -> str:
    nodes, per_node = _nodes(plan)
    grace = stop_s(plan)
    torchrun = _torchrun(nodes, per_node, f"$HEAD:{PORT}", "$SLURM_JOB_ID", grace)
    command = _shell(torchrun + _train_args(plan, config) + ["--out", "$RUN_DIR"])
    b = plan.layout.best
    lead = max(SLURM_LEAD_S, grace + MARGIN_S)
    return f"""#!/bin/bash
# trimtab plan --emit slurm: {plan.preset} on {plan.layout.gpus} x {plan.layout.gpu}
# layout: pp {b.pp} x tp {b.tp} x dp {b.dp} (ep {b.ep}, {b.strategy}), micro-batch {b.micro_batch_tokens} tokens
#SBATCH --job-name=trimtab-{plan.preset}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --cpus-per-task={8 * per_node}
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=TERM@{lead}
# EDIT: --partition, --account, --time as the site asks
set -euo pipefail
RUN_DIR={shlex.quote(run_dir)}  # EDIT: the run directory (the config's out), on storage every node mounts
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=8
mkdir -p "$RUN_DIR"
STARTED=$(mktemp -p "$RUN_DIR" .slurm-job.XXXXXX)  # this job's start, by the run directory's clock
{_SLURM_HELPERS}START_STEP=$(newest)
# one torchrun agent a node; SIGTERM before the time limit reaches srun's tasks (not B:, which signals only
# this shell): each rank finishes its step, saves and exits 143, its summary.json says "stopped (SIGTERM)"
# ("... during start-up)" before its first step); torchrun's agent, signalled too, waits {grace} s for that
# (--shutdown-timeout: the plan's estimate of the steps and saves a stop takes, doubled), then kills them,
# and exits 1
status=0
srun --kill-on-bad-exit=0 {command} || status=$?
# --requeue brings a job back after a node failure or a preemption, never after its time limit: a run the
# SIGTERM above stopped (its summary.json, written by this job, says so) is queued again here to resume from
# its checkpoint. torchrun's agent also SIGTERMs the other ranks when one FAILS (a crash, a bug, a bad GPU),
# and they write the same summary: queued again on it, a failure that recurs looped forever. So the stop is
# queued again when it came near the time limit (the time left within the warning, {lead} s, + {SLURM_EARLY_S} s)
# or when the run saved a checkpoint newer than the one this job started from (a failure after progress gets
# one more try, from there); never a stop with time left and no new checkpoint, nor more than
# {MAX_IDLE_REQUEUES} time-limit requeues in a row without one (a start-up longer than --time; the count is in
# $RUN_DIR/.slurm-requeues, by job id: SLURM_RESTART_COUNT counts Slurm's own requeues too). Not a finished
# run, nor one that failed without that summary, nor one scancel ended (it signals this shell too)
{_slurm_requeue(lead)}exit "$status"
"""


def _k8s(plan: Plan, config: str | None) -> str:
    nodes, per_node = _nodes(plan)
    name = f"trimtab-{plan.preset}".replace(".", "-").lower()
    endpoint = f"{name}-master-0:{PORT}"
    grace = stop_s(plan)
    # the run directory on the volume every pod mounts: checkpoints outlive a pod
    command = _torchrun(nodes, per_node, endpoint, name, grace) + _train_args(plan, config)
    command += ["--set", f"out=/runs/{name}"]

    def replica(count: int) -> dict:
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {
                "spec": {
                    # SIGTERM reaches torchrun (the container's first process), which waits `grace` for
                    # its ranks' stop-and-save; the pod's default 30 s would kill them first
                    "terminationGracePeriodSeconds": grace + MARGIN_S,
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": "trimtab:latest",  # EDIT: the image built from the repository's Dockerfile
                            "command": list(command),  # a list each: no YAML anchors
                            "env": [{"name": "OMP_NUM_THREADS", "value": "8"}],
                            "resources": {"limits": {"nvidia.com/gpu": per_node}},
                            "volumeMounts": [{"name": "runs", "mountPath": "/runs"}],
                        }
                    ],
                    "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": "trimtab-runs"}}],  # EDIT
                }
            },
        }

    specs = {"Master": replica(1)} | ({"Worker": replica(nodes - 1)} if nodes > 1 else {})
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {"app": "trimtab", "preset": plan.preset}},
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": nodes,
                "maxReplicas": nodes,
                "maxRestarts": MAX_RESTARTS,
            },
            # restartPolicy OnFailure restarts a container whose torchrun gave up (its own restarts spent: a rank
            # that fails again and again) without end unless backoffLimit caps the restarts of the job's running
            # pods; a pod evicted or preempted comes back as a new pod, its restarts at 0: not counted. The training
            # operator sums the restarts of every running pod's containers (PastBackoffLimit), and when one node's
            # torchrun gives up the others' rendezvous fails too: a round restarts up to every node's container,
            # so a bare MAX_RESTARTS was spent by one round on 3 or more nodes. MAX_RESTARTS rounds of all nodes
            "runPolicy": {"backoffLimit": MAX_RESTARTS * nodes},
            "pytorchReplicaSpecs": specs,
        },
    }
    b = plan.layout.best
    head = (
        f"# trimtab plan --emit k8s: {plan.preset} on {plan.layout.gpus} x {plan.layout.gpu}; layout pp {b.pp} x "
        f"tp {b.tp} x dp {b.dp} (ep {b.ep}, {b.strategy})\n"
    )
    return head + dump_yaml(job)
