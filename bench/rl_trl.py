"""RL step time against TRL's GRPOTrainer (issue 33, "Speed against TRL"), on CPU: the same model
(a trimtab run exported to Hugging Face, then imported by both), the same prompts, group size,
prompts a step, response budget, sampling and learning rate.

    python bench/rl_trl.py [--preset debug] [--steps 12] [--reps 3] [--new 16]
    python bench/rl_trl.py --dry-run     # tiny: checks it runs, writes nothing to BENCHMARKS.md

Needs TRL (`pip install -c constraints.txt trl`: not a dependency of trimtab). Each repetition
runs `trimtab rl` and a TRL GRPOTrainer script as child processes, back to back (the order
turned at each repetition), each for --steps steps of --prompts prompts x --group responses,
GRPO advantages, token-mean loss (TRL's "dapo" loss type), no KL term, one update a batch, the
same Python reward (a leading space; the reward is not what is timed). The time of a step is
rollout + scoring + update + the loop's own work: for trimtab, the time between its step lines on
stdout (log every step; the logged step_time leaves the hooks out); for TRL, between its on_step_end
callbacks. Each run's median step past the first two; the claim is the median of
the paired ratios TRL / trimtab with its 95% bootstrap interval (goal: >= 1.5x). The mean
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
import time
from collections import deque
from pathlib import Path

from _benchfile import publish  # bench/_benchfile.py, next to this file
from _measure import Contention, paired_ratio, run_train
from trimtab.rundir import read_metrics

BENCH = Path(__file__).resolve().parent
REWARD = "python:_rl_verifiers:leading_space"

# The TRL side, run as a child (so TRL and its imports never load into this process).
TRL_SCRIPT = r"""
import json, sys, time
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

marks = []
class Marks(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if not marks:
            marks.append(time.perf_counter())
    def on_step_end(self, args, state, control, **kwargs):
        marks.append(time.perf_counter())

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
                      callbacks=[Marks(), Lengths()])
trainer.train()
steps = [b - a for a, b in zip(marks, marks[1:])]
print("RESULT " + json.dumps({"steps": steps, "lengths": lengths}))
"""


def _prompts(path: Path, n: int) -> None:
    """The built-in arithmetic task's prompts as a JSONL file both trainers read."""
    from trimtab.data.arithmetic import problems  # noqa: PLC0415 (after the bench's own imports)

    with path.open("w") as f:
        for prompt, answer in problems(n, seed=1):
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")


def _trimtab(args, work: Path, model: Path, prompts: Path, rep: int) -> dict:
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    out = work / f"trimtab-{rep}"
    cmd = [sys.executable, "-m", "trimtab", "rl", *sets, "--out", str(out)]
    marks = _line_times(cmd, {**env, "PYTHONUNBUFFERED": "1"})
    logged = [m for m in read_metrics(out) if "step_time" in m]
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return {"step_s": statistics.median(steps[2:]), "length": statistics.mean(m["rl/response_tokens"] for m in logged)}


def _line_times(cmd: list[str], env: dict[str, str]) -> list[float]:
    """When each of the run's step lines ("step N/M ...", its log on stderr, unbuffered, once a
    step) reached this process: between two, the wall time of a whole step, as TRL's is timed
    between its callbacks (the logged step_time leaves the hooks out). Read blocking, so this
    process takes no CPU from the run: the earlier stat of metrics.jsonl every millisecond slowed
    the run's own step_time by a median 5% (4 paired runs, one 39%)."""
    marks, told = [], deque(maxlen=200)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if line.startswith("step "):
            marks.append(time.perf_counter())
        told.append(line)
    if proc.wait():
        sys.exit(f"trimtab rl failed (exit {proc.returncode}):\n{''.join(told)[-4000:]}")
    return marks


def _trl(args, work: Path, model: Path, prompts: Path, rep: int) -> dict:
    spec = {"model": str(model), "prompts": str(prompts), "out": str(work / f"trl-{rep}"), "group": args.group}
    spec |= {"prompts_per_step": args.prompts_per_step, "new": args.new, "steps": args.steps, "lr": args.lr}
    spec["seed"] = 1
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", TRL_SCRIPT, json.dumps(spec)], capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"TRL's GRPOTrainer failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return {"step_s": statistics.median(result["steps"][2:]), "length": statistics.mean(result["lengths"] or [0])}


def measure(args) -> dict:
    from trimtab.hf import export_run  # noqa: PLC0415

    work = Path(args.out)
    base = work / "base"
    run_train(["--preset", args.preset, "--max-steps", "2", "--set", "log.progress=false"], base, "the base run")
    model = export_run(base, work / "hf")
    prompts = work / "prompts.jsonl"
    _prompts(prompts, 2000)
    runs: dict[str, list[dict]] = {"trimtab": [], "trl": []}
    with Contention() as busy:
        for rep in range(args.reps):
            order = (("trimtab", _trimtab), ("trl", _trl))
            for name, fn in order if rep % 2 == 0 else order[::-1]:
                runs[name].append(fn(args, work, model, prompts, rep))
                print(f"rep {rep} {name}: {runs[name][-1]}", flush=True)
    return {"runs": runs, "other_cpu": busy.other}


def report(args, results: dict) -> str:
    runs = results["runs"]
    ratio = paired_ratio([r["step_s"] for r in runs["trl"]], [r["step_s"] for r in runs["trimtab"]])
    lines = [
        f"`{args.preset}` (2 steps of training, exported to Hugging Face and imported by both), "
        f"{args.prompts_per_step} prompts x {args.group} responses a step, up to {args.new} new tokens, "
        f"lr {args.lr:g}, fp32, {args.steps} steps a run, {args.reps} runs each, back to back; the median step "
        "past the first two.",
        "",
        "| trainer | seconds a step (median over runs) | response tokens (mean) |",
        "|---|---|---|",
    ]
    for name, label in (("trimtab", "trimtab `rl`"), ("trl", "TRL `GRPOTrainer`")):
        step = statistics.median(r["step_s"] for r in runs[name])
        length = statistics.mean(r["length"] for r in runs[name])
        lines.append(f"| {label} | {step:.3f} | {length:.1f} |")
    lines += ["", f"- TRL / trimtab, time a step: **{ratio}**; goal >= 1.5x: {ratio.verdict(1.5)}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="4 steps, 1 run each, 4 tokens: no BENCHMARKS.md")
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.reps, args.new = 4, 1, 4
    args.out = args.out or tempfile.mkdtemp(prefix="bench-rl-trl-")
    results = measure(args)
    heading = "## RL step time against TRL's GRPOTrainer (`bench/rl_trl.py`)"
    publish(heading, report(args, results), precision="fp32", other_cpu=results["other_cpu"], dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
