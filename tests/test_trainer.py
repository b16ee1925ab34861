"""End-to-end tests through the real training loop on the debug preset (CPU, seconds each)."""

import json
import logging
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

import trimtab
from helpers import StopAt
from trimtab.checkpoint import list_checkpoints
from trimtab.config import load_config, merge, read_saved
from trimtab.errors import CheckpointError, ConfigError, DataError
from trimtab.rundir import read_decisions
from trimtab.training import setup as setup_py
from trimtab.training.setup import setup
from trimtab.training.trainer import Trainer


def debug_cfg(out, steps=24, sets=(), preset="debug", **overrides):
    base = {
        "out": str(out),
        "train": {
            "max_steps": steps,
            "eval_every": 0,
            "log_every": 2,
            "precision": "fp32",
        },  # fp32: bf16 autocast on CPU rounds differently on CPUs with and without AVX512-bf16
        "data": {"max_bytes": 150_000},
        "checkpoint": {"every": 8},
        "log": {"progress": False, "tensorboard": False},
    }
    return load_config(preset=preset, overrides=merge(base, overrides), sets=list(sets))


def logged(run_dir, key="loss"):
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m[key]) for m in lines if key in m]


def final_weights(run_dir):
    return load_file(str(list_checkpoints(run_dir)[-1] / "model.safetensors"))


def files_of(run_dir):
    """Every file of a run directory (the run lock aside) with its mtime and contents."""
    return {
        p.relative_to(run_dir).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_debug_run_learns_and_writes_its_run_dir(tmp_path):
    # 20 steps: the loss falls ~1.3 by then (0.5 asked), as 40 steps showed (6.2 -> 4.8 at step 20)
    summary = trimtab.train(debug_cfg(tmp_path / "r", steps=20, sets=["log.tensorboard=true"]))
    run = tmp_path / "r"
    assert summary["status"] == "completed" and summary["step"] == 20
    for name in ("config.yaml", "metrics.jsonl", "tokenizer.json", "summary.json"):
        assert (run / name).is_file(), name
    assert list((run / "tb").glob("events.out.tfevents.*"))
    losses = [loss for _, loss in logged(run)]
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    assert summary["val_loss"] is not None and summary["val_loss"] < losses[0]
    saved = load_config(overrides=__import__("yaml").safe_load((run / "config.yaml").read_text()))
    assert saved.model.vocab_size == 512  # derived value written out
    assert 400_000 < summary["non_embedding_params"] < 600_000  # debug is ~0.5M
    assert summary["tokens"] >= 20 * 2048  # every step fills its token budget
    compiled = summary["compile"]  # train.compile auto: 20 debug steps never repay a compile
    assert not compiled["enabled"] and compiled["reason"].startswith("auto: 20 steps")
    assert compiled["first_step_s"] > 0 and compiled["steady_step_s"] > 0


def test_interrupted_and_resumed_run_equals_uninterrupted_bitwise(tmp_path):
    # 16 steps: the stop at 11 is past warmup (10) and a scheduled checkpoint (8), mid log window, and
    # the resumed session still trains through the cosine decay (24 steps took 48 of the test's steps)
    trimtab.train(debug_cfg(tmp_path / "a", steps=16))
    first = trimtab.train(debug_cfg(tmp_path / "b", steps=16), hooks=[StopAt(11)])
    assert first["status"] == "stopped (test)" and first["step"] == 11
    assert list_checkpoints(tmp_path / "b")[-1].name == "step_000011"
    second = trimtab.train(debug_cfg(tmp_path / "b", steps=16))
    assert second["step"] == 16 and second["steps_this_session"] == 5
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logged(tmp_path / "a") == logged(tmp_path / "b")  # identical loss curve, incl. the window at 11
    assert logged(tmp_path / "a", "grad_norm") == logged(tmp_path / "b", "grad_norm")


def test_resume_extends_a_finished_run_hashing_its_checkpoint_once(tmp_path, monkeypatch):
    """The resumed checkpoint's files are hashed when latest_valid chooses it, and were again when
    it was read (minutes for a large model's optimizer state)."""
    from trimtab import checkpoint, checkpoint_load

    trimtab.train(debug_cfg(tmp_path / "r", steps=8))
    verify, calls = checkpoint.verify, []
    for module in (checkpoint, checkpoint_load):
        monkeypatch.setattr(module, "verify", lambda path: calls.append(path.name) or verify(path))
    summary = trimtab.train(debug_cfg(tmp_path / "r", steps=12))
    assert summary["step"] == 12 and summary["steps_this_session"] == 4
    assert calls.count("step_000008") == 1, calls


def test_a_finished_run_asked_to_go_on_says_so_and_changes_nothing(tmp_path, caplog):
    run = tmp_path / "r"
    first = trimtab.train(debug_cfg(run, steps=8, sets=["log.tensorboard=true"]))
    before = files_of(run)
    assert {"config.yaml", "metrics.jsonl", "summary.json"} <= before.keys() and any(
        k.startswith("tb/") for k in before
    )
    with caplog.at_level(logging.WARNING):
        again = trimtab.train(debug_cfg(run, steps=8, sets=["log.tensorboard=true"]))
    assert again == first == json.loads((run / "summary.json").read_text())  # the saved figures, not 0 tokens/s
    assert files_of(run) == before  # nothing rewritten: config, metrics, summary, tb/, checkpoints
    assert f"{run} has finished: it is at step 8 of 8 (train.max_steps 8)" in caplog.text
    assert (
        "nothing was trained and nothing in it changed. A larger --max-steps (train.max_steps) trains on" in caplog.text
    )
    (run / "summary.json").unlink()
    del before["summary.json"]
    shorter = trimtab.train(debug_cfg(run, steps=6))  # finished too; no summary.json: built from the checkpoint
    assert (shorter["status"], shorter["step"], shorter["total_steps"]) == ("completed", 8, 6)
    assert shorter["tokens"] == first["tokens"] and shorter["checkpoint"].endswith("step_000008")
    assert files_of(run) == before


def test_sigterm_during_start_up_trains_nothing_and_the_rerun_resumes(tmp_path, monkeypatch, caplog):
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=4))
    before, handler = files_of(run), signal.getsignal(signal.SIGTERM)
    reading = setup_py.build_phases

    def terminated_while_reading(*args):
        os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler at the next bytecode: here
        return reading(*args)

    monkeypatch.setattr(setup_py, "build_phases", terminated_while_reading)
    with caplog.at_level(logging.WARNING):
        stopped = trimtab.train(debug_cfg(run, steps=8))
    assert stopped == {
        "status": "stopped (SIGTERM during start-up)",
        "exit_code": 143,
        "run_dir": str(run),
        "step": 4,
        "steps_this_session": 0,
        "resumable": True,
    }
    assert (
        "stopped by SIGTERM during start-up at step 4; nothing new was trained; re-run the same command" in caplog.text
    )
    after = files_of(run)  # nothing changed but summary.json, which says so (a scheduler's wrapper requeues on it)
    assert json.loads(after.pop("summary.json")[1]) == stopped
    before.pop("summary.json")
    assert after == before
    assert signal.getsignal(signal.SIGTERM) is handler  # given back
    monkeypatch.undo()
    resumed = trimtab.train(debug_cfg(run, steps=8))
    assert (resumed["status"], resumed["step"], resumed["steps_this_session"]) == ("completed", 8, 4)


