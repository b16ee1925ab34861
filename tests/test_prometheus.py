"""log.prometheus (training/services/prometheus.py): a real run scraped over HTTP while it trains,
the decision counter moving after a fault; a port already taken refused naming the key."""

import socket
import urllib.request

import pytest

from helpers import free_port
from trimtab import api
from trimtab.errors import ConfigError
from trimtab.training.hooks import Hook

pytest.importorskip("prometheus_client", reason="log.prometheus needs prometheus-client (the track extra, in [dev])")
RUN = {
    "train": {"max_steps": 8, "eval_every": 4, "log_every": 1},
    "data": {"max_bytes": 150000},
    "log": {"progress": False, "tensorboard": False, "report": False},
}


def series(text: str, name: str, **labels: str) -> float | None:
    """The value of the series `name` whose labels include `labels` in a /metrics page."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


class Scrape(Hook):
    """GET /metrics at the end of the given steps, as Prometheus would."""

    def __init__(self, port: int, steps: tuple[int, ...]):
        self.port, self.steps, self.pages = port, steps, {}

    def on_step_end(self, run, out):
        if run.step in self.steps:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as page:
                self.pages[run.step] = page.read().decode()


def test_a_run_is_scraped_live_and_its_decisions_are_counted(tmp_path):
    port = free_port()
    scrape = Scrape(port, (2, 6))
    prometheus = {"enabled": True, "port": port, "addr": "127.0.0.1"}
    api.train(
        preset="debug",
        out=str(tmp_path / "r"),
        hooks=[scrape],
        faults=["nan_loss@3"],
        **{**RUN, "log": {**RUN["log"], "prometheus": prometheus}},
    )
    early, late = scrape.pages[2], scrape.pages[6]
    labels = {"run": "r", "rank": "0"}
    assert series(early, "trimtab_step", **labels) == 2.0 and series(late, "trimtab_step", **labels) == 6.0
    assert series(early, "trimtab_last_step_timestamp_seconds", **labels) > 1.7e9  # a heartbeat: unix time
    assert series(late, "trimtab_tokens", **labels) > series(early, "trimtab_tokens", **labels) > 0
    for gauge in ("trimtab_loss", "trimtab_lr", "trimtab_grad_norm", "trimtab_tokens_per_second"):
        assert series(late, gauge, **labels) is not None, gauge
    assert series(late, "trimtab_val_loss", **labels) is not None  # the evaluation at step 4
    # a figure not yet measured has no series (a 0 would read as a perfect held-out loss)
    assert series(early, "trimtab_val_loss", **labels) is None and series(late, "trimtab_loss_scale") is None
    # the fault at step 3: none before it, one nonfinite decision after
    assert series(early, "trimtab_decisions_total", rule="nonfinite") is None
    assert series(late, "trimtab_decisions_total", rule="nonfinite", action="skip_step", **labels) == 1.0
    assert series(late, "trimtab_checkpoint_step", **labels) == 0.0  # the initial checkpoint


def test_a_port_already_taken_is_refused_naming_the_setting(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        prometheus = {"enabled": True, "port": port, "addr": "127.0.0.1"}
        with pytest.raises(ConfigError, match=r"log\.prometheus\.port: 127\.0\.0\.1:\d+ cannot serve /metrics"):
            api.train(
                preset="debug", out=str(tmp_path / "r"), **{**RUN, "log": {**RUN["log"], "prometheus": prometheus}}
            )
    assert not (tmp_path / "r" / "checkpoints").is_dir() or not any((tmp_path / "r" / "checkpoints").iterdir())


def test_the_shipped_dashboard_and_alerts_read_only_series_the_exporter_serves(tmp_path):
    """docs/grafana/trimtab.json and alerts.yml parse, and every trimtab_* name in their
    expressions is a series a live exporter serves."""
    import json
    import re
    from pathlib import Path

    import yaml

    from trimtab.config.log import PrometheusConfig
    from trimtab.training.services.prometheus import PrometheusExporter

    docs = Path(__file__).parent.parent / "docs" / "grafana"
    dashboard = json.loads((docs / "trimtab.json").read_text())
    rules = yaml.safe_load((docs / "alerts.yml").read_text())["groups"][0]["rules"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]] + [r["expr"] for r in rules]
    exporter = PrometheusExporter(PrometheusConfig(enabled=True, port=free_port(), addr="127.0.0.1"), tmp_path)
    try:
        families = list(exporter.registry.collect())  # a labelled series has no sample before its first value
        served = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    finally:
        exporter.on_train_end(None, {})
    used = {name for e in exprs for name in re.findall(r"\btrimtab_[a-z_]+", e)}
    assert len(used) >= 12 and used <= served, used - served


def test_a_run_that_raised_does_not_keep_its_port_from_the_next_run_of_the_process(tmp_path):
    """A run that ends in an exception never reaches on_train_end: the next run of the same process
    (an API caller's retry) on that port serves its own /metrics instead of being refused."""
    from trimtab.config.log import PrometheusConfig
    from trimtab.training.services.prometheus import PrometheusExporter

    cfg = PrometheusConfig(enabled=True, port=free_port(), addr="127.0.0.1")
    PrometheusExporter(cfg, tmp_path / "crashed")  # its run raised: no on_train_end
    retry = PrometheusExporter(cfg, tmp_path / "retry")
    try:
        retry.step.set(3)
        with urllib.request.urlopen(f"http://127.0.0.1:{cfg.port}/metrics", timeout=10) as page:
            text = page.read().decode()
        assert series(text, "trimtab_step", run="retry") == 3.0 and series(text, "trimtab_step", run="crashed") is None
    finally:
        retry.on_train_end(None, {})
    with socket.socket() as again:  # the port is free once the run ends (its scrape's TIME_WAIT aside)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", cfg.port))
