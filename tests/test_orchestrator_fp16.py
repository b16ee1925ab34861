"""fp16 with a GradScaler through the real loop: overflow steps are the scaler's to skip; a storm
of them is the orchestrator's. CPU fp16 is emulated and slow, so the model here is tiny."""

import json

import trimtab
from trimtab.config import load_config, merge
from trimtab.rundir import read_decisions

TINY = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1},
    "train": {
        "max_steps": 14,
        "batch_tokens": 256,
        "micro_batch_tokens": 256,
        "eval_every": 0,
        "precision": "fp16",
        "log_every": 2,
    },
    "data": {"max_bytes": 150_000},
    "log": {"progress": False, "tensorboard": False},
    # its LR cut comes at step 10 of 14: judged on 4 steps, not "too early" at the end
    "orchestrator": {"fp16": {"max_overflows": 3}, "throughput": {"enabled": False}, "outcome_after": 4},
}


def test_fp16_overflow_storm_cuts_the_lr_and_is_not_journaled_as_nonfinite(tmp_path):
    cfg = load_config(preset="debug", overrides=merge(TINY, {"out": str(tmp_path / "r"), "faults": ["inf_grad@8:3"]}))
    summary = trimtab.train(cfg)
    assert summary["status"] == "completed" and summary["precision"] == "fp16"
    decisions = read_decisions(tmp_path / "r")
    # the overflowed steps' updates, withheld, made up at the last step (sound): orchestrator.make_up
    assert [(d["step"], d["rule"], d["action"]) for d in decisions] == [
        (10, "fp16", "scale_lr"),
        (14, "make_up", "set_total_steps"),
    ]
    assert decisions[0]["applied"] == ["lr multiplier 1 -> 0.5"]
    assert decisions[0]["outcome"]["result"] == "recovered"


def test_the_loss_scale_follows_train_loss_scale_and_stops_at_its_floor(tmp_path):
    """train.loss_scale: init 1024, growth x4 after 3 clean steps, backoff x0.25, floor 128:
    overflows injected at steps 5-7 take the scale 4096 -> 1024 -> 256 -> 128 (not 64: the
    floor), then three clean steps grow it to 512, and the logged scale says so."""
    scale = {"init": 1024, "growth_interval": 3, "growth_factor": 4.0, "backoff_factor": 0.25, "floor": 128}
    overrides = merge(TINY, {"out": str(tmp_path / "r"), "faults": ["inf_grad@5:3"], "train": {"loss_scale": scale}})
    overrides["train"]["log_every"] = 1
    overrides["orchestrator"]["fp16"]["max_overflows"] = 10  # the scaler's to handle here, not the rule's
    trimtab.train(load_config(preset="debug", overrides=overrides))
    logged = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    scales = [m["loss_scale"] for m in logged if "loss_scale" in m][:11]
    assert scales == [1024, 1024, 4096, 4096, 1024, 256, 128, 128, 128, 512, 512], scales
