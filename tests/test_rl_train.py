"""`trimtab rl` (rl/, training/trainer.py): GRPO steps through the trainer's loop, from a trained
run's weights: the policy learns a reward it can reach, the RL figures are logged, a clean run
takes no action, and an interrupted run resumes to exactly the uninterrupted one's weights."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import trimtab_cli
from trimtab.rundir import read_decisions

RL = [
    "--preset", "debug",
    "--set", "log.progress=false", "--set", "log.report=false", "--set", "train.log_every=1",
    "--set", "rl.prompts_per_step=8", "--set", "rl.group_size=8", "--set", "rl.max_new_tokens=2",
    "--set", "rl.reward=python:rl_verifiers:starts_with_space",
    "--set", "optim.warmup_steps=0", "--set", "optim.lr=1e-2", "--set", "checkpoint.every=3",
]  # fmt: skip


@pytest.fixture(scope="module")
def base(debug_run):
    """A debug run of two steps: a tokenizer and weights to start RL from (the session's, conftest.py)."""
    return debug_run


def rl(out, base, steps: int, *extra: str, code: int = 0):
    """`trimtab rl` into `out`, its exit code `code` (3: the orchestrator gave up); its RL steps' metrics."""
    done = trimtab_cli(
        ["rl", *RL, "--out", str(out), "--max-steps", str(steps), "--set", f"train.init_from={base}", *extra],
        out.parent,
    )
    assert done.returncode == code, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "rl/reward" in line]


def test_the_policy_learns_a_reward_it_can_reach_and_a_clean_run_takes_no_action(tmp_path, base):
    logged = rl(tmp_path / "rl", base, 16, "--set", "train.eval_every=8", "--set", "rl.held_out=16")
    rewards = [m["rl/reward"] for m in logged]
    assert len(rewards) == 16 and sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards
    for key in (
        "rl/zero_variance_groups",
        "rl/response_tokens",
        "rl/truncated",
        "rl/clip_fraction",
        "rl/kl",
        "rl/entropy",
    ):
        assert key in logged[-1], key
    assert logged[-1]["phase"] == "rl" and logged[-1]["rl/verifier_failures"] == 0
    assert read_decisions(tmp_path / "rl") == []
    # the held-out prompts answered greedily at steps 8 and 16, and the last figures in the summary
    lines = [json.loads(line) for line in (tmp_path / "rl/metrics.jsonl").read_text().splitlines()]
    evals = [m for m in lines if "rl/held_out_pass@1" in m]
    # the starting policy at step 0 (the baseline), then every 8 steps
    assert [m["step"] for m in evals] == [0, 8, 16] and all(0 <= m["rl/held_out_pass@1"] <= 1 for m in evals)
    summary = json.loads((tmp_path / "rl/summary.json").read_text())
    assert summary["rl/held_out_pass@1"] == evals[-1]["rl/held_out_pass@1"] and summary["status"] == "completed"