def test_corrupt_newest_checkpoint_falls_back(tmp_path, caplog):
    trimtab.train(debug_cfg(tmp_path / "r", steps=16))
    newest = list_checkpoints(tmp_path / "r")[-1]
    (newest / "model.safetensors").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        summary = trimtab.train(debug_cfg(tmp_path / "r", steps=16))
    assert "corrupt newer checkpoint(s) set aside" in caplog.text and newest.name in caplog.text
    assert summary["steps_this_session"] == 8 and summary["step"] == 16


def test_a_damaged_config_yaml_is_checked_against_the_checkpoint_and_written_again(tmp_path):
    """A run's config.yaml cut short (a disk fault): export names it and the fix; a resume with
    another model is refused against the checkpoint's own config (state.json), each key named, before
    config.yaml is written again (it wrote the wrong model there once, which then refused the right
    one); the run's own settings resume and config.yaml records them again."""
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=8))
    (run / "config.yaml").write_text("model: [\n")
    with pytest.raises(ConfigError, match=r"config.yaml:2: invalid YAML .*restore it, or remove it"):
        trimtab.load_run(run)
    other = r"holds a run with a different model \(model.d_model: 96 there, 128 now"
    with pytest.raises(CheckpointError, match=other):
        trimtab.train(debug_cfg(run, steps=12, sets=["model.d_model=128"]))
    assert (run / "config.yaml").read_text() == "model: [\n"
    summary = trimtab.train(debug_cfg(run, steps=12))
    assert summary["status"] == "completed" and summary["steps_this_session"] == 4
    assert read_saved(run).model.d_model == 96
    (run / "config.yaml").unlink()  # removed, as the error's fix says: checked against the checkpoint too
    with pytest.raises(CheckpointError, match=other):
        trimtab.train(debug_cfg(run, steps=16, sets=["model.d_model=128"]))
    assert not (run / "config.yaml").exists()
    assert trimtab.train(debug_cfg(run, steps=16))["steps_this_session"] == 4


