"""The table of actions: every intervention a hook or a person can ask of a running job.

One entry per action names its parameters (type, bounds, default), its `trimtab ctl` verb, a
one-line description and how the journal words it. Control's validation, `trimtab ctl`'s parsing
and help, and the journal's console lines all derive from this table, so adding an action is one
entry here and one effect in Control's EFFECTS (training/control.py), which is checked against
this table when it is imported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trimtab.config import CHECKPOINTING
from trimtab.config.orchestrator import MODES, OrchestratorConfig
from trimtab.errors import ConfigError
from trimtab.words import counted

REQUIRED = object()  # a parameter without a default


@dataclass(frozen=True, kw_only=True)
class ActionParam:
    """One parameter of an action (ACTIONS): its type, range and default, checked when the action
    is requested (Control.request) and when `trimtab ctl` sends it."""

    name: str
    # float | int | str | step ('last_good' or a step number) | rows (list of row ids) | turns (knob
    # changes: [step, action, value before, value set], the action one of `choices`)
    kind: str
    bounds: str = ""  # e.g. "(0, inf)", "[0, 1]": open or closed ends (numbers only)
    default: Any = REQUIRED
    ctl: bool = True  # a `trimtab ctl` argument (rows are not typed by hand)
    choices: tuple[str, ...] = ()  # str parameters: the values allowed

    def check(self, action: str, value: Any) -> Any:
        """The value, converted and checked; ConfigError naming the action and parameter."""
        if self.kind == "rows":
            if not isinstance(value, (list, tuple)) or not all(_whole(v) and v >= 0 for v in value):
                raise ConfigError(f"{action}: '{self.name}' must be a list of row numbers >= 0, got {value!r}")
            return [int(v) for v in value]
        if self.kind == "turns":
            return _turns(action, self.name, value, self.choices)
        if self.kind == "step":
            if value == "last_good" or (_whole(value) and value >= 0):
                return value if value == "last_good" else int(value)
            raise ConfigError(f"{action}: '{self.name}' must be 'last_good' or a step number, got {value!r}")
        if self.kind == "str":
            if not isinstance(value, str):
                raise ConfigError(f"{action}: '{self.name}' must be a string, got {value!r}")
            if self.choices and value not in self.choices:
                raise ConfigError(f"{action}: unknown {self.name} {value!r}; one of {', '.join(self.choices)}")
            return value
        number = (
            _whole(value) if self.kind == "int" else isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        if not number or not self.within(float(value)):
            what = "a whole number" if self.kind == "int" else "a number"
            raise ConfigError(f"{action}: '{self.name}' must be {what} in {self.bounds}, got {value!r}")
        return int(value) if self.kind == "int" else float(value)

    def within(self, value: float) -> bool:
        if not self.bounds:
            return math.isfinite(value)
        low, high = (float(x) for x in self.bounds[1:-1].split(","))
        above = value > low if self.bounds[0] == "(" else value >= low
        below = value < high if self.bounds[-1] == ")" else value <= high
        return above and below and not math.isnan(value)

    def parse(self, verb: str, word: str) -> Any:
        """A `trimtab ctl` argument (a word on the command line) as the parameter's type."""
        try:
            if self.kind == "int":
                return int(word)
            if self.kind == "float":
                return float(word)
            if self.kind == "step":
                return word if word == "last_good" else int(word)
        except ValueError:
            kind = {"int": "whole number", "float": "number", "step": "step number"}[self.kind]
            raise ConfigError(f"ctl {verb}: {self.name.upper()} must be a {kind}, got '{word}'") from None
        return word


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _turns(action: str, name: str, value: Any, choices: tuple[str, ...]) -> list[list[Any]]:
    """Knob changes in the order made, [step, action, value before, value set] each, the values
    checked as that action's own parameter."""
    turns = value if isinstance(value, (list, tuple)) else [None]
    for turn in turns:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 4 and _whole(turn[0]) and turn[0] >= 0):
            raise ConfigError(f"{action}: '{name}' must be a list of [step, action, before, after], got {value!r}")
        if turn[1] not in choices:
            raise ConfigError(f"{action}: '{name}' turns unknown knob {turn[1]!r}; one of {', '.join(choices)}")
    check = [ACTIONS[knob].params[0].check for _, knob, _, _ in turns]
    return [[int(t[0]), t[1], ok(action, t[2]), ok(action, t[3])] for t, ok in zip(turns, check)]


