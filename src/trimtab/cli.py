"""`trimtab` command line: each subcommand parses its flags and calls one library function."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trimtab.errors import RunFinished, TrimtabError
from trimtab.training.actions import help_text
from trimtab.training.signals import StartUpInterrupted, handle_signals

if TYPE_CHECKING:
    from trimtab.config import RunConfig


def _train(args: argparse.Namespace) -> int:
    with handle_signals() as signals:  # start-up begins: a signal ends it cleanly, even in torch's import
        cfg = _train_config(args)
        signals.run_dir = cfg.run_dir
        from trimtab import api

        summary = api.train_or_raise(cfg)
    from trimtab.distributed import is_main

    if is_main():  # torchrun: one summary for the job
        _print_summary(summary)
    return summary.get("exit_code", 0)  # non-zero: the orchestrator gave up (docs/orchestrator.md)


def _train_config(args: argparse.Namespace) -> RunConfig:
    from trimtab.config import load_config

    overrides: dict = {}
    if args.out:
        overrides["out"] = args.out
    if args.max_steps is not None:
        overrides["train"] = {"max_steps": args.max_steps}
    if args.orchestrator:
        overrides["orchestrator"] = {"mode": args.orchestrator}
    cfg = load_config(args.config, preset=args.preset, overrides=overrides, sets=args.set)
    if args.inject:
        from trimtab.orchestrator.faults import parse_fault

        for spec in args.inject:
            parse_fault(spec, "--inject")
        cfg.faults = [*cfg.faults, *args.inject]
    return cfg


def _print_summary(summary: dict) -> None:
    lines = [
        f"{summary['status']}: step {summary['step']}/{summary['total_steps']} "
        f"({summary['steps_this_session']} this session, {summary['seconds']:.0f}s), "
        f"{summary['tokens']:,} tokens, {summary['tokens_per_s']:,.0f} tokens/s"
    ]
    if summary.get("val_loss") is not None:
        lines.append(f"val_loss {summary['val_loss']:.4f} (perplexity {summary['val_ppl']:.2f})")
    if summary.get("mfu") is not None:
        lines.append(f"MFU {summary['mfu']:.1%} of {summary['peak_flops_source']}")
    compiled = summary.get("compile") or {}
    if compiled.get("enabled") and compiled.get("cold_start_s") is not None:
        lines.append(
            f"torch.compile: cold start {compiled['cold_start_s']:.1f}s (first step {compiled['first_step_s']:.1f}s, "
            f"then {compiled['steady_step_s']:.2f}s a step)"
        )
    active = summary.get("active_params", summary["params"])
    sparse = f", {active:,} active per token" if active != summary["params"] else ""
    lines.append(
        f"model: {summary['params']:,} parameters ({summary['non_embedding_params']:,} "
        f"non-embedding{sparse}), {summary['device']} {summary['precision']}"
    )
    lines.append(f"run directory: {summary['run_dir']}")
    print("\n".join(lines))


def _ctl(args: argparse.Namespace) -> int:
    from trimtab.orchestrator import ctl
    from trimtab.rundir import liveness

    command = ctl.parse_command(args.action, args.args)
    running, _ = liveness(args.run_dir)
    path = ctl.send(args.run_dir, command, queue=args.queue)
    if running:
        print(f"sent to the job in {args.run_dir} ({path.name}); it applies it at its next step", end="")
    else:
        print(f"queued in {args.run_dir} ({path.name}); the run is not running: it applies it when it resumes", end="")
    print(" and journals it in decisions.jsonl")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from trimtab import benchmarks

    if args.name is None:
        print(benchmarks.listing())
        return 0
    return benchmarks.run(args.name, args.args)


def _generate(args: argparse.Namespace) -> int:
    from trimtab import api

    text = api.generate(
        args.run_dir,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(args.prompt + text)
    return 0


def _export(args: argparse.Namespace) -> int:
    from trimtab.hf import export_run

    out = export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype)
    print(f"exported {args.run_dir} to {out} (load it with transformers' AutoModelForCausalLM.from_pretrained)")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from trimtab.evaluation import evaluate

    tasks = [t for t in (args.tasks or "").split(",") if t]
    results = evaluate(
        args.path,
        tasks=tasks,
        data=args.data,
        include_path=args.include_path,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        stride=args.stride,
    )
    if "data" in results:
        d = results["data"]
        print(
            f"{d['file']}: {d['tokens']:,} tokens, {d['bytes']:,} bytes: perplexity {d['perplexity']:.3f}, "
            f"bits per byte {d['bits_per_byte']:.4f} (context {d['context']}, stride {d['stride']})"
        )
    for task, metrics in results.get("tasks", {}).items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "alias"))
    print(f"results in {args.path}/eval/")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from trimtab import merge

    if args.method == "average":
        out = merge.average(args.source, args.last, args.out)
        print(f"averaged the last {args.last} checkpoints of {args.source} into {out}")
    else:
        out = merge.merge(args.source, args.out)
        print(f"merged {args.source} into {out}")
    print(f"train on: {train_from_hint(out)}; export: trimtab export {out} --out DIR")
    return 0


def train_from_hint(model: str | Path) -> str:
    """The command that trains on from `model`, into a run directory of its own: without --out
    it would land on runs/<preset>, most likely a run that has finished."""
    model = Path(model)
    return f"trimtab train --set train.init_from={model} --out {model.with_name(model.name + '-train')}"


def _data_prepare(args: argparse.Namespace) -> int:
    from trimtab.data.prepare import Options, prepare

    options = Options(format=args.format, text_field=args.text_field, skip_bad_records=args.skip_bad_records)
    manifest = prepare(
        args.sources, args.out, args.tokenizer, args.vocab_size, options, args.workers, "pass --skip-bad-records"
    )
    files = sum(1 for f in manifest["files"] if f.get("prepared"))
    print(
        f"{args.out}: {manifest.get('tokens', 0):,} tokens in {manifest.get('documents', 0):,} documents from "
        f"{files} files, {len(manifest['shards'])} shards ({manifest['dtype']}); train on it: "
        f"trimtab train --set data.source={args.out}"
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    from trimtab.plan import plan_command

    print(
        plan_command(
            args.config,
            args.preset,
            args.set,
            args.out,
            dataset_tokens=args.dataset_tokens,
            data=args.data,
            budget_flops=args.budget_flops,
            budget_hours=args.budget_hours,
            gpu=args.gpu,
            devices=args.devices,
            gpus_per_node=args.gpus_per_node,
        )
    )
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from trimtab import doctor

    return doctor.main(args.preset, args.device, args.nproc, args.strategy, args.json)


def _presets(args: argparse.Namespace) -> int:
    from trimtab.model.catalog import format_catalog, preset_catalog

    print(format_catalog(preset_catalog()))
    return 0


def _tune(args: argparse.Namespace) -> int:
    from trimtab.tune import tune

    result = tune(args.space, trials=args.trials, workers=args.workers, storage=args.storage, out=args.out)
    print(result.summary)
    return 0 if result.complete else 1  # interrupted: the same command resumes the study


def _report(args: argparse.Namespace) -> int:
    from trimtab.report import write_report

    out = write_report(args.runs, args.out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB; opens offline in any browser)", file=sys.stderr)
    return 0


def _runs(args: argparse.Namespace) -> int:
    from trimtab.report.runs import print_runs

    return print_runs(args.root, args.sort, reverse=args.reverse, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trimtab", description="Train language models that watch their own training and correct it."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train (or resume) a run")
    p.add_argument("config", nargs="?", help="run config YAML (optional)")
    p.add_argument("--preset", help="model/run preset (see `trimtab presets`); default: small")
    p.add_argument("--out", help="run directory; re-running with the same --out resumes")
    p.add_argument("--max-steps", type=int, help="pretraining steps (train.max_steps)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)"
    )
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@STEP[:PARAM]",
        help="inject a fault, e.g. nan_loss@30 or oom@10:512 (repeatable; see docs/orchestrator.md)",
    )
    p.add_argument(
        "--orchestrator", choices=("auto", "advise", "off"), help="orchestrator mode (orchestrator.mode); default auto"
    )
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "ctl",
        help="act on a running job (journaled as a manual decision)",
        description="Drops a command for the job in RUN_DIR, which applies it at its next step and journals it. "
        "A run that is not running is refused (nothing is sent) unless --queue.",
        epilog="actions:\n" + help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir")
    p.add_argument("action")
    p.add_argument("args", nargs="*")
    p.add_argument(
        "--queue", action="store_true", help="if the run is not running, apply the command when it next resumes"
    )
    p.set_defaults(func=_ctl)

    p = sub.add_parser(
        "bench",
        help="list the benchmarks (bench/ of the source checkout), or run one",
        description="Without NAME: list the benchmarks. With NAME: run bench/NAME.py with ARGS, e.g. "
        "`trimtab bench healing --scenarios nan_loss --steps 40`; `trimtab bench NAME --help` shows its options.",
    )
    p.add_argument("name", nargs="?", help="the benchmark to run (bench/NAME.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark's script")
    p.set_defaults(func=_bench)

    p = sub.add_parser("generate", help="sample text from a trained run")
    p.add_argument("run_dir")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_generate)

    p = sub.add_parser("export", help="write a run as a Hugging Face model directory (transformers loads it)")
    p.add_argument("run_dir")
    p.add_argument(
        "--out",
        required=True,
        help="directory to write: new or empty, or an earlier trimtab export (only the files it wrote are replaced)",
    )
    p.add_argument("--step", type=int, help="the checkpoint to export (default: the newest valid one)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="weights' dtype (default: the imported model's, else float32)",
    )
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "eval",
        help="score a run or a Hugging Face directory: lm-evaluation-harness tasks and/or a text file's perplexity",
    )
    p.add_argument("path", help="a run directory (its newest valid checkpoint) or a Hugging Face model directory")
    p.add_argument("--tasks", metavar="A,B", help="lm-eval tasks, e.g. trimtab_tiny (shipped, offline) or hellaswag")
    p.add_argument("--include-path", metavar="DIR", help="a directory of your own lm-eval task YAMLs")
    p.add_argument("--limit", type=float, help="examples per task (a fraction below 1)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--data", metavar="FILE", help="a text file: perplexity and bits per byte, no lm-eval needed")
    p.add_argument("--stride", type=int, help="--data window advance in tokens (default: the whole context)")
    p.set_defaults(func=_eval)

    p = sub.add_parser(
        "merge",
        help="merge models with a mergekit recipe, or average a run's last checkpoints (docs/merge.md)",
    )
    p.add_argument("source", help="a recipe YAML (mergekit format), or with --method average a run directory")
    p.add_argument("--out", required=True, help="the run directory to write the merged model to (new or empty)")
    p.add_argument(
        "--method", choices=("recipe", "average"), default="recipe", help="average: LAWA checkpoint averaging"
    )
    p.add_argument("--last", type=int, default=3, help="--method average: how many of the newest checkpoints")
    p.set_defaults(func=_merge)

    p = sub.add_parser("data", help="prepare data: token shards a run reads memory-mapped (docs/data.md)")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser(
        "prepare",
        help="tokenize text, JSONL (.gz, .zst), Parquet, Arrow and CSV files into memory-mapped token shards",
        description="Tokenize SOURCES (files, directories, globs) into DIR. Re-running adds new files only, "
        "resumes an interrupted prepare and rebuilds a corrupt shard from its sources.",
    )
    p.add_argument("sources", nargs="+", metavar="SOURCE")
    p.add_argument("--out", required=True, metavar="DIR", help="the prepared directory (created, or added to)")
    p.add_argument(
        "--tokenizer", metavar="PATH", help="a tokenizer.json or a Hugging Face model directory (default: train a BPE)"
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of the BPE trained when no --tokenizer")
    p.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "chat", "instruction"))
    p.add_argument("--text-field", default="text", help="the record field holding the text (default: text)")
    p.add_argument(
        "--skip-bad-records", action="store_true", help="skip malformed records (counted) instead of failing"
    )
    p.add_argument("--workers", type=int, default=0, help="processes (default: one per core)")
    p.set_defaults(func=_data_prepare)

    p = sub.add_parser("plan", help="Chinchilla plan: tokens, epochs, steps, FLOPs, memory, time (docs/planner.md)")
    p.add_argument("config", nargs="?", help="run config YAML (optional)")
    p.add_argument("--preset", help="model/run preset (see `trimtab presets`); default: small")
    p.add_argument("--out", help="directory for plan.json and plan.txt; default: the run directory")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)"
    )
    data = p.add_mutually_exclusive_group()
    data.add_argument("--dataset-tokens", type=float, metavar="N", help="unique training tokens in the data")
    data.add_argument("--data", metavar="PATH", help="count the data's tokens (the run's tokenizer, else bytes)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-flops", type=float, metavar="F", help="compute budget in FLOPs")
    budget.add_argument("--budget-hours", type=float, metavar="H", help="compute budget in hours on the hardware")
    p.add_argument("--gpu", metavar="NAME", help="plan for this GPU (e.g. H100) instead of this machine")
    p.add_argument(
        "--gpus", "--devices", dest="devices", type=int, default=1, help="devices training together (default 1)"
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, for the parallel layout (default 8)")
    p.set_defaults(func=_plan)

    p = sub.add_parser(
        "tune",
        help="hyperparameter search with Optuna over a space file (docs/tune.md)",
        description="Run trials of SPACE.yaml's study (a base config, a per-trial budget and the config keys to "
        "search). Workers started anywhere on the same storage join one study; an interrupted study resumes.",
    )
    p.add_argument("space", help="the space file (YAML)")
    p.add_argument("--trials", type=int, help="trials the study should reach in all (default: the space file's)")
    p.add_argument("--workers", type=int, default=1, help="worker processes on this machine (default 1)")
    p.add_argument("--storage", help="an Optuna storage URL (default: sqlite:///STUDY_DIR/study.db)")
    p.add_argument("--out", help="the study directory (default: the space file's study.out, else runs/tune/NAME)")
    p.set_defaults(func=_tune)

    p = sub.add_parser("report", help="write a self-contained HTML report of one run or several overlaid")
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run directories (several: overlaid for comparison), or a healing benchmark's healing.json "
        "(or the directory holding it)",
    )
    p.add_argument("--out", help="the HTML file (default: RUN/report.html for one run, else report.html)")
    p.set_defaults(func=_report)

    p = sub.add_parser("runs", help="a table of the runs under a directory")
    p.add_argument("root", nargs="?", default="runs", help="the directory to search (default: runs)")
    p.add_argument(
        "--sort",
        default="val_loss",
        help="column to sort by: run, preset, status, steps, tokens, val_loss, decisions, healed, wall_s "
        "(default: val_loss; runs without a value last)",
    )
    p.add_argument("--reverse", action="store_true", help="sort descending")
    p.add_argument("--json", action="store_true", help="the rows as JSON")
    p.set_defaults(func=_runs)

    p = sub.add_parser("presets", help="list the presets")
    p.set_defaults(func=_presets)

    p = sub.add_parser(
        "doctor",
        help="device, precision and why, attention kernel, memory, distributed "
        "backends, and a micro-batch that fits a preset",
    )
    p.add_argument("--preset", default="small", help="preset to size the micro-batch for (default: small)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "mps"))
    p.add_argument("--nproc", type=int, default=1, help="processes per machine it would run (torchrun)")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"), help="distributed.strategy")
    p.add_argument("--json", action="store_true", help="the facts as JSON")
    p.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="trimtab: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TrimtabError as exc:
        print(f"trimtab: error: {exc}", file=sys.stderr)
        return 2
    except (RunFinished, StartUpInterrupted) as stopped:  # nothing trained, on purpose: not an error
        if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks for the job
            print(f"trimtab: {stopped}", file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())
