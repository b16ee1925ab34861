"""The goodput ledger of a run whose checkpoint.dir is in object storage (training/services/storage.py,
resilience/goodput.py): the time training waits for an upload is checkpointing, and the ledger's
files travel with the run's other record files to a fresh machine. The store is a local folder
(file://): what is tested is what the run does around the upload, not the store's protocol."""

import logging
import shutil
import time

import trimtab
from trimtab import storage
from trimtab.config import load_config, merge
from trimtab.resilience.goodput import read_mark
from trimtab.rundir import read_json
from trimtab.storage import open_remote
from trimtab.training.services.storage import RemoteCheckpoints, restore_from

UPLOAD_S = 1.5  # how long the slowed store takes to upload one checkpoint


def debug_cfg(out, steps, **checkpoint):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "log_every": 1, "precision": "fp32"},
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 2, **checkpoint},
        "log": {"progress": False, "tensorboard": False, "report": False},
    }
    return load_config(preset="debug", overrides=merge(base, {}))


def test_waits_for_a_slow_stores_uploads_are_checkpointing_in_the_ledger(tmp_path, monkeypatch):
    """checkpoint.asynchronous with a slow store: each collection of a background write waited for
    the upload before it in the storage hook's on_checkpoint, after the ledger had read the save's
    stall (counted `other`), and the run's end waited for the last upload after the ledger closed
    (counted nowhere). Saves at 0, 2, 4, 6 (the last one synchronous): the upload of 4 is waited
    for by the save of 6, the upload of 6 by the run's end; every second of it is checkpointing."""
    upload, wait, waited = storage.Remote.upload, RemoteCheckpoints.wait, []

    def slow(self, local):
        time.sleep(UPLOAD_S)
        upload(self, local)

    def timed(self):  # every second training is held by an upload
        started = time.perf_counter()
        wait(self)
        waited.append(time.perf_counter() - started)

    monkeypatch.setattr(storage.Remote, "upload", slow)
    monkeypatch.setattr(RemoteCheckpoints, "wait", timed)
    out = tmp_path / "run"
    summary = trimtab.train(debug_cfg(out, 6, dir=f"file://{tmp_path}/store", asynchronous=True))
    assert summary["status"] == "completed"
    seconds = read_json(out / "summary.json")["goodput"]["seconds"]
    assert sum(waited) >= UPLOAD_S, waited  # the store held training: what this test is about
    assert seconds["checkpoint"] >= sum(waited), (seconds, waited)
    ledger = read_json(out / "goodput.json")["sessions"][-1]
    assert ledger["end"] == "completed" and round(ledger["seconds"]["checkpoint"], 3) == seconds["checkpoint"]
    # the store's copy of the ledger is the one closed with the last wait in it
    assert read_json(tmp_path / "store" / "run" / "goodput.json")["sessions"][-1] == ledger


def test_the_ledgers_step_mark_is_uploaded_and_restored_on_a_fresh_machine(tmp_path, caplog):
    """goodput.step (the last step a session completed, resilience/goodput.py) was not among the
    record files uploaded with each checkpoint: a run restored from the store lost it, and with it
    the exact steps lost of a session the fresh machine's restart incident reports. Nor was
    summary.json, written after the last upload: the same command on the fresh machine said the run
    "has not finished: ... the session that saved that checkpoint ended before writing summary.json"."""
    url, out = f"file://{tmp_path}/store", tmp_path / "run"
    first = trimtab.train(debug_cfg(out, 4, dir=url))
    assert first["status"] == "completed"
    mark = (out / "goodput.step").read_bytes()
    started = read_json(out / "goodput.json")["sessions"][-1]["started"]
    assert read_mark(out, started)[0] == 4
    assert (tmp_path / "store" / "run" / "goodput.step").read_bytes() == mark
    shutil.rmtree(out)  # the machine lost: only the store remains
    found = restore_from(open_remote(url), out)
    assert found is not None and found[1]["step"] == 4
    assert (out / "goodput.step").read_bytes() == mark and read_mark(out, started)[0] == 4
    caplog.set_level(logging.INFO)
    assert trimtab.train(debug_cfg(out, 4, dir=url)) == first == read_json(out / "summary.json")
    assert f"{out} has finished: it is at step 4 of 4" in caplog.text and "has not finished" not in caplog.text