@dataclass(frozen=True, kw_only=True)
class Action:
    name: str
    help: str  # one line, for `trimtab ctl --help` and docs
    says: str | Callable[[dict[str, Any]], str]  # the journal's words: a format string over the parameters
    params: tuple[ActionParam, ...] = ()
    verb: str | None = None  # the `trimtab ctl` verb; None: not for people

    def check(self, params: dict[str, Any], who: str = "") -> dict[str, Any]:
        """Parameters checked against the table, defaults filled in; ConfigError otherwise, naming
        `who` asked (`ctl mode` for a person's command; the action's name by default)."""
        who, names = who or self.name, [p.name for p in self.params]
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise ConfigError(
                f"{who}: unknown parameter(s) {', '.join(unknown)}; it takes {', '.join(names) or 'none'}"
            )
        out = {}
        for p in self.params:
            if p.name in params and params[p.name] is not None:
                out[p.name] = p.check(who, params[p.name])
            elif p.default is REQUIRED:
                raise ConfigError(f"{who}: '{p.name}' is required")
            elif p.default is not None:
                out[p.name] = p.default
        return out

    def usage(self) -> str:
        """e.g. `scale-lr FACTOR` or `add-expert LAYER [SOURCE]`."""
        names = {p.name: "|".join(p.choices) if 0 < len(p.choices) <= 4 else p.name.upper() for p in self.params}
        words = [names[p.name] if p.default is REQUIRED else f"[{names[p.name]}]" for p in self.params if p.ctl]
        return " ".join([self.verb or self.name, *words])

    def describe(self, params: dict[str, Any]) -> str:
        values = {p.name: params.get(p.name, None if p.default is REQUIRED else p.default) for p in self.params}
        values["where"] = "all layers" if values.get("layer") is None else f"layer {values['layer']}"
        values["n_rows"] = len(values.get("skip_rows") or values.get("rows") or [])
        return self.says(values) if callable(self.says) else self.says.format(**values)


LAYER = ActionParam(name="layer", kind="int", bounds="[0, inf)", default=None)  # None: every layer of that kind
MOE_LAYER = ActionParam(name="layer", kind="int", bounds="[0, inf)")  # surgery: one layer, named
EXPERT = ActionParam(name="expert", kind="int", bounds="[0, inf)")
# The knobs a rollback may put back (its `knobs`): those RL's rules turn on a policy that is falling
# (orchestrator/rl_reward.py: KnobTurns), each an action of one parameter, and what RunView reads of it now
PUT_BACK: dict[str, Callable[[Any], Any]] = {
    "set_rl_temperature": lambda view: view.rl_temperature,
    "set_entropy_bonus": lambda view: view.rl_entropy_coef,
    "set_overlong_penalty": lambda view: view.rl_overlong[1],
    "set_overlong_filter": lambda view: "on" if view.rl_overlong[0] else "off",
    "set_rl_difficulty": lambda view: view.rl_difficulty,  # a curriculum raise (rl/curriculum.py)
}

