"""Live metrics for Prometheus (`log.prometheus`, docs/tracking.md): every rank serves /metrics
over HTTP through the official client, on `port` + its local rank (ranks of one host never
share a port), each series labelled with the run, the rank and the host.

What a dashboard and an alert need: the step and tokens, loss and validation loss, tokens/s,
MFU, memory, gradient norm and LR as gauges; the orchestrator's decisions counted by rule and
action, and rollbacks; the newest checkpoint's step and age; and a heartbeat, the time of the
last finished step, so an alert can say "no progress for 10 minutes" whatever hung. An RL run
adds its figures (reward, held-out reward, entropy, ...) under `trimtab_rl_*`.

The server is started when the hook is made, before training: a port taken is a clear error
naming log.prometheus.port (exit code 2), not a run that trains unwatched. A run that raised
(no on_train_end) leaves its server up until the next run of the process on that port replaces it.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trimtab.config.log import PrometheusConfig
from trimtab.errors import ConfigError
from trimtab.training.hooks import Hook

if TYPE_CHECKING:
    from trimtab.training.state import StepOutput
    from trimtab.training.view import RunView

# metrics.jsonl's figures -> (gauge, help); an RL run's rl/* figures are added by name
GAUGES = {
    "loss": ("trimtab_loss", "training loss of the last logged step"),
    "val_loss": ("trimtab_val_loss", "held-out loss at the last evaluation"),
    "tokens_per_s": ("trimtab_tokens_per_second", "training throughput over the last log window"),
    "mfu": ("trimtab_mfu", "model FLOPs utilisation, 0..1"),
    "grad_norm": ("trimtab_grad_norm", "gradient norm before clipping"),
    "lr": ("trimtab_lr", "learning rate applied"),
    "peak_rss_mb": ("trimtab_peak_rss_megabytes", "the process's peak resident memory"),
    "cuda_max_alloc_mb": ("trimtab_cuda_max_allocated_megabytes", "the CUDA device's peak memory allocated"),
    "step_time": ("trimtab_step_seconds", "seconds a step over the last log window"),
    "loss_scale": ("trimtab_loss_scale", "fp16's loss scale (train.loss_scale)"),
}
# this process's servers by (addr, port): a run that raised never reached on_train_end, and its
# server, left up, would refuse the next run of the process (an API caller's retry) that port
_SERVING: dict[tuple[str, int], Any] = {}


class PrometheusExporter(Hook):
    """Gauges and counters of the run, served from this process (one per rank)."""

    def __init__(self, cfg: PrometheusConfig, run_dir: Path) -> None:
        import prometheus_client as prom

        self.port = cfg.port + int(os.environ.get("LOCAL_RANK", "0"))
        self.registry = prom.CollectorRegistry()
        labels = {"run": Path(run_dir).name, "rank": os.environ.get("RANK", "0"), "host": socket.gethostname()}
        self._labels = labels

        def series(kind: Any, name: str, text: str, extra: tuple[str, ...] = ()) -> Any:
            """A metric labelled with the run, rank and host: this process's series, or with
            `extra` labels the family (its series made per value)."""
            family = kind(name, text, [*labels, *extra], registry=self.registry)
            return family if extra else family.labels(**labels)

        # a figure's series appears with its first value: a gauge at 0 would read as a held-out
        # loss of 0 before the first evaluation, and fp32's loss scale as 0
        self.gauges = {
            key: prom.Gauge(name, text, list(labels), registry=self.registry) for key, (name, text) in GAUGES.items()
        }
        self.step = series(prom.Gauge, "trimtab_step", "optimizer steps taken")
        self.tokens = series(prom.Gauge, "trimtab_tokens", "input tokens trained on")
        self.heartbeat = series(
            prom.Gauge, "trimtab_last_step_timestamp_seconds", "when the last step ended (unix time)"
        )
        self.checkpoint_step = series(prom.Gauge, "trimtab_checkpoint_step", "the newest checkpoint's step")
        self.checkpoint_time = series(
            prom.Gauge, "trimtab_checkpoint_timestamp_seconds", "when the newest checkpoint was written"
        )
        self.rl = series(prom.Gauge, "trimtab_rl", "an RL run's figures (rl/NAME in metrics.jsonl)", ("figure",))
        self.decisions = series(prom.Counter, "trimtab_decisions", "the orchestrator's decisions", ("rule", "action"))
        self.rollbacks = series(prom.Counter, "trimtab_rollbacks", "rollbacks to a checkpoint")
        self._key = (cfg.addr, self.port)
        _stop(_SERVING.pop(self._key, None))  # an earlier run of this process that ended in an exception
        try:
            self.server, self.thread = prom.start_http_server(self.port, cfg.addr, registry=self.registry)
            _SERVING[self._key] = self.server
        except OSError as exc:
            raise ConfigError(
                f"log.prometheus.port: {cfg.addr}:{self.port} cannot serve /metrics ({exc.strerror or exc}); "
                "set log.prometheus.port to a free port (each rank takes port + its local rank), or "
                "log.prometheus.enabled=false"
            ) from None

    def on_step_end(self, run: RunView, out: StepOutput) -> None:
        self.step.set(run.step)
        self.heartbeat.set(time.time())

    def on_log(self, run: RunView, metrics: dict[str, Any]) -> None:
        self._figures(metrics)

    def on_eval(self, run: RunView, metrics: dict[str, Any]) -> None:
        self._figures(metrics)

    def _figures(self, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key in self.gauges:
                self.gauges[key].labels(**self._labels).set(value)
            elif key == "tokens":
                self.tokens.set(value)
            elif key.startswith("rl/"):
                self.rl.labels(**self._labels, figure=key.removeprefix("rl/")).set(value)

    def on_decision(self, run: RunView, decision: dict[str, Any]) -> None:
        self.decisions.labels(**self._labels, rule=decision["rule"], action=decision["action"]).inc()

    def on_checkpoint(self, run: RunView, path: Path) -> None:
        self.checkpoint_step.set(run.step)
        self.checkpoint_time.set(time.time())

    def on_rollback(self, run: RunView, saved_state: dict[str, Any]) -> None:
        self.rollbacks.inc()
        self.step.set(run.step)

    def on_train_end(self, run: RunView, summary: dict[str, Any]) -> None:
        if _SERVING.get(self._key) is self.server:
            del _SERVING[self._key]
        _stop(self.server)


def _stop(server: Any) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()
