"""`trimtab plan --emit slurm|k8s` (plan/launch.py) and the Dockerfile: the files parse (bash -n,
YAML) and carry the plan's numbers: nodes, GPUs a node, the layout's settings, the checkpoint
interval of its resilience section."""

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from trimtab.cli import main

ROOT = Path(__file__).parent.parent


def plan(tmp_path: Path, emit: str, capsys) -> tuple[dict, str]:
    args = ["plan", "--preset", "dense-1b", "--gpu", "H100", "--gpus", "16", "--out", str(tmp_path), "--emit", emit]
    assert main(args) == 0
    assert "launch." in capsys.readouterr().out
    saved = json.loads((tmp_path / "plan.json").read_text())
    name = {"slurm": "launch.sbatch", "k8s": "launch.yaml"}[emit]
    return saved, (tmp_path / name).read_text()


def settings(saved: dict) -> list[str]:
    best = saved["layout"]["best"]
    return [f"train.micro_batch_tokens={best['micro_batch_tokens']}", f"distributed.strategy={best['strategy']}"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash checks the script's syntax")
def test_the_slurm_script_parses_and_carries_the_plan(tmp_path, capsys):
    saved, script = plan(tmp_path, "slurm", capsys)
    assert subprocess.run(["bash", "-n", str(tmp_path / "launch.sbatch")]).returncode == 0
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d" in script and "-m trimtab train" in script
    assert all(f"--set {s}" in script for s in settings(saved))
    every = int(re.search(r"checkpoint\.every=(\d+)", script).group(1))
    assert every > 1 and "checkpoint.asynchronous=true" in script


def test_the_pytorchjob_parses_and_carries_the_plan(tmp_path, capsys):
    saved, text = plan(tmp_path, "k8s", capsys)
    job = yaml.safe_load(text)
    assert job["kind"] == "PyTorchJob" and job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] + specs["Worker"]["replicas"] == 2
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    command = " ".join(container["command"])
    assert command.startswith("torchrun --nnodes=2 --nproc_per_node=8") and "out=/runs/" in command
    assert all(s in container["command"] for s in settings(saved))


def test_the_pytorchjob_does_not_restart_a_failing_rank_forever(tmp_path, capsys):
    """restartPolicy OnFailure with no backoffLimit: a container whose torchrun spent its restarts on a
    rank that fails each time was restarted by the kubelet without end (the training operator counts
    no limit unless runPolicy.backoffLimit is set)."""
    from trimtab.plan.launch import MAX_RESTARTS

    _, text = plan(tmp_path, "k8s", capsys)
    spec = yaml.safe_load(text)["spec"]
    assert all(r["restartPolicy"] == "OnFailure" for r in spec["pytorchReplicaSpecs"].values())
    # the operator sums every running pod's restarts, and a round of torchrun giving up restarts each node's
    # container: a bare MAX_RESTARTS was spent by a round and a half on these 2 nodes (one on 3 or more)
    nodes = sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values())
    assert nodes == 2 and spec["runPolicy"]["backoffLimit"] == MAX_RESTARTS * nodes


def test_a_launch_file_edited_for_a_site_is_kept_when_planned_again(tmp_path, capsys):
    """--emit overwrote launch.sbatch, the EDIT lines a person filled in (partition, account) lost."""
    _, script = plan(tmp_path, "slurm", capsys)
    edited = script.replace("# EDIT: --partition", "#SBATCH --partition=gpu\n# EDIT: --partition")
    (tmp_path / "launch.sbatch").write_text(edited)
    args = ["plan", "--preset", "dense-1b", "--gpu", "H100", "--gpus", "8", "--out", str(tmp_path), "--emit", "slurm"]
    assert main(args) == 0
    assert f"the one before kept as {tmp_path / 'launch.sbatch.1.bak'}" in capsys.readouterr().out
    assert (tmp_path / "launch.sbatch.1.bak").read_text() == edited
    assert "#SBATCH --nodes=1" in (tmp_path / "launch.sbatch").read_text()
    plan(tmp_path, "slurm", capsys)  # 16 GPUs again: the 8-GPU file differs, kept too
    plan(tmp_path, "slurm", capsys)  # the same file again: nothing to keep
    kept = sorted(p.name for p in tmp_path.glob("launch.sbatch*"))
    assert kept == ["launch.sbatch", "launch.sbatch.1.bak", "launch.sbatch.2.bak"]


