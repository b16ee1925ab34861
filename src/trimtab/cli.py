"""`trimtab` command line: each subcommand parses its flags and calls one library function.

A subcommand is its handler with a table above it: `@command(NAME, HELP, *ARGS)` (commands.py),
each ARG one `add_argument` call's flags and keywords; build_parser turns the tables into the
argparse parser. The subcommands that train and steer a run (`train`, `rl`, `dpo`, `ctl`) are
cli_train.py's, imported first: `trimtab --help` lists them first, then this module's in order."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shlex
import sys
from pathlib import Path

from trimtab.cli_train import CONFIG, PRESET, SET
from trimtab.commands import COMMANDS, OneOf, add_args, arg, command, number
from trimtab.errors import ConfigError, RunFinished, TrimtabError
from trimtab.training.services.signals import StartUpInterrupted, stop_exit
from trimtab.words import counted
from trimtab.write_errors import survive_closed_readers

GROUPS = {"data": "prepare data: token shards a run reads memory-mapped (docs/data.md)"}


@command(
    "bench",
    "list the benchmarks (bench/ of the source checkout), or run one",
    arg("name", nargs="?", help="the benchmark to run (bench/NAME.py)"),
    arg("args", nargs=argparse.REMAINDER, help="passed to the benchmark's script"),
    description="Without NAME: list the benchmarks. With NAME: run bench/NAME.py with ARGS, e.g. "
    "`trimtab bench healing --scenarios nan_loss --steps 40`; `trimtab bench NAME --help` shows its options.",
)
def _bench(args: argparse.Namespace) -> int:
    from trimtab import benchmarks

    if args.name is None:
        print(benchmarks.listing())
        return 0
    return benchmarks.run(args.name, args.args)


@command(
    "generate",
    "sample text from a trained run",
    arg("run_dir"),
    arg("--prompt", default=""),
    arg("--max-new-tokens", type=number(int, 1), default=64),
    arg("--temperature", type=number(float, 0), default=0.8, help="0: greedy"),
    arg("--top-k", type=number(int, 0), default=50, help="0: no top-k filter"),
    arg("--top-p", type=number(float, 0, 1, above=True), default=0.95),
    arg("--seed", type=int, default=0),
)
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


@command(
    "export",
    "write a run as a Hugging Face model directory (transformers loads it)",
    arg("run_dir"),
    arg(
        "--out",
        required=True,
        help="directory to write: new or empty, or an earlier trimtab export (only the files it wrote are replaced)",
    ),
    OneOf(
        arg("--step", type=int, help="the checkpoint to export (default: the newest valid one)"),
        arg("--snapshot", type=int, metavar="STEP", help="a lean snapshot to export (checkpoint.snapshot_every)"),
    ),
    arg(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="weights' dtype (default: the imported model's, else float32)",
    ),
)
def _export(args: argparse.Namespace) -> int:
    from trimtab.hf.export import export_checkpoint

    out, path = export_checkpoint(args.run_dir, args.out, step=args.step, dtype=args.dtype, snapshot=args.snapshot)
    remote = ", trust_remote_code=True" if any(Path(out).glob("modeling_*.py")) else ""  # its own model code
    load = f"transformers' AutoModelForCausalLM.from_pretrained(DIR{remote})"
    # transformers 5's AutoTokenizer reads config.json first: it asks about the model's code, or with
    # trust_remote_code=False warns of "a model of type `trimtab`"; this class reads the tokenizer's files only
    if remote:
        load += ", its tokenizer with PreTrainedTokenizerFast.from_pretrained(DIR)"
    # the step said: a corrupt newest checkpoint is skipped with a warning, and this line is what is read
    step = int(path.name.removeprefix("step_"))
    what = f"lean snapshot step {step}" if args.snapshot is not None else f"checkpoint step {step}"
    print(f"exported {args.run_dir} ({what}) to {out} (load it with {load})")
    return 0


@command(
    "eval",
    "score a run or a Hugging Face directory: lm-evaluation-harness tasks and/or a text file's perplexity",
    arg("path", help="a run directory (its newest valid checkpoint) or a Hugging Face model directory"),
    arg("--tasks", metavar="A,B", help="lm-eval tasks, e.g. trimtab_tiny (shipped, offline) or hellaswag"),
    arg("--include-path", metavar="DIR", help="a directory of your own lm-eval task YAMLs"),
    arg("--limit", type=number(float, 0, above=True), help="examples per task (a fraction below 1)"),
    arg("--num-fewshot", type=number(int, 0), help="few-shot examples per prompt (default: the task's)"),
    arg("--batch-size", type=number(int, 1), default=8),
    arg(
        "--data",
        metavar="FILE|DIR",
        help="a file read as training reads it: perplexity, bits per byte; or a prepared directory: its loss in rows",
    ),
    arg("--split", choices=["held-out", "all"], default="held-out", help="--data DIR's rows: held-out split or all"),
    arg("--held-out", action="store_true", help="the run's own held-out rows: val_loss, and per mixture source"),
    arg("--stride", type=number(int, 1), help="--data window advance in tokens (default: the whole context)"),
    arg("--out", metavar="DIR", help="the results' folder (default: RUN/eval; a Hugging Face directory's ./eval/NAME)"),
    SET,  # train's, over the run's config.yaml (e.g. model.max_seq_len with model.rope_scaling)
)
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
        sets=args.set,
        held_out=args.held_out,
        split=args.split,
        out=args.out,
    )
    for key in ("prepared", "held_out"):  # val_loss, and val_loss/NAME per source of a mixture
        if key in results:
            r = results[key]
            losses = ", ".join(f"{k} {v:.4f}" for k, v in r.items() if k.startswith("val_loss"))
            print(f"{r.get('directory') or 'held-out (' + r['held_out'] + ')'}: {r['rows']:,} rows: {losses}")
    if "data" in results:
        d = results["data"]
        print(
            f"{d['file']}: {d['tokens']:,} tokens, {d['bytes']:,} bytes: perplexity {d['perplexity']:.3f}, "
            f"bits per byte {d['bits_per_byte']:.4f} (context {d['context']}, stride {d['stride']})"
        )
    for task, metrics in results.get("tasks", {}).items():
        n = f" ({metrics['samples']:,} examples)" if "samples" in metrics else ""  # a count, not a score
        print(f"{task}{n}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k not in ("alias", "samples")))
    if "not_recorded" in results:  # a read-only model directory: the scores above are all there is
        print(f"results not recorded ({results['not_recorded']})")
    else:  # a run in object storage: its cached copy; a Hugging Face directory: not in it (harness.results_folder)
        print(f"results in {results['recorded_in']}/")
    return 0


@command(
    "merge",
    "merge models with a mergekit recipe, or average a run's last checkpoints (docs/merge.md)",
    arg("source", help="a recipe YAML (mergekit format), or with --method average a run directory"),
    arg("--out", required=True, help="the run directory to write the merged model to (new or empty)"),
    arg("--method", choices=("recipe", "average"), default="recipe", help="average: LAWA checkpoint averaging"),
    arg("--last", type=number(int, 1), help="--method average: how many of the newest checkpoints (default 3)"),
)
def _merge(args: argparse.Namespace) -> int:
    from trimtab import merge

    if args.method != "average" and args.last is not None:
        raise ConfigError(
            "--last is for --method average (a run's newest checkpoints); a recipe lists its models: drop "
            "--last, or pass a run directory with --method average"
        )
    if args.method == "average":
        last = args.last or 3
        out = merge.average(args.source, last, args.out)
        print(f"averaged checkpoints {_averaged(out)} of {args.source} into {out}")
    else:
        out = merge.merge(args.source, args.out)
        print(f"merged {args.source} into {out}")
    print(f"train on: {train_from_hint(out)}; export: trimtab export {shlex.quote(str(out))} --out DIR")
    return 0


def _averaged(out: Path) -> str:
    """The steps `merge --method average` averaged, from its record (step 0 and checkpoints saved
    unhealthy are left out of "the last N": the steps say which went in)."""
    from trimtab.checkpoint import STATE, list_checkpoints
    from trimtab.rundir import read_json

    found = list_checkpoints(out)
    record = (read_json(found[0] / STATE) or {}).get("merge", {}) if found else {}
    return ", ".join(map(str, record.get("steps", []))) or "(steps not recorded)"


def train_from_hint(model: str | Path) -> str:
    """The command that trains on from `model` (a run directory): with its config.yaml, whose
    model the weights are (the default preset's is another), into a run directory of its own
    (without --out it would land on runs/<preset>, most likely a run that has finished)."""
    from trimtab.rundir import CONFIG as CONFIG_FILE

    model = Path(model)
    config, out = shlex.quote(str(model / CONFIG_FILE)), shlex.quote(str(model.with_name(model.name + "-train")))
    return f"trimtab train {config} --set train.init_from={shlex.quote(str(model))} --out {out}"


def _vocab_size(text: str) -> int:
    """--vocab-size: at least the BPE's base (data/tokenizer.py MIN_VOCAB), as prepare checks it;
    imported only when given (the tokenizers library is no part of the CLI's start)."""
    from trimtab.data.tokenizer import MIN_VOCAB

    return number(int, MIN_VOCAB)(text)


_vocab_size.__name__ = "int"  # argparse's "invalid int value: 'x'"


@command(
    "data prepare",
    "tokenize text, JSONL (.gz, .zst), Parquet, Arrow and CSV files into memory-mapped token shards",
    arg("sources", nargs="+", metavar="SOURCE"),
    arg("--out", required=True, metavar="DIR", help="the prepared directory (created, or added to)"),
    arg(
        "--tokenizer", metavar="PATH", help="a tokenizer.json or a Hugging Face model directory (default: train a BPE)"
    ),
    arg(
        "--vocab-size",
        type=_vocab_size,
        help="vocabulary of the BPE a new directory trains when no --tokenizer (default 4096, at least 262)",
    ),
    arg("--format", default="auto", choices=("auto", "text", "jsonl", "chat", "instruction")),
    arg("--text-field", default="text", help="the record field holding the text (default: text)"),
    arg("--skip-bad-records", action="store_true", help="skip malformed records (counted) instead of failing"),
    arg(
        "--garbage-filter",
        default="warn",
        choices=("off", "warn", "drop"),
        help="documents that pack like random bytes, base64 or mis-encoded text: name them (warn), leave them out",
    ),
    arg("--workers", type=number(int, 0), default=0, help="processes (default: one per core)"),
    description="Tokenize SOURCES (files, directories, globs) into DIR. Re-running adds new files only, "
    "resumes an interrupted prepare and rebuilds a corrupt shard from its sources.",
)
def _data_prepare(args: argparse.Namespace) -> int:
    from trimtab.data.prepare import Options, prepare

    options = Options(args.format, args.text_field, args.skip_bad_records, args.garbage_filter)
    manifest = prepare(
        args.sources, args.out, args.tokenizer, args.vocab_size, options, args.workers, "pass --skip-bad-records"
    )
    files = sum(1 for f in manifest["files"] if f.get("prepared"))
    print(
        f"{args.out}: {counted(manifest.get('tokens', 0), 'token')} in "
        f"{counted(manifest.get('documents', 0), 'document')} from {counted(files, 'file')}, "
        f"{counted(len(manifest['shards']), 'shard')} ({manifest['dtype']}); train on it: "
        f"trimtab train --set data.source={shlex.quote(str(args.out))}"
    )
    return 0


@command(
    "plan",
    "Chinchilla plan: tokens, epochs, steps, FLOPs, memory, time (docs/planner.md)",
    CONFIG,
    PRESET,
    arg("--out", help="directory for plan.json and plan.txt; default: the run directory"),
    SET,
    OneOf(
        arg(
            "--dataset-tokens",
            type=number(float, 0, above=True),
            metavar="N",
            help="unique training tokens in the data",
        ),
        arg("--data", metavar="PATH", help="count the data's tokens (the run's tokenizer, else bytes)"),
    ),
    OneOf(
        arg("--budget-flops", type=number(float, 0, above=True), metavar="F", help="compute budget in FLOPs"),
        arg(
            "--budget-hours",
            type=number(float, 0, above=True),
            metavar="H",
            help="compute budget in hours on the hardware",
        ),
    ),
    arg("--gpu", metavar="NAME", help="plan for this GPU (e.g. H100) instead of this machine"),
    arg("--gpus", "--devices", dest="devices", type=number(int, 1), default=1, help="devices training together"),
    arg("--gpus-per-node", type=number(int, 1), default=8, help="GPUs per node, for the parallel layout (default 8)"),
    arg("--emit", choices=("slurm", "k8s"), help="also write a launch file: a Slurm script or a PyTorchJob"),
)
def _plan(args: argparse.Namespace) -> int:
    from trimtab.hardware import pick_device
    from trimtab.plan import plan_command
    from trimtab.training.services.cpu_precision import run_precision

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
            emit=args.emit,
            precision_of=lambda cfg: run_precision(pick_device("auto"), cfg),
        )
    )
    return 0


