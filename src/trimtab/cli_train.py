"""The `trimtab` subcommands that train a run and steer it: `train`, `rl` and `dpo` (a run's config
from their flags, the summary they print) and `ctl` (a person's command to a running job).

Apart from cli.py, which imports this module first: `trimtab --help` lists these subcommands
first, in this module's order, then cli.py's (commands.py: COMMANDS, in declaration order).
Nothing else imports it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trimtab.commands import arg, command
from trimtab.rundir import advice_line, newest_step, read_decisions, standing_advice
from trimtab.training.actions import help_text
from trimtab.training.services.signals import handle_signals

if TYPE_CHECKING:
    from trimtab.config import RunConfig
    from trimtab.orchestrator.fault_specs import Fault


# shared by train and plan
CONFIG = arg("config", nargs="?", help="run config YAML (optional)")
PRESET = arg("--preset", help="model/run preset (see `trimtab presets`); default: small")
SET = arg(
    "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)"
)


# shared by train and rl
OUT = arg("--out", help="run directory; re-running with the same --out resumes")
INJECT = arg(
    "--inject",
    action="append",
    default=[],
    metavar="KIND@STEP[:PARAM]",
    help="inject a fault, e.g. nan_loss@30 or oom@10:512 (repeatable; see docs/orchestrator.md)",
)
MODE = arg("--orchestrator", choices=("auto", "advise", "off"), help="orchestrator mode (orchestrator.mode): auto")
# a resume naming another length: schedule.reconcile keeps make-up's steps on top (docs/orchestrator.md, make-up)
PRETRAIN_STEPS = arg(
    "--max-steps",
    type=int,
    help="pretraining steps (train.max_steps); on resume the new length, plus the steps orchestrator.make_up "
    "added for withheld updates",
)


@command(
    "dpo",
    "direct preference optimization on preference pairs from a trained model (train.init_from; docs/rl.md)",
    *(CONFIG, PRESET, OUT, arg("--max-steps", type=int, help="DPO steps (train.max_steps)"), SET, INJECT, MODE),
)
@command(
    "rl",
    "reinforcement learning on verifiable rewards from a trained model (train.init_from; docs/rl.md)",
    *(CONFIG, PRESET, OUT, arg("--max-steps", type=int, help="RL steps (train.max_steps)"), SET, INJECT, MODE),
)
@command(
    "train",
    "train (or resume) a run",
    *(CONFIG, PRESET, OUT, PRETRAIN_STEPS, SET, INJECT, MODE),
)
def _train(args: argparse.Namespace) -> int:
    with handle_signals() as signals:  # start-up begins: a signal ends it cleanly, even in torch's import
        try:
            cfg = _train_config(args, args.command if args.command in ("rl", "dpo") else None)
            signals.run_dir = cfg.run_dir
            from trimtab import api

            summary = api.train_or_raise(cfg)
        except KeyboardInterrupt:  # a second Ctrl-C (the first asks for a stop after the step and a save)
            at = f" (step {newest_step(signals.run_dir)})" if signals.run_dir is not None else ""
            if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks for the job
                print(
                    f"trimtab: stopped at once by a second Ctrl-C; the same command resumes from the last "
                    f"checkpoint{at}",
                    file=sys.stderr,
                )
            return 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
        except RuntimeError as exc:  # a collective failed: a peer lost is said in one line, anything else raised
            if not _peer_was_lost(exc):
                raise
            return _peer_lost_exit(exc, signals.run_dir)
    # the run's objects (its process groups, with their gloo threads holding tensors) freed while the
    # interpreter is whole: destroyed during its finalization, a rank can abort at exit (SIGABRT,
    # "terminate called without an active exception", pytorch/pytorch#179291)
    gc.collect()
    from trimtab.distributed import is_main

    if is_main():  # torchrun: one summary for the job
        _print_summary(summary)
    return summary.get("exit_code", 0)  # non-zero: the orchestrator gave up (docs/orchestrator.md)


PEER_LOST_EXIT = 1  # an uncaught error's status: torchrun restarts a failed worker (--max-restarts), not one exiting 0


def _peer_was_lost(exc: RuntimeError) -> bool:
    """Whether `exc` is a collective failing because a peer process is gone (training/emergency.py peer_lost),
    under torchrun only: one process has no peer."""
    from trimtab.training.emergency import peer_lost

    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and peer_lost(exc)


def _peer_lost_exit(exc: RuntimeError, run_dir: Path | None) -> int:
    """A survivor's end after a peer was lost (training/emergency.py): one line instead of gloo's 40-line
    traceback, which says nothing a person acts on, and a failing exit status for torchrun to restart on. No line
    where this survivor claimed the lost step and said its line (the emergency save's, or why none): a second
    line for the same loss only repeated it."""
    from trimtab.training.emergency import SAID, lost_words, next_words

    if getattr(exc, SAID, False):
        return PEER_LOST_EXIT
    saved = f"the newest checkpoint is step {newest_step(run_dir)}" if run_dir is not None else "nothing was saved"
    print(
        f"trimtab: rank {os.environ.get('RANK', '0')}: ended, a peer was lost ({lost_words(exc)}); {saved}: "
        + next_words("it"),
        file=sys.stderr,
        flush=True,
    )
    return PEER_LOST_EXIT


# Under `trimtab rl` and `trimtab dpo` the loss is a policy objective, not a likelihood: the rules
# that judge a likelihood's course (a spike, a rise above the start, divergence, a plateau, an
# early stop, bad rows by their loss, a Mixture-of-Depths layer's loss after its capacity fell) are
# off unless a --set turns one on (docs/rl.md).
SHOWN_ADVICE = 3  # standing advice named at the end of a run; the rest counted
RL_OFF = ("spike", "above_start", "divergence", "plateau", "early_stop", "rows", "mod")


def _train_config(args: argparse.Namespace, section: str | None = None) -> RunConfig:
    from trimtab.config import derive, load_config

    # RL's loss is a clipped objective, not a likelihood: the rules that judge a likelihood's course
    # and the live planner's loss-curve fit are off (a --set turns one back on)
    off = {"orchestrator": {r: {"enabled": False} for r in RL_OFF}, "plan": {"status_every": 0}}
    # rl or dpo: on, said to be the subcommand's setting, not the person's (config/provenance.py)
    fixed = (f"trimtab {section}", {section: {"enabled": True}, **off}) if section else None
    overrides: dict = {}
    if args.out:
        overrides["out"] = args.out
    if args.max_steps is not None:
        overrides["train"] = {"max_steps": args.max_steps}
    if args.orchestrator:
        overrides.setdefault("orchestrator", {})["mode"] = args.orchestrator
    cfg = load_config(args.config, preset=args.preset, overrides=overrides, sets=args.set, fixed=fixed)
    given = [(spec, "faults") for spec in cfg.faults] + [(spec, "--inject") for spec in args.inject or []]
    if given:
        from trimtab.orchestrator.fault_specs import parse_fault

        for spec, key in given:
            _warn_if_past_the_end(parse_fault(spec, key), key, cfg)
    if args.inject:
        cfg = derive(cfg, {"faults": [*cfg.faults, *args.inject]})
    return cfg


def _warn_if_past_the_end(fault: Fault, key: str, cfg: RunConfig) -> None:
    """A fault after the run's last step never fires, and the run then reads as healthy: said, not
    refused (the orchestrator or a later resume may lengthen the run). A length set by train.epochs
    or auto is known only at setup, so only train.max_steps is checked here."""
    train = cfg.train
    if train.epochs or not isinstance(train.max_steps, int):
        return
    last = train.max_steps + cfg.finetune.steps
    if fault.step > last:
        logging.getLogger("trimtab").warning(
            "%s %s is after the run's last step %d (train.max_steps%s): it fires only if the run is "
            "lengthened; give a step from 1 to %d, or raise --max-steps",
            key,
            fault.spec,
            last,
            " + finetune.steps" if cfg.finetune.steps else "",
            last,
        )


def _print_summary(summary: dict) -> None:
    replayed = summary.get("steps_replayed", 0)  # a start-up stop's summary has none
    again = f", {replayed} of them again after a rollback or a restart" if replayed else ""
    lines = [
        f"{summary['status']}: step {summary['step']}/{summary['total_steps']} "
        f"({summary['steps_this_session']} this session{again}, {summary['seconds']:.0f}s), "
        f"{summary['tokens']:,} tokens, {summary['tokens_per_s']:,.0f} tokens/s"
    ]
    if summary.get("val_loss") is not None:
        line = f"val_loss {summary['val_loss']:.4f} (perplexity {summary['val_ppl']:.2f})"
        if summary.get("eval_final") is False:  # absent: a summary from before the key
            line += f", from step {summary['eval_step']}: not of the weights the run ended with"
        lines.append(line)
    if summary.get("skipped_steps"):  # the run's (summary.json); each metrics line counts its window's
        n = summary["skipped_steps"]
        lines.append(f"{n} update{'s' if n != 1 else ''} withheld (skipped steps)")
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
    lines += _standing_advice(summary["run_dir"])
    lines.append(f"run directory: {summary['run_dir']}")
    print("\n".join(lines))


def _standing_advice(run_dir: str) -> list[str]:
    """The orchestrator's advice no one carried out, said at the end: advice repeated is folded into
    its first line (seen_again), which scrolled by long before."""
    standing = standing_advice(read_decisions(run_dir))
    if not standing:
        return []
    shown = [f"  {advice_line(d)}" for d in standing[:SHOWN_ADVICE]]
    more = f"  and {len(standing) - SHOWN_ADVICE} more" if len(standing) > SHOWN_ADVICE else None
    head = f"advice standing, not applied ({len(standing)}; decisions.jsonl; `trimtab ctl RUN ACTION` applies one):"
    return [head, *shown, *([more] if more else [])]


@command(
    "ctl",
    "act on a running job (journaled as a manual decision)",
    arg("run_dir"),
    arg("action"),
    arg("args", nargs="*"),
    arg("--queue", action="store_true", help="if the run is not running, apply the command when it next resumes"),
    description="Drops a command for the job in RUN_DIR, which applies it at its next step and journals it. "
    "A run that is not running is refused (nothing is sent) unless --queue.",
    epilog="actions:\n" + help_text(),
    raw=True,
)
def _ctl(args: argparse.Namespace) -> int:
    from trimtab.orchestrator import ctl
    from trimtab.rundir import read_summary

    command = ctl.parse_command(args.action, args.args)
    running, _ = ctl.taking(args.run_dir)
    path = ctl.send(args.run_dir, command, queue=args.queue)
    if running:
        print(f"sent to the job in {args.run_dir} ({path.name}); it applies it at its next step", end="")
    else:
        print(f"queued in {args.run_dir} ({path.name}); the run is not running: it applies it when it resumes", end="")
    print(" and journals it in decisions.jsonl")
    done = read_summary(args.run_dir) or {}
    if not running and done.get("status") == "completed":  # re-running the same command changes nothing
        print(
            f"note: the run has completed (step {done.get('step')} of {done.get('total_steps')}): only `trimtab train` "
            "with a larger --max-steps (train.max_steps) resumes it"
        )
    return 0
