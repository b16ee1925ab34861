"""RL step time against TRL's GRPOTrainer (issue 33, "Speed against TRL"), on CPU: the same model
(a trimtab run exported to Hugging Face, then imported by both), the same prompts, group size,
prompts a step, response budget, sampling and learning rate.

    python bench/rl_trl.py [--preset debug] [--steps 32] [--reps 12] [--new 16]
    python bench/rl_trl.py --dry-run     # tiny: checks it runs, writes nothing to BENCHMARKS.md

Needs TRL (`pip install -c constraints.txt trl`: not a dependency of trimtab). Each repetition
runs `trimtab rl` and a TRL GRPOTrainer script as child processes, both for --steps steps of
--prompts prompts x --group responses, GRPO advantages, token-mean loss (TRL's "dapo" loss type),
no KL term, one update a batch, the same Python reward (a leading space; the reward is not what is
timed). The two run in lockstep: each waits at the end of every step (trimtab: a hook's
on_step_end; TRL: a callback's) until this process lets it take its next, one trainer at a time,
the first of a pair turned at each step. A step's time is from that release to its next step
end: rollouts, scoring, the update, the hooks or callbacks and the log. Adjacent steps are a
fraction of a second apart, so the host's drift in speed (10-40% over minutes on a shared
machine: the earlier runs back to back paired whole runs and spread 1.27-2.20x) falls on both
alike. A run's ratio is the median of its paired steps' TRL / trimtab past the first two; the
claim is the median of the runs' ratios with its 95% bootstrap interval (goal: >= 1.5x). The mean
response lengths are reported beside it: a policy that ends its responses sooner is cheaper.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import Contention, median_ratio, run_train
from trimtab.rundir import read_metrics

BENCH = Path(__file__).resolve().parent
REWARD = "python:_rl_verifiers:leading_space"
SETTLE = 2  # timed steps left out of a run's pairs: the first steps after start-up run slower

# Each child's end of the lockstep: at every step's end it reports the step's seconds since its
# release (-1: the first step, its start-up included) and waits for the next release.
LOCKSTEP = r"""
import sys, time
released = [None]
def lockstep():
    seconds = -1.0 if released[0] is None else time.perf_counter() - released[0]
    print(f"LOCKSTEP {seconds!r}", flush=True)
    sys.stdin.readline()
    released[0] = time.perf_counter()
"""

# The trimtab side: `trimtab rl` itself (its command line), with one more hook.
TRIMTAB_SCRIPT = (
    LOCKSTEP
    + r"""
from trimtab import api, cli
from trimtab.training.hooks import Hook

class Lockstep(Hook):
    def on_step_end(self, run, out):
        lockstep()

built_in = api.built_in_hooks
api.built_in_hooks = lambda config: built_in(config) + [Lockstep()]
sys.exit(cli.main(sys.argv[1:]))
"""
)

# The TRL side, run as a child (so TRL and its imports never load into this process).
TRL_SCRIPT = (
    LOCKSTEP
    + r"""
import json
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from _rl_verifiers import leading_space

spec = json.loads(sys.argv[1])
tok = AutoTokenizer.from_pretrained(spec["model"])
tok.pad_token = tok.pad_token or tok.eos_token
tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
prompts = [json.loads(line)["prompt"] for line in open(spec["prompts"])]

def reward(completions, **kwargs):
    return [leading_space(c, "") for c in completions]

class Lockstep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        lockstep()

lengths = []
class Lengths(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
            lengths.append(logs["completions/mean_length"])

G, P = spec["group"], spec["prompts_per_step"]
args = GRPOConfig(
    output_dir=spec["out"], use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no",
    per_device_train_batch_size=G * P, gradient_accumulation_steps=1, num_generations=G,
    max_completion_length=spec["new"], max_steps=spec["steps"], learning_rate=spec["lr"],
    lr_scheduler_type="constant", warmup_steps=0, temperature=1.0, top_p=1.0, beta=0.0, num_iterations=1,
    loss_type="dapo", epsilon=0.2, epsilon_high=0.28, logging_steps=1, seed=spec["seed"],
    dataloader_num_workers=0, disable_tqdm=True,
)
trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tok,
                      train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                      callbacks=[Lockstep(), Lengths()])
