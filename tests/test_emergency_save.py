"""A DDP survivor's emergency save (training/emergency.py): a peer lost inside a step's collectives
leaves rank 0 with the last completed step's weights and optimizer, which it saves alone.

In one process: the lost peer is a collective raising gloo's error (what rank 0 saw when torchrun's
`--inject kill_rank@7:1` killed rank 1: docs/resilience.md), and the save is allowed as under DDP."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from trimtab.api import built_in_hooks
from trimtab.cli_train import _peer_lost_exit, _peer_was_lost
from trimtab.config import load_config
from trimtab.orchestrator import core
from trimtab.resilience.elastic import SESSION_ENV
from trimtab.resilience.watchdog import Watchdog
from trimtab.resilience.watchdogs import NoWatchdog
from trimtab.rundir import read_metrics
from trimtab.training import emergency
from trimtab.training.emergency import EmergencySave, emergency_resume_line, every_ranks_rng, peer_lost
from trimtab.training.hooks import Hook
from trimtab.training.setup import setup
from trimtab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

GLOO = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13971. This is typically caused by"
SETS = [
    "train.max_steps=3",
    "train.eval_every=0",
    "train.log_every=100",
    "log.progress=false",
    "log.tensorboard=false",
    "data.max_bytes=100000",
    "model.n_layers=1",
    "train.precision=fp32",
]


def trainer(out, every: int, *sets: str) -> Trainer:
    cfg = load_config(preset="debug", overrides={"out": str(out)}, sets=[*SETS, f"checkpoint.every={every}", *sets])
    return Trainer(setup(cfg), hooks=built_in_hooks(cfg))


def lose_peer_in(t: Trainer, step: int, monkeypatch, then=None) -> list[float]:
    """The step's gradient all-reduce fails as rank 1 dies in step `step`; DDP's conditions hold; `then()` runs
    first. The loss's time (time.monotonic()) goes into the list returned."""
    reduce, when = t.dist.reduce_step, []

    def reduce_step(*args, **kwargs):
        if t.state.step + 1 == step:
            if then is not None:
                then()
            when.append(time.monotonic())
            raise RuntimeError(GLOO)
        return reduce(*args, **kwargs)

    monkeypatch.setattr(t.dist, "reduce_step", reduce_step)
    monkeypatch.setattr(t, "emergency_save_possible", lambda: None, raising=False)  # old code: none
    return when