@command(
    "tune",
    "hyperparameter search with Optuna over a space file (docs/tune.md)",
    arg("space", help="the space file (YAML)"),
    arg("--trials", type=number(int, 1), help="trials the study should reach in all (default: the space file's)"),
    arg("--workers", type=number(int, 1), default=1, help="worker processes on this machine (default 1)"),
    arg("--storage", help="an Optuna storage URL (default: sqlite:///STUDY_DIR/study.db)"),
    arg("--out", help="the study directory (default: the space file's study.out, else runs/tune/NAME)"),
    description="Run trials of SPACE.yaml's study (a base config, a per-trial budget and the config keys to "
    "search). Workers started anywhere on the same storage join one study; an interrupted study resumes.",
)
def _tune(args: argparse.Namespace) -> int:
    from trimtab.tune import tune

    # own_process: the command outlives a SIGKILLed worker (the OOM killer), even a single one, to report it
    result = tune(
        args.space, trials=args.trials, workers=args.workers, storage=args.storage, out=args.out, own_process=True
    )
    print(result.summary)
    if not result.complete:
        return 1  # interrupted: the same command resumes the study
    return 0 if result.best is not None else NO_BEST  # ended, every trial pruned or failed: a script must not go on


NO_BEST = 3  # a study that ended without a completed trial: no best.yaml (as a run the orchestrator gave up on)