trainer.train()
print("RESULT " + json.dumps({"lengths": lengths}))
"""
)


def _prompts(path: Path, n: int) -> None:
    """The built-in arithmetic task's prompts as a JSONL file both trainers read."""
    from trimtab.data.arithmetic import problems  # noqa: PLC0415 (after the bench's own imports)

    with path.open("w") as f:
        for prompt, answer in problems(n, seed=1):
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")


def _trimtab_cmd(args, model: Path, prompts: Path, out: Path) -> list[str]:
    sets = ["--preset", args.preset, "--set", f"train.init_from={model}", "--set", f"rl.prompts={prompts}"]
    sets += ["--set", f"rl.reward={REWARD}", "--set", f"rl.group_size={args.group}", "--set", "rl.held_out=0"]
    sets += ["--set", f"rl.prompts_per_step={args.prompts_per_step}", "--set", f"rl.max_new_tokens={args.new}"]
    # a constant LR, as TRL's (lr_scheduler_type="constant")
    sets += ["--set", f"optim.lr={args.lr}", "--set", "optim.schedule=constant", "--set", "optim.warmup_steps=0"]
    sets += ["--set", "checkpoint.every=0"]
    sets += ["--set", "train.log_every=1", "--set", "train.eval_every=0", "--set", "log.progress=false"]
    sets += ["--set", "log.report=false", "--set", "log.tensorboard=false", "--set", "train.precision=fp32"]
    # one forward and backward of the step's responses, as TRL's (per_device_train_batch_size =
    # the step's rows, no accumulation): micro-batches as large as fit (the preset's 1024 tokens
    # would split them in two)
    sets += ["--set", "train.micro_batch_tokens=0", "--max-steps", str(args.steps)]
    return [sys.executable, "-c", TRIMTAB_SCRIPT, "rl", *sets, "--out", str(out)]


def _trl_cmd(args, model: Path, prompts: Path, out: Path) -> list[str]:
    spec = {"model": str(model), "prompts": str(prompts), "out": str(out), "group": args.group}
    spec |= {"prompts_per_step": args.prompts_per_step, "new": args.new, "steps": args.steps, "lr": args.lr}
    spec["seed"] = 1
    return [sys.executable, "-c", TRL_SCRIPT, json.dumps(spec)]


def _pair(args, work: Path, model: Path, prompts: Path, rep: int) -> dict[str, dict]:
    """One repetition: both trainers started at once, then stepped in lockstep (LOCKSTEP) ->
    each one's step seconds past its first step and its mean response length."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    out = {"trimtab": work / f"trimtab-{rep}", "trl": work / f"trl-{rep}"}
    cmds = {
        "trimtab": _trimtab_cmd(args, model, prompts, out["trimtab"]),
        "trl": _trl_cmd(args, model, prompts, out["trl"]),
    }
    logs = {name: work / f"{name}-{rep}.log" for name in cmds}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in cmds.items():
            with logs[name].open("w") as log:  # the child's stderr (trimtab's step lines, warnings)
                procs[name] = subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
                )
        for name in procs:
            _reported(procs[name], name, logs[name])  # the first step, start-up included: not timed
        steps: dict[str, list[float]] = {name: [] for name in procs}
        names = list(procs)
        for i in range(args.steps - 1):
            for name in names if i % 2 == 0 else names[::-1]:
                procs[name].stdin.write("go\n")
                procs[name].stdin.flush()
                steps[name].append(_reported(procs[name], name, logs[name]))
        tails = {name: _finished(proc, name, logs[name]) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # a child that failed leaves the other waiting at its step's end
                proc.kill()
    trl = json.loads(next(line for line in tails["trl"].splitlines() if line.startswith("RESULT "))[7:])
    logged = [m for m in read_metrics(out["trimtab"]) if "step_time" in m]
    return {
        "trimtab": {"steps": steps["trimtab"], "length": statistics.mean(m["rl/response_tokens"] for m in logged)},
        "trl": {"steps": steps["trl"], "length": statistics.mean(trl["lengths"] or [0])},
    }


def _reported(proc: subprocess.Popen, name: str, log: Path) -> float:
    """The child's next LOCKSTEP report (read blocking: this process takes no CPU from it)."""
    for line in proc.stdout:
        if line.startswith("LOCKSTEP "):
            return float(line.split()[1])
    sys.exit(f"{name} ended before its steps were done (exit {proc.wait()}):\n{log.read_text()[-4000:]}")


