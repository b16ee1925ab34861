"""The hang watchdog: a thread per rank that ends a stalled process fast and leaves its stack.

A rank that stops (a deadlock, a device that no longer answers, a peer's OOM inside a backward)
stalls every rank in its next collective, which waits out the process group's timeout (600 s by
default; PRIOR_ART: NVRx, torchelastic). Here the loop beats at each section of a step (data,
forward_backward, sync, optimizer, hooks, rollback, evaluation, checkpoint); a section that runs past its
timeout ends the process, so torchrun's elastic agent restarts the job from the newest
checkpoint at once. Timeouts follow NVRx: a section's first run in a process gets
`first_timeout_s` (start-up, compilation, first save), later runs `timeout_factor` x the longest
seen, at least `min_timeout_s`. After a restart a section's first run is timed by the longest the
session before saw (its beat files keep it: timed_before), so a rank frozen in the first step after
a restart is found in about the usual timeout, not first_timeout_s. Time the whole process stood
stopped (SIGSTOP then SIGCONT: `scontrol suspend`, Ctrl-Z then fg) is no section's: its watchdog
finds it as a poll long overdue while the loop's thread used no CPU, and takes it off the
section's time.

Before it ends the process, the watchdog writes every thread's Python stack to
RUN_DIR/hangs/rankR.txt and raises the alarm in RUN_DIR/hangs/alarm.json; every other rank's
watchdog sees the alarm within ALARM_POLL_S and writes its own stack too, so the hang explains itself
(the rank still in `data` while the others wait in `sync` is the one that stopped). Each rank also
keeps RUN_DIR/ranks/rankR.json (host, pid, step, section; every `beat_s`, and at once when the loop
enters a section SECTION_BEAT_S after the last write): after a restart, the rank whose beats
stopped first and that left no exit record is the one that was lost; a frozen rank (SIGSTOP, a
deadlock holding the GIL: its watchdog thread stops with it) is named where it froze, not where its
timer last wrote. Under torchrun the ranks' heartbeats in the store (resilience/heartbeat.py) find a
rank lost without a word (its host's power or network) in resilience.heartbeat_s, not the section's timeout.
A frozen rank of this host is SIGKILLed: the collective a survivor waits in fails, and the survivor saves
the last completed step alone (training/emergency.py) before it ends, exit 5 still (_loop_saves).

Torch-free (the thread must run while the main thread is stuck inside torch).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trimtab.resilience import procs
from trimtab.resilience.beats import LOST, RANKS, on_hosts, stopped, timed_before
from trimtab.resilience.elastic import node_of, node_rank, session
from trimtab.resilience.heartbeat import Heartbeat
from trimtab.rundir import read_json, write_json

HUNG = 5  # the process's exit code when the watchdog ended it (docs/orchestrator.md, exit codes)
HANGS, ALARM = "hangs", "alarm.json"
POLL_S = 0.5  # the timeouts' resolution
ALARM_POLL_S = 2.0  # one stat of hangs/alarm.json per rank this often (a shared filesystem's load)
# a survivor's answer to another rank's alarm while it writes its emergency save (loss_known): the save is not cut
SAVING = "; saving the last completed step for a lost peer (an emergency save): it ends once that is written"
GRACE_S = 5.0  # how long the rank that raised the alarm waits for the others' stacks
FROZEN_S = 1.0  # a poll this much later than POLL_S, the loop's thread idle through it: the process was stopped
# The loop writes its beat file itself on entering a section this long after the last write: a rank
# that freezes (its watchdog thread frozen too) leaves the section and step it froze in, not one of
# up to beat_s before. At most one write a second on the loop's thread, never one per section of a fast step.
SECTION_BEAT_S = 1.0
# how long a rank that killed frozen peers waits for its loop's collective to fail for them and its emergency save to
# begin (Watchdog._loop_saves): 0.4 s measured under gloo; no more, else the process ends as a hang (exit 5)
RESCUE_S = 5.0


class Watchdog:
    """Feed it with beat(section, step) from the loop; start() / stop() around training."""

    # what must finish before _end's os._exit, given when the hang was found (time.monotonic()), bounded by its own
    # clock: rank 0's upload in flight to checkpoint.dir (training/emergency.py upload_before_hang_exit), a daemon
    # thread the exit cut (the store's newest stayed the checkpoint before the one uploading). Set by the Trainer.
    before_exit: Callable[[float], None] | None = None

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world: int,
        *,
        first_timeout_s: float,
        timeout_factor: float,
        min_timeout_s: float,
        beat_s: float,
    ) -> None:
        self.run_dir, self.rank, self.world = Path(run_dir), rank, world
        self.first_timeout_s, self.timeout_factor, self.min_timeout_s = first_timeout_s, timeout_factor, min_timeout_s
        self.beat_s = beat_s
        self.current = ("start-up", time.monotonic())  # (section, when it began): one object, read whole
        self.step = 0
        self.longest: dict[str, float] = {}  # section -> its longest completed run in this process
        self.before = timed_before(self.run_dir, rank, world)  # the same, of the session before (a restart)
        self.started = time.time()  # an alarm older than this process is a past session's
        self._alarm_checked = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_beat_file = 0.0
        self._kept_lost = False  # the previous session's beat file moved aside before the first write
        self._beat_lock = threading.Lock()  # the loop and this thread both write the beat file (one temp name)
        self._loop_thread = threading.get_ident()  # whose CPU time tells a stopped process from a busy one
        self._polled = (time.monotonic(), time.thread_time())  # the last poll: monotonic, the loop thread's CPU
        self._thawed = (0.0, 0.0)  # (a section's start, the seconds the process was stopped within it)
        self.heartbeat: Heartbeat | None = None  # through torchrun's store: a lost host named in seconds
        # a collective of this rank failed for a lost peer (training/emergency.py): its emergency save runs under the
        # section's timeout; the heartbeat, finding the same peer silent heartbeat_s on, ended it mid-write (os._exit)
        self.loss_known = False
        self._answered = False  # this rank wrote its stack for an alarm (_answer)
        self._killed: list[int] = []  # the frozen peers of this host it SIGKILLed (_end_mute_peers)
        self.rescue_s = 0.0  # how long it waits for the loop's emergency save once it killed them (make_watchdog)
        self._hung_exit = ""  # its exit record once it killed a frozen peer for its loop to save: stop() ends, HUNG

    # ------------------------------------------------------------------ from the loop

    def beat(self, section: str, step: int | None = None) -> None:
        """The loop enters `section` (of step `step`): the previous section completed."""
        now = time.monotonic()
        previous, since = self.current
        took = now - since - self._stopped_during(since, now)  # a pause must not inflate later timeouts
        if took > self.longest.get(previous, 0.0):
            self.longest[previous] = took
        self.current = (section, now)  # one store: the thread never sees a section with another's start
        if step is not None:
            self.step = step
        if self.heartbeat is not None:
            self.heartbeat.poke(self.step, section)
        if time.time() - self._last_beat_file >= SECTION_BEAT_S:  # never wait on the thread's own write
            self._write_beat(wait=False)

    @contextlib.contextmanager
    def watching(self) -> Iterator[Watchdog]:
        """Watch for the block; an error that ends it is the rank's exit record (what a restart reads)."""
        self.start()
        try:
            yield self
        except BaseException as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.stop(f"{type(exc).__name__}: {first}"[:300])
            raise
        self.stop()

    def start(self) -> Watchdog:
        self._loop_thread = threading.get_ident()  # the thread that beats: the loop's
        self._polled = (time.monotonic(), self._loop_cpu())
        with contextlib.suppress(OSError):
            (self.run_dir / RANKS).mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="trimtab-watchdog")
        self._thread.start()
        if self.heartbeat is not None:
            self.heartbeat.start()
        return self

    def stop(self, exit_record: str | None = None) -> None:
        """Training is over (or failed with `exit_record`): no more timeouts; the rank's file says so."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self._hung_exit:  # the hang's record first: the loop's error (the lost peer's) is its consequence
            exit_record = f"{self._hung_exit} ({exit_record or 'ended'})"
        self._write_beat(exit=exit_record or "ended")
        if self._hung_exit:  # this rank killed a frozen peer and its loop saved for it (_end): a hang's exit
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(HUNG)

    def timeout(self, section: str) -> float:
        if section in self.longest:
            return max(self.min_timeout_s, self.timeout_factor * self.longest[section])
        if section in self.before:  # its first run here, timed before a restart: a frozen rank found in minutes
            return min(self.first_timeout_s, max(self.min_timeout_s, self.timeout_factor * self.before[section]))
        return self.first_timeout_s

    # ------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll(time.monotonic(), self._loop_cpu())

    def _poll(self, now: float, cpu: float) -> None:
        """One look at the current section at monotonic time `now` (`cpu`: the loop thread's CPU time)."""
        section, since = self.current
        elapsed, limit = now - since - self._stopped_in(since, now, cpu), self.timeout(section)
        if elapsed > limit:
            self._end(raised=True, section=section, elapsed=elapsed, limit=limit)
        elif self.heartbeat is not None and not self.loss_known and (lost := self.heartbeat.lost(POLL_S)):
            self._end(raised=True, section=section, elapsed=elapsed, limit=limit, lost=lost)
        elif now - self._alarm_checked >= ALARM_POLL_S and self._alarm() is not None:
            if not self.loss_known:
                self._end(raised=False, section=section, elapsed=elapsed, limit=limit)
            elif not self._answered:  # its emergency save goes on, under its section's timeout (the first branch)
                self._answer(False, section, elapsed, limit, SAVING)
        elif time.time() - self._last_beat_file >= self.beat_s:
            self._write_beat()

    def _stopped_in(self, since: float, now: float, cpu: float) -> float:
        """The seconds the whole process was stopped (SIGSTOP then SIGCONT: `scontrol suspend`,
        Ctrl-Z then fg) within the section that began at `since`, as this thread's polls found
        them. Stopped time is not the section's: on SIGCONT this thread may wake before the loop
        beats, and the loop was not slow. A hung rank's watchdog keeps polling on time, so a hang
        still fires."""
        gap = self._stop_gap(now, cpu)
        self._polled = (now, cpu)
        start, stopped = self._thawed
        if start != since:  # another section: stops before it are not its own
            start, stopped = since, 0.0
        # at most the section's whole time: a section that began after SIGCONT has none of it
        self._thawed = (start, min(stopped + gap, now - since))
        return self._thawed[1]

    def _stopped_during(self, since: float, now: float) -> float:
        """For beat() (the loop's thread): the stopped seconds of the section that began at `since`,
        those this thread found and one it has not polled since (the loop beat first after SIGCONT)."""
        start, stopped = self._thawed
        known = stopped if start == since else 0.0
        unseen = self._stop_gap(now, time.thread_time()) if self._thread is not None else 0.0
        return known + max(0.0, min(unseen, now - since - known))

    def _stop_gap(self, now: float, cpu: float) -> float:
        """The seconds the process stood still since this thread's last poll (0: it ran). The sign: a
        poll more than FROZEN_S overdue while the loop's thread used less CPU than the gap (a loop
        holding the GIL in a long computation delays this thread too, but runs). A stall that
        blocks holding the GIL reads as stopped: its watchdog could not have run through it anyway."""
        polled, polled_cpu = self._polled
        gap = now - polled
        return gap - POLL_S if gap - POLL_S > FROZEN_S and cpu - polled_cpu < gap - FROZEN_S else 0.0

    def _loop_cpu(self) -> float:
        """The loop thread's CPU seconds; 0 where the platform cannot say (then the gap alone decides)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._loop_thread))
        except (AttributeError, OSError):
            return 0.0

    def _alarm(self) -> dict[str, Any] | None:
        self._alarm_checked = time.monotonic()
        path = self.run_dir / HANGS / ALARM
        with contextlib.suppress(OSError):
            if path.stat().st_mtime >= self.started:
                return read_json(path)
        return None

    def _end(self, *, raised: bool, section: str, elapsed: float, limit: float, lost: dict | None = None) -> None:
        """Write this rank's stack (and raise the alarm, or answer it), then end the process; `lost`: what the
        heartbeat found lost (Heartbeat.lost), the cause instead of a timeout."""
        found = time.monotonic()
        folder = self._answer(raised, section, elapsed, limit)
        if raised:  # the others' stacks, before torchrun's agent tears the job down
            self._await_stacks(folder)
            self._killed = self._end_mute_peers(folder)
        self._say(raised, section, elapsed, limit, folder, lost)
        if self._killed and self._loop_saves():
            # the loop's emergency save goes on, under its section's timeout (_poll's first branch); the process
            # ends as a hang's does, exit HUNG (stop), not the lost peer's 1: the watchdog ended it
            self._hung_exit = f"hung in {section}"
            return
        if self.before_exit is not None:
            with contextlib.suppress(Exception):  # whatever fails there, the hang still ends the process
                self.before_exit(found)
        os._exit(HUNG)

    def _loop_saves(self) -> bool:
        """Whether the loop, its collective failed for the frozen ranks this rank killed (their sockets closed:
        0.4 s measured under gloo, whose abort() and shutdown() leave a collective under way blocked: torch
        2.13), writes the last completed step alone (training/emergency.py sets loss_known, then beats the save's
        section: the section that timed out is the loop's no more), or ends with the collective's error (a save
        refused, or another survivor's). Up to rescue_s (RESCUE_S under torchrun): a loop in no collective, or
        one that does not fail (NCCL's waits out its timeout), ends as a hang did."""
        waiting, deadline = self.current, time.monotonic() + self.rescue_s
        while time.monotonic() < deadline:
            if self._stop.is_set() or (self.loss_known and self.current is not waiting):
                return True
            time.sleep(0.05)
        return False

    def _answer(self, raised: bool, section: str, elapsed: float, limit: float, saving: str = "") -> Path:
        """Write this rank's stack and record in hangs/ (and raise the alarm, or answer it); `saving`: it answers
        but goes on with its emergency save (the alarm's rank neither waits for its stack nor kills it as mute)."""
        self._answered = True
        folder = self.run_dir / HANGS
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            record = {
                "rank": self.rank,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "step": self.step,
                "section": section,
                "seconds": round(elapsed, 3),
                "timeout_s": round(limit, 3),
                "raised": raised,
                "time": time.time(),
                # where the heartbeat last heard of the peers that stood still: newer than their beat files
                "heard": {str(r): p for r, p in self.heartbeat.positions.items()} if self.heartbeat else {},
            }
            with open(folder / f"rank{self.rank}.txt", "w") as fh:
                fh.write(
                    f"rank {self.rank} at step {self.step}, section {section} for {elapsed:.1f} s "
                    f"(timeout {limit:.1f} s){'' if raised else saving or '; ended on the alarm of another rank'}\n\n"
                )
                fh.flush()
                faulthandler.dump_traceback(fh, all_threads=True)
            write_json(folder / f"rank{self.rank}.json", {**record, "saving": True} if saving else record)
            if raised and self._alarm() is None:
                write_json(folder / ALARM, record)
            if not saving:  # a saving rank's exit record comes with its save's end
                self._write_beat(exit=f"hung in {section}" if raised else "ended on another rank's hang alarm")
        return folder

    def _await_stacks(self, folder: Path) -> None:
        """Wait up to GRACE_S for the other ranks' stacks, but not for a rank known not to answer: one whose
        heartbeat stood still (Heartbeat.quiet), or one of this host whose process is stopped or gone. The line
        comes when the last stack that can come is in, not always GRACE_S later."""
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            answered = {int(p.stem[4:]) for p in folder.glob("rank*.txt") if p.stem[4:].isdigit()}
            mute = set(self.heartbeat.quiet() if self.heartbeat is not None else []) | set(self._frozen_here())
            if len(answered | mute) >= self.world:
                return
            time.sleep(0.1)

    def _frozen_here(self) -> list[int]:
        """This session's ranks on this host whose process is stopped (SIGSTOP: state T) or has ended."""
        frozen = []
        for rank in (r for r in range(self.world) if r != self.rank):
            beat = read_json(self.run_dir / RANKS / f"rank{rank}.json")
            mine = isinstance(beat, dict) and "time" in beat and beat.get("host") == socket.gethostname()
            if mine and beat.get("session") == session():
                if procs.gone(beat.get("pid"), beat["time"]) or procs.state(beat.get("pid")) == "T":
                    frozen.append(rank)
        return frozen

    def _say(
        self, raised: bool, section: str, elapsed: float, limit: float, folder: Path, lost: dict | None = None
    ) -> None:
        """One line on the console: torchrun shows only the exit code (5), and what happened is in
        the hangs/ folder and the next session's journal; the frozen ranks of this host it SIGKILLed (_killed)."""
        what = self._lost_words(lost) if lost else self._hung_words(section, elapsed, limit, folder) if raised else ""
        what = what or f"ended at step {self.step} on another rank's hang alarm"
        if self._killed:
            killed = ", ".join(map(str, self._killed))
            what += (
                f"; killed rank {killed} (SIGKILL: frozen on this host): the collective waiting for it fails, and "
                "the last completed step is saved alone where it can be (an emergency save)"
            )
        with contextlib.suppress(OSError, ValueError):
            print(f"trimtab: rank {self.rank} {what}; the ranks' stacks are in {folder}", file=sys.stderr, flush=True)

    def _hung_words(self, section: str, elapsed: float, limit: float, folder: Path) -> str:
        """What the rank that raised the alarm says: it hung, or it only waited (in a collective)
        for the rank that stopped, named with where it stopped."""
        past = f"past its timeout of {limit:.0f} s (the resilience.* timeouts, docs/resilience.md)"
        beats = self._session_beats()
        blame = stopped(self._session_hangs(folder, section), beats)
        if blame["ranks"] == [self.rank]:
            return f"hung: {section} ran {elapsed:.0f} s at step {self.step}, {past}"
        who = f"rank {', '.join(map(str, blame['ranks']))}"
        where = f" in {blame['section']} at step {blame['step']}" if blame["section"] else ""
        why = (
            "and did not answer the alarm (frozen: stopped, or deadlocked holding the GIL; or gone)"
            if blame["silent"]
            else "(the others wait for it in a collective)"
        )
        on = on_hosts(blame["ranks"], beats, bool(blame["silent"]))
        return f"waited {elapsed:.0f} s in {section} at step {self.step}, {past}: {who} stopped{where} {why}{on}"

    def _lost_words(self, lost: dict[str, Any]) -> str:
        """What the rank whose heartbeat watch found a loss says: the ranks silent, where they were, their host."""
        if "store" in lost:
            return (
                f"found the store at {lost['store']} (torchrun's rendezvous agent, or rank 0) not answering for "
                f"{lost['seconds']:.0f} s at step {self.step}: its host is lost or frozen"
            )
        beats = self._session_beats()
        where = [f" in {b['section']} at step {b['step']}" for r in lost["ranks"][:1] if (b := beats.get(r)) and b]
        return (
            f"found rank {', '.join(map(str, lost['ranks']))} silent: its heartbeat stopped {lost['seconds']:.0f} s "
            f"ago{''.join(where)} (lost: its host down or cut off, or the process frozen); this rank waited in "
            f"{self.current[0]} at step {self.step}{on_hosts(lost['ranks'], beats, True)}"
        )

    def _session_hangs(self, folder: Path, section: str) -> list[dict[str, Any]]:
        """This session's hang records: the other ranks' that answered the alarm, and this one's."""
        records = [read_json(folder / f"rank{r}.json") for r in range(self.world) if r != self.rank]
        found = [r for r in records if isinstance(r, dict) and "section" in r and r.get("time", 0) >= self.started]
        return [*found, {"rank": self.rank, "step": self.step, "section": section}]

    def _session_beats(self) -> dict[int, dict[str, Any]]:
        """Every rank of the job -> its last beat of this session ({} where it wrote none)."""
        beats: dict[int, dict[str, Any]] = {}
        for rank in range(self.world):
            beat = read_json(self.run_dir / RANKS / f"rank{rank}.json")
            beats[rank] = beat if isinstance(beat, dict) and beat.get("session") == session() else {}
            known = self.heartbeat.positions.get(rank) if self.heartbeat is not None else None
            if known and known["time"] > beats[rank].get("time", 0.0):  # written at each section: current
                beats[rank] = {**beats[rank], **known}
        return beats

    def gone_peers(self) -> list[int]:
        """This job's ranks on this host whose process has ended (its beat's pid runs no more, or is a zombie):
        torchrun's agent SIGTERMs the survivors as it reaps a dead worker, which can come before a survivor's own
        collective fails for it (training/emergency.py peer_loss). A rank on another host is not seen, and only
        this node's ranks' beats are read (a signal handler's work: not a large job's every file)."""
        host, node = socket.gethostname(), node_of(self.rank)
        gone = []
        for rank in (r for r in range(self.world) if r != self.rank and node_of(r) == node):
            beat = read_json(self.run_dir / RANKS / f"rank{rank}.json")
            mine = isinstance(beat, dict) and beat.get("session") == session() and beat.get("host") == host
            if mine and procs.gone(beat.get("pid"), beat["time"]):
                gone.append(rank)
        return gone

    def _end_mute_peers(self, folder: Path) -> list[int]:
        """Ranks of this job on this host that wrote no stack within the grace are frozen (a
        stopped process, a deadlock that holds the GIL): SIGKILL them, as NVRx ends hung ranks, so
        torchrun restarts now instead of after its own 30 s wait for a SIGTERM they cannot take, and
        this rank's collective fails for them (its emergency save). The ranks killed."""
        answered, host, killed = {p.stem for p in folder.glob("rank*.txt")}, socket.gethostname(), []
        for path in (self.run_dir / RANKS).glob("rank*.json"):
            beat = read_json(path)  # this session's only: rankR.lost.json is a lost session's, its pid another's now
            mute = isinstance(beat, dict) and path.stem not in answered and beat.get("host") == host
            mute = mute and beat.get("session") == session()
            mute = mute and beat.get("pid") not in (None, os.getpid())
            if mute and procs.alive_since(int(beat["pid"]), beat["time"]):
                with contextlib.suppress(OSError):
                    os.kill(int(beat["pid"]), signal.SIGKILL)
                    killed.append(int(beat["rank"]))
        return sorted(killed)

    def _write_beat(self, wait: bool = True, **extra: Any) -> None:
        """This rank's beat file now (with `extra`: its exit record); wait=False: not if the other
        thread is writing it (the loop's write skipped then, the next section's comes a second later)."""
        if not self._beat_lock.acquire(blocking=wait):
            return
        try:
            self._write_beat_locked(extra)
        finally:
            self._beat_lock.release()

    def _write_beat_locked(self, extra: dict[str, Any]) -> None:
        self._last_beat_file = time.time()
        record = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "node": node_rank(),  # torchrun's
            "pid": os.getpid(),
            "step": self.step,
            "section": self.current[0],
            "time": self._last_beat_file,
            "started": self.started,
            "session": session(),
            "world": self.world,
            # what a restarted session times its sections' first runs by (timed_before); dict() copies
            # in one step, while the loop's thread may add a section
            "longest": {k: round(v, 3) for k, v in dict(self.longest).items()},
            **extra,
        }
        path = self.run_dir / RANKS / f"rank{self.rank}.json"
        with contextlib.suppress(OSError):  # a full disk must not end the run
            if not self._kept_lost:  # the lost session's beat, for rank 0 to read (incidents.py)
                self._kept_lost = True
                old = read_json(path)
                if isinstance(old, dict) and old.get("session") != record["session"]:
                    os.replace(path, path.with_suffix(LOST))
            write_json(path, record, indent=None, durable="exit" in extra)
