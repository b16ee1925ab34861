"""checkpoint.dir in object storage (trimtab/storage.py, training/services/storage.py,
docs/storage.md), against a real S3 API server: moto's, started by the test and spoken to over
HTTP through s3fs and botocore as production speaks to S3 (AWS_ENDPOINT_URL points them at it)."""

import json
import logging
import re
import shutil
import threading
import time
import uuid

import pytest
import torch
from safetensors.torch import load_file

import trimtab
from helpers import FAST, StopAt, free_port, trimtab_cli
from trimtab import storage
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config, merge
from trimtab.errors import ConfigError
from trimtab.rundir import read_decisions, read_json
from trimtab.storage import MANIFEST, Remote, open_remote, redact, restore, retain

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

# one worker for the module (--dist loadgroup): its module-scoped store server and reference run
# are made once, not on each worker
pytestmark = pytest.mark.xdist_group("test_storage")

SECRET = "s3cr3t-never-logged-9f2c"  # the test credentials' secret: never in a log line or a run file


@pytest.fixture(scope="module")
def endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    yield f"http://127.0.0.1:{server._port}"
    server.stop()


def aws_env(monkeypatch, endpoint, credentials=True):
    """The standard AWS environment, pointed at the test's server; nothing read from this host's
    ~/.aws or an instance role."""
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    if credentials:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)


@pytest.fixture
def bucket(monkeypatch, endpoint):
    """A new bucket on the test's server, the environment set for it; its s3:// URL."""
    aws_env(monkeypatch, endpoint)
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
    return f"s3://{name}"


def debug_cfg(out, steps=8, sets=(), **overrides):
    base = {
        "out": str(out),
        "train": {"max_steps": steps, "eval_every": 0, "log_every": 1, "precision": "fp32"},
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 3},
        "log": {"progress": False, "tensorboard": False, "report": False},
    }
    return load_config(preset="debug", overrides=merge(base, overrides), sets=list(sets))


def logged(run_dir):
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["loss"]) for m in lines if "loss" in m]


