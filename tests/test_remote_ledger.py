"""The goodput ledger through object storage: what a user running jobs meets when a run ends on
purpose and its machine is then lost, against a real S3 API server (test_storage.py's)."""

import shutil

import pytest

import trimtab
from trimtab.rundir import read_json

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
from test_storage import bucket, debug_cfg, endpoint  # noqa: E402, F401  (the fixtures: a bucket on moto's server)


def test_a_completed_run_restored_from_the_bucket_is_not_journaled_as_a_lost_session(tmp_path, bucket):  # noqa: F811
    """A run that completed, its machine then gone, lengthened on a fresh one from the bucket: the
    ledger's first session ended on purpose, so no restart incident and no down time."""
    url, out = f"{bucket}/done", tmp_path / "a"
    assert trimtab.train(debug_cfg(out, steps=3, checkpoint={"dir": url}))["status"] == "completed"
    shutil.rmtree(out)
    trimtab.train(debug_cfg(out, steps=5, checkpoint={"dir": url}))
    ledger = read_json(out / "goodput.json")
    assert [s["end"] for s in ledger["sessions"]] == ["completed", "completed"]
    assert ledger["incidents"] == []