def test_an_interrupted_rl_run_resumes_to_the_uninterrupted_weights(tmp_path, base):
    """...and logs its figures: stopped at step 2 of a log window of 3 steps, the line at step 3
    averages steps 1-3 as the uninterrupted run's (the resumed session's step alone before)."""
    window = ("--set", "train.log_every=3")
    whole = rl(tmp_path / "whole", base, 4, *window)
    assert rl(tmp_path / "parts", base, 4, *window, "--inject", "sigterm@2", code=143) == []  # stopped in the window
    both = rl(tmp_path / "parts", base, 4, *window)
    assert [m["step"] for m in both] == [m["step"] for m in whole] == [3, 4]
    figures = lambda lines: [{k: v for k, v in m.items() if k.startswith("rl/")} for m in lines]  # noqa: E731
    assert figures(both) == figures(whole)
    a = load_file(tmp_path / "whole/checkpoints/step_000004/model.safetensors")
    b = load_file(tmp_path / "parts/checkpoints/step_000004/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_asynchronous_rollouts_learn_from_a_policy_two_steps_behind_and_resume_exactly(tmp_path, base):
    """rl.max_staleness 2 (rl/engine.py): the batch trained at step s is the policy of step s - 2's
    (the starting policy's before), generated in the rollout thread; the decoupled objective
    learns from them; a run stopped at step 3 resumes with the two batches it had generated
    ahead (in the checkpoint) to the uninterrupted run's weights; another staleness is refused."""
    stale = ("--set", "rl.max_staleness=2", "--set", "orchestrator.rl_ratio.enabled=false")  # lr 1e-2: it acts
    whole = rl(tmp_path / "whole", base, 16, *stale)
    assert [m["rl/staleness"] for m in whole] == [0, 1] + [2] * 14
    assert all(0 < m["rl/behaviour_weight"] <= 2 for m in whole) and "rl/behaviour_capped" in whole[-1]
    rewards = [m["rl/reward"] for m in whole]
    # learned: +0.18 to +0.73 over seeds 0-7 (16 steps; the course of 12 was one seed's luck)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    rl(tmp_path / "parts", base, 16, *stale, "--inject", "sigterm@3", code=143)
    both = rl(tmp_path / "parts", base, 16, *stale)
    assert [m["rl/reward"] for m in both] == rewards
    a = load_file(tmp_path / "whole/checkpoints/step_000016/model.safetensors")
    b = load_file(tmp_path / "parts/checkpoints/step_000016/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = ["rl", *RL, "--out", str(tmp_path / "parts"), "--max-steps", "18", "--set", f"train.init_from={base}"]
    done = trimtab_cli([*other, "--set", "rl.max_staleness=1"], tmp_path)
    assert done.returncode == 2 and "rl.max_staleness" in done.stderr, done.stderr[-2000:]


def test_groups_that_teach_nothing_turn_on_dynamic_sampling_then_raise_the_temperature(tmp_path, base):
    """rl_signal: a reward no response earns leaves every group flat; the first rollouts say so (no
    reward at all: what it means, the fixes); after a window of 2 steps the orchestrator turns dynamic
    sampling on (each step then draws 4x the prompts, still flat); each next window it samples warmer
    (x1.25), the objective follows; at the ceiling, dynamic sampling having drawn a whole window without
    a signal, the run stops (exit 3: it trained on with loss 0 to the end before, exit 0). With step 0's held-out
    count of 0/64 besides, the first rollouts prove it: the stop comes at step 1 (it came at step 10)."""
    sets = ["--set", "rl.reward=python:rl_verifiers:nothing", "--set", "orchestrator.rl_signal.window=2"]
    sets += ["--set", "rl.prompts_per_step=4", "--set", "rl.group_size=4", "--set", "orchestrator.outcome_after=4"]
    sets += ["--set", "orchestrator.rl_signal.max_temperature=1.6"]
    assert len(rl(tmp_path / "proven", base, 14, *sets, code=3)) == 1  # rl.held_out 64 (the default)
    proven = [d for d in read_decisions(tmp_path / "proven") if d["rule"] == "rl_signal"]
    assert [(d["step"], d["action"], d["evidence"]["proven"]) for d in proven] == [(1, "stop", True)]
    logged = rl(tmp_path / "flat", base, 14, *sets, "--set", "rl.held_out=0", code=3)  # the first rollouts alone
    decisions = [d for d in read_decisions(tmp_path / "flat") if d["rule"] == "rl_signal"]
    warned = decisions.pop(0)
    assert (warned["step"], warned["action"], warned["evidence"]["kind"]) == (1, "none", "no_reward")
    assert "pass@4 0" in warned["summary"] and "rl.group_size" in warned["summary"]
    assert (decisions[0]["step"], decisions[0]["action"], decisions[0]["params"]) == (
        2,
        "set_dynamic_sampling",
        {"value": "on"},
    )
    assert [m["rl/groups_drawn"] for m in logged[:4]] == [4, 4, 16, 16]  # 3 resampling rounds a step
    raised = [d["params"]["value"] for d in decisions if d["action"] == "set_rl_temperature" and d["applied"]]
    assert raised == [1.25, 1.5625, 1.6], decisions
    last = decisions[-1]  # at step 10: the remedies spent, a stop whose reason says why and the fixes
    assert (last["step"], last["action"], last["params"]["exit_code"]) == (10, "stop", 3), decisions
    assert last["evidence"]["dynamic_sampling"] == 1.0 and last["evidence"]["groups_drawn"] == 16
    summary = json.loads((tmp_path / "flat/summary.json").read_text())
    assert summary["exit_code"] == 3 and summary["status"].startswith("gave up (the policy earns no learning signal")
    assert all(fix in summary["status"] for fix in ("train.init_from", "rl.prompts", "rl.group_size")), summary
    assert len(logged) == 10 and logged[0]["rl/temperature"] == 1.0 and logged[-1]["rl/temperature"] == raised[-1]
    assert all(m["rl/zero_variance_groups"] == 1.0 and m["loss"] == 0.0 for m in logged)
    state = json.loads(sorted((tmp_path / "flat/checkpoints").glob("step_*"))[-1].joinpath("state.json").read_text())
    # checkpointed: a resume samples as warm
    assert state["train"]["rl_temperature"] == raised[-1] and state["train"]["rl_dynamic_sampling"] is True


def test_verifications_that_time_out_get_a_longer_timeout(tmp_path, base):
    """rl_verifier: a sound verifier slower than a tight rl.verifier_timeout_s (0.25 s against
    0.1, killed each time: reward 0) fails every verification; after a window of 2 steps the
    orchestrator allows 4x longer and the verifications succeed from then on."""
    small = ["--set", "rl.prompts_per_step=2", "--set", "rl.group_size=4", "--set", "rl.verifier_retries=0"]
    small += ["--set", "rl.held_out=0"]  # no evaluation: the slow verifier would score 64 more
    rule = ["--set", "orchestrator.rl_verifier.window=2", "--set", "orchestrator.rl_verifier.factor=4"]
    slow = ["--set", "rl.reward=python:rl_verifiers:slow", "--set", "rl.verifier_timeout_s=0.1", *small, *rule]
    logged = rl(tmp_path / "slow", base, 4, *slow)
    decisions = [d for d in read_decisions(tmp_path / "slow") if d["rule"] == "rl_verifier"]
    assert [(d["step"], d["action"], d["params"]) for d in decisions] == [(2, "set_verifier_timeout", {"value": 0.4})]
    assert decisions[0]["evidence"]["timeouts"] == decisions[0]["evidence"]["failed"] == 16
    assert [m["rl/verifier_failures"] for m in logged] == [8, 8, 0, 0]
    assert [m["rl/verifier_timeout_s"] for m in logged] == [0.1, 0.1, 0.4, 0.4]
    state = json.loads(sorted((tmp_path / "slow/checkpoints").glob("step_*"))[-1].joinpath("state.json").read_text())
    assert state["train"]["rl_verifier_timeout"] == 0.4  # checkpointed: a resume keeps it


def test_a_verifier_that_raises_on_every_response_is_named_and_stops_the_run(tmp_path, base):
    """rl_verifier: a verifier with a bug (KeyError on every call) scores every response 0, so
    nothing can be learned: the error is said on the log once, named in the journal's evidence,
    and after a window of 2 steps the run stops with exit code 3 (gave up), not at max_steps."""
    sets = ["--set", "rl.reward=python:rl_verifiers:broken", "--set", "orchestrator.rl_verifier.window=2"]
    sets += ["--set", "rl.held_out=0", "--set", "rl.prompts_per_step=2", "--set", "rl.group_size=4"]
    out = tmp_path / "broken"
    done = trimtab_cli(
        ["rl", *RL, *sets, "--out", str(out), "--max-steps", "8", "--set", f"train.init_from={base}"], tmp_path
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stderr.count("rl.reward's verifier failed on a response to prompt '") == 1  # the prompt named
    assert "(no reward: its advantage is 0): KeyError: 'answer'; fix the verifier (rl.reward python:" in done.stderr
    (decision,) = [d for d in read_decisions(out) if d["rule"] == "rl_verifier"]
    assert (decision["step"], decision["action"]) == (2, "stop")
    assert decision["evidence"]["error"] == "KeyError: 'answer'" and decision["evidence"]["failed"] == 16
    assert (
        "KeyError: 'answer'" in decision["params"]["reason"] and "start the run again" in decision["params"]["reason"]
    )
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "rl/reward" in line]
    assert [m["step"] for m in logged] == [1, 2] and all(m["rl/verifier_failures"] == 8 for m in logged)


def test_rl_needs_a_model_to_start_from_and_a_length(tmp_path):
    done = trimtab_cli(["rl", "--preset", "debug", "--out", str(tmp_path / "r"), "--max-steps", "2"], tmp_path)
    assert (
        done.returncode == 2
        and "rl: the tokenizer of the model to train is unknown; set train.init_from" in done.stderr
    )
    done = trimtab_cli(["rl", "--preset", "debug", "--out", str(tmp_path / "r"), "--set", "rl.group_size=1"], tmp_path)
    assert done.returncode == 2 and "rl.group_size" in done.stderr


def decided(out, rule: str) -> list[dict]:
    return [d for d in read_decisions(out) if d["rule"] == rule]


def test_an_entropy_collapse_gets_an_entropy_bonus_and_the_entropy_comes_back(tmp_path, base):
    """rl_entropy, for real: at lr 1e-2 a reward that pays half for a leading space, and the rest
    for a digit after it that one token never shows, collapses the sampled first token from ~6.2
    nats to ~1.7 at a reward of 0.5; the bonus doubles each window of 3 steps (0.01, 0.02, 0.04),
    and the entropy's fall reverses (1.26 -> 1.7 on the machine this was written on)."""
    sets = ["--set", "rl.reward=python:rl_verifiers:half_credit", "--set", "rl.max_new_tokens=1"]
    sets += ["--set", "orchestrator.rl_entropy.window=3", "--set", "orchestrator.rl_entropy.threshold=0.35"]
    logged = rl(tmp_path / "e", base, 26, *sets)
    decisions = decided(tmp_path / "e", "rl_entropy")
    assert [d["params"] for d in decisions[:3]] == [{"value": 0.01}, {"value": 0.02}, {"value": 0.04}], decisions
    first = decisions[0]["evidence"]
    assert first["entropy"] < 0.35 * first["start_entropy"] and first["reward"] < 0.9
    entropy = [m["rl/entropy"] for m in logged]
    # the collapse stopped and went back: the last entropy above the lowest since the first bonus (its
    # size is the host's: 1.26 -> 1.7 on an AMD EPYC, 1.857 -> 1.874 at step 26 on an Intel Xeon whose
    # policy collapsed later; without the bonus it falls to the end)
    since = entropy[decisions[0]["step"] - 1 :]
    assert since[-1] > min(since), entropy
    assert logged[-1]["rl/entropy_coef"] >= 0.04


def test_a_training_reward_parting_from_the_held_out_one_rolls_back_to_the_best_then_stops(tmp_path, base):
    """rl_hacking, for real: trained on starts_with_space, measured on its opposite
    (rl.held_out_reward), the held-out reward falls from its best as the training reward rises
    (1.0 -> 0 at step 4 as it went 0.15 -> 0.45 by step 8); the run goes back to the best evaluation's
    checkpoint (kept from pruning) with the LR halved, and when that happens again it stops. The best is
    step 0's, with no training reward before it: the level it is measured from is the first window's
    after it. Read as 0 (before), this run's training reward at 0.14, flat while the greedy held-out
    answers flipped at step 4, already read as a rise: the parting this test saw was that 0's. The
    held-out count's own fall (its test: test_rl_held_out_fall.py) is set out of reach (`sigmas`): 16
    problems from 16/16 to 0/16 fire it at step 6, before the training reward has risen twice."""
    sets = ["--set", "rl.held_out_reward=python:rl_verifiers:no_space", "--set", "rl.held_out=16"]
    sets += ["--set", "train.eval_every=2", "--set", "checkpoint.every=2", "--set", "orchestrator.rl_hacking.window=2"]
    sets += ["--set", "orchestrator.rl_hacking.sigmas=100"]
    rl(tmp_path / "h", base, 24, *sets, code=3)  # gave up, as rl_reward does (it exited 0, "stop requested")
    first, second = decided(tmp_path / "h", "rl_hacking")
    best = first["evidence"]["best_step"]
    assert (first["action"], first["params"]) == ("rollback", {"to": best, "lr_factor": 0.5})
    assert first["applied"] == [f"rolled back from step {first['step']} to step {best}; lr multiplier 1 -> 0.5"]
    assert first["evidence"]["held_out_reward"] <= first["evidence"]["best_held_out_reward"] - 0.1
    assert first["evidence"]["train_reward"] >= first["evidence"]["train_reward_at_best"] + 0.05
    assert second["action"] == "stop" and second["evidence"]["times"] == 2 and second["step"] < 24
    summary = json.loads((tmp_path / "h/summary.json").read_text())
    assert summary["exit_code"] == 3 and (tmp_path / f"h/checkpoints/step_{best:06d}").is_dir()
    assert summary["status"].startswith("gave up (the held-out reward keeps falling while the training reward rises")


def test_nans_that_outlast_skips_and_an_lr_cut_roll_back_keeping_the_prompts(tmp_path, base):
    """The instability ladder's last rung on an RL phase: NaN for 8 steps (skip, skip, LR cut,
    skip, skip, then restore the last good checkpoint). Data attribution scores token rows; an RL
    phase's rows are prompts (it had crashed on them), so the rollback keeps them and says why,
    and the run trains to its end."""
    rl(tmp_path / "n", base, 16, "--inject", "nan_loss@8:8")
    decisions = decided(tmp_path / "n", "nonfinite")
    assert [d["action"] for d in decisions[:6]] == ["skip_step"] * 2 + ["scale_lr"] + ["skip_step"] * 2 + ["rollback"]
    rollback = decisions[5]
    assert rollback["params"]["skip_rows"] == [] and "RL prompts" in rollback["reasoning"]
    assert rollback["applied"][0].startswith(f"rolled back from step {rollback['step']} to step 6")
    summary = json.loads((tmp_path / "n/summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == summary["total_steps"] >= 16


def test_nan_weights_are_found_by_the_probe_and_rolled_back_at_once(tmp_path, base):
    """weights_nan (a NaN row in the first query projection): every step is NaN; the first non-finite
    step checks the weights, finds them not finite and rolls back at once, as in pretraining (RL has no
    held-out text to score; a loss would not show it anyway: torch's CPU flash attention gives a NaN
    query a zero output)."""
    rl(tmp_path / "w", base, 10, "--inject", "weights_nan@5")
    decisions = decided(tmp_path / "w", "nonfinite")
    assert [d["action"] for d in decisions[:1]] == ["rollback"], decisions
    assert "a weight or an optimizer moment is not finite" in decisions[0]["reasoning"]
    summary = json.loads((tmp_path / "w/summary.json").read_text())
    assert summary["status"] == "completed"


def test_a_failed_evaluation_is_journaled_and_training_goes_on(tmp_path, base):
    """eval_error: the held-out evaluation at step 4 fails in a forward. RL's evaluations were
    unguarded (an error there ended the run, and the injector did not take them for one); it is
    abandoned and journaled as in pretraining, and the evaluations after it run."""
    sets = ["--set", "train.eval_every=2", "--set", "rl.held_out=8", "--set", "rl.prompts=builtin:arithmetic"]
    rl(tmp_path / "e", base, 6, *sets, "--set", "rl.reward=exact", "--inject", "eval_error@4")
    assert [(d["step"], d["action"]) for d in decided(tmp_path / "e", "eval_error")] == [(4, "none")]
    lines = [json.loads(line) for line in (tmp_path / "e/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "rl/held_out_reward" in m] == [0, 2, 6]


def test_faults_that_corrupt_token_rows_are_refused_in_rl_naming_why(tmp_path, base):
    args = ["rl", *RL, "--out", str(tmp_path / "b"), "--max-steps", "3", "--set", f"train.init_from={base}"]
    done = trimtab_cli([*args, "--inject", "bad_rows@2"], tmp_path)
    assert done.returncode != 0 and "bad_rows@2 turns training rows of tokens to garbage" in done.stderr
    assert "an RL or DPO run has none" in done.stderr


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    """150 steps of debug on the built-in arithmetic task: a policy that answers and ends."""
    out = tmp_path_factory.mktemp("rl") / "arithmetic"
    done = trimtab_cli(
        [
            "train",
            "--preset",
            "debug",
            "--out",
            str(out),
            "--max-steps",
            "150",
            "--set",
            "data.source=builtin:arithmetic",
        ],
        out.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow  # 150 steps of a warm start first (~40 s on one core)
def test_responses_that_run_into_the_budget_get_the_soft_overlong_penalty_and_come_back(tmp_path, arithmetic):
    """rl_length, for real: from a warm start whose answers end (2% cut at 8 tokens), a reward
    for longer responses runs them into the budget (>80% cut within 6 steps); the rule puts the
    soft penalty over the budget's last quarter, then half. Where every response is cut by then,
    the penalty grades them all alike and teaches nothing (two seeds of four stayed at the budget
    through step 48): the rule rolls back to the policy that drew the last rollouts still ending, the penalty
    kept (a replay that runs away again: back there with a lower LR). Either way the responses are back under
    the budget by step 24 (seeds 0-3 and this one measured: under 10% cut). On an AVX512-bf16 Xeon the runaway
    began in the start window (0%, 2%, 59% cut at steps 1-3): the rollback went to step 3, whose next rollouts
    were 98% cut, and the replay stayed at the budget (all cut at steps 21-24)."""
    sets = ["--set", "rl.reward=python:rl_verifiers:longer", "--set", "rl.max_new_tokens=8", "--set", "optim.lr=1e-3"]
    sets += ["--set", "rl.prompts=builtin:arithmetic", "--set", "orchestrator.rl_length.window=3"]
    logged = rl(tmp_path / "l", arithmetic, 24, *sets)
    decisions = decided(tmp_path / "l", "rl_length")
    assert [(d["action"], d["params"]) for d in decisions[:2]] == [
        ("set_overlong_penalty", {"tokens": 2}),
        ("set_overlong_penalty", {"tokens": 4}),
    ]
    for later in decisions[2:3]:  # back to before the runaway, the penalty kept
        assert later["action"] == "rollback" and "lr_factor" not in later["params"]
        assert later["params"]["to"] == later["evidence"]["short_step"] < later["step"]
    for again in decisions[3:]:  # where the replay ran away again: back there with a lower LR
        assert again["action"] != "rollback" or again["params"]["lr_factor"] < 1, again
    truncated = [m["rl/truncated"] for m in logged]
    assert truncated[0] < 0.2 and max(truncated) > 0.8 and sum(truncated[-4:]) / 4 < 0.3, truncated
    assert not decided(tmp_path / "l", "rl_reward")  # the verifier pays for length: the penalty's fall is no fault


def test_a_batch_queued_ahead_keeps_its_policy_copy_while_the_ring_of_copies_grows():
    """Asynchronous RL (training/policy.py _policy_snapshot): after a resume the ring of policy
    copies starts empty; the copy for the next batch was taken from the ring's oldest while it
    grew, the one a queued batch was still generating from, and its weights were overwritten under
    it (a killed run then resumed to other weights: bug seen with max_staleness 1). Each snapshot
    of a batch that may be queued has a copy of its own."""
    from types import SimpleNamespace

    from trimtab.config import load_config
    from trimtab.model import build_model
    from trimtab.training.policy import PolicyTraining

    cfg = load_config(preset="debug", sets=["rl.max_staleness=1", "model.vocab_size=64"])
    used = []
    trainer = SimpleNamespace(
        behaviour=[], cfg=cfg, loader=SimpleNamespace(max_staleness=1), model=build_model(cfg.model),
        device=torch.device("cpu"), state=SimpleNamespace(step=6), rl_temperature=1.0,
        _generate=lambda model, prompts, seed, temperature, version: used.append(model),
    )  # fmt: skip
    for step in (6, 7, 8, 9):  # batch s + 1 is generated while batch s may still be
        trainer.state.step = step
        policy, _ = PolicyTraining._policy_snapshot(trainer)
        policy([[1]], 0)
    assert all(a is not b for a, b in zip(used, used[1:])), [id(m) for m in used]
    assert len({id(m) for m in used[:3]}) == 3 and len(trainer.behaviour) == 3  # max_staleness + 2


def test_a_kl_term_holds_the_policy_near_its_start_and_resumes_exactly(tmp_path, base):
    """rl.kl_coef: KL to the frozen starting policy (the run's step-0 checkpoint, kept from
    pruning even with checkpoint.keep=1) stays ~3x lower at beta 1 than at ~0; a run with the
    term, stopped and resumed, reloads that reference and ends with the uninterrupted weights."""
    sets = ["--set", "checkpoint.keep=1", "--set", "rl.held_out=0"]
    held = rl(tmp_path / "held", base, 8, *sets, "--set", "rl.kl_coef=1.0")
    free = rl(tmp_path / "free", base, 8, *sets, "--set", "rl.kl_coef=1e-9")
    late = lambda logged: sum(m["rl/kl_ref"] for m in logged[4:]) / 4  # noqa: E731
    assert late(held) < 0.6 * late(free), ([m["rl/kl_ref"] for m in held], [m["rl/kl_ref"] for m in free])
    assert (tmp_path / "held/checkpoints/step_000000").is_dir()
    rl(tmp_path / "parts", base, 8, *sets, "--set", "rl.kl_coef=1.0", "--inject", "sigterm@4", code=143)
    resumed = rl(tmp_path / "parts", base, 8, *sets, "--set", "rl.kl_coef=1.0")
    assert [m["rl/kl_ref"] for m in resumed] == [m["rl/kl_ref"] for m in held]
    a = load_file(tmp_path / "held/checkpoints/step_000008/model.safetensors")
    b = load_file(tmp_path / "parts/checkpoints/step_000008/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rollouts_out_of_memory_are_generated_in_smaller_passes_and_a_spent_budget_stops(tmp_path, base):
    """An out-of-memory error generating a step's 64 rollouts (rollout_oom: more than 20 rows at
    once do not fit from step 3 on): the orchestrator halves the rows a pass (32, then 16), the
    step's prompts are generated again and training goes on, the knob kept in the checkpoint; with
    one retry allowed the run stops, saying why, with exit code 3 (gave up)."""
    logged = rl(tmp_path / "rl", base, 5, "--inject", "rollout_oom@3:20")
    assert [m["step"] for m in logged] == [1, 2, 3, 4, 5]
    assert [d["params"]["at_once"] for d in decided(tmp_path / "rl", "oom")] == [32, 16]
    state = json.loads((tmp_path / "rl/checkpoints/step_000005/state.json").read_text())
    assert state["train"]["rl_generation_rows"] == 16
    args = ["rl", *RL, "--out", str(tmp_path / "spent"), "--max-steps", "4", "--set", f"train.init_from={base}"]
    done = trimtab_cli([*args, "--set", "orchestrator.oom.max_retries=1", "--inject", "rollout_oom@2:10"], tmp_path)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "out of memory generating rollouts after 1 retries" in done.stderr


def test_asynchronous_rollouts_out_of_memory_are_generated_again_in_smaller_passes(tmp_path, base):
    """rl.max_staleness=1: the batch generated ahead for step 4 (during step 3) runs out of memory
    in the rollout thread (more than 20 rows from step 3 on), which ended the run at step 3's
    checkpoint (it waits for the batches ahead). The checkpoint holds those before it; at its turn
    the failed batch is generated again in smaller passes (32, then 16) and training goes on; a
    run killed after that checkpoint resumes from it to the end."""
    sets = ["--set", "rl.max_staleness=1", "--inject", "rollout_oom@3:20"]
    logged = rl(tmp_path / "a", base, 6, *sets)
    assert [m["step"] for m in logged] == [1, 2, 3, 4, 5, 6]
    assert [d["params"]["at_once"] for d in decided(tmp_path / "a", "oom")] == [32, 16]
    state = json.loads((tmp_path / "a/checkpoints/step_000003/state.json").read_text())["data"]
    assert state["ahead"] == [] and state["max_staleness"] == 1
    args = ["rl", *RL, "--max-steps", "6", "--set", f"train.init_from={base}", *sets]
    killed = trimtab_cli([*args, "--out", str(tmp_path / "k"), "--inject", "sigkill@5"], tmp_path)
    assert killed.returncode != 0
    resumed = rl(tmp_path / "k", base, 6, *sets)
    assert [m["step"] for m in resumed][-1] == 6


def test_rollouts_too_far_off_the_policy_trained_are_generated_fresher_then_on_policy(tmp_path, base):
    """rl_ratio, for real: at lr 1e-2 a step moves the policy so far that rollouts generated two
    steps behind have 60-90% of their tokens' pi / pi_behaviour outside the clip range; after 3
    such steps the staleness halves (2 -> 1), recurs, and goes to 0 (synchronous), where the share
    falls to 0 and the reward climbs (to ~0.9 by step 10)."""
    logged = rl(tmp_path / "rl", base, 12, "--set", "rl.max_staleness=2")
    decisions = decided(tmp_path / "rl", "rl_ratio")
    assert [d["params"]["steps"] for d in decisions] == [1, 0], decisions
    assert decisions[0]["evidence"]["off_policy"] >= 0.2 and decisions[0]["evidence"]["staleness"] > 1
    after = [m for m in logged if m["step"] > decisions[-1]["step"]]
    assert after and all(m["rl/off_policy"] < 0.2 and m["rl/staleness"] == 0 for m in after), after


def test_data_parallel_rollouts_answer_a_share_each_and_agree_on_every_figure(tmp_path, base):
    """RL under torchrun's data parallelism (2 ranks, DDP): each rank answers 4 of a step's 8
    prompts; the step's counts and normaliser are both ranks' (one small all-reduce), so both
    decide and update alike, the log counts every rank's groups, and the policy learns the reward
    as one process does."""
    from helpers import run
    from trimtab.cli_train import RL_OFF

    rl = {"enabled": True, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 2, "held_out": 8}
    rl["reward"] = "python:rl_verifiers:starts_with_space"
    likelihood_rules_off = {rule: {"enabled": False} for rule in RL_OFF}  # as `trimtab rl` turns them off
    # rl_signal off: where the policy learns the reward fastest (an Intel Xeon's numerics), its groups
    # go flat ("solved") by step 11 and dynamic sampling changes the rows drawn, which this test counts
    rules = likelihood_rules_off | {"rl_signal": {"enabled": False}}
    train = {"init_from": str(base), "max_steps": 12}
    ranks = run(tmp_path / "dp", 2, rl=rl, train=train, optim={"lr": 2e-2, "warmup_steps": 0}, orchestrator=rules)
    a, b = ranks
    assert a["weights"] == b["weights"] and a["decisions"] == b["decisions"] and a["summary"]["status"] == "completed"
    assert all(len(s["rows"]) == 32 for s in a["steps"] + b["steps"])  # 4 prompts x 8 responses a rank
    assert all(set(x["rows"]).isdisjoint(y["rows"]) for x, y in zip(a["steps"], b["steps"]))  # prompts apart
    logged = [json.loads(line) for line in (tmp_path / "dp/metrics.jsonl").read_text().splitlines()]
    logged = [m for m in logged if "rl/reward" in m]
    assert [m["rl/groups_drawn"] for m in logged] == [8.0] * 12  # both ranks' groups
    rewards = [m["rl/reward"] for m in logged]
    # lr 2e-2: the gain over seeds 1, 3, 4 and 1234 was 0.74-0.85; at 1e-2, 0.10-0.56 over eight
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards


def test_data_parallel_dynamic_sampling_draws_as_many_rounds_on_every_rank(tmp_path, base):
    """Under data parallelism the orchestrator decides on every rank's counts, and dynamic
    sampling's rounds continue while every rank's groups with a signal fall short (an all-reduce
    a round): with a reward no response earns, both ranks turn it on at step 2 and draw the same
    three extra rounds a step (16 groups, 8 a rank), in lockstep (a rank that stopped early would
    hang the other)."""
    from helpers import run
    from trimtab.cli_train import RL_OFF

    rl = {"enabled": True, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 2, "held_out": 0}
    rl["reward"] = "python:rl_verifiers:nothing"
    rules = {rule: {"enabled": False} for rule in RL_OFF} | {"rl_signal": {"window": 2}}
    a, b = run(tmp_path / "flat", 2, rl=rl, train={"init_from": str(base), "max_steps": 4}, orchestrator=rules)
    assert a["decisions"] == b["decisions"] and a["decisions"][1]["action"] == "set_dynamic_sampling"  # 0: warned
    logged = [json.loads(line) for line in (tmp_path / "flat/metrics.jsonl").read_text().splitlines()]
    assert [m["rl/groups_drawn"] for m in logged if "rl/groups_drawn" in m] == [4, 4, 16, 16]


def test_asynchronous_data_parallel_rollouts_learn_and_resume_with_every_ranks_batches(tmp_path, base):
    """rl.max_staleness 2 under torchrun (2 ranks, DDP): each rank's rollout thread generates its
    share two steps ahead, its sums on a process group of their own (the trainer's all-reduces
    go on beside them); both ranks decide and update alike and learn; a job stopped at step 3
    resumes with every rank's batches generated ahead (gathered into the checkpoint) to the
    uninterrupted job's weights."""
    from helpers import run
    from trimtab.cli_train import RL_OFF

    rl = {"enabled": True, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 2, "held_out": 0}
    rl |= {"reward": "python:rl_verifiers:starts_with_space", "max_staleness": 2}
    rules = {rule: {"enabled": False} for rule in [*RL_OFF, "rl_ratio"]}  # lr 1e-2: rl_ratio would act
    job = dict(rl=rl, optim={"lr": 1e-2, "warmup_steps": 0}, orchestrator=rules)
    a, b = run(tmp_path / "whole", 2, train={"init_from": str(base), "max_steps": 16}, **job)
    assert a["weights"] == b["weights"] and a["decisions"] == b["decisions"] == []
    logged = [json.loads(line) for line in (tmp_path / "whole/metrics.jsonl").read_text().splitlines()]
    logged = [m for m in logged if "rl/reward" in m]
    assert [m["rl/staleness"] for m in logged] == [0, 1] + [2] * 14
    assert [m["rl/groups_drawn"] for m in logged] == [8] * 16  # both ranks' groups
    rewards = [m["rl/reward"] for m in logged]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards  # as in one process: 16 steps
    stopped = run(tmp_path / "parts", 2, train={"init_from": str(base), "max_steps": 16}, faults=["sigterm@3"], **job)
    assert [s["step"] for s in stopped[0]["steps"]] == [1, 2, 3]
    state = json.loads((tmp_path / "parts/checkpoints/step_000003/state.json").read_text())["data"]
    assert [len(r) for r in state["ahead_ranks"]] == [2, 2]
    resumed = run(tmp_path / "parts", 2, train={"init_from": str(base), "max_steps": 16}, **job)
    assert resumed[0]["weights"] == a["weights"] and resumed[1]["weights"] == b["weights"]


@pytest.mark.parametrize(
    "layout, refused",
    [
        ({}, False),  # auto over 2 processes: DDP, 4 prompts a rank
        ({"strategy": "ddp"}, False),
        ({"strategy": "fsdp"}, True),  # was let through: FSDP2's gathered weights became inference tensors
        ({"tp": 2}, True),
        ({"strategy": "ddp", "world": 3}, "rl.prompts_per_step=8 must be a multiple of the 3"),
    ],
    ids=["auto", "ddp", "fsdp", "tp", "ddp-3-ranks"],
)
def test_rl_under_torchrun_refuses_what_it_cannot_split_naming_the_key(layout, refused):
    """The layout as setup builds it for `world` processes, before the model is wrapped (where the
    check runs): a sharded model is refused, a prompt count the ranks cannot split too."""
    from trimtab.config import load_config
    from trimtab.distributed.mesh import Mesh
    from trimtab.distributed.parallel import Parallel
    from trimtab.errors import ConfigError
    from trimtab.training.setup import check_policy_ranks

    layout = dict(layout)
    world = layout.pop("world", 2)
    cfg = load_config(preset="debug", overrides={"rl": {"enabled": True, "prompts_per_step": 8}, "distributed": layout})
    ranks = Parallel(cfg.distributed, torch.device("cpu"), world, 0, mesh=Mesh.of(cfg.distributed, world))
    if not refused:
        check_policy_ranks(cfg, ranks)
        return
    with pytest.raises(ConfigError, match="data parallelism only" if refused is True else refused):
        check_policy_ranks(cfg, ranks)


@pytest.mark.parametrize("staleness", [0, 1])
def test_one_ranks_rollouts_out_of_memory_shrink_every_ranks_generation_alike(tmp_path, base, staleness):
    """Under torchrun, rank 1 alone runs out of memory generating its 32 rollouts (more than 20
    rows do not fit from step 3 on), synchronous or in the rollout thread: every rank hears it at
    the step's sum, all halve their generation passes together (32 -> 16 rows), the decision the
    same on both and journaled once, and the job ends with the ranks' weights equal. (Rank 1 used
    to handle it alone, unjournaled, its passes no longer its peer's; any other error there left
    rank 0 waiting in the sum.)"""
    from helpers import run
    from trimtab.cli_train import RL_OFF

    rl = {"enabled": True, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 2, "held_out": 0}
    rl |= {"reward": "python:rl_verifiers:starts_with_space", "max_staleness": staleness}
    rules = {rule: {"enabled": False} for rule in [*RL_OFF, "rl_ratio"]}
    job = dict(rl=rl, optim={"lr": 1e-2, "warmup_steps": 0}, orchestrator=rules)
    a, b = run(
        tmp_path / "oom", 2, train={"init_from": str(base), "max_steps": 5}, faults=["rollout_oom@3:20@rank1"], **job
    )
    assert a["decisions"] == b["decisions"] and a["weights"] == b["weights"]
    assert [(d["action"], d["params"]["at_once"]) for d in a["decisions"] if d["rule"] == "oom"] == [
        ("set_generation_rows", 16)
    ]
    assert [d["rule"] for d in read_decisions(tmp_path / "oom")].count("oom") == 1
    assert a["summary"]["status"] == "completed" and all(len(s["rows"]) == 32 for s in a["steps"] + b["steps"])
