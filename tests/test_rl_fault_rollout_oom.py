"""`--inject rollout_oom@S` where nothing generates rollouts (`trimtab train`, `trimtab dpo`):
refused naming the fault and what to inject instead. It was accepted and never fired, unsaid,
so a run "tested" for the heal had met no fault at all."""

from helpers import trimtab_cli

FAST = ["--set", "log.progress=false", "--set", "log.report=false"]


def test_rollout_oom_outside_rl_is_refused(tmp_path):
    args = ["--preset", "debug", "--out", str(tmp_path / "run"), "--max-steps", "2", *FAST]
    done = trimtab_cli(["train", *args, "--inject", "rollout_oom@1:2"], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "faults: rollout_oom@1:2 fails RL's generation of rollouts, and this run generates none" in done.stderr
    assert "oom@STEP[:TOKENS]" in done.stderr  # what fails a training step instead