@command(
    "report",
    "write a self-contained HTML report of one run or several overlaid",
    arg(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run directories (several: overlaid for comparison), or a healing benchmark's healing.json "
        "(or the directory holding it)",
    ),
    arg(
        "--out",
        help="the HTML file, or a directory to hold report.html (default: RUN/report.html, or report.html for several)",
    ),
)
def _report(args: argparse.Namespace) -> int:
    from trimtab.report import write_report

    out = write_report(args.runs, args.out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB; opens offline in any current browser)", file=sys.stderr)
    return 0


@command(
    "runs",
    "a table of the runs under a directory",
    arg("root", nargs="?", default="runs", help="the directory to search (default: runs)"),
    arg(
        "--sort",
        default="val_loss",
        help="column to sort by: run, preset, status, steps, tokens, val_loss, held_out, decisions, notes, healed, "
        "wall_s, ettr (default: val_loss; runs without a value last)",
    ),
    arg("--reverse", action="store_true", help="sort descending"),
    arg("--json", action="store_true", help="the rows as JSON"),
)
def _runs(args: argparse.Namespace) -> int:
    from trimtab.report.runs import print_runs

    return print_runs(args.root, args.sort, reverse=args.reverse, as_json=args.json)


@command("presets", "list the presets")
def _presets(args: argparse.Namespace) -> int:
    from trimtab.model.catalog import format_catalog, preset_catalog

    print(format_catalog(preset_catalog()))
    return 0


