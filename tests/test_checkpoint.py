import json
import logging
import os
import shutil

import pytest
import torch
from torch import nn

from trimtab.checkpoint import (
    checkpoint_root,
    commit_checkpoint,
    find_checkpoint,
    latest_valid,
    list_checkpoints,
    put_back_replaced,
    save_checkpoint,
    set_aside_corrupt,
)
from trimtab.checkpoint_load import load_checkpoint, load_model, load_weights
from trimtab.config import load_config
from trimtab.errors import CheckpointError
from trimtab.model.transformer import Transformer


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def save(tmp_path, step, keep=3, model=None):
    model = model or Tied()
    return save_checkpoint(
        tmp_path, step, model.state_dict(), {"optimizer": {"x": torch.ones(2)}}, {"train": {"step": step}}, keep=keep
    )


def test_round_trip_with_tied_weights(tmp_path):
    model = Tied()
    path = save(tmp_path, 7, model=model)
    weights, optim_state, state = load_checkpoint(path)
    assert state["step"] == 7 and state["train"] == {"step": 7}
    assert torch.equal(optim_state["optimizer"]["x"], torch.ones(2))
    fresh = Tied()
    load_weights(fresh, weights, path)
    assert torch.equal(fresh.head.weight, model.embed.weight)
    assert fresh.head.weight is fresh.embed.weight  # still tied after loading


def test_keeps_last_k_and_leaves_no_temp_dirs(tmp_path):
    for step in (10, 20, 30, 40):
        save(tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000030", "step_000040"]
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))


def test_truncated_newest_falls_back_with_warning(tmp_path, caplog):
    save(tmp_path, 10)
    newest = save(tmp_path, 20)
    data = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING):
        path, state = latest_valid(tmp_path)
    assert path.name == "step_000010" and state["step"] == 10
    assert "step_000020" in caplog.text and "truncated or corrupt" in caplog.text


def truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def test_a_corrupt_checkpoint_is_said_once_with_the_step_it_falls_back_to(tmp_path, caplog):
    """A rule's has_checkpoint, then the rollback's find_checkpoint, then a resume's latest_valid
    read the same directory (under FSDP rank 0 did all three): one warning, naming the corrupt
    checkpoint and the one used instead; the step saved again and found corrupt again is new."""
    save(tmp_path, 10)
    truncate(save(tmp_path, 20))
    with caplog.at_level(logging.WARNING, logger="trimtab.checkpoint"):
        assert find_checkpoint(tmp_path, 20)[0].name == "step_000010"
        assert find_checkpoint(tmp_path, 25)[0].name == "step_000010"
        assert latest_valid(tmp_path)[0].name == "step_000010"
    said = [r.getMessage() for r in caplog.records if "skipping corrupt" in r.getMessage()]
    assert len(said) == 1, said
    assert "step_000020" in said[0] and "falling back to" in said[0] and "(step 10)" in said[0]
    caplog.clear()
    truncate(save(tmp_path, 20))
    with caplog.at_level(logging.WARNING, logger="trimtab.checkpoint"):
        latest_valid(tmp_path)
    assert sum("skipping corrupt" in r.getMessage() for r in caplog.records) == 1


def test_bitflip_and_missing_state_are_detected(tmp_path):
    save(tmp_path, 10)
    newest = save(tmp_path, 20)
    raw = bytearray((newest / "optim.pt").read_bytes())
    raw[-10] ^= 0xFF
    (newest / "optim.pt").write_bytes(bytes(raw))
    assert latest_valid(tmp_path)[0].name == "step_000010"
    (list_checkpoints(tmp_path)[0] / "state.json").unlink()
    assert latest_valid(tmp_path) is None


def test_failed_write_leaves_previous_checkpoints_intact(tmp_path, monkeypatch):
    save(tmp_path, 10)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError):
        save(tmp_path, 20)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000010"]
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))


def test_weights_for_another_shape_are_refused(tmp_path):
    path = save(tmp_path, 1)
    weights, _, _ = load_checkpoint(path)
    other = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(CheckpointError, match="do not fit this model"):
        load_weights(other, weights, path)