def test_a_peer_lost_mid_step_leaves_the_last_completed_step_saved_as_a_normal_save_would(tmp_path, monkeypatch, capfd):
    """Checkpoints every 3 steps, rank 1 lost in step 3: step 2 is saved (it was lost before), its weights,
    optimizer, data position and RNG bit for bit those of an undisturbed run's save of step 2, and the
    restart resumes from it, saying so, and ends as the undisturbed run. The survivor says the loss in one line,
    the save's, which says where the run resumes: the CLI's exit line is left out after it."""
    plain = trainer(tmp_path / "plain", every=1)
    plain.fit()
    hit = trainer(tmp_path / "hit", every=3)
    lose_peer_in(hit, 3, monkeypatch)
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="Connection closed by peer") as lost:
        hit.fit()
    with monkeypatch.context() as torchrun:
        torchrun.setenv("WORLD_SIZE", "2")
        assert _peer_was_lost(lost.value) and _peer_lost_exit(lost.value, tmp_path / "hit") == 1
    said = [line for line in capfd.readouterr().err.splitlines() if "peer was lost" in line]
    assert len(said) == 1 and said[0].endswith(  # before: the save's line, then the CLI's exit line
        "torchrun restarts the job from step 2 (--max-restarts), or the same command resumes it"
    )
    saved = sorted(p.name for p in (tmp_path / "hit" / "checkpoints").glob("step_*"))
    assert saved == ["step_000000", "step_000002"]  # before: step 0 only
    ours, theirs = tmp_path / "hit/checkpoints/step_000002", tmp_path / "plain/checkpoints/step_000002"
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (torch.load(p / "optim.pt", weights_only=False) for p in (ours, theirs))
    moments = [
        (oa["optimizer"]["state"][i][m], ob["optimizer"]["state"][i][m])
        for i in ob["optimizer"]["state"]
        for m in ("exp_avg", "exp_avg_sq", "step")
    ]
    assert len(moments) > 3 and all(torch.equal(x, y) for x, y in moments)
    assert torch.equal(oa["rng"]["torch"], ob["rng"]["torch"])
    assert torch.equal(oa["row_gate"], ob["row_gate"])  # the gate's token tables, taken back to the step's start
    sa, sb = (json.loads((p / "state.json").read_text()) for p in (ours, theirs))
    assert sa["data"] == sb["data"] and sa["row_gate"] == sb["row_gate"]
    assert {k: v for k, v in sa["train"].items() if k != "train_seconds"} == {
        k: v for k, v in sb["train"].items() if k != "train_seconds"
    }
    lost = "RuntimeError: Connection closed by peer, the peer at 127.0.0.1:13971"  # GLOO's words and address
    assert sa["emergency"] == {"rank": 0, "error": lost} and sa["good"] is False

    capfd.readouterr()
    again = trainer(tmp_path / "hit", every=3)
    assert again.state.step == 2 and "resuming from step 2, an emergency save" in capfd.readouterr().err
    again.fit()
    end, base = again.model.state_dict(), plain.model.state_dict()
    assert all(torch.equal(end[k], base[k]) for k in base)


def test_no_emergency_save_once_the_update_began_nor_where_a_lost_rank_held_shards(tmp_path, monkeypatch):
    """A failure after the optimizer step began (the weights are no completed step's) saves nothing,
    and a sharded or one-process run says why it cannot."""
    hit = trainer(tmp_path / "late", every=3)
    monkeypatch.setattr(hit, "emergency_save_possible", lambda: None)
    update = hit._update

    def failing_update(skip):
        update(skip)
        if hit.state.step + 1 == 3:
            raise RuntimeError(GLOO)  # (in truth no collective runs here: the window is what is tested)

    monkeypatch.setattr(hit, "_update", failing_update)
    with pytest.raises(RuntimeError):
        hit.fit()
    assert not (tmp_path / "late/checkpoints/step_000002").exists()
    assert "no peer" in Trainer.emergency_save_possible(hit)
    monkeypatch.setattr(type(hit.dist), "sharded", property(lambda self: True))
    monkeypatch.setattr(hit.dist, "world", 2)
    assert "shards" in Trainer.emergency_save_possible(hit)
    assert (
        peer_lost(RuntimeError(GLOO))
        and not peer_lost(RuntimeError("shape mismatch"))
        and not peer_lost(ValueError("Connection closed by peer"))
    )


EVAL = ("train.max_steps=5", "train.eval_every=2", "train.eval_tokens=256")


def test_a_peer_lost_in_an_evaluation_leaves_its_step_saved_as_an_undisturbed_save_would(tmp_path, monkeypatch):
    """Evaluations every 2 steps, checkpoints every 3, rank 1 lost in step 4's evaluation: step 4, complete, is
    saved (before: the restart went back to step 3), with an undisturbed save's weights, optimizer, RNG, data
    position and training state: what the restart resumes is the undisturbed run's."""
    plain = trainer(tmp_path / "plain", 4, *EVAL)
    plain.fit()
    hit = trainer(tmp_path / "hit", 3, *EVAL)
    monkeypatch.setattr(hit, "emergency_save_possible", lambda: None)
    evaluate = hit.evaluate

    def failing(*args):
        if hit.state.step == 4:
            raise RuntimeError(GLOO)  # its held-out loss summed over the ranks
        return evaluate(*args)

    monkeypatch.setattr(hit, "evaluate", failing)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    saved = sorted(p.name for p in (tmp_path / "hit" / "checkpoints").glob("step_*"))
    assert saved == ["step_000000", "step_000003", "step_000004"]
    ours, theirs = tmp_path / "hit/checkpoints/step_000004", tmp_path / "plain/checkpoints/step_000004"
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (torch.load(p / "optim.pt", weights_only=False) for p in (ours, theirs))
    assert torch.equal(oa["rng"]["torch"], ob["rng"]["torch"])
    moments = ob["optimizer"]["state"].items()
    assert all(torch.equal(oa["optimizer"]["state"][i]["exp_avg"], m["exp_avg"]) for i, m in moments)
    sa, sb = (json.loads((p / "state.json").read_text()) for p in (ours, theirs))
    assert sa["data"] == sb["data"] and sa["row_gate"] == sb["row_gate"]
    assert {k: v for k, v in sa["train"].items() if k != "train_seconds"} == {
        k: v for k, v in sb["train"].items() if k != "train_seconds"
    }