@command(
    "doctor",
    "device, precision and why, attention kernel, memory, distributed backends, and a micro-batch that fits a preset",
    arg("--preset", default="small", help="preset to size the micro-batch for (default: small)"),
    arg("--device", default="auto", choices=("auto", "cpu", "cuda", "mps")),
    arg("--nproc", type=number(int, 1), default=1, help="processes per machine it would run (torchrun)"),
    arg("--strategy", default="ddp", choices=("ddp", "fsdp"), help="distributed.strategy"),
    SET,  # train's: the run's own settings on the preset (e.g. train.activation_checkpointing, model.n_layers)
    arg("--json", action="store_true", help="the facts as JSON"),
)
def _doctor(args: argparse.Namespace) -> int:
    from trimtab import doctor

    return doctor.main(args.preset, args.device, args.nproc, args.strategy, args.json, args.set)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trimtab", description="Train language models that watch their own training and correct it."
    )
    subparsers = {"": parser.add_subparsers(dest="command", required=True)}
    for c in COMMANDS:
        group, _, name = c.name.rpartition(" ")
        if group not in subparsers:  # its group's first command adds the group, e.g. `data`
            p = subparsers[""].add_parser(group, help=GROUPS[group])
            subparsers[group] = p.add_subparsers(dest=f"{group}_command", required=True)
        formatter = argparse.RawDescriptionHelpFormatter if c.raw else argparse.HelpFormatter
        p = subparsers[group].add_parser(
            name, help=c.help, description=c.description, epilog=c.epilog, formatter_class=formatter
        )
        add_args(p, c.args)
        p.set_defaults(func=c.func)
    return parser