def test_a_damaged_run_tokenizer_is_refused_with_the_way_back(tmp_path):
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=8))
    good = (run / "tokenizer.json").read_bytes()
    (run / "tokenizer.json").write_text("{garbage")
    with pytest.raises(DataError, match=r"run's tokenizer .* remove it and run the same command again"):
        trimtab.train(debug_cfg(run, steps=12))
    (run / "tokenizer.json").unlink()  # the fix the error gives: the BPE is trained again, the same
    assert trimtab.train(debug_cfg(run, steps=12))["steps_this_session"] == 4
    assert (run / "tokenizer.json").read_bytes() == good


def test_loss_is_token_normalised_across_micro_batches(tmp_path):
    """The same step split into 2 or 8 micro-batches gives the same loss and gradient."""
    results = []
    for micro in (1024, 256):
        trainer = Trainer(setup(debug_cfg(tmp_path / f"m{micro}", sets=[f"train.micro_batch_tokens={micro}"])))
        grads = {}
        step = trainer.optimizer.step

        def capture(*args, _step=step, _trainer=trainer, _grads=grads, **kwargs):
            _grads.update({n: p.grad.clone() for n, p in _trainer.model.named_parameters()})
            return _step(*args, **kwargs)

        trainer.optimizer.step = capture
        batch = trainer.loader.next_batch()
        out = trainer.train_step(batch)
        results.append((len(batch.micro), out.loss.item(), out.grad_norm.item(), grads))
    (n1, loss1, norm1, g1), (n2, loss2, norm2, g2) = results
    assert n2 == 4 * n1  # really split differently
    assert loss1 == pytest.approx(loss2, rel=1e-5) and norm1 == pytest.approx(norm2, rel=1e-5)
    assert all(torch.allclose(g1[k], g2[k], rtol=1e-4, atol=1e-8) for k in g1)


def test_pretrain_then_finetune_switches_data_and_schedule(tmp_path):
    chat = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]
        }
        for i in range(300)
    ]
    chat.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = debug_cfg(
        tmp_path / "r",
        steps=10,
        finetune={
            "steps": 6,
            "data": {"source": str(chat), "seq_len": 64, "pack": False},
            "optim": {"lr": 1e-3, "warmup_steps": 2, "schedule": "constant"},
        },
    )
    summary = trimtab.train(cfg)
    assert summary["step"] == 16
    lines = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = {m["step"]: m for m in lines if "loss" in m}
    evals = {m["step"]: m for m in lines if "val_loss" in m}
    assert train[10]["phase"] == "pretrain" and train[16]["phase"] == "finetune"
    assert train[16]["lr"] == pytest.approx(1e-3)  # the finetune phase's own constant schedule
    # each phase is evaluated on its own held-out data at its end
    assert evals[10]["phase"] == "pretrain" and evals[16]["phase"] == "finetune"
    assert evals[16]["val_loss"] < evals[10]["val_loss"]  # chat data is easy; it learned it


def instructions(tmp_path):
    """A small instruction file and the finetune section that trains on it."""
    path = tmp_path / "inst.jsonl"
    rows = [{"prompt": f"what is {i} plus {i}?", "response": f"{2 * i}."} for i in range(200)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    optim = {"lr": 1e-3, "warmup_steps": 2, "schedule": "constant"}
    return {"steps": 4, "data": {"source": str(path), "seq_len": 32, "pack": False}, "optim": optim}


@pytest.mark.parametrize("stopped_at", [8, 5], ids=["finished", "mid-pretraining"])
def test_a_finetune_phase_added_on_resume_trains_after_pretraining(tmp_path, stopped_at):
    """The checkpoint's one phase length against the config's two failed with an IndexError
    before the lengths were reconciled; the new phase is added and journaled."""
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=8), hooks=[StopAt(stopped_at)])
    summary = trimtab.train(debug_cfg(run, steps=8, finetune=instructions(tmp_path)))
    assert (summary["status"], summary["step"]) == ("completed", 12)
    train = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m}
    assert train[8]["phase"] == "pretrain" and train[12]["phase"] == "finetune"
    (d,) = [d for d in read_decisions(run, abandoned=True) if d["rule"] == "config"]
    assert (d["step"], d["evidence"]["key"], d["evidence"]["old"], d["evidence"]["new"]) == (
        stopped_at,
        "finetune.steps",
        0,
        4,
    )