def test_with_rank_0_lost_another_survivor_claims_the_emergency_save(tmp_path, monkeypatch):
    """Rank 0 lost in step 3: rank 1, a survivor holding the same replica, saves step 2 (before: no rank but 0
    ever saved, and the restart went back to step 0). An earlier session's claim of the step is taken over; a
    third survivor, finding this one's claim, writes nothing."""
    monkeypatch.setattr(emergency, "RANK_0_FIRST_S", 0.0, raising=False)  # old code: none
    hit = trainer(tmp_path / "hit", 3)
    lose_peer_in(hit, 3, monkeypatch)
    monkeypatch.setattr(hit.dist, "rank", 1)
    earlier = tmp_path / "hit/checkpoints/.emergency_step_000002"
    earlier.touch()
    os.utime(earlier, (0, 0))  # a session killed in its emergency save of step 2
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    state = json.loads((tmp_path / "hit/checkpoints/step_000002/state.json").read_text())
    assert state["emergency"]["rank"] == 1 and state["train"]["step"] == 2
    assert not hit._claim(2)  # another survivor of this session
    again = trainer(tmp_path / "hit", 3)
    assert again.state.step == 2


@pytest.mark.parametrize("rank", [0, 1])
def test_a_peer_lost_where_no_emergency_save_is_sound_says_so_once_and_where_the_restart_resumes(
    tmp_path, monkeypatch, capfd, rank
):
    """FSDP2 (the lost rank held shards): a peer lost in step 3 saves nothing, and the survivor that claims the
    step says why and that the restart resumes from step 0, rank 1 too (rank 0 lost) though its other lines are
    silenced as under torchrun (before: nothing said, the restart went back silently)."""
    monkeypatch.setattr(emergency, "RANK_0_FIRST_S", 0.0)
    hit = trainer(tmp_path / "fsdp", every=3)
    lose_peer_in(hit, 3, monkeypatch)
    shards = "FSDP2, tensor, expert or pipeline parallelism: the lost rank held shards of the state"
    monkeypatch.setattr(hit, "emergency_save_possible", lambda: shards)
    monkeypatch.setattr(hit.dist, "rank", rank)
    capfd.readouterr()
    quiet = logging.getLogger("trimtab")
    level, _ = quiet.level, quiet.setLevel(logging.ERROR if rank else quiet.level)  # distributed/parallel.py
    try:
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            hit.fit()
    finally:
        quiet.setLevel(level)
    said = [line for line in capfd.readouterr().err.splitlines() if "no emergency save" in line]
    assert said == [
        f"{'trimtab: rank 1: ' if rank else ''}step 2: a peer was lost (RuntimeError: Connection closed by peer, "
        "the peer at 127.0.0.1:13971); "
        f"no emergency save ({shards}): the restart resumes from the last checkpoint, step 0"
    ]
    assert sorted(p.name for p in (tmp_path / "fsdp" / "checkpoints").glob("step_*")) == ["step_000000"]


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
def test_a_claims_staleness_holds_with_this_nodes_clock_off_from_the_file_systems(tmp_path, monkeypatch, skew):
    """Rank 1 on a node whose clock is an hour ahead (behind) of the shared file system's: rank 0's claim of
    this session, made now, is kept (before: read as an earlier session's, removed, and both wrote the step);
    an earlier session's claim, made a minute before this one began, is taken over (before: kept, so no
    survivor wrote the step)."""
    fake = SimpleNamespace(time=lambda: time.time() + skew, sleep=lambda s: None, perf_counter=time.perf_counter)
    monkeypatch.setattr(emergency, "time", fake)
    survivor = EmergencySave()
    survivor.cfg = SimpleNamespace(run_dir=tmp_path)
    survivor.dist = SimpleNamespace(rank=1, is_main=False, world=1)
    survivor.mark_step_start()  # this session's first step
    time.sleep(0.05)  # past the coarse clock file systems stamp mtimes with (a jiffy)
    claims = tmp_path / "checkpoints"
    claims.mkdir()
    (claims / ".emergency_step_000002").touch()  # rank 0's, on a node whose clock is the file system's
    earlier = claims / ".emergency_step_000005"
    earlier.touch()
    os.utime(earlier, (time.time() - 60, time.time() - 60))  # a session killed in its emergency save
    assert not survivor._claim(2)
    assert survivor._claim(5)
    assert sorted(p.name for p in claims.iterdir()) == [".emergency_step_000002", ".emergency_step_000005"]