_TABLE = (
    Action(
        name="skip_step",
        verb="skip-step",
        says="skip step",
        help="withhold the next step's update",
        # who asked: a person's `trimtab ctl` (people.py) or a hook's request; either is theirs, not made up
        # (orchestrator/make_up.py), which the step that withholds it says (StepOutput.skip_by), not its number
        params=(ActionParam(name="by", kind="str", default="hook", ctl=False, choices=("person", "hook")),),
    ),
    Action(
        name="scale_lr",
        verb="scale-lr",
        says="lr x{factor:.3g}",
        help="multiply the LR (the schedule keeps its shape)",
        params=(ActionParam(name="factor", kind="float", bounds="(0, inf)"),),
    ),
    Action(
        name="set_lr",
        verb="set-lr",
        says="lr = {value:.3g}",
        help="set the LR now (in a warm-up, the LR it rises to); the schedule keeps its shape from this level",
        params=(ActionParam(name="value", kind="float", bounds="(0, inf)"),),
    ),
    Action(
        name="emergency_lr_reduction",
        verb="emergency-lr",
        says="lr x{factor:.3g}",
        help="cut the LR (default x0.1)",
        params=(ActionParam(name="factor", kind="float", bounds="(0, 1)", default=0.1),),
    ),
    Action(
        name="rollback",
        verb="rollback",
        says=lambda v: (
            f"roll back to {v['to']}"
            + (f", skip {counted(v['n_rows'], 'row')}" if v["n_rows"] else "")
            + (f", lr x{v['lr_factor']:.3g}" if v["lr_factor"] else "")
            + (", knobs turned after it put back" if v["knobs"] else "")
        ),
        help="restore the last good checkpoint (or the newest at or before step TO); the knobs stay",
        params=(
            ActionParam(name="to", kind="step", default="last_good"),
            ActionParam(name="skip_rows", kind="rows", default=None, ctl=False),
            ActionParam(name="lr_factor", kind="float", bounds="(0, 1)", default=None, ctl=False),  # None: the LR stays
            # RL rule rl_reward's: the knobs RL's rules turned on the falling policy, put back to
            # what the restored policy ran with where turned after its step (a person's stay)
            ActionParam(name="knobs", kind="turns", default=None, ctl=False, choices=tuple(PUT_BACK)),
        ),
    ),
    Action(
        name="skip_data",
        says=lambda v: f"leave out {counted(v['n_rows'], 'row')}",
        help="leave these training rows out from now on",
        params=(ActionParam(name="rows", kind="rows", ctl=False),),
    ),
    Action(
        name="set_micro_batch_tokens",
        verb="micro-batch",
        says="micro-batch {tokens} tokens",
        help="tokens per forward/backward; the optimization batch stays the same",
        params=(ActionParam(name="tokens", kind="int", bounds="[1, inf)"),),
    ),
    Action(
        name="set_activation_checkpointing",
        verb="checkpointing",
        says="activation checkpointing {mode}",
        help="what a block's backward computes again instead of keeping it (train.activation_checkpointing)",
        params=(ActionParam(name="mode", kind="str", choices=CHECKPOINTING),),
    ),
    Action(
        name="set_grad_clip",
        verb="grad-clip",
        says="grad clip {value:g}",
        help="gradient-norm clipping threshold (0: off)",
        params=(ActionParam(name="value", kind="float", bounds="[0, inf)"),),
    ),
    Action(
        name="set_weight_decay",
        verb="weight-decay",
        says="weight decay {value:g}",
        help="AdamW weight decay of the decayed parameter group",
        params=(ActionParam(name="value", kind="float", bounds="[0, inf)"),),
    ),
    Action(
        name="save_checkpoint",
        verb="checkpoint",
        says=lambda v: (
            "save a checkpoint"
            + ("" if v["keep"] is None else f" (first delete all but the newest {v['keep']}, the last good, the best)")
        ),
        help="save a checkpoint now; with KEEP, first delete older ones (not the last good, the best) to free space",
        params=(ActionParam(name="keep", kind="int", bounds="[1, inf)", default=None),),
    ),
    Action(
        name="stop",
        verb="stop",
        says=lambda v: f"save and stop ({v['reason']})" + (f", exit code {v['exit_code']}" if v["exit_code"] else ""),
        help="save a checkpoint and stop",
        # exit_code: 0 a requested stop; 3 gave up, training cannot be healed; 4 gave up, no
        # checkpoint can be written (docs/orchestrator.md, exit codes)
        params=(
            ActionParam(name="reason", kind="str", default="stop requested"),
            ActionParam(name="exit_code", kind="int", bounds="[0, 125]", default=0, ctl=False),
        ),
    ),
    Action(
        name="exclude_node",
        verb="exclude-node",
        says="save and restart without node {node}",
        help="elastic jobs (torchrun --nnodes MIN:MAX): save, end NODE's agent and ranks, resume on the others",
        params=(ActionParam(name="node", kind="int", bounds="[1, inf)"),),
    ),
    Action(
        name="add_expert",
        verb="add-expert",
        says=lambda v: (
            f"add an expert to layer {v['layer']}"
            + ("" if v["source"] is None else f" (a copy of expert {v['source']})")
        ),
        help="split an expert in two: a copy of SOURCE (default: the busiest)",
        params=(MOE_LAYER, ActionParam(name="source", kind="int", bounds="[0, inf)", default=None)),
    ),
    Action(
        name="prune_expert",
        verb="prune-expert",
        says="prune expert {expert} of layer {layer}",
        help="remove an expert (its router row and weights)",
        params=(MOE_LAYER, EXPERT),
    ),
    Action(
        name="reinit_expert",
        verb="reinit-expert",
        says="re-initialise expert {expert} of layer {layer}",
        help="revive an expert as a copy of the busiest (router row, weights, bias; fresh moments)",
        params=(MOE_LAYER, EXPERT),
    ),
    Action(
        name="reset_router",
        verb="reset-router",
        says="reset the router row of expert {expert} in layer {layer}",
        help="re-centre a collapsed expert's router row and selection bias on the others' mean",
        params=(MOE_LAYER, EXPERT),
    ),
    Action(
        name="set_capacity_factor",
        verb="capacity-factor",
        says="capacity factor {value:g} ({where})",
        help="MoE capacity factor (0: dropless)",
        params=(ActionParam(name="value", kind="float", bounds="[0, inf)"), LAYER),
    ),
    Action(
        name="set_router_temperature",
        verb="router-temperature",
        says="router temperature {value:g} ({where})",
        help="softmax temperature of the MoE router",
        params=(ActionParam(name="value", kind="float", bounds="(0, inf)"), LAYER),
    ),
    Action(
        name="set_balance_coef",
        verb="balance-coef",
        says="balance coefficient {value:g} ({where})",
        help="weight of the MoE load-balancing loss (model.moe.balance_coef)",
        params=(ActionParam(name="value", kind="float", bounds="[0, inf)"), LAYER),
    ),
    Action(
        name="set_mod_capacity",
        verb="mod-capacity",
        says="MoD capacity {value:g} ({where})",
        help="target share of tokens a Mixture-of-Depths block processes",
        params=(ActionParam(name="value", kind="float", bounds="(0, 1]"), LAYER),
    ),
    Action(
        name="set_rl_temperature",
        verb="rl-temperature",
        says="RL sampling temperature {value:g}",
        help="the temperature RL samples responses at, and evaluates their log-probabilities at (rl.temperature)",
        params=(ActionParam(name="value", kind="float", bounds="(0, inf)"),),
    ),
    Action(
        name="set_entropy_bonus",
        verb="entropy-bonus",
        says="RL entropy bonus {value:g}",
        help="the weight of the policy's entropy in the RL objective (rl.entropy_coef)",
        params=(ActionParam(name="value", kind="float", bounds="[0, inf)"),),
    ),
    Action(
        name="set_overlong_filter",
        verb="overlong-filter",
        says="RL overlong filter {value}",
        help="RL leaves responses cut at rl.max_new_tokens out of the loss (rl.overlong_filter)",
        params=(ActionParam(name="value", kind="str", choices=("on", "off")),),
    ),
    Action(
        name="set_overlong_penalty",
        verb="overlong-penalty",
        says=lambda v: f"RL overlong penalty over the last {counted(v['tokens'], 'token')}",
        help="RL's soft penalty: the last TOKENS of the budget cost up to 1 reward (rl.overlong_buffer)",
        params=(ActionParam(name="tokens", kind="int", bounds="[0, inf)"),),
    ),
    Action(
        name="set_dynamic_sampling",
        verb="dynamic-sampling",
        says="RL dynamic sampling {value}",
        help="RL drops groups whose responses all earned one reward and draws more prompts (rl.dynamic_sampling)",
        params=(ActionParam(name="value", kind="str", choices=("on", "off")),),
    ),
    Action(
        name="set_rl_difficulty",
        verb="rl-difficulty",
        says=lambda v: f"RL task difficulty {counted(v['digits'], 'digit')}",
        help="the built-in RL task's difficulty, its operands' digits (rl.prompts builtin:arithmetic:DIGITS): its "
        "training problems drawn again at it (rl/curriculum.py)",
        params=(ActionParam(name="digits", kind="int", bounds="[1, inf)"),),
    ),
    Action(
        name="set_max_staleness",
        verb="max-staleness",
        says=lambda v: f"RL rollouts at most {counted(v['steps'], 'step')} behind",
        help="how many optimizer steps behind the policy trained RL's rollouts may be generated (rl.max_staleness)",
        params=(ActionParam(name="steps", kind="int", bounds="[0, inf)"),),
    ),
    Action(
        name="set_generation_rows",
        verb="generation-rows",
        says=lambda v: f"RL generation {counted(v['at_once'], 'row')} at a time",
        help="rows RL generates in one pass (a step's prompts x group in several passes after an out-of-memory error)",
        params=(ActionParam(name="at_once", kind="int", bounds="[1, inf)"),),
    ),
    Action(
        name="set_verifier_timeout",
        verb="verifier-timeout",
        says="RL verifier timeout {value:g} s",
        help="seconds one verification of an RL response may take before it is killed (rl.verifier_timeout_s)",
        params=(ActionParam(name="value", kind="float", bounds="(0, 86400]"),),
    ),
    Action(
        name="set_total_steps",
        verb="total-steps",
        says=lambda v: f"run length {counted(v['steps'], 'step')}",
        help="the run's total steps (the pretraining schedule stretches or shrinks to the new end); a resume keeps "
        "it unless it names another --max-steps, which then replaces it, but for orchestrator.make_up's steps for "
        "withheld updates: they stay on top, as on a fresh run of that --max-steps",
        params=(
            ActionParam(name="steps", kind="int", bounds="[1, inf)"),
            # who changed it, where that matters: make_up's steps repair withheld updates (TrainState.made_up)
            ActionParam(name="by", kind="str", default=None, ctl=False, choices=("make_up",)),
        ),
    ),
    Action(
        name="set_checkpoint_every",
        verb="checkpoint-every",
        says=lambda v: f"a checkpoint every {counted(v['steps'], 'step')}",
        help="steps between checkpoints (the checkpoint interval rule sets it from save cost and MTBF)",
        params=(ActionParam(name="steps", kind="int", bounds="[1, inf)"),),
    ),
)
ACTIONS: dict[str, Action] = {a.name: a for a in _TABLE}
MOE_KNOBS = {
    "set_capacity_factor": "capacity_factor",
    "set_router_temperature": "router_temperature",
    "set_balance_coef": "balance_coef",
}  # action -> the MoE layer's attribute (and config key)
# Knobs of `trimtab rl` runs: elsewhere a person's command for one is refused (by `trimtab ctl` from the
# run's config.yaml, by Control in the job) instead of being journaled as if it had changed something
RL_ONLY = frozenset(
    {
        "set_rl_temperature",
        "set_entropy_bonus",
        "set_overlong_filter",
        "set_overlong_penalty",
        "set_dynamic_sampling",
        "set_rl_difficulty",
        "set_max_staleness",
        "set_generation_rows",
        "set_verifier_timeout",
    }
)


