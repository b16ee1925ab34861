"""The `resilience:` section: what keeps a job going when a process, a node or a collective fails
(trimtab/resilience/, docs/resilience.md): the hang watchdog and its timeouts."""

from __future__ import annotations

from dataclasses import dataclass, field

from trimtab.config.checks import Section, _check

WATCHDOG_MODES = ("auto", "on", "off")


@dataclass
class FtConfig(Section):
    """Per-step fault tolerance across replica groups through torchft (distributed/ft.py): each
    group is one `trimtab train` job (one process, or torchrun's data-parallel ranks) with its own
    run directory; a Lighthouse forms a quorum every step; the groups alive average their
    gradients and step, a failed group is dropped and its replacement copies the state of a
    healthy one live."""

    enabled: bool = False
    lighthouse: str = ""  # the Lighthouse's address (http://HOST:PORT); empty: $TORCHFT_LIGHTHOUSE
    replica_group: int = 0  # this job's group, 0 .. groups - 1: its share of each step's rows
    groups: int = 1  # replica groups the data is split over (the global batch is theirs together)
    min_replicas: int = 1  # groups a step needs to commit
    timeout_s: float = 30.0  # a quorum, an all-reduce or a recovery waits this long for a peer

    def validate(self) -> None:
        if not self.enabled:
            return
        _check(self.groups >= 1, "resilience.ft.groups", "must be >= 1")
        _check(
            0 <= self.replica_group < self.groups,
            "resilience.ft.replica_group",
            f"must be 0 .. {self.groups - 1} (resilience.ft.groups is {self.groups})",
        )
        _check(
            1 <= self.min_replicas <= self.groups,
            "resilience.ft.min_replicas",
            f"must be 1 .. resilience.ft.groups ({self.groups})",
        )
        _check(self.timeout_s > 0, "resilience.ft.timeout_s", "must be > 0 seconds")


@dataclass
class ResilienceConfig(Section):
    """Timeouts after NVIDIA's resiliency extension (NVRx), whose in-job restarts wait 1800 s for
    the first heartbeat and a safety factor of 5 over the measured section times afterwards."""

    # auto: on under torchrun (a hung rank stalls every rank in its next collective), off in one
    # process (nothing waits for it: a person sees the stall). on | off force it.
    watchdog: str = "auto"
    first_timeout_s: float = 1800.0  # a section's first run in a process: start-up, compilation, first save
    timeout_factor: float = 5.0  # afterwards: this many times the longest run of that section seen
    min_timeout_s: float = 60.0  # never less (a slow filesystem, a busy host)
    beat_s: float = 10.0  # each rank writes RUN_DIR/ranks/rankR.json this often (what a restart reads)
    # a rank whose heartbeat in torchrun's store stood still this long is lost (a host gone without closing its
    # sockets fails no collective: the section timeout would find it); 0: no heartbeat (resilience/heartbeat.py)
    heartbeat_s: float = 5.0
    # A step the update gate flags is computed again before it is judged: a different result was a
    # transient fault and the re-run's update is applied (training/rerun.py; Megatron-LM's rerun)
    rerun: bool = True
    ft: FtConfig = field(default_factory=FtConfig)

    def validate(self) -> None:
        _check(self.watchdog in WATCHDOG_MODES, "resilience.watchdog", f"must be one of {', '.join(WATCHDOG_MODES)}")
        for key in ("first_timeout_s", "min_timeout_s", "beat_s"):
            _check(getattr(self, key) > 0, f"resilience.{key}", "must be > 0 seconds")
        _check(self.heartbeat_s >= 0, "resilience.heartbeat_s", "must be >= 0 seconds (0: no heartbeat)")
        _check(self.timeout_factor >= 1, "resilience.timeout_factor", "must be >= 1 (a multiple of the longest run)")
        _check(
            self.first_timeout_s >= self.min_timeout_s,
            "resilience.first_timeout_s",
            f"must be >= resilience.min_timeout_s ({self.min_timeout_s}): the first run of a section is the slowest",
        )
        self.ft.validate()