def test_the_emergency_saves_rng_gives_every_rank_the_writers_stream_on_its_own_gpu():
    """Rank 1 writes on cuda:1 for 3 GPUs: every rank drew alike on its own GPU, so each must get the state of
    cuda:1 for its device (before: the writer's whole list, whose cuda:0 and cuda:2 no rank of it had drawn
    on, so the restart's rank 0 and 2 went on from their seed's stream). The CPU stream is kept; a CPU run's
    RNG is left as it is."""
    cpu = torch.get_rng_state()
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(3)]
    rng = every_ranks_rng({"torch": cpu, "cuda": states}, torch.device("cuda", 1))
    assert torch.equal(rng["torch"], cpu) and len(rng["cuda"]) == 3
    assert all(torch.equal(s, states[1]) for s in rng["cuda"])
    plain = {"torch": cpu}
    assert every_ranks_rng(plain, torch.device("cpu")) is plain


def test_a_resume_from_an_emergency_save_says_every_rank_has_the_writers_row_gate_reference():
    """Each rank's row gate reference is its own rows' and an emergency save holds the writer's alone: on 2
    ranks every rank resumes with it (a 2-rank resume: 2,832 of 40,960 counts off on the other rank), which
    the restart's line now says (before: only who wrote the save). One process, or no gate: nothing to say."""
    state = {"emergency": {"rank": 1, "error": "RuntimeError: Connection closed by peer"}, "train": {"step": 19}}
    gated = {**state, "row_gate": {"frequencies": [3, 1]}}
    said = emergency_resume_line(gated, world=2)
    assert said.startswith("resuming from step 19, an emergency save: rank 1 wrote it alone")
    assert "every rank resumes with rank 1's row gate reference" in said
    assert "row gate" not in emergency_resume_line(gated, world=1) + emergency_resume_line(state, world=2)


class _Survivor(EmergencySave):
    """A trainer as far as a signal handler goes: a survivor whose collective may have failed for a lost peer."""

    stop_reason = ""
    dist = SimpleNamespace(on_signal=lambda name: "")
    watchdog = NoWatchdog()

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason


