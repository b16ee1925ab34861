"""The best evaluation's checkpoint is kept from pruning (checkpoint.keep counts the newest only);
which one it is began anew in each session, so a resumed run kept the best since its resume and
pruned the run's best (soak: 5 kills, the best val_loss of 3.697 at step 300 deleted). It is in the
checkpoint now, and a resume, or a rollback, takes it from there."""

import json

import trimtab
from test_trainer import debug_cfg


def test_a_resumed_run_keeps_the_checkpoint_of_its_best_evaluation_before_the_resume(tmp_path):
    run_dir = tmp_path / "r"

    def session(faults):
        return trimtab.train(
            debug_cfg(
                run_dir,
                steps=8,
                train={"max_steps": 8, "eval_every": 2},
                checkpoint={"every": 2, "keep": 1},
                orchestrator={"mode": "off"},
                faults=faults,
            )
        )

    # stopped after step 5, past step 4's evaluation (a stop signal leaves an evaluation under way off for its save)
    session(["sigterm@5"])
    # the second session's weights are ruined at step 6: every evaluation after is worse than step 4's
    assert session(["sigterm@5", "weights_noise@6:10"])["status"] == "completed"
    evals = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = {m["step"]: m["val_loss"] for m in evals if "val_loss" in m}
    assert min(val, key=val.get) == 4 and val[8] > val[4], val
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert "step_000004" in kept, kept
    state = json.loads((run_dir / "checkpoints" / kept[-1] / "state.json").read_text())
    assert state["best"]["eval"][0] == 4 and state["best"]["checkpoint"] == 4
