"""Control's effects on reinforcement learning's knobs: the `trimtab ctl` rl-* commands and the turns of
RL's own rules (orchestrator/rl_remedies.py), a part of Control (control.py), which refuses them on a run
that is not `trimtab rl` (actions.py RL_ONLY). Each knob of the rollout loader is kept in the train state
as rl_<knob> (checkpointed, so a resume keeps it) and applied again to a loader the trainer rebuilds
(apply_rl_knobs); outside an RL phase (a DPO run) each says it changed nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trimtab.errors import ConfigError
from trimtab.rl.batches import RolloutLoader
from trimtab.rl.curriculum import set_difficulty
from trimtab.words import counted

if TYPE_CHECKING:
    from trimtab.training.trainer import Trainer

# (the train state's field, the RolloutLoader's attribute) of each loader knob a person or a rule turns
LOADER_KNOBS = (
    ("rl_verifier_timeout", "verifier_timeout_s"),
    ("rl_dynamic_sampling", "dynamic_sampling"),
    ("rl_overlong_filter", "overlong_filter"),
    ("rl_overlong_buffer", "overlong_buffer"),
    ("rl_max_staleness", "max_staleness"),
    ("rl_generation_rows", "generation_rows"),
)


class RLKnobs:
    """Control's RL effects (Control holds the trainer named here; EFFECTS names each)."""

    _trainer: Trainer

    def apply_rl_knobs(self) -> None:
        """The loader knobs turned in this run, applied again to a loader the trainer rebuilt (a new phase's)."""
        t = self._trainer
        if not isinstance(t.loader, RolloutLoader):
            return
        for kept, knob in LOADER_KNOBS:
            if (value := getattr(t.state, kept)) is not None:
                setattr(t.loader, knob, value)

    def _set_dynamic_sampling(self, value: str) -> str:
        return self._rl_switch("dynamic sampling", "dynamic_sampling", value)

    def _rl_switch(self, what: str, knob: str, value: str) -> str:
        """An RL loader's on/off knob `knob`, kept in the train state as rl_<knob> (checkpointed)."""
        t = self._trainer
        if not isinstance(t.loader, RolloutLoader):
            return f"no RL phase is running: {what} is unchanged"
        before = "on" if getattr(t.loader, knob) else "off"
        setattr(t.loader, knob, value == "on")
        setattr(t.state, f"rl_{knob}", value == "on")
        return f"RL {what} {before} -> {value}"

    def _set_rl_difficulty(self, digits: int) -> str:
        t = self._trainer
        if not isinstance(t.loader, RolloutLoader):
            return "no RL phase is running: the task's difficulty is unchanged"
        before = t.state.rl_difficulty or t.loader.difficulty  # RunView.rl_difficulty
        if digits == t.loader.difficulty != before:  # a rollback's put-back (Control._put_back): the loader restored it
            t.state.rl_difficulty = digits
            return (
                f"RL task difficulty {before} -> {digits} digits: the raise reverted with the policy it fell from "
                "(the restored checkpoint's problems, in its order)"
            )
        try:  # a ConfigError: answered as failed; the phase's rows widened by the loader's phase (RLPhase.fit)
            done = set_difficulty(t.loader, digits, t.cfg.model.max_seq_len)
        except ConfigError:
            # a raise that did not fit found the task's ceiling (loader.top_difficulty): a rollback keeps it too
            t.state.rl_top_difficulty = t.loader.top_difficulty or t.state.rl_top_difficulty
            raise
        t.state.rl_difficulty = digits  # a journaled decision, as an LR cut: a rollback keeps it (keep_rl_difficulty)
        return done

    def keep_rl_difficulty(self) -> list[str]:
        """After a rollback (Control._rollback, once the knobs are put back): a raise decided after the restored
        checkpoint, drawn again. The loader came back at the checkpoint's difficulty, undoing the raise unsaid; rule
        rl_signal raised it again a window later (a weights_nan rollback: 4 more steps at the learned task). A fall's
        rollback (rl_reward, a held-out fall) reverts a rule's raise with the other knobs it puts back instead. The
        ceiling a raise found since is kept as well (_keep_top)."""
        t = self._trainer
        # a prompt file since (a resume's edit of rl.prompts) has no difficulty: nothing to keep
        if not isinstance(t.loader, RolloutLoader) or not t.loader.difficulty:
            return []
        said, kept = self._keep_top(), t.state.rl_difficulty
        if not kept or t.loader.difficulty == kept:
            return said
        # it fitted model.max_seq_len when raised; RLPhase.fit widens data.seq_len again
        done = set_difficulty(t.loader, kept, t.cfg.model.max_seq_len)
        return [f"{done}: the raise decided after the checkpoint kept", *said]

    def _keep_top(self) -> list[str]:
        """The ceiling found after the restored checkpoint (a raise that did not fit model.max_seq_len), put back on
        the loader, which came back without it: rule rl_signal tried the raise again and it failed again (weights_nan
        after the ceiling at 2 digits: the raise to 3 failed at steps 4 and 6, the stop at step 8, not 6)."""
        t = self._trainer
        top = t.state.rl_top_difficulty
        if not top or t.loader.top_difficulty == top:
            return []
        t.loader.top_difficulty = top  # each batch's `top`, rl_signal's evidence (rl_remedies._harder)
        return [f"the task's ceiling kept: {top} digits (a raise past it did not fit model.max_seq_len)"]

    def _set_verifier_timeout(self, value: float) -> str:
        t = self._trainer
        if not isinstance(t.loader, RolloutLoader):
            return "no RL phase is running: the verifier timeout is unchanged"
        before, t.state.rl_verifier_timeout = t.loader.verifier_timeout_s, value
        t.loader.verifier_timeout_s = value
        return f"RL verifier timeout {before:g} -> {value:g} s"

    def _set_generation_rows(self, at_once: int) -> str:
        t = self._trainer
        if not isinstance(t.loader, RolloutLoader):
            return "no RL phase is running: the generation batch is unchanged"
        before = t.view.rl_generation_rows
        t.loader.generation_rows = t.state.rl_generation_rows = at_once
        return f"RL generation rows at a time {before} -> {at_once}"

    def _set_max_staleness(self, steps: int) -> str:
        t = self._trainer
        if not isinstance(t.loader, RolloutLoader):
            return "no RL phase is running: the staleness bound is unchanged"
        before = t.loader.max_staleness
        t.loader.max_staleness = t.state.rl_max_staleness = steps
        return f"RL rollouts at most {before} -> {counted(steps, 'step')} behind (the batches generated ahead dropped)"

    def _set_entropy_bonus(self, value: float) -> str:
        t = self._trainer
        before, t.state.rl_entropy_coef = t.rl_entropy_coef, value
        return f"RL entropy bonus {before:g} -> {value:g}"

    def _set_overlong_filter(self, value: str) -> str:
        return self._rl_switch("overlong filter", "overlong_filter", value)

    def _set_overlong_penalty(self, tokens: int) -> str:
        t = self._trainer
        if not isinstance(t.loader, RolloutLoader):
            return "no RL phase is running: the overlong penalty is unchanged"
        if tokens >= t.cfg.rl.max_new_tokens:  # a failure: answered, journaled as failed (it read as applied)
            raise ConfigError(
                f"the overlong penalty's buffer ({tokens}) must be under rl.max_new_tokens "
                f"({t.cfg.rl.max_new_tokens}): unchanged"
            )
        before, t.state.rl_overlong_buffer = t.loader.overlong_buffer, tokens
        t.loader.overlong_buffer = tokens
        done = f"RL overlong penalty buffer {before} -> {counted(tokens, 'token')}"
        if tokens and t.loader.overlong_filter:  # the penalty acts through the cut responses' gradient
            done += f"; {self._set_overlong_filter('off')}"
        return done

    def _set_rl_temperature(self, value: float) -> str:
        t = self._trainer
        before = t.rl_temperature
        t.state.rl_temperature = value
        return f"RL sampling temperature {before:g} -> {value:g}"