def test_a_lost_peers_words_name_its_address_from_gloos_message():
    """A survivor's line for a lost peer said "Connection reset by peer" alone: a peer on another host
    (torchrun --nnodes 2, one agent's worker killed) was not named. gloo's message names the pair's other
    end; its source path's bracket, and a failure that is no lost peer's, name no address."""
    reset = (
        "Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/"
        "gloo/transport/tcp/pair.cc:537] Read error [10.0.0.7]:28559: Connection reset by peer. This is typically"
    )
    closed = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [fe80::1]:9886"
    words = emergency.lost_words
    assert words(RuntimeError(reset)) == "RuntimeError: Connection reset by peer, the peer at 10.0.0.7:28559"
    assert words(RuntimeError(closed)) == "RuntimeError: Connection closed by peer, the peer at fe80::1:9886"
    assert words(RuntimeError("[x.cc:5] Broken pipe")) == "RuntimeError: Broken pipe"
    assert words(RuntimeError("bad [1.2.3.4]:5")) == "RuntimeError: bad [1.2.3.4]:5"


def test_torchruns_sigterm_to_a_survivor_names_the_lost_peer_not_a_stop_after_the_step(capfd):
    """torchrun's agent SIGTERMs the survivors as it sees a rank gone; a survivor took it as gloo's error
    unwound and said "stopping after this step and saving" before the emergency save's line: the cause is
    the lost peer (the exception in flight, or one the trainer caught), not a stop after the step."""
    from trimtab.training.services.signals import SignalHandler

    before = signal.getsignal(signal.SIGINT)  # the handler sets Python's own back (a second Ctrl-C)
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9886")
        except RuntimeError:
            SignalHandler(_Survivor())(signal.SIGTERM, None)  # as gloo's error unwinds
        caught = _Survivor()
        caught.peer_lost_as = "RuntimeError: Connection reset by peer"  # saving_if_a_peer_is_lost caught it
        SignalHandler(caught)(signal.SIGTERM, None)
        SignalHandler(_Survivor())(signal.SIGTERM, None)  # a scheduler's SIGTERM: no peer lost, no line yet
    finally:
        signal.signal(signal.SIGINT, before)
    assert capfd.readouterr().err.splitlines() == [  # the stop's line comes as the ranks agree (Trainer._agree)
        "trimtab: SIGTERM: torchrun's agent ends the survivors of a lost peer (RuntimeError: Connection closed by "
        "peer, the peer at 127.0.0.1:9886)",
        "trimtab: SIGTERM: torchrun's agent ends the survivors of a lost peer (RuntimeError: Connection reset by peer)",
    ]


def test_torchruns_sigterm_before_a_survivors_collective_failed_names_the_peer_whose_process_ended(
    tmp_path, monkeypatch, capfd
):
    """A survivor computing when its peer was killed takes torchrun's SIGTERM before any collective of its own
    failed: nothing in flight, nothing caught, and it said "stopping after this step and saving" (before). Its
    peer on this host beat with a pid that has ended since (reaped by the agent, or a zombie not yet): named. A
    peer still running (the scheduler's SIGTERM reaches every rank) leaves the stop, whose line comes as the ranks
    agree on it (Trainer._agree)."""
    from trimtab.training.services.signals import SignalHandler

    monkeypatch.setenv(SESSION_ENV, "s1")  # the beats of this session only are read
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's: ranks 0 and 1 on this node
    dog = Watchdog(tmp_path, 0, 2, first_timeout_s=60, timeout_factor=3, min_timeout_s=60, beat_s=10)
    ended = subprocess.Popen(["true"])
    ended.wait()
    running = subprocess.Popen(["sleep", "30"])
    before = signal.getsignal(signal.SIGINT)
    try:
        for pid in (ended.pid, running.pid):
            beat = {"rank": 1, "host": socket.gethostname(), "pid": pid, "time": time.time(), "session": "s1"}
            (tmp_path / "ranks").mkdir(exist_ok=True)
            (tmp_path / "ranks" / "rank1.json").write_text(json.dumps(beat))
            survivor = _Survivor()
            survivor.watchdog = dog
            SignalHandler(survivor)(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGINT, before)
        running.kill()
        running.wait()
    assert capfd.readouterr().err.splitlines() == [
        "trimtab: SIGTERM: torchrun's agent ends the survivors of a lost peer (rank 1's process ended)",
    ]