@pytest.mark.parametrize(
    ("saved", "loaded", "named"), [("debug-moe", "debug", "MoE"), ("debug-hybrid", "debug-moe", "Mixture-of-Depths")]
)
def test_a_checkpoint_of_other_layer_kinds_is_refused_naming_both(tmp_path, saved, loaded, named):
    """A MoE or MoD checkpoint loaded into a model of other layer kinds (init_from with another
    preset) is refused with both layer lists, not a KeyError from deep inside the model."""
    model = Transformer(load_config(preset=saved, sets=["model.vocab_size=64"]).model)
    state = {"moe": model.moe_state(), "mod": model.mod_state()}
    path = save_checkpoint(tmp_path, 1, model.state_dict(), {}, state, keep=1)
    other = Transformer(load_config(preset=loaded, sets=["model.vocab_size=64"]).model)
    with pytest.raises(CheckpointError, match=f"its {named} layers are \\[.*\\], this model's .*preset"):
        load_model(other, path)


def test_corrupt_checkpoints_set_aside_are_kept_out_of_resume_and_pruning(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step)
    (list_checkpoints(tmp_path)[-1] / "optim.pt").write_bytes(b"damaged")
    found, _ = latest_valid(tmp_path)
    assert [p.name for p in set_aside_corrupt(tmp_path, after=20, keep=2)] == ["step_000030"]
    assert found.name == "step_000020" and latest_valid(tmp_path)[0] == found
    save(tmp_path, 30, keep=1)  # the same step again, later: the corrupt copy is not replaced
    (list_checkpoints(tmp_path)[-1] / "optim.pt").write_bytes(b"damaged again")
    set_aside_corrupt(tmp_path, after=20, keep=2)
    corrupt = checkpoint_root(tmp_path) / "corrupt"
    assert sorted(p.name for p in corrupt.iterdir()) == ["step_000030", "step_000030.2"]
    assert (corrupt / "step_000030" / "optim.pt").read_bytes() == b"damaged"
    save(tmp_path, 40, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000040"]  # pruned; corrupt/ untouched
    assert len(list(corrupt.iterdir())) == 2


def test_the_corrupt_checkpoints_set_aside_are_bounded_to_the_newest_keep(tmp_path):
    """checkpoints/corrupt/ grew by a whole checkpoint at every set-aside (a failing disk: one each rollback
    or resume), never pruned; bounded now as rolled_back/ is, its record of them kept."""
    corrupt = checkpoint_root(tmp_path) / "corrupt"
    for step in (10, 20, 30):
        save(tmp_path, step, keep=5)
        os.utime(list_checkpoints(tmp_path)[-1], (step, step))  # written in this order, whatever the clock's grain
        set_aside_corrupt(tmp_path, after=step - 1, keep=2)
        (corrupt / "fallback.json").write_text("{}")
    assert sorted(p.name for p in corrupt.iterdir()) == ["fallback.json", "step_000020", "step_000030"]
    set_aside_corrupt(tmp_path, after=100, keep=1)  # bounded though none was moved
    assert sorted(p.name for p in corrupt.iterdir()) == ["fallback.json", "step_000030"]


def test_every_file_of_a_checkpoint_has_the_umask_mode(tmp_path):
    """safetensors writes 0600 on its own; the rest, sharded files included, 0666 & ~umask."""
    previous = os.umask(0o027)
    try:
        whole = save(tmp_path / "one", 5)
        tmp = checkpoint_root(tmp_path / "dp") / ".tmp_step_000007_sharded"  # as Parallel.save leaves it
        (tmp / "dcp").mkdir(parents=True)
        for name, mode in (("dcp/.metadata", 0o644), ("dcp/__0_0.distcp", 0o600), ("optim.pt", 0o644)):
            (tmp / name).write_bytes(b"x")
            os.chmod(tmp / name, mode)
        sharded = commit_checkpoint(tmp_path / "dp", 7, tmp, {"train": {"step": 7}}, keep=3)
    finally:
        os.umask(previous)
    for path in (whole, sharded):
        modes = {f.relative_to(path).as_posix(): oct(f.stat().st_mode & 0o777) for f in path.rglob("*") if f.is_file()}
        assert set(modes.values()) == {"0o640"}, modes


def test_a_resumes_changed_router_knobs_replace_those_the_checkpoint_restored():
    """training/checkpointing.apply_live_keys: the new config's MoE and MoD knobs over the model's."""
    from trimtab.training.loading import apply_live_keys

    model = Transformer(load_config(preset="debug-hybrid", sets=["model.vocab_size=64"]).model)
    knobs = {"model.moe.router_jitter": 0.2, "model.moe.z_loss_coef": 0.0, "model.mod.layer_capacity": "[0.25,0.125]"}
    cfg = load_config(preset="debug-hybrid", sets=["model.vocab_size=64", *(f"{k}={v}" for k, v in knobs.items())])
    apply_live_keys(model, cfg, list(knobs))
    assert {(moe.jitter, moe.z_loss_coef) for _, moe in model.moe_layers()} == {(0.2, 0.0)}
    assert [router.target for _, router in model.mod_layers()] == [0.25, 0.125]


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank, for the sharded (DCP) writer's collectives."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def test_a_failed_sharded_write_leaves_no_temp_dir_and_the_next_clears_a_stale_one(
    tmp_path, monkeypatch, one_rank_group
):
    """On a disk that stays full each failed sharded save left its .tmp_*_sharded directory (its
    partial shards) behind, keeping the disk full: now the failing write removes its own, the next
    attempt removes one a killed writer left, and a later save leaves no leftovers."""
    from trimtab.distributed import checkpoint as sharded

    class OneRank(sharded.Checkpoints):
        world, rank, is_main = 1, 0, True

    def full_disk(app, where, group):
        where.mkdir(parents=True)
        (where / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    root = checkpoint_root(tmp_path)
    write = OneRank()._write_sharded
    app = {"model": {"w": torch.ones(3)}}
    args = ({"rng": None}, {"train": {"step": 5}}, 3, (), one_rank_group)
    (root / ".tmp_step_000003_sharded" / "dcp").mkdir(parents=True)  # a killed writer's
    (root / ".tmp_step_000003_sharded" / "dcp" / "__0_0.distcp").write_bytes(b"partial")
    with monkeypatch.context() as patched:
        patched.setattr(sharded, "_dcp_save", full_disk)
        for step in (5, 6):  # the disk stays full
            with pytest.raises(OSError, match="No space left"):
                write(tmp_path, step, app, *args)
            assert not list(root.glob(".tmp*"))
    assert write(tmp_path, 7, app, *args).name == "step_000007"
    assert not list(root.glob(".tmp*")) and [p.name for p in list_checkpoints(tmp_path)] == ["step_000007"]


class OneProcess:
    """Parallel's from_main / on_main / close, for resume_point in one process."""

    def from_main(self, fn, *args):
        return fn(*args)

    on_main = from_main

    def close(self):
        pass


def test_a_bit_flip_in_state_json_is_refused_and_resume_falls_back(tmp_path, caplog):
    """state.json is sealed by its own manifest entry: a flipped digit (lr_scale 1.0 -> 9.0, the
    data cursor 1280 -> 1380) is refused like a corrupt model file, not trained on."""
    from trimtab.training.resume import resume_point, set_aside_note

    cfg = load_config(preset="debug", sets=[f"out={tmp_path}", "train.max_steps=100"])
    for step in (20, 40):
        state = {"train": {"step": step, "lr_scale": 1.0}, "data": {"cursor": 32 * step}, "moe": {2: {}, 10: {}}}
        save_checkpoint(tmp_path, step, Tied().state_dict(), {"optimizer": {}}, state, keep=3)
    newest = list_checkpoints(tmp_path)[-1]
    text = (newest / "state.json").read_text()
    for good, bad in (('"lr_scale": 1.0', '"lr_scale": 9.0'), ('"cursor": 1280', '"cursor": 1380')):
        assert good in text
        (newest / "state.json").write_text(text.replace(good, bad))
        with caplog.at_level(logging.WARNING):
            assert latest_valid(tmp_path)[0].name == "step_000020"
        assert "step_000040/state.json: size or checksum differs" in caplog.text
    path, state = resume_point(cfg, OneProcess())
    assert path.name == "step_000020" and state["data"]["cursor"] == 640
    assert "step_000040 (state.json: size or checksum differs" in set_aside_note(tmp_path, 20)  # the resume's line
    assert (checkpoint_root(tmp_path) / "corrupt" / "step_000040").is_dir()


def test_a_resume_past_corrupt_checkpoints_hashes_each_once_and_records_each_ones_own_reason(tmp_path, monkeypatch):
    """The resume's search verified (hashed) each corrupt checkpoint and only logged why; the set-aside
    verified each again for its record, and paired those reasons with the moves by position."""
    import trimtab.checkpoint as checkpoint
    from trimtab.training.resume import resume_point

    for step in (10, 20, 30):
        save(tmp_path, step)
    (checkpoint_root(tmp_path) / "step_000030" / "optim.pt").write_bytes(b"damaged")
    (checkpoint_root(tmp_path) / "step_000020" / "model.safetensors").unlink()
    (checkpoint_root(tmp_path) / "corrupt" / "step_000030").mkdir(parents=True)  # an earlier session's copy
    hashed, digest = [], checkpoint._digest
    monkeypatch.setattr(checkpoint, "_digest", lambda path: hashed.append(str(path)) or digest(path))
    cfg = load_config(preset="debug", sets=[f"out={tmp_path}", "train.max_steps=100"])
    assert resume_point(cfg, OneProcess())[0].name == "step_000010"
    assert len(hashed) == len(set(hashed)) == 4, hashed  # 30 and 10: model, optim.pt; 20: its model is missing
    record = json.loads((checkpoint_root(tmp_path) / "corrupt" / "fallback.json").read_text())
    why = {r["checkpoint"]: (r["reason"].split("/")[-1], r["kept_in"].split("/")[-1]) for r in record["refused"]}
    assert why == {
        "step_000020": ("model.safetensors: missing", "step_000020"),
        "step_000030": ("optim.pt: size or checksum differs from the manifest (truncated or corrupt)", "step_000030.2"),
    }


def test_the_fallback_record_names_no_corrupt_checkpoint_the_bound_pruned(tmp_path):
    """A resume that set aside more corrupt checkpoints than checkpoint.keep pruned the oldest at once, and
    fallback.json still gave each a `kept_in` that was gone (the line: "never pruned"); one kept is there."""
    from trimtab.training.resume import resume_point, set_aside_note, take_fallback

    for step in (10, 20, 30, 40):
        save(tmp_path, step, keep=5)
        os.utime(list_checkpoints(tmp_path)[-1], (step, step))  # written in this order, whatever the clock's grain
        if step > 10:
            (checkpoint_root(tmp_path) / f"step_{step:06d}" / "optim.pt").write_bytes(b"damaged")
    cfg = load_config(preset="debug", sets=[f"out={tmp_path}", "train.max_steps=100", "checkpoint.keep=2"])
    assert resume_point(cfg, OneProcess())[0].name == "step_000010"
    record = json.loads((checkpoint_root(tmp_path) / "corrupt" / "fallback.json").read_text())
    kept = {r["checkpoint"]: r["kept_in"] for r in record["refused"]}
    assert kept["step_000020"] is None and all(os.path.isdir(kept[f"step_0000{s}"]) for s in (30, 40)), kept
    note = set_aside_note(tmp_path, 10)
    assert "step_000020 (optim.pt: size" in note and "pruned" in note and "never pruned" not in note
    shutil.rmtree(kept["step_000030"])  # pruned since (a later set-aside's bound): the record says so when read
    kept = {r["checkpoint"]: r["kept_in"] for r in take_fallback(tmp_path, 10)["refused"]}
    assert kept["step_000030"] is None and os.path.isdir(kept["step_000040"])


def test_an_old_manifest_without_state_json_still_loads(tmp_path):
    """Checkpoints from before state.json was sealed list only the other files: loaded unchecked."""
    path = save(tmp_path, 10)
    state = json.loads((path / "state.json").read_text())
    assert set(state["manifest"]) == {"model.safetensors", "optim.pt", "state.json"}
    del state["manifest"]["state.json"]
    state["train"]["step"] = 11  # unsealed: nothing to compare it with
    (path / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    assert latest_valid(tmp_path)[1]["train"] == {"step": 11}
    assert load_checkpoint(path)[2]["step"] == 10


def test_a_sharded_checkpoints_state_json_is_sealed_too(tmp_path, one_rank_group):
    """The DCP path commits through the same manifest: every rank's shards and state.json."""
    from trimtab.distributed import checkpoint as sharded

    class OneRank(sharded.Checkpoints):
        world, rank, is_main = 1, 0, True

    app, state = {"model": {"w": torch.ones(3)}}, {"train": {"lr_scale": 1.0}}
    for step in (5, 7):
        OneRank()._write_sharded(tmp_path, step, app, {"rng": None}, state, 3, (), one_rank_group)
    newest = list_checkpoints(tmp_path)[-1]
    text = (newest / "state.json").read_text()
    assert {"dcp/__0_0.distcp", "optim.pt", "state.json"} <= set(json.loads(text)["manifest"])
    (newest / "state.json").write_text(text.replace('"lr_scale": 1.0', '"lr_scale": 9.0'))
    assert latest_valid(tmp_path)[0].name == "step_000005"


def killed_while_saving_again(run_dir, step):
    """checkpoints/ as a process killed inside _replace_dir leaves it when saving `step` again:
    step_N renamed aside (its first rename), the new copy never renamed into place."""
    final = checkpoint_root(run_dir) / f"step_{step:06d}"
    aside = final.with_name(f".tmp_{final.name}_replaced_4242")
    os.replace(final, aside)
    return aside


def test_a_step_a_killed_process_was_saving_again_is_put_back_and_resumed_from(tmp_path, caplog):
    """A kill between _replace_dir's two renames left step 40 only in its aside copy: resume took
    step 20, and the next save's cleanup deleted the copy (the trained steps 20..40 lost). Resume
    puts it back as step_40 and resumes from it; the copy goes only once step_40 is in place."""
    from trimtab.training.resume import resume_point

    cfg = load_config(preset="debug", sets=[f"out={tmp_path}", "train.max_steps=100"])
    for step in (20, 40):
        state = {"train": {"step": step, "lr_scale": 1.0}, "data": {"cursor": 32 * step}}
        save_checkpoint(tmp_path, step, Tied().state_dict(), {"optimizer": {}}, state, keep=3)
    aside = killed_while_saving_again(tmp_path, 40)
    with caplog.at_level(logging.WARNING):
        path, state = resume_point(cfg, OneProcess())
    assert path.name == "step_000040" and state["data"]["cursor"] == 1280
    assert not aside.exists() and f"put back as {path}" in caplog.text
    assert not (checkpoint_root(tmp_path) / "corrupt").exists()
    # the next save's cleanup (prune) puts one back too, and deletes one only beside its step_N
    aside = killed_while_saving_again(tmp_path, 40)
    save(tmp_path, 60)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000020", "step_000040", "step_000060"]
    assert not list(checkpoint_root(tmp_path).glob(".tmp*"))
    save(tmp_path, 60)  # saved again, undisturbed: the aside copy is gone
    assert not list(checkpoint_root(tmp_path).glob(".tmp*"))


def test_the_new_copy_of_a_step_saved_again_is_the_one_put_back(tmp_path, caplog):
    """Killed between _replace_dir's renames, the step's new copy is sealed in its temp folder:
    it holds what the run decided since the old one (a rollback's left-out rows), so it is the
    one put back (the old one was, and the journal called the rollback abandoned); damaged, the
    old one is."""
    state = {"train": {"step": 40, "lr_scale": 1.0}, "data": {"cursor": 1280}}
    for run, skipped in ((tmp_path, []), (tmp_path / "again", [3, 5])):
        save_checkpoint(run, 40, Tied().state_dict(), {}, {**state, "skipped": skipped}, keep=3)
    aside = killed_while_saving_again(tmp_path, 40)
    new = aside.with_name(".tmp_step_000040_4242")
    os.replace(checkpoint_root(tmp_path / "again") / "step_000040", new)
    with caplog.at_level(logging.WARNING):
        path, state = latest_valid(tmp_path)
    assert path.name == "step_000040" and state["skipped"] == [3, 5] and f"{new}: put back as {path}" in caplog.text
    save(tmp_path, 60)  # the old copy goes once its step is in place
    assert not list(checkpoint_root(tmp_path).glob(".tmp*"))
    # the new copy damaged: the old one is put back
    os.replace(path, new)
    (new / "optim.pt").write_bytes(b"damaged")
    save_checkpoint(tmp_path / "old", 40, Tied().state_dict(), {}, {**state, "skipped": []}, keep=3)
    os.replace(checkpoint_root(tmp_path / "old") / "step_000040", aside)
    with caplog.at_level(logging.WARNING):
        assert put_back_replaced(checkpoint_root(tmp_path)) == [path]
    assert json.loads((path / "state.json").read_text())["skipped"] == [] and f"{new}: a copy of" in caplog.text


def test_an_invalid_only_copy_of_a_step_is_said_and_kept_not_put_back(tmp_path, caplog):
    for step in (20, 40):
        save(tmp_path, step)
    aside = killed_while_saving_again(tmp_path, 40)
    (aside / "optim.pt").write_bytes(b"damaged")
    with caplog.at_level(logging.WARNING):
        assert latest_valid(tmp_path)[0].name == "step_000020"
    assert f"{aside}: a copy of step_000040, not put back" in caplog.text
    save(tmp_path, 30)  # its cleanup leaves it for a person to look at
    assert aside.is_dir() and not (checkpoint_root(tmp_path) / "step_000040").exists()


def test_a_sharded_save_a_lost_rank_cut_is_not_resumed_and_is_said(tmp_path, caplog):
    """A rank killed in a sharded save: the survivors' shards (and DCP's .metadata) lie in
    .tmp_step_N_sharded, never committed (no state.json). The resume took the step before, as it
    should, but without a word: the steps since then were lost unexplained. Now the cut save is said, in
    the resume's one line (set_aside_note): it said its own "resuming from step_000005" line beside it."""
    from trimtab.training.resume import _set_aside, set_aside_note

    save(tmp_path, 5)
    for step in (3, 10):  # an older one (a save cut before step 5's) is not this resume's news
        cut = checkpoint_root(tmp_path) / f".tmp_step_{step:06d}_sharded" / "dcp"
        cut.mkdir(parents=True)
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            (cut / name).write_bytes(b"shard")
    found = latest_valid(tmp_path)
    assert found[0].name == "step_000005"
    with caplog.at_level(logging.WARNING, logger="trimtab.training.resume"):
        _set_aside(tmp_path, found, {}, 3)
    assert "resuming from" not in caplog.text and "cut" not in caplog.text  # the resume's line says it
    note = set_aside_note(tmp_path, 5)
    assert "; the save of step 10 was cut before its commit (.tmp_step_000010_sharded in" in note
    assert "000003" not in note
    (checkpoint_root(tmp_path) / "step_000005" / "state.json").unlink()  # none valid left: a start over says it
    with caplog.at_level(logging.WARNING, logger="trimtab.training.resume"):
        _set_aside(tmp_path, latest_valid(tmp_path), {}, 3)
    assert "the save of step 3, 10 was cut before its commit" in caplog.text and "starting over" in caplog.text
