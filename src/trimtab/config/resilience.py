"""The `resilience:` section: what keeps a job going when a process, a node or a collective fails
(trimtab/resilience/, docs/resilience.md): the hang watchdog and its timeouts."""

from __future__ import annotations

from dataclasses import dataclass

from trimtab.config.checks import Section, _check

WATCHDOG_MODES = ("auto", "on", "off")


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
    # A step the update gate flags is computed again before it is judged: a different result was a
    # transient fault and the re-run's update is applied (training/rerun.py; Megatron-LM's rerun)
    rerun: bool = True

    def validate(self) -> None:
        _check(self.watchdog in WATCHDOG_MODES, "resilience.watchdog", f"must be one of {', '.join(WATCHDOG_MODES)}")
        for key in ("first_timeout_s", "min_timeout_s", "beat_s"):
            _check(getattr(self, key) > 0, f"resilience.{key}", "must be > 0 seconds")
        _check(self.timeout_factor >= 1, "resilience.timeout_factor", "must be >= 1 (a multiple of the longest run)")
        _check(
            self.first_timeout_s >= self.min_timeout_s,
            "resilience.first_timeout_s",
            f"must be >= resilience.min_timeout_s ({self.min_timeout_s}): the first run of a section is the slowest",
        )