RUNS = ("plain", "hit")


def test_a_resume_from_an_emergency_save_draws_the_random_stream_an_undisturbed_run_draws(tmp_path, monkeypatch):
    """The training loop's own draws (a MoE router's jitter, model.moe.router_jitter: noise on every forward)
    continue after a resume from an emergency save as in a run never interrupted: rank 1 lost in step 3, the
    restart trains step 3 from step 2's save with the same noise, so its losses and weights are the
    undisturbed run's bit for bit, and its RNG ends where that run's ends. Without the RNG of the step's start
    (the state it had as the save was written instead, after step 3's forward drew), the noise differs."""
    moe = ("train.log_every=1", "model.n_layers=2", "model.moe.router_jitter=0.3", "train.batch_tokens=512")
    moe += ("train.micro_batch_tokens=512", "model.moe.n_experts=4")

    def run(name: str) -> Trainer:
        cfg = load_config(preset="debug-moe", overrides={"out": str(tmp_path / name)}, sets=[*SETS, *moe])
        return Trainer(setup(cfg), hooks=built_in_hooks(cfg))

    plain = run("plain")
    plain.fit()
    ends = torch.get_rng_state()
    hit = run("hit")
    lose_peer_in(hit, 3, monkeypatch)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    again = run("hit")
    assert again.state.step == 2
    again.fit()
    assert torch.equal(torch.get_rng_state(), ends)
    losses = [[m["loss"] for m in read_metrics(tmp_path / n) if m.get("step", 0) > 2 and "loss" in m] for n in RUNS]
    assert len(losses[0]) == 1 and losses[0] == losses[1]
    end, base = again.model.state_dict(), plain.model.state_dict()
    assert all(torch.equal(end[k], base[k]) for k in base)


def test_a_peer_lost_in_the_hooks_after_the_update_saves_that_step_and_a_refusal_says_why(tmp_path, monkeypatch, capfd):
    """Rank 1 lost after step 2's update, in the orchestrator's read of every rank's figures (all_max, each step on
    CPU): step 2, complete, is saved with an undisturbed save's weights, optimizer and data position, and the
    restart ends as the undisturbed run (before: nothing saved, "the newest checkpoint is step 0", torchrun
    `kill -9` of rank 1 after its update). Where no save is sound, the survivor says why, not the CLI alone."""
    plain = trainer(tmp_path / "plain", every=1)
    plain.fit()
    hit = trainer(tmp_path / "hit", every=3)
    monkeypatch.setattr(hit, "emergency_save_possible", lambda: None)
    read = core.all_max

    def all_max(values):
        if hit.state.step == 2 and not hit._said:
            raise RuntimeError(GLOO)
        return read(values)

    monkeypatch.setattr(core, "all_max", all_max)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    assert hit.watchdog.loss_known  # its heartbeat leaves the save to the section's timeout (test_heartbeat.py)
    ours, theirs = tmp_path / "hit/checkpoints/step_000002", tmp_path / "plain/checkpoints/step_000002"
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (torch.load(p / "optim.pt", weights_only=False) for p in (ours, theirs))
    assert all(
        torch.equal(oa["optimizer"]["state"][i]["exp_avg"], m["exp_avg"]) for i, m in ob["optimizer"]["state"].items()
    )
    sa, sb = (json.loads((p / "state.json").read_text()) for p in (ours, theirs))
    assert torch.equal(oa["rng"]["torch"], ob["rng"]["torch"])
    assert sa["data"] == sb["data"] and sa["train"]["step"] == 2 and sa["emergency"]["rank"] == 0
    again = trainer(tmp_path / "hit", every=3)
    assert again.state.step == 2
    again.fit()
    end, base = again.model.state_dict(), plain.model.state_dict()
    assert all(torch.equal(end[k], base[k]) for k in base)
    monkeypatch.setattr(again, "emergency_save_possible", lambda: None)
    again.update_begins()  # as a failure between the update's start and its step's bookkeeping finds it
    capfd.readouterr()
    assert not again.emergency_save(RuntimeError(GLOO))  # before: no line; the CLI's said only the newest checkpoint
    assert "no emergency save (the optimizer's update had begun" in capfd.readouterr().err