def test_a_refused_resume_leaves_the_run_directory_as_it_was(tmp_path):
    """config.yaml was written before the checkpoint's checks (the data position, the phase
    lengths) refused the resume: it then named the refused config, which the run's own command
    (`train RUN/config.yaml`) and load_run read back."""
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=8, finetune=instructions(tmp_path)), hooks=[StopAt(10)])
    before = files_of(run)
    with pytest.raises(DataError, match="train.seed changed"):
        trimtab.train(debug_cfg(run, steps=8, sets=["train.seed=7"], finetune=instructions(tmp_path)))
    with pytest.raises(ConfigError, match="'train.max_steps' changed from 8 to 9, but this run is already past"):
        trimtab.train(debug_cfg(run, steps=9, finetune=instructions(tmp_path)))
    assert files_of(run) == before
    assert trimtab.train(read_saved(run))["step"] == 12  # its own config resumes it


def test_bad_input_fails_before_touching_the_run_dir(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        trimtab.train(debug_cfg(tmp_path / "r", sets=[f"data.source={tmp_path / 'missing.txt'}"]))
    assert not (tmp_path / "r").exists()


def test_resume_with_another_model_shape_is_refused(tmp_path):
    trimtab.train(debug_cfg(tmp_path / "r", steps=4))
    with pytest.raises(CheckpointError, match=r"different model \(model.d_model: 96 there, 128 now; model.head_dim"):
        trimtab.train(debug_cfg(tmp_path / "r", steps=8, sets=["model.d_model=128"]))


def test_a_resume_may_turn_the_router_knobs_but_not_change_the_experts(tmp_path):
    """The model's keys compared one by one, each differing one named (the whole model.moe
    section was printed, the key not said); the live knobs (trimtab ctl, the orchestrator) are no
    other model: the config's new value replaces the checkpoint's."""
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=4, preset="debug-moe"))
    with pytest.raises(CheckpointError, match=r"different model \(model.moe.top_k: 2 there, 1 now;"):
        trimtab.train(debug_cfg(run, 6, ["model.moe.top_k=1", "model.moe.balance_coef=0.05"], "debug-moe"))
    sets = ["model.moe.balance_coef=0.05", "model.moe.router_jitter=0.1"]
    summary = trimtab.train(debug_cfg(run, steps=6, sets=sets, preset="debug-moe"))
    assert summary["status"] == "completed" and summary["steps_this_session"] == 2
    state = json.loads((list_checkpoints(run)[-1] / "state.json").read_text())
    assert {layer["balance_coef"] for layer in state["moe"].values()} == {0.05}
    assert read_saved(run).model.moe.router_jitter == 0.1
    trainer = Trainer(setup(debug_cfg(run, 8, ["model.moe.balance_coef=0.02"], "debug-moe")))
    assert {moe.balance_coef for _, moe in trainer.model.moe_layers()} == {0.02}
    trainer.rollback(0)  # to the first session's checkpoint, whose state holds 0.01: the config's value stays
    assert {moe.balance_coef for _, moe in trainer.model.moe_layers()} == {0.02}


def test_generate_from_a_trained_run(tmp_path):
    trimtab.train(debug_cfg(tmp_path / "r", steps=8))
    text = trimtab.generate(tmp_path / "r", "def ", max_new_tokens=12, seed=1)
    assert isinstance(text, str) and text
    assert text == trimtab.generate(tmp_path / "r", "def ", max_new_tokens=12, seed=1)  # seeded


def test_generate_handles_empty_and_overlong_prompts(tmp_path):
    trimtab.train(debug_cfg(tmp_path / "r", steps=2))
    assert isinstance(trimtab.generate(tmp_path / "r", "", max_new_tokens=4), str)
    assert isinstance(trimtab.generate(tmp_path / "r", "x = 1\n" * 400, max_new_tokens=4), str)
