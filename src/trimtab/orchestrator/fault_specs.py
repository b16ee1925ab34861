"""Fault specs: what `--inject KIND@STEP[:PARAM][@rankR]` (or an entry of `faults:` in the
config) asks for, parsed and checked (`parse_fault`: a ConfigError naming the key), and which
of them a resumed run keeps (`late_faults`); the injector (orchestrator/faults.py) fires them.
Apart from the injector, so that checking a spec (`trimtab train --inject`, the config) needs
neither torch nor the run. The kinds:

    nan_loss@S[:N]          the loss is NaN for N steps (default 1): NaN gradients too. Under pipeline
                            parallelism a rank without the last stage (where the loss is) makes its own
                            stages' output NaN instead, which the stages after it carry to the loss
    inf_grad@S              the gradients hold +inf
    grad_spike@S:F          every gradient is multiplied by F (default 1000), at the first step from S
                            whose gradient is not all zero (an RL step of flat groups has none to multiply)
    bad_batch@S[:N]         the rows of N steps (default 1) turn to garbage tokens, wherever they recur
    bad_rows@S[:N]          a quarter of the rows of N steps (default 4) turn to garbage, the rest stay
                            clean: what the orchestrator's data attribution must tell apart
    lr_spike@S:F            from step S on, a stray writer multiplies the optimizer's LR by F after
                            the trainer set it (default 10): an LR nothing in the config explains
    oom@S[:T]               from step S on, a forward whose activations weigh more than T tokens' do
                            without checkpointing raises OutOfMemoryError (weighed by plan/memory.py
                            under train.activation_checkpointing: selective and full fit more);
                            without T, the micro-batch in use at step S no longer fits
    rollout_oom@S[:R]       from step S on, RL's generation over more than R rows at once raises
                            OutOfMemoryError; without R, the generation batch in use at step S no longer fits
    weights_nan@S           a weight matrix row becomes NaN
    weights_noise@S[:F]     every block weight gets Gaussian noise of F x its own std (default 1):
                            finite but wrecked weights, as one bad update leaves them
    slow@S[:N]              N steps (default 10) each take 0.25 s longer
    eval_error@S[:N]        the first N evaluations (default 1) at or after step S fail in a forward,
                            as a record the model cannot take would make them
    eval_hang@S[:T]         every forward of the first evaluation at or after S stalls T seconds
                            (default 5): with train.eval_timeout below that, it is abandoned
    sigterm@S / sigkill@S   the process receives the signal
    kill_rank@S:R           under torchrun, rank R is killed (SIGKILL) as step S begins: a lost
                            process or node (torchrun --max-restarts restarts the job; docs/resilience.md)
    lose_node@S[:N]         under torchrun with several nodes (--nnodes MIN:MAX), node N (default: the
                            last) is lost as step S begins: its agent and every rank on it get SIGKILL.
                            The others restart on the nodes left (docs/resilience.md, elastic)
    slow_rank@S:R:F         under torchrun, from step S on rank R's forwards take F times as long
                            (default 3): a throttled device; every rank waits for it
    bitflip@S:R             under torchrun, one bit of one weight of rank R flips as step S begins
                            (a mantissa bit: the weight stays finite): silent data corruption
    grad_bitflip@S[:R]      in step S's first backward on rank R (default 0; one process: 0), the top
                            exponent bit of one gradient element flips: x 2^128, finite, and the
                            gradient norm overflows. Once: the step computed again is clean (a
                            transient fault, as silent data corruption in a device; training/rerun.py).
                            FSDP2: in rank R's shard of the gradient, as its reduce-scatter filled it
    hang_rank@S:R           under torchrun, rank R stops as step S begins and never comes back (a
                            deadlock, a device that no longer answers); the others wait for it in the
                            step's collectives until the watchdog ends the job (resilience.watchdog)
    corrupt_checkpoint@S    the first checkpoint written at or after S is truncated
    kill_in_save@S[:R]      rank R (default 0; one process: 0) receives SIGKILL while it writes the
                            first checkpoint at or after S: its files written, not yet committed
                            (with checkpoint.asynchronous, in the background writer as training goes on)
    disk_full@S[:N]         the next N checkpoint saves (default 1) at or after S fail with ENOSPC
    expert_collapse@S[:M]   every MoE layer's routing collapses onto expert 0: its selection bias
                            (expert_bias) rises by M (default 1). Router probs lie in [0, 1], so M >= 1
                            makes expert 0 every token's choice whatever the router says; a smaller M
                            is a partial collapse. It persists: no loss gradient reaches expert_bias,
                            only the aux-loss-free balancer (bias_update_rate, off in the presets) or
                            a router reset does, and it is checkpointed (a balancer gone wrong, or a
                            bias restored from another run). A push on the router row instead heals
                            by itself within ~5 steps on debug-moe (the z-loss), so it would not test
                            the orchestrator.
    dead_expert@S[:L]       MoE layer L's (default: the first) last expert is starved: its selection bias
                            drops 1 below every other's, so no token picks it (router probs lie in
                            [0, 1]) and its load stays 0 (persistent and checkpointed, as expert_collapse).
                            Not a push on its router row: logits are linear in the token, so no row is
                            last for every token; a row starved for this batch may win another's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trimtab.errors import ConfigError

# kind -> (default PARAM, PARAM is a count of firings rather than a value)
KINDS: dict[str, tuple[float | None, bool]] = {
    "nan_loss": (1, True),
    "inf_grad": (1, True),
    "grad_spike": (1000.0, False),
    "bad_batch": (1, True),
    "bad_rows": (4, True),
    "lr_spike": (10.0, False),
    "oom": (None, False),
    "rollout_oom": (None, False),
    "weights_nan": (1, True),
    "weights_noise": (1.0, False),
    "slow": (10, True),
    "eval_error": (1, True),
    "eval_hang": (5.0, False),
    "sigterm": (1, True),
    "sigkill": (1, True),
    "corrupt_checkpoint": (1, True),
    "disk_full": (1, True),
    "expert_collapse": (1.0, False),
    "dead_expert": (None, False),
    "kill_rank": (None, False),
    "hang_rank": (None, False),
    "slow_rank": (3.0, False),
    "bitflip": (None, False),
    "lose_node": (None, False),
    "grad_bitflip": (None, False),
    "kill_in_save": (None, False),
}
RANK_FAULTS = (
    "grad_bitflip",
    "kill_in_save",
    "kill_rank",
    "hang_rank",
    "slow_rank",
    "bitflip",
)  # PARAM is the rank (and slow_rank's factor): KIND@STEP:RANK
PERSISTENT = ("lr_spike", "oom", "rollout_oom", "slow_rank")  # in force from their step on, never "fired"
# a checkpoint's faults: step 0 is the initial checkpoint's (every other kind's step is a training step, from 1)
AT_SAVE = ("corrupt_checkpoint", "kill_in_save", "disk_full")


@dataclass
class Fault:
    kind: str
    step: int
    param: float | None  # None: the fault's own default (oom: the size in use when it starts)
    spec: str
    rank: int | None = None  # data parallelism: fire on this rank only (None: every rank)

    @property
    def count(self) -> int:
        return int(self.param) if KINDS[self.kind][1] else 1


def parse_fault(spec: str, key: str = "faults") -> Fault:
    body, at_rank, rank_text = spec.strip().partition("@rank")
    if at_rank and not rank_text.isdigit():
        raise ConfigError(f"{key}: '{spec}' must end in @rankR with R a rank number, e.g. nan_loss@30@rank1")
    kind, _, rest = body.partition("@")
    step_text, _, param_text = rest.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"{key}: unknown fault '{kind}' in '{spec}'; one of {', '.join(KINDS)}")
    if not step_text.isdigit():
        raise ConfigError(f"{key}: '{spec}' must look like KIND@STEP[:PARAM], e.g. nan_loss@30")
    if int(step_text) == 0 and kind not in AT_SAVE:
        raise ConfigError(
            f"{key}: '{spec}' is at step 0, before training's first step: steps count from 1, so give "
            f"{_at_step(Fault(kind, 0, None, spec.strip()), 1)} for the first step (only a checkpoint's faults, "
            f"{', '.join(AT_SAVE)}, take step 0: the initial checkpoint)"
        )
    if kind in ("lose_node", "dead_expert"):  # PARAM a node (lose_node: on every rank) or a MoE layer
        if at_rank or (param_text and not param_text.isdigit()):
            shape = "lose_node@STEP[:NODE]" if kind == "lose_node" else "dead_expert@STEP[:LAYER]"
            raise ConfigError(f"{key}: '{spec}' must look like {shape}, e.g. {kind}@{step_text}:1")
        return Fault(kind, int(step_text), float(param_text) if param_text else None, spec.strip())
    if kind in RANK_FAULTS:  # on the rank its PARAM names
        rank_part, _, factor_text = param_text.partition(":")
        factor = _number(factor_text) if kind == "slow_rank" and factor_text else KINDS[kind][0]
        slow_ok = kind != "slow_rank" or (factor is not None and factor > 1)
        rank_part = rank_part or ("0" if kind in ("grad_bitflip", "kill_in_save") else "")  # one process: 0
        if at_rank or not rank_part.isdigit() or (factor_text and kind != "slow_rank") or not slow_ok:
            shape = "STEP:RANK:FACTOR (FACTOR > 1)" if kind == "slow_rank" else "STEP:RANK"
            raise ConfigError(f"{key}: '{spec}' must look like {kind}@{shape}, e.g. {kind}@{step_text}:1")
        return Fault(kind, int(step_text), factor or 1.0, spec.strip(), int(rank_part))
    default, is_count = KINDS[kind]
    try:
        param = float(param_text) if param_text else default
    except ValueError:
        raise ConfigError(f"{key}: the parameter of '{spec}' must be a number") from None
    sized = kind in ("oom", "rollout_oom")  # without PARAM: the size in use when it starts
    if (param is None and not sized) or (param is not None and param <= 0) or (is_count and param != int(param)):
        need = "a whole number of firings" if is_count else "a positive number"
        raise ConfigError(f"{key}: '{spec}' needs {need} after ':' (e.g. {kind}@{step_text}:512)")
    param = None if param is None else float(param)
    return Fault(kind, int(step_text), param, spec.strip(), int(rank_text) if at_rank else None)


def parse_faults(specs: list[str]) -> list[Fault]:
    return [parse_fault(spec, f"faults[{i}]") for i, spec in enumerate(specs)]


def late_faults(faults: list[Fault], record: dict[str, Any], step: int) -> tuple[list[Fault], list[tuple[Fault, str]]]:
    """The faults a run resumed at `step` keeps, and a line for each that it has passed and never
    had (added to the config since: faults.json neither lists it nor saw it fire). Such a fault's
    step ran without it, so a one-time fault is not injected (it would fire at the next step and
    be recorded as fired); a PERSISTENT one is in force from the next step, as it would be had it
    been there all along."""
    kept, lines = [], []
    for fault in faults:
        if not step or fault.step > step or _known(fault, record):
            kept.append(fault)
        elif fault.kind in PERSISTENT:
            kept.append(fault)
            lines.append(
                (fault, f"faults: {fault.spec} starts before this run's step {step}: in force from step {step + 1} on")
            )
        else:
            lines.append(
                (
                    fault,
                    f"faults: {fault.spec} is before this run's step {step} (it resumed there): not injected; to "
                    f"inject it now, give a later step ({_at_step(fault, step + 1)})",
                )
            )
    return kept, lines


def _known(fault: Fault, record: dict[str, Any]) -> bool:
    """Whether the run had `fault` before this session: recorded as its own, or seen at work (a
    faults.json from before "specs" was recorded)."""
    seen = [record.get(k, {}) for k in ("fired", "evaluations", "oom_limit", "rollout_oom_limit")]
    return fault.spec in record.get("specs", []) or any(fault.spec in s for s in seen)


def _at_step(fault: Fault, step: int) -> str:
    """`fault`'s spec at another step, its PARAM and @rankR kept: nan_loss@5:2 -> nan_loss@13:2."""
    rest = fault.spec.split("@", 1)[1]
    digits = len(rest) - len(rest.lstrip("0123456789"))
    return f"{fault.kind}@{step}{rest[digits:]}"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