class Intervenes(Hook):
    """Requests `action` at step 2's end; with `lost_in`, rank 1 is lost in on_applied just after it."""

    def __init__(self, action: str, lost_in: bool, **params) -> None:
        self.action, self.params, self.lost_in, self.requested = action, params, lost_in, False

    def on_step_end(self, run, out) -> None:
        if run.step == 2 and not self.requested:
            self.requested = True
            run.control.request(self.action, **self.params)

    def on_applied(self, run) -> None:
        if self.lost_in and self.requested:
            self.lost_in = False
            raise RuntimeError(GLOO)


def intervened(out, monkeypatch, hook: Intervenes) -> Trainer:
    cfg = load_config(preset="debug", overrides={"out": str(out)}, sets=[*SETS, "checkpoint.every=1"])
    t = Trainer(setup(cfg), hooks=[*built_in_hooks(cfg), hook])
    monkeypatch.setattr(t, "emergency_save_possible", lambda: None)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        t.fit()
    return t


def test_a_peer_lost_once_an_intervention_is_applied_saves_the_step_with_it_and_one_lost_in_it_saves_none(
    tmp_path, monkeypatch, capfd
):
    """Rank 1 lost in on_applied (the console's step line, after control.apply): the step with the intervention
    applied is saved (before: no save, the restart went back to the last checkpoint and lost the decision). A
    rollback leaving rows out, applied whole, saves its restored step again with the rows out; one lost in the
    rollback's load (half-applied) saves nothing and says so."""
    cut = intervened(tmp_path / "cut", monkeypatch, Intervenes("scale_lr", True, factor=0.5))
    state = json.loads((tmp_path / "cut/checkpoints/step_000002/state.json").read_text())
    assert state["emergency"]["rank"] == 0 and state["train"]["lr_scale"] == 0.5 and cut.last_saved == 2
    cut.mark_step_start()  # a step begins; its batch is read, then an out-of-memory retry applies a smaller budget
    kept, _ = cut._step_start, cut.loader.next_batch()
    with cut.applying("set_micro_batch_tokens", mid_step=True):
        pass
    assert cut._step_start is kept  # the step's start, not the position past the batch read
    with cut.applying("scale_lr", mid_step=False):
        pass
    assert cut._step_start[1] != kept[1]  # between steps: the state as it is, marked anew
    capfd.readouterr()
    back = intervened(tmp_path / "back", monkeypatch, Intervenes("rollback", True, to=1, skip_rows=[0, 1]))
    state = json.loads((tmp_path / "back/checkpoints/step_000001/state.json").read_text())
    assert state["emergency"]["rank"] == 0 and state["data"]["skipped"] == [0, 1] and state["good"]
    assert back.state.step == 1 and "rank 0 saved step 1 alone" in capfd.readouterr().err
    hook = Intervenes("rollback", False, to=1)
    cfg = load_config(preset="debug", overrides={"out": str(tmp_path / "half")}, sets=[*SETS, "checkpoint.every=1"])
    half = Trainer(setup(cfg), hooks=[*built_in_hooks(cfg), hook])
    monkeypatch.setattr(half, "emergency_save_possible", lambda: None)
    monkeypatch.setattr(half.dist, "read_checkpoint", lambda path: (_ for _ in ()).throw(RuntimeError(GLOO)))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        half.fit()
    said = capfd.readouterr().err
    assert "no emergency save (rollback was being applied: a half-applied intervention is no whole state)" in said
    assert not (tmp_path / "half/checkpoints/step_000002").exists()