RULE_NAMES = ("nonfinite", "end", *OrchestratorConfig.RULES)  # end: the check of the state a phase ends in
# The orchestrator's own commands (a person's, through `trimtab ctl`), beside the run's actions:
# the orchestrator applies them itself, Control never sees them.
COMMANDS: dict[str, Action] = {
    a.name: a
    for a in (
        Action(
            name="pause_rule",
            verb="pause-rule",
            says="pause rule {rule}",
            help="stop acting on one rule's findings",
            params=(ActionParam(name="rule", kind="str", choices=RULE_NAMES),),
        ),
        Action(
            name="resume_rule",
            verb="resume-rule",
            says="resume rule {rule}",
            help="act on a paused rule's findings again",
            params=(ActionParam(name="rule", kind="str", choices=RULE_NAMES),),
        ),
        Action(
            name="set_mode",
            verb="mode",
            says="orchestrator mode {mode}",
            help="auto: act, advise: only journal, off: no monitoring",
            params=(ActionParam(name="mode", kind="str", choices=MODES),),
        ),
    )
}
VERBS: dict[str, Action] = {a.verb: a for a in (*ACTIONS.values(), *COMMANDS.values()) if a.verb}


def help_text() -> str:
    """Every ctl verb with its arguments and one line on what it does (the CLI's help)."""
    rows = [(a.usage(), a.help) for a in VERBS.values()]
    width = max(len(usage) for usage, _ in rows)
    return "\n".join(f"  {usage:<{width}}  {text}" for usage, text in rows)


def action(name: str) -> Action:
    if name not in ACTIONS:
        raise ConfigError(f"unknown action '{name}'; one of {', '.join(ACTIONS)}")
    return ACTIONS[name]


def describe(name: str, params: dict[str, Any]) -> str:
    """The journal's and console's words for an action, e.g. `lr x0.5`; "log only" for none."""
    if name == "none":
        return "log only"
    if name not in ACTIONS:
        extra = ", ".join(f"{k}={v}" for k, v in params.items())
        return name.replace("_", " ") + (f" ({extra})" if extra else "")
    return ACTIONS[name].describe(params)