def _finished(proc: subprocess.Popen, name: str, log: Path) -> str:
    """Release the child from its last step; the rest of its output once it exits."""
    proc.stdin.write("go\n")
    proc.stdin.close()
    rest = proc.stdout.read()
    if proc.wait():
        sys.exit(f"{name} failed (exit {proc.returncode}):\n{log.read_text()[-4000:]}")
    return rest


def measure(args) -> dict:
    from trimtab.hf import export_run  # noqa: PLC0415

    work = Path(args.out)
    base = work / "base"
    run_train(["--preset", args.preset, "--max-steps", "2", "--set", "log.progress=false"], base, "the base run")
    model = export_run(base, work / "hf")
    prompts = work / "prompts.jsonl"
    _prompts(prompts, 2000)
    runs: list[dict[str, dict]] = []
    with Contention() as busy:
        for rep in range(args.reps):
            runs.append(_pair(args, work, model, prompts, rep))
            ours, theirs = (statistics.median(runs[-1][n]["steps"][SETTLE:]) for n in ("trimtab", "trl"))
            print(f"rep {rep}: trimtab {ours:.4f} s, TRL {theirs:.4f} s a step (medians)", flush=True)
    return {"runs": runs, "other_cpu": busy.other}


def run_ratio(run: dict[str, dict]) -> float:
    """One repetition's TRL / trimtab: the median of its paired steps' ratios past SETTLE."""
    pairs = zip(run["trl"]["steps"][SETTLE:], run["trimtab"]["steps"][SETTLE:], strict=True)
    return statistics.median(theirs / ours for theirs, ours in pairs)


def report(args, results: dict) -> str:
    runs = results["runs"]
    ratios = [run_ratio(run) for run in runs]
    ratio = median_ratio(ratios)
    lines = [
        f"`{args.preset}` (2 steps of training, exported to Hugging Face and imported by both), "
        f"{args.prompts_per_step} prompts x {args.group} responses a step, up to {args.new} new tokens, "
        f"lr {args.lr:g}, fp32, {args.reps} runs of {args.steps} steps, the two trainers in lockstep "
        f"(a step of one, then a step of the other); each run's steps past the first {SETTLE + 1} paired.",
        "",
        "| trainer | seconds a step (median, all runs) | response tokens (mean) |",
        "|---|---|---|",
    ]
    for name, label in (("trimtab", "trimtab `rl`"), ("trl", "TRL `GRPOTrainer`")):
        step = statistics.median(t for run in runs for t in run[name]["steps"][SETTLE:])
        length = statistics.mean(run[name]["length"] for run in runs)
        lines.append(f"| {label} | {step:.3f} | {length:.1f} |")
    lines += [
        "",
        f"- TRL / trimtab, time a step: **{ratio}** (the runs' own: {min(ratios):.3f}-{max(ratios):.3f}); "
        f"goal >= 1.5x: {ratio.verdict(1.5)}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="5 steps, 1 run, 4 tokens: no BENCHMARKS.md")
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.reps, args.new = 5, 1, 4
    args.out = args.out or tempfile.mkdtemp(prefix="bench-rl-trl-")
    results = measure(args)
    heading = "## RL step time against TRL's GRPOTrainer (`bench/rl_trl.py`)"
    publish(heading, report(args, results), precision="fp32", other_cpu=results["other_cpu"], dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