def final_weights(run_dir):
    return load_file(str(list_checkpoints(run_dir)[-1] / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same 8 steps, one session, no object storage."""
    out = tmp_path_factory.mktemp("reference") / "a"
    trimtab.train(debug_cfg(out))
    return out


def interrupted(tmp_path, url):
    """A run with checkpoint.dir, stopped after step 5 of 8 (saved: 0, 3, 5, each uploaded), then
    its run directory lost: a fresh machine with only the bucket."""
    out = tmp_path / "b"
    first = trimtab.train(debug_cfg(out, checkpoint={"dir": url}), hooks=[StopAt(5)])
    assert first["step"] == 5
    complete, partial = open_remote(url).listing()
    assert complete == ["step_000000", "step_000003", "step_000005"] and partial == []
    shutil.rmtree(out)
    return out


def assert_same_run(a, b):
    """The same final weights, bit for bit, and the same loss curve, the lines of the session
    before the machine was lost included (the run's record files come back from the store)."""
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert logged(a) == logged(b)


def test_interrupted_run_resumes_exactly_from_the_bucket(tmp_path, bucket, uninterrupted, caplog):
    """The issue's done-when: a debug run with checkpoint.dir on s3 is interrupted, its machine
    lost, and the next session resumes from the bucket exactly (weights bitwise, the loss curve)."""
    caplog.set_level(logging.INFO)
    out = interrupted(tmp_path, f"{bucket}/runs/b")
    second = trimtab.train(debug_cfg(out, checkpoint={"dir": f"{bucket}/runs/b"}))
    assert second["step"] == 8 and second["steps_this_session"] == 3  # resumed at step 5
    assert (out / "config.yaml").is_file() and (out / "tokenizer.json").is_file()  # from run/
    assert_same_run(uninterrupted, out)
    sessions = read_json(out / "goodput.json")["sessions"]  # the ledger goes on: the lost machine's session, then this
    assert [(s["from_step"], s["step"]) for s in sessions] == [(0, 5), (5, 8)]
    # the bucket follows the run directory's retention (keep 3)
    remote = open_remote(f"{bucket}/runs/b")
    assert remote.listing() == ([p.name for p in list_checkpoints(out)], [])
    # the credentials are nowhere: not in a log line, not in a run file
    assert SECRET not in caplog.text
    assert all(SECRET.encode() not in p.read_bytes() for p in out.rglob("*") if p.is_file())


def test_a_partial_upload_is_never_resumed_and_a_corrupt_one_falls_back(tmp_path, bucket, uninterrupted, caplog):
    """step 5's upload lost its manifest (the writer died before it), step 3's weights are
    damaged in the bucket: the resume skips both, each said, and starts exactly from step 0."""
    url = f"{bucket}/b"
    out = interrupted(tmp_path, url)
    fs = open_remote(url).fs
    fs.rm_file(f"{url}/step_000005/{MANIFEST}")
    weights = f"{url}/step_000003/model.safetensors"
    data = bytearray(fs.cat_file(weights))
    data[-1] ^= 0xFF
    fs.pipe_file(weights, bytes(data))
    second = trimtab.train(debug_cfg(out, checkpoint={"dir": url}))
    assert second["steps_this_session"] == 8  # from step 0's checkpoint
    assert "step_000005: skipped, an upload that did not finish" in caplog.text
    assert "step_000003: skipped, not a valid checkpoint" in caplog.text
    assert_same_run(uninterrupted, out)
    assert "step_000005" not in open_remote(url).listing()[0]
    # the store's corrupt checkpoint is an incident journaled as the run directory's are (the partial upload is not)
    fell = [d for d in read_decisions(out) if d["rule"] == "checkpoint_fallback"]
    assert len(fell) == 1, [d["rule"] for d in read_decisions(out)]
    e = fell[0]["evidence"]
    assert [(r["checkpoint"], r["store"]) for r in e["refused"]] == [("step_000003", url)]
    assert (e["resumed_step"], e["newest_step"], e["steps_lost"]) == (0, 3, 3)
    assert f"did not download the ones in {url}" in fell[0]["reasoning"]


def test_restore_takes_the_newest_valid_checkpoint(tmp_path, bucket, caplog):
    """storage.restore on its own: the corrupt newest is skipped for the one before it."""
    remote = open_remote(f"{bucket}/r")
    for step in (1, 2):
        local = tmp_path / "src" / f"step_{step:06d}"
        local.mkdir(parents=True)
        (local / "w.bin").write_bytes(bytes([step]) * 10)
        (local / MANIFEST).write_text(json.dumps({"step": step, "manifest": {"w.bin": 10}}))
        remote.upload(local)
    remote.fs.pipe_file(f"{bucket}/r/step_000002/w.bin", b"short")

    def verify(path):
        state = json.loads((path / MANIFEST).read_text())
        assert (path / "w.bin").stat().st_size == state["manifest"]["w.bin"], "truncated"
        return state

    found = restore(remote, tmp_path / "dst", verify)
    assert found[0] == tmp_path / "dst" / "step_000001" and found[1]["step"] == 1
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["step_000001"]  # no temp dir left
    assert "step_000002: skipped, not a valid checkpoint (truncated" in caplog.text


class Recording:
    """A file system that records the order of the writes Remote makes."""

    def __init__(self, fs):
        self.fs, self.writes = fs, []

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def put_file(self, local, remote):
        self.writes.append(("put", remote.rsplit("/", 1)[-1]))
        self.fs.put_file(local, remote)

    def rm_file(self, path):
        self.writes.append(("rm", path.rsplit("/", 1)[-1]))
        self.fs.rm_file(path)


def test_the_manifest_is_uploaded_last_and_removed_first_when_a_step_is_saved_again(tmp_path):
    """An object store has no rename: completeness is state.json written after every file; a step
    saved again (after a rollback) reads as partial while it is replaced, never as a mix."""
    remote = open_remote(f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt")
    remote.fs = recording = Recording(remote.fs)
    local = tmp_path / "step_000004"
    (local / "dcp").mkdir(parents=True)
    for name in ("model.safetensors", "optim.pt", "dcp/x.distcp", MANIFEST):
        (local / name).write_text(name)
    remote.upload(local)
    assert recording.writes[-1] == ("put", MANIFEST) and len(recording.writes) == 4
    recording.writes.clear()
    (local / "dcp" / "x.distcp").unlink()
    remote.upload(local)
    assert recording.writes == [
        ("rm", MANIFEST),
        ("put", "model.safetensors"),
        ("put", "optim.pt"),
        ("rm", "x.distcp"),
        ("put", MANIFEST),
    ]
    assert remote.listing() == (["step_000004"], [])


def test_a_missing_bucket_is_a_config_error_naming_the_key(bucket):
    missing = f"{bucket}-absent"
    with pytest.raises(ConfigError, match=r"checkpoint.dir.*bucket 'ckpt-\w+-absent' does not exist; create it"):
        open_remote(f"{missing}/run")


def test_an_unreachable_endpoint_fails_in_seconds(monkeypatch, endpoint):
    aws_env(monkeypatch, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"checkpoint.dir.*unreachable .*AWS_ENDPOINT_URL"):
        open_remote("s3://any-bucket/run")
    assert time.monotonic() - started < 30


def test_a_hung_endpoint_fails_in_seconds_not_half_an_hour(monkeypatch):
    """A store that accepts connections and never answers (a stopped server, a stalled proxy): the
    start-up check's read timeout, retried by botocore alone, refuses it in under a minute (s3fs's
    own retries on top of botocore's made it 5 x 3 x 120 s); the check's timeout cut here to keep
    the test short. A store that never answers times every read out, however busy the host, so
    0.5 s reads cost no flakiness: botocore's 4 attempts and their jittered backoff end in 3-10 s;
    s3fs's retries on top queue 20 connections behind the 16 the backlog holds (63 s, measured)."""
    import socket

    monkeypatch.setattr(storage, "CHECK_READ_S", 0.5)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # the kernel completes each connection; nobody reads or answers
        aws_env(monkeypatch, f"http://127.0.0.1:{hung.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(ConfigError, match=r"checkpoint.dir.*unreachable \(ReadTimeoutError.*AWS_ENDPOINT_URL"):
            open_remote("s3://any-bucket/run")
    assert time.monotonic() - started < 45


def test_missing_credentials_name_the_standard_places(monkeypatch, endpoint):
    aws_env(monkeypatch, endpoint, credentials=False)
    with pytest.raises(ConfigError, match=r"checkpoint.dir.*no credentials found.*AWS_ACCESS_KEY_ID"):
        open_remote("s3://any-bucket/run")


def test_credentials_in_the_url_are_refused_and_never_repeated():
    with pytest.raises(ConfigError, match="checkpoint.dir") as refused:
        load_config(preset="debug", overrides={"checkpoint": {"dir": f"s3://AKIA:{SECRET}@bucket/run"}})
    assert SECRET not in str(refused.value)
    with pytest.raises(ConfigError, match="must be a storage URL"):
        load_config(preset="debug", overrides={"checkpoint": {"dir": "bucket/run"}})
    assert redact(f"http://key:{SECRET}@host:9000/x") == "http://***@host:9000/x"


def test_a_bad_bucket_on_the_command_line_exits_2_and_writes_nothing(tmp_path, bucket):
    """The CLI: one line naming checkpoint.dir and the fix, exit code 2, no run directory."""
    out = tmp_path / "run"
    args = ["train", "--preset", "debug", "--out", str(out), "--max-steps", "2", *FAST]
    done = trimtab_cli([*args, "--set", f"checkpoint.dir={bucket}-absent/run"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("trimtab: error: config key 'checkpoint.dir'") and "does not exist" in last, last
    assert "Traceback" not in done.stderr and not out.exists()


def test_replica_groups_and_a_store_are_refused_together(tmp_path):
    cfg = debug_cfg(tmp_path / "r", checkpoint={"dir": "memory://x/y"})
    from trimtab.training.services.storage import open_store

    assert isinstance(open_store(cfg), Remote)
    ft = debug_cfg(tmp_path / "r", checkpoint={"dir": "memory://x/y"}, resilience={"ft": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"checkpoint.dir.*not built for resilience.ft"):
        open_store(ft)


def fake_step(root, step, payload=b"w"):
    local = root / f"step_{step:06d}"
    local.mkdir(parents=True, exist_ok=True)
    (local / "w.bin").write_bytes(payload)
    (local / MANIFEST).write_text(json.dumps({"step": step, "manifest": {}}))
    return local


def test_retention_follows_the_run_directory(tmp_path):
    """The store keeps what the run directory keeps plus its own newest `keep` below the newest
    local one; partial uploads and steps newer than the run directory's newest that it lacks (a
    rolled-back trajectory) go."""
    remote = open_remote(f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt")
    for step in (0, 2, 4, 6, 8, 10, 12):
        remote.upload(fake_step(tmp_path, step))
    remote.fs.rm_file(f"{remote.root}/step_000012/{MANIFEST}")  # a killed upload
    # the run rolled back to 4 and saved 6 again: its directory holds 2 (last good), 4, 6
    gone = retain(remote, {"step_000002", "step_000004", "step_000006"}, keep=2)
    assert sorted(gone) == ["step_000000", "step_000008", "step_000010", "step_000012"]
    assert remote.listing() == (["step_000002", "step_000004", "step_000006"], [])
    # a restored run directory holds few checkpoints: the store's older ones within `keep` stay
    remote.upload(fake_step(tmp_path, 7))
    assert retain(remote, {"step_000006", "step_000007"}, keep=3) == ["step_000002"]
    assert remote.listing()[0] == ["step_000004", "step_000006", "step_000007"]


def test_a_store_that_refuses_access_says_so(monkeypatch):
    remote = open_remote(f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt")

    def denied(*args, **kwargs):
        raise PermissionError("Access Denied")

    monkeypatch.setattr(remote.fs, "pipe_file", denied)
    with pytest.raises(ConfigError, match=r"checkpoint.dir.*access denied \(Access Denied\); give these credentials"):
        storage._check(remote, "checkpoint.dir")


def test_background_checkpoints_are_uploaded_once_on_disk(tmp_path, bucket):
    """checkpoint.asynchronous: each checkpoint is uploaded when its write is collected (the
    next save, the run's end); the store ends as the run directory."""
    out, url = tmp_path / "r", f"{bucket}/async"
    trimtab.train(debug_cfg(out, steps=6, checkpoint={"dir": url, "asynchronous": True}))
    local = [p.name for p in list_checkpoints(out)]
    assert local[-1] == "step_000006" and open_remote(url).listing() == (local, [])


def test_other_paths_read_and_write_object_storage(tmp_path, bucket, monkeypatch, caplog):
    """train.init_from, trimtab eval and trimtab export's RUN_DIR read a run from its
    checkpoint.dir (fetched into the cache, verified); export --out uploads, its record last."""
    from trimtab.evaluation import evaluate
    from trimtab.hf import export_run

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path / "cache"))
    source, url = tmp_path / "source", f"{bucket}/source"
    trimtab.train(debug_cfg(source, steps=4, checkpoint={"dir": url}))
    text = tmp_path / "notes.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    here = evaluate(source, data=str(text))["data"]
    there = evaluate(url, data=str(text))  # the newest checkpoint, step 4, fetched
    assert there["step"] == 4 and there["data"]["perplexity"] == here["perplexity"]
    assert str(tmp_path / "cache") in there["model"]  # results recorded in the cached copy
    # an export from the bucket, into the bucket: the same files as a local export
    export_run(source, tmp_path / "local-export")
    assert export_run(url, f"{bucket}/export") == f"{bucket}/export"
    fs = open_remote(f"{bucket}/export").fs
    exported = {p.rsplit("/", 1)[-1] for p in fs.find(f"{bucket}/export")}
    assert exported == {p.name for p in (tmp_path / "local-export").iterdir()}
    ours = (tmp_path / "local-export" / "model.safetensors").read_bytes()
    assert fs.cat_file(f"{bucket}/export/model.safetensors") == ours
    # train.init_from the bucket's step 3: the new run starts from exactly those weights
    start = tmp_path / "finetune"
    trimtab.train(debug_cfg(start, steps=1, train={"init_from": f"{url}/step_000003"}))
    assert "train.init_from " + f"{url}/step_000003: fetched into" in caplog.text
    first = load_file(str(list_checkpoints(start)[0] / "model.safetensors"))
    origin = load_file(str(list_checkpoints(source)[0].parent / "step_000003" / "model.safetensors"))
    assert first.keys() == origin.keys() and all(torch.equal(first[k], origin[k]) for k in first)


def test_an_export_never_overwrites_a_prefix_it_did_not_write(tmp_path, bucket):
    from trimtab.hf import export_run

    fs = open_remote(bucket).fs
    fs.pipe_file(f"{bucket}/theirs/data.bin", b"someone's")
    with pytest.raises(ConfigError, match=r"--out '.*/theirs' is not empty and holds no trimtab export"):
        export_run(tmp_path / "never-read", f"{bucket}/theirs")
    assert fs.cat_file(f"{bucket}/theirs/data.bin") == b"someone's"


def test_data_sources_and_prepared_shards_in_object_storage(tmp_path, bucket, monkeypatch, caplog):
    """data.source a prefix in the bucket: fetched into the cache once (used again while the
    bucket's listing is unchanged), and the run is the one the same local folder gives; prepared
    shards (trimtab data prepare) from the bucket as well."""
    from trimtab.data.prepare import prepare
    from trimtab.data.sources import builtin_files

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("TRIMTAB_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    for path in builtin_files()[1][:40]:
        (folder / path.name).write_bytes(path.read_bytes())
    fs = open_remote(bucket).fs
    fs.put(str(folder), f"{bucket}/corpus", recursive=True)
    here = tmp_path / "here"
    trimtab.train(debug_cfg(here, steps=2, data={"source": str(folder)}))
    there = debug_cfg(tmp_path / "there", steps=2, data={"source": f"{bucket}/corpus"})
    trimtab.train(there)
    assert logged(here) == logged(tmp_path / "there")
    assert caplog.text.count("data.source: fetched") == 1
    copy = storage.mirror(f"{bucket}/corpus", "data.source")  # the cached copy, used again
    assert copy.parent.parent == tmp_path / "cache" / "remote-data" and caplog.text.count("data.source: fetched") == 1
    prepare([str(folder)], tmp_path / "prepared", tokenizer=str(here / "tokenizer.json"))
    fs.put(str(tmp_path / "prepared"), f"{bucket}/prepared", recursive=True)
    summary = trimtab.train(debug_cfg(tmp_path / "shards", steps=1, data={"source": f"{bucket}/prepared"}))
    assert summary["step"] == 1 and caplog.text.count("data.source: fetched") == 2


def test_each_tuning_trial_has_its_own_prefix(tmp_path):
    """A checkpoint.dir resumes what it holds: trimtab tune gives each trial (and best.yaml's
    run) a prefix of its own under the base's, or the second trial would resume the first."""
    import yaml

    from trimtab.tune import load_space

    doc = {
        "study": {"name": "s", "seed": 0},
        "base": {"preset": "debug", "checkpoint": {"dir": "s3://bucket/study/"}},
        "budget": {"max_steps": 2},
        "space": {"optim.lr": {"log_uniform": [1.0e-3, 1.0e-2]}},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    space = load_space(tmp_path / "s.yaml")
    cfg = space.config({"optim.lr": 1e-3}, tmp_path / "trials" / "trial_0003")
    assert cfg.checkpoint.dir == "s3://bucket/study/trial_0003"


@pytest.mark.slow
def test_a_data_parallel_run_uploads_its_sharded_checkpoints(tmp_path, bucket):
    """Two ranks (DDP: sharded checkpoints, every rank's DCP files in one directory): rank 0
    uploads each whole; the run directory lost, one process resumes from the bucket's newest."""
    import helpers

    # the ranks are forked by the test process's fork server, with its environment: one started
    # before this test's AWS environment was set would not reach the bucket, so start it afresh
    if helpers._server is not None and helpers._server.poll() is None:
        helpers._server.stdin.close()  # it ends at the end of its input
        helpers._server.wait(timeout=60)
    helpers._server = None
    out, url, steps = tmp_path / "dp", f"{bucket}/dp", helpers.STEPS
    helpers.run(out, 2, checkpoint={"dir": url})
    complete, partial = open_remote(url).listing()
    assert complete[-1] == f"step_{steps:06d}" and partial == []
    files = open_remote(url).fs.find(f"{url}/{complete[-1]}")
    assert sum(p.endswith(".distcp") for p in files) == 2  # both ranks' shards
    shutil.rmtree(out)
    summary = trimtab.train(debug_cfg(out, steps=steps + 2, checkpoint={"dir": url, "every": 5}))
    assert summary["steps_this_session"] == 2  # resumed at the last step, resharded to one process


def test_a_manifest_naming_files_outside_its_checkpoint_is_not_restored(tmp_path, caplog):
    remote = open_remote(f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt")
    local = fake_step(tmp_path / "src", 3)
    (local / MANIFEST).write_text(json.dumps({"step": 3, "manifest": {"../../escaped": {}}}))
    remote.upload(local)
    assert restore(remote, tmp_path / "dst", lambda path: {}) is None
    assert "names a file outside the checkpoint: '../../escaped'" in caplog.text
    assert not (tmp_path / "escaped").exists()


def test_an_upload_survives_the_run_directory_moving_its_checkpoint(tmp_path):
    """The upload thread reads hard links made at once: the local prune (or a rollback) taking
    the checkpoint away while it uploads leaves the upload whole."""
    from trimtab.training.services.storage import RemoteCheckpoints

    url = f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt"
    hook = RemoteCheckpoints(url, tmp_path, keep=3)
    step = fake_step(tmp_path / "checkpoints", 5, payload=b"x" * 1_000_000)
    hook.on_checkpoint(None, step)
    shutil.rmtree(step)  # pruned locally while it uploads
    hook.wait()
    remote = open_remote(url)
    assert remote.listing() == (["step_000005"], [])
    assert remote.fs.cat_file(f"{remote.root}/step_000005/w.bin") == b"x" * 1_000_000
    assert not any((tmp_path / "checkpoints" / ".upload").iterdir())  # the links removed


def test_a_restored_run_that_compares_with_its_start_gets_the_step_0_checkpoint_too(tmp_path, bucket):
    """RL's KL term and DPO read their reference from the run's step-0 checkpoint: a fresh machine
    restores it beside the newest, which alone would leave the reference unreadable."""
    from trimtab.config import load_config
    from trimtab.training.services.storage import reference_steps, restore_from

    remote = open_remote(f"{bucket}/ref")
    for step in (0, 4, 8):
        remote.upload(fake_step(tmp_path / "src", step))
    run_dir = tmp_path / "run"
    found = restore_from(remote, run_dir, ("step_000000",))
    assert found[0].name == "step_000008"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000000", "step_000008"]
    assert reference_steps(load_config(preset="debug", overrides={"dpo": {"enabled": True}})) == ("step_000000",)
    assert reference_steps(load_config(preset="debug")) == ()


def test_a_newer_format_checkpoint_in_the_store_is_refused_not_passed_over(tmp_path, caplog):
    """A checkpoint a newer trimtab uploaded is not corrupt: restoring the one before it would
    train the run back from there; the refusal (with its fix) reaches the caller."""
    from trimtab.errors import NewerCheckpointError

    remote = open_remote(f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt")
    for step in (2, 4):
        remote.upload(fake_step(tmp_path / "src", step))

    def verify(path):
        if path.name.endswith("step_000004_remote"):
            raise NewerCheckpointError(f"{path}: checkpoint format 9 is newer than this trimtab's; upgrade trimtab")
        return {}

    with pytest.raises(NewerCheckpointError, match="upgrade trimtab"):
        restore(remote, tmp_path / "dst", verify)
    assert not (tmp_path / "dst").exists() or not list((tmp_path / "dst").iterdir())  # nothing half-restored


def test_a_second_writer_takes_the_prefix_over_and_the_first_stops_writing(tmp_path, bucket, monkeypatch):
    """Two processes pointed at one checkpoint.dir (a run started with another's, a machine thought
    lost still running) interleaved their checkpoints, each deleting the other's newer ones as a
    rolled-back trajectory. The later one takes the prefix over at its first upload; the earlier
    one's next upload and pruning are refused naming the other, and delete nothing."""
    url = f"{bucket}/shared"
    first = open_remote(url)
    first.upload(fake_step(tmp_path / "a", 4))
    this = storage._PROCESS
    monkeypatch.setattr(storage, "_PROCESS", "another-process")  # what a second process's Remote writes as
    open_remote(url).upload(fake_step(tmp_path / "b", 2))  # resumed from an older checkpoint than the first's newest
    monkeypatch.setattr(storage, "_PROCESS", this)
    with pytest.raises(storage.StoreTakenError, match=r"another trimtab \(pid \d+ on .+\) writes to s3://"):
        first.upload(fake_step(tmp_path / "a", 6))
    with pytest.raises(storage.StoreTakenError, match="give each run a checkpoint.dir of its own"):
        retain(first, {"step_000004"}, keep=3)
    assert first.listing() == (["step_000002", "step_000004"], [])  # neither wrote nor deleted


def run_dir_with_files(root, **model):
    """A run directory's config.yaml (a resolved config, its vocabulary settled as complete()
    settles it; `model` overrides) and tokenizer.json."""
    import yaml

    from trimtab.config import derive

    cfg = derive(debug_cfg(root), {"model": {"vocab_size": 300, **model}})
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (root / "tokenizer.json").write_text("{}")
    return root


def test_the_run_files_are_uploaded_again_when_the_store_lost_them(tmp_path):
    """A store emptied or restarted under a run (its checkpoints uploaded again since) had no
    run/config.yaml: what reads the prefix (eval, export, a resume) found no trimtab run there."""
    from trimtab.training.services.storage import RemoteCheckpoints

    url = f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt"
    run_dir = run_dir_with_files(tmp_path / "run")
    hook = RemoteCheckpoints(url, run_dir, keep=3)
    hook.on_checkpoint(None, fake_step(run_dir / "checkpoints", 3))
    hook.wait()
    remote = open_remote(url)
    remote.fs.rm(f"{remote.root}/run/config.yaml")
    remote.fs.rm(f"{remote.root}/run/tokenizer.json")
    hook.on_checkpoint(None, fake_step(run_dir / "checkpoints", 6))
    hook.wait()
    assert remote.fs.exists(f"{remote.root}/run/tokenizer.json")
    assert remote.fs.cat_file(f"{remote.root}/run/config.yaml") == (run_dir / "config.yaml").read_bytes()


def test_a_run_pointed_at_another_models_prefix_is_refused_before_anything_is_downloaded(tmp_path, bucket):
    """A new run given another run's checkpoint.dir downloaded that run's files into its --out,
    then was refused with "use a new --out" (it had), its directory left holding the other's."""
    url = f"{bucket}/other"
    remote = open_remote(url)
    remote.put_run_files(run_dir_with_files(tmp_path / "other"))
    remote.upload(fake_step(tmp_path / "src", 3))
    out = tmp_path / "new"
    with pytest.raises(ConfigError, match=r"checkpoint.dir.*holds another run.*model.n_layers: 5 there, 3 here"):
        trimtab.train(debug_cfg(out, checkpoint={"dir": url}, model={"n_layers": 3}))
    assert not out.exists()
    from trimtab.training.services.storage import open_store

    assert open_store(debug_cfg(out, checkpoint={"dir": url})) is not None  # the same model: that run resumes
    knob = debug_cfg(out, checkpoint={"dir": url}, model={"moe": {"capacity_factor": 2.0}})
    assert open_store(knob) is not None  # a live knob a resume may change


class Blocking:
    """A Remote whose uploads wait until released: a store that stopped answering."""

    def __init__(self, remote):
        self.remote, self.release = remote, threading.Event()

    def __getattr__(self, name):
        return getattr(self.remote, name)

    def upload(self, local):
        self.release.wait(30)
        self.remote.upload(local)


def test_training_held_by_an_upload_is_said_and_counted_as_checkpointing(tmp_path, monkeypatch, caplog):
    """A store that stopped answering held training at the next checkpoint with no line said, the
    time counted as `other`: the wait is said (the store, the seconds), and a synchronous save
    waits inside its own time (save_seconds: the ledger's checkpoint bucket)."""
    from trimtab.training.services import storage as services

    monkeypatch.setattr(services, "WAIT_WARN_S", 0.2)
    url = f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt"
    hook = services.RemoteCheckpoints(url, tmp_path, keep=3)
    hook.remote = blocking = Blocking(hook.remote)
    hook.on_checkpoint(None, fake_step(tmp_path / "checkpoints", 3))
    threading.Timer(0.5, blocking.release.set).start()
    started = time.monotonic()
    hook.on_save_stall(None)  # the next save's stall
    assert time.monotonic() - started >= 0.4 and hook._thread is None
    assert f"training waits for the upload of step_000003 to {url} (checkpoint.dir)" in caplog.text
    assert re.search(rf"the upload of step_000003 to {url} \(checkpoint.dir\) held training \d+ s", caplog.text)


def test_a_run_whose_prefix_was_taken_over_says_it_uploads_no_more(tmp_path, monkeypatch, caplog):
    from trimtab.training.services.storage import RemoteCheckpoints

    url = f"memory://trimtab-test-{uuid.uuid4().hex[:8]}/ckpt"
    hook = RemoteCheckpoints(url, tmp_path, keep=3)
    hook.on_checkpoint(None, fake_step(tmp_path / "checkpoints", 3))
    hook.wait()
    this = storage._PROCESS
    monkeypatch.setattr(storage, "_PROCESS", "another-process")
    open_remote(url).upload(fake_step(tmp_path / "b", 2))
    monkeypatch.setattr(storage, "_PROCESS", this)
    hook.on_checkpoint(None, fake_step(tmp_path / "checkpoints", 6))
    hook.wait()
    assert f"step_000006 was not uploaded to {url}: this run's uploads there stopped for good" in caplog.text
    assert "the next checkpoint is uploaded again" not in caplog.text
    caplog.clear()
    hook.on_checkpoint(None, fake_step(tmp_path / "checkpoints", 9))
    hook.on_train_end(None, {})
    assert caplog.text == "" and open_remote(url).listing() == (["step_000002", "step_000003"], [])