# libraries that add a console handler of their own to their logger when imported and leave it propagating:
# `trimtab eval --tasks hellaswag` offline printed each of huggingface_hub's retries twice, once as "trimtab: ..."
OWN_HANDLERS = ("huggingface_hub", "datasets")


def main(argv: list[str] | None = None) -> int:
    # trimtab's own lines at INFO, other libraries' at WARNING: with the root at INFO, botocore said
    # "trimtab: Found credentials in environment variables." 3 times a run with checkpoint.dir s3://
    survive_closed_readers()  # a console piped into `head` that closes: training goes on (write_errors.py)
    logging.basicConfig(level=logging.WARNING, format="trimtab: %(message)s")
    logging.getLogger("trimtab").setLevel(logging.INFO)
    for name in OWN_HANDLERS:  # they print through a handler of their own: through ours too, each line came twice
        logging.getLogger(name).propagate = False
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TrimtabError as exc:
        # torchrun: a config refusal is every rank's alike, said once a machine (each rank's, it was said as often);
        # by each machine's first rank, as a path missing on one node is refused there alone
        if not isinstance(exc, ConfigError) or os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"trimtab: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trimtab runs | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flush writes nowhere
        return 0
    # nothing trained, on purpose: not an error (RunPastLength, fewer steps than the run has, is: caught above);
    # a SIGTERM in start-up: 143, not done (stop_exit)
    except (RunFinished, StartUpInterrupted) as stopped:
        if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks for the job
            print(f"trimtab: {stopped}", file=sys.stderr)
        return stop_exit(stopped.signame) if isinstance(stopped, StartUpInterrupted) else 0
    except Exception as exc:
        from trimtab.write_errors import os_error, out_error

        error = os_error(exc)  # Python's OSError, or safetensors' "... (os error 28)"
        if error is None:
            raise
        if error.errno != errno.ENOSPC:  # an --out that cannot be made (/proc/x): said, not a traceback
            message = out_error(error, getattr(args, "out", None))
            if message is None:
                raise
            print(f"trimtab: error: {message}", file=sys.stderr)
            return 2
        # training meets a full disk in its own way (rule disk: older checkpoints freed, or exit 4);
        # export, merge, data prepare and the rest stop here, their partial output removed or resumable
        # a write() names no file ("[Errno 28] No space left on device", the run lock's on a full --out): say where
        where = f" under {args.out}" if getattr(args, "out", None) and not error.filename else ""
        print(
            f"trimtab: error: the disk is full{where} ({exc}); free space or write elsewhere, then run it again",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