def test_emitting_needs_a_layout_that_fits(tmp_path, capsys):
    assert main(["plan", "--preset", "debug", "--out", str(tmp_path), "--emit", "slurm"]) == 2
    assert "plan --emit needs a layout" in capsys.readouterr().err


def test_the_dockerfile_installs_the_torch_the_constraints_pin():
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"torch=={pinned}" in dockerfile and "-c constraints.txt" in dockerfile


# Slurm's commands as the generated script calls them: `srun` (the job step: it copies the summary
# the case gives into the run directory the script passed as --out, as rank 0 would write it, saves
# the checkpoint the case gives, and exits as torchrun's agent does), `scontrol` (records each call;
# `show job` prints the case's JOB_INFO) and `squeue` (the job's time left, as the case gives it)
FAKE_SRUN = """#!/bin/bash
out=""
while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done
[ -n "$out" ] || exit 3
[ -z "${CKPT:-}" ] || mkdir -p "$out/checkpoints/step_$CKPT"
[ -z "${SUMMARY:-}" ] || cp "$SUMMARY" "$out/summary.json"
exit "$RC"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "$CALLS"
[ "$*" != "show job $SLURM_JOB_ID" ] || { echo "${JOB_INFO:-}"; exit 0; }
[ "$1" != show ] || echo node1
"""
FAKE_SQUEUE = """#!/bin/bash
echo "$LEFT"
"""
NEAR_THE_LIMIT = "2:40"  # squeue's time left (%L) when the warning before the time limit stopped the run


def slurm_job(tmp_path: Path):
    """job(summary folder or None, the agent's exit status, the time left, the step of a checkpoint
    saved) -> (the script's exit status, its scontrol calls): tmp_path/launch.sbatch run with the
    stand-ins for srun, scontrol and squeue."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("squeue", FAKE_SQUEUE)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "42"}
    env |= {"SLURM_JOB_NODELIST": "node[1-2]", "CALLS": str(tmp_path / "calls")}
    env.pop("SLURM_JOB_END_TIME", None)  # a suite run inside a Slurm job: each case gives its own

    def job(
        summary: str | None, rc: int, left: str = NEAR_THE_LIMIT, saved: int | None = None, **extra: str
    ) -> tuple[int, list[str]]:
        (tmp_path / "calls").write_text("")
        case = env | {"RC": str(rc), "LEFT": left} | ({"CKPT": f"{saved:06d}"} if saved is not None else {})
        case |= extra
        case |= {"SUMMARY": str(tmp_path / summary / "summary.json")} if summary else {}
        done = subprocess.run(["bash", str(tmp_path / "launch.sbatch")], cwd=tmp_path, env=case, capture_output=True)
        (tmp_path / "stdout").write_bytes(done.stdout)
        return done.returncode, (tmp_path / "calls").read_text().splitlines()

    return job


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash runs the script")
def test_the_slurm_script_requeues_a_run_the_time_limit_stopped_and_nothing_else(tmp_path, capsys):
    """--requeue does not bring back a job that ended at its time limit: the ranks saved on the
    SIGTERM before it and ended, and the run silently stopped. The script queues it again when this
    job's summary.json says the SIGTERM stopped it; not a finished run, nor one that crashed after
    an earlier job's stop."""
    from trimtab.rundir import read_json, write_summary

    plan(tmp_path, "slurm", capsys)
    for status in ("stopped (SIGTERM)", "completed"):
        (tmp_path / status.split()[0]).mkdir()
        write_summary(tmp_path / status.split()[0], {"status": status, "step": 7, "total_steps": 40})
    job = slurm_job(tmp_path)

    # the agent, signalled too, exits 1; rank 0 wrote "stopped (SIGTERM)"
    assert job("stopped", 1) == (1, ["show hostnames node[1-2]", "requeue 42"])
    assert job("completed", 0) == (0, ["show hostnames node[1-2]"])  # finished: not again
    summary = tmp_path / "runs" / "dense-1b" / "summary.json"
    write_summary(summary.parent, read_json(tmp_path / "stopped" / "summary.json"))
    os.utime(summary, (summary.stat().st_mtime - 60,) * 2)  # an earlier job's: this one crashed before writing
    assert job(None, 1) == (1, ["show hostnames node[1-2]"])
    assert list(summary.parent.glob(".slurm-job.*")) == []  # the job's stamp is gone


