"""TensorBoard on a run restored on a fresh machine: checkpoint.dir's store holds metrics.jsonl but
not tb/, so TensorBoard showed the steps since the restore alone. A resumed run with no events
file writes its kept curves from metrics.jsonl first (abandoned steps and those past the
checkpoint left out); one with its events files writes nothing again."""

import json
from types import SimpleNamespace

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trimtab.training.hooks import TensorBoardLogger

LINES = [
    {"step": 2, "phase": "pretrain", "loss": 6.0, "lr": 1e-3},
    {"step": 4, "phase": "pretrain", "loss": 9.0, "lr": 1e-3, "abandoned": True},  # a rollback's branch
    {"step": 4, "phase": "pretrain", "loss": 5.5, "lr": 1e-3},
    {"step": 4, "phase": "pretrain", "val_loss": 5.6, "val_ppl": 270.4},
    {"step": 6, "phase": "pretrain", "loss": 5.2, "lr": 1e-3},  # past the checkpoint a resume starts from
]


def _curves(tb) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(tb))
    events.Reload()
    return {tag: [(e.step, round(e.value, 4)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_resumed_run_without_events_files_writes_its_curves_from_metrics_jsonl(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))
    logger = TensorBoardLogger(tmp_path / "tb")
    logger.on_train_start(SimpleNamespace(step=4, run_dir=tmp_path))
    logger.on_log(None, {"step": 5, "loss": 5.3, "lr": 1e-3})
    logger.writer.close()
    curves = _curves(tmp_path / "tb")
    assert curves["train/loss"] == [(2, 6.0), (4, 5.5), (5, 5.3)]
    assert curves["eval/val_loss"] == [(4, 5.6)] and "train/val_loss" not in curves
    again = TensorBoardLogger(tmp_path / "tb")  # a later resume: its files are there, nothing doubled
    again.on_train_start(SimpleNamespace(step=5, run_dir=tmp_path))
    again.writer.close()
    assert _curves(tmp_path / "tb")["train/loss"] == [(2, 6.0), (4, 5.5), (5, 5.3)]