def test_the_launch_files_give_a_large_models_stop_and_save_its_time():
    """On SIGTERM every rank finishes its step and saves, but torchrun's agent, signalled too, kills
    its workers 30 s after forwarding it (--shutdown-timeout's default), the script warned 120 s
    before the time limit and a pod's grace is 30 s: dense-70b on 64 H100s (788 GiB of weights and
    AdamW state, a step estimated at minutes) was killed in its stop: no checkpoint, no summary, no
    requeue. Each now waits at least two steps and two writes at the plan's bandwidths."""
    from trimtab.config import load_config
    from trimtab.plan.launch import launch_file
    from trimtab.plan.memory import named_gpu
    from trimtab.plan.report import make_plan
    from trimtab.plan.resilience import FS_BYTES_PER_S, WRITE_BYTES_PER_S

    plan = make_plan(load_config(None, preset="dense-70b"), hardware=named_gpu("H100", 64))
    write = plan.resilience.state_bytes / min(64 * WRITE_BYTES_PER_S, FS_BYTES_PER_S)
    needed = 2 * plan.layout.best.step_s + 2 * write  # asynchronous saves: one in flight, then the last
    script = launch_file(plan, "slurm", None)[1]
    grace = int(re.search(r"--shutdown-timeout=(\d+)", script).group(1))
    lead = int(re.search(r"#SBATCH --signal=TERM@(\d+)", script).group(1))
    assert "checkpoint.asynchronous=true" in script and needed < grace < lead
    pod = yaml.safe_load(launch_file(plan, "k8s", None)[1])["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert f"--shutdown-timeout={grace}" in pod["spec"]["containers"][0]["command"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > grace


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash runs the script")
def test_a_sigterm_in_start_up_writes_a_summary_and_the_slurm_script_requeues_it(tmp_path, capsys):
    """A SIGTERM before the first step (the data read, the model built, a restart near the time
    limit) ended the call and wrote no summary.json, so the script's requeue rule never saw it and
    the run silently stopped. Now rank 0 writes one saying so, resumable, and the job is queued again."""
    from trimtab.training.services.signals import StartUpInterrupted, handle_signals

    plan(tmp_path, "slurm", capsys)
    run = tmp_path / "start-up"
    (run / "checkpoints" / "step_000012").mkdir(parents=True)  # where a re-run resumes
    with pytest.raises(StartUpInterrupted), handle_signals(run_dir=run):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode: here
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped (SIGTERM during start-up)" and summary["resumable"] is True
    assert (summary["step"], summary["steps_this_session"]) == (12, 0)
    assert slurm_job(tmp_path)("start-up", 1) == (1, ["show hostnames node[1-2]", "requeue 42"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash runs the script")
def test_the_slurm_script_does_not_requeue_a_rank_failure_forever(tmp_path, capsys):
    """torchrun's agent SIGTERMs the other ranks when one fails; they wrote "stopped (SIGTERM ...)" as
    on the time limit's warning, and the script queued the job again, for ever where the failure
    recurs. Now a stop with time left is queued again only when the run saved a newer checkpoint, and
    one at the time limit without a newer checkpoint at most MAX_IDLE_REQUEUES times in a row."""
    from trimtab.plan.launch import MAX_IDLE_REQUEUES
    from trimtab.rundir import write_summary

    plan(tmp_path, "slurm", capsys)
    for name, status in (("failed", "stopped (SIGTERM)"), ("start-up", "stopped (SIGTERM during start-up)")):
        (tmp_path / name).mkdir()
        write_summary(tmp_path / name, {"status": status, "step": 7, "total_steps": 40})
    job, queued = slurm_job(tmp_path), (1, ["show hostnames node[1-2]", "requeue 42"])
    not_queued = (1, ["show hostnames node[1-2]"])
    assert job("failed", 1, left="1-03:59:12") == not_queued  # a rank failed hours before the limit
    assert "a rank failed (torchrun stopped the others" in (tmp_path / "stdout").read_text()
    assert job("start-up", 1, left="3:59:12") == not_queued  # ... in start-up, where rank 0 waited for it
    assert job("failed", 1, left="3:59:12", saved=7) == queued  # it trained and saved first: one more try
    assert job("failed", 1, left="3:58:40") == not_queued  # from there it fails again at once: no more
    # neither squeue nor scontrol can say: not taken for the time limit
    assert job("start-up", 1, left="") == (1, not_queued[1] + ["show job 42"])
    for _ in range(MAX_IDLE_REQUEUES):  # at the time limit, still in start-up (longer than --time)
        assert job("start-up", 1) == queued
    assert job("start-up", 1) == not_queued
    assert "after 3 requeues in a row: not queued again" in (tmp_path / "stdout").read_text()
    assert job("start-up", 1, saved=8) == queued  # a newer checkpoint: the count starts again
    assert job("start-up", 1) == queued


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash runs the script")
def test_the_slurm_script_requeues_a_time_limit_stop_without_squeue(tmp_path, capsys):
    """The time left came from squeue only: on a node without it (or when it failed) a stop at the time
    limit with no newer checkpoint read as a rank failure, "unknown s left", and the run silently
    stopped. Now scontrol's EndTime, else Slurm's SLURM_JOB_END_TIME, gives it, still at most
    MAX_IDLE_REQUEUES times in a row."""
    import time

    from trimtab.plan.launch import MAX_IDLE_REQUEUES
    from trimtab.rundir import write_summary

    plan(tmp_path, "slurm", capsys)
    (tmp_path / "start-up").mkdir()
    write_summary(tmp_path / "start-up", {"status": "stopped (SIGTERM during start-up)", "step": 7, "total_steps": 40})
    job = slurm_job(tmp_path)
    (tmp_path / "bin" / "squeue").unlink()  # not on the node
    soon, later = int(time.time()) + 150, int(time.time()) + 4 * 3600
    at = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(soon))  # scontrol's EndTime, the node's local time
    queued = (1, ["show hostnames node[1-2]", "show job 42", "requeue 42"])
    assert job("start-up", 1, JOB_INFO=f"   StartTime=2026-01-01T00:00:00 EndTime={at} Deadline=N/A") == queued
    assert job("start-up", 1, SLURM_JOB_END_TIME=str(soon)) == queued  # scontrol cannot say either
    assert job("start-up", 1, SLURM_JOB_END_TIME=str(later))[1] == queued[1][:2]  # hours left: a rank failed
    assert "with 14" in (tmp_path / "stdout").read_text()  # ~14400 s left, not "unknown"
    assert job("start-up", 1, SLURM_JOB_END_TIME=str(soon)) == queued
    assert MAX_IDLE_REQUEUES == 3 and job("start-up", 1, SLURM_JOB_END_TIME=str(soon))[1] == queued[1][:2]
