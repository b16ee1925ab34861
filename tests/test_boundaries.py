"""The hook boundary holds in the code: hooks only observe (a RunView, read only), Control is the
one writer and the loop applies it, the fault injector writes through its own named handle, and
Control's effects are an explicit table checked at import."""

import ast
from pathlib import Path

import pytest

import trimtab
from trimtab.config import load_config
from trimtab.training import control as control_module
from trimtab.training.actions import ACTIONS
from trimtab.training.control import AT_ONCE, EFFECTS, Control, check_effects
from trimtab.training.hooks import Hook, HookWroteError

SRC = Path(__file__).resolve().parents[1] / "src" / "trimtab"

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(run_dir, steps=3):
    return load_config(
        preset="debug",
        overrides={
            "out": str(run_dir),
            "train": {"max_steps": steps, "eval_every": 0, "batch_tokens": 1024},
            "data": {"max_bytes": 150_000},
            "log": {"progress": False, "tensorboard": False, "report": False},
        },
    )


class Writer(Hook):
    """Tries every way of writing through the view, once, after step 1; records what each raised."""

    def __init__(self):
        self.raised: dict[str, str] = {}
        self.cfg_max_steps = None

    def on_step_end(self, run, out):
        if out.step != 1:
            return
        attempts = {
            "set a parameter": lambda: next(run.model.parameters()).data.fill_(0.0),
            "optimizer.step": lambda: run.optimizer.step(),
            "replace rows": lambda: run.train_rows.replace(0, [1, 2, 3]),
            "set lr": lambda: run.optimizer.param_groups[0].__setitem__("lr", 1.0),
            "assign lr_scale": lambda: setattr(run, "lr_scale", 10.0),
            "assign a new attribute": lambda: setattr(run, "model", None),
            "apply control": lambda: run.control.apply(),
            "replace control": lambda: setattr(run, "control", None),
            "assign on control": lambda: setattr(run.control, "request", None),
            "set a config field": lambda: setattr(run.cfg.train, "max_steps", 1),
        }
        for what, attempt in attempts.items():
            try:
                attempt()
            except AttributeError as exc:
                self.raised[what] = str(exc)
        self.cfg_max_steps = run.cfg.train.max_steps


def test_a_hook_cannot_write_through_the_view(tmp_path):
    writer = Writer()
    summary = trimtab.train(_tiny(tmp_path / "r"), hooks=[writer])
    assert set(writer.raised) == {
        "set a parameter",
        "optimizer.step",
        "replace rows",
        "set lr",
        "assign lr_scale",
        "assign a new attribute",
        "apply control",
        "replace control",
        "assign on control",
        "set a config field",
    }, writer.raised
    assert "read-only" in writer.raised["assign a new attribute"]
    assert "run.control.request" in writer.raised["assign on control"]
    assert "resolved and read-only" in writer.raised["set a config field"]
    assert writer.cfg_max_steps == 3 and summary["step"] == 3  # the config is frozen: the run kept its length


def test_requests_through_the_view_are_applied_by_the_loop(tmp_path):
    """A request made in a hook changes nothing until the loop applies it, after the step's hooks."""
    seen = []

    class Asker(Hook):
        def on_step_end(self, run, out):
            if out.step == 1:
                run.control.request("scale_lr", on_done=seen.append, factor=0.5)
                seen.append(run.lr_scale)  # not yet
            elif out.step == 2:
                seen.append(run.lr_scale)

    trimtab.train(_tiny(tmp_path / "r"), hooks=[Asker()])
    assert seen == [1.0, "lr multiplier 1 -> 0.5", 0.5]


def test_every_action_has_one_effect_and_every_effect_an_action():
    assert set(EFFECTS) == set(ACTIONS)
    assert AT_ONCE <= set(EFFECTS)
    assert all(getattr(Control, effect.__name__) is effect for effect in EFFECTS.values())
    check_effects()  # as at import


def test_the_effect_table_is_checked_at_import():
    with pytest.raises(ImportError, match="no effect for action"):
        check_effects({k: v for k, v in EFFECTS.items() if k != "set_grad_clip"})
    with pytest.raises(ImportError, match="effects for no action"):
        check_effects({**EFFECTS, "teleport": Control._stop})
    with pytest.raises(ImportError, match="set_grad_clip's effect takes"):
        check_effects({**EFFECTS, "set_grad_clip": Control._stop})
    src = Path(control_module.__file__).read_text()
    assert "\ncheck_effects()\n" in src  # called at module level
    assert "getattr(self" not in src  # no lookup of an effect by name


def _py_files():
    return [p for p in SRC.rglob("*.py") if p.is_file()]


def test_no_hook_reaches_behind_the_view_or_applies_control():
    """Outside the trainer's own modules nothing reads a view's private attributes, calls
    Control.apply, or reads the model, optimizer or rows off a view."""
    own = {
        "training/trainer.py",
        "training/checkpointing.py",
        "training/phases.py",
        "training/oom.py",
        "training/view.py",
        "training/control.py",
        "training/instrument.py",
    }
    bad = []
    for path in _py_files():
        rel = path.relative_to(SRC).as_posix()
        if rel in own:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if name in ("run", "view") and (
                node.attr.startswith("_") or node.attr in ("model", "optimizer", "train_rows")
            ):
                bad.append(f"{rel}:{node.lineno} {name}.{node.attr}")
            if node.attr == "apply" and isinstance(base, ast.Attribute) and base.attr == "control":
                bad.append(f"{rel}:{node.lineno} control.apply")
    assert bad == []


def test_the_fault_injector_is_the_one_instrument():
    """Only a test instrument gets a FaultHandle, and the fault injector is the only one."""
    instruments = []
    for path in _py_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Instrument" for b in node.bases):
                instruments.append(f"{path.relative_to(SRC).as_posix()}:{node.name}")
    assert instruments == ["orchestrator/faults.py:FaultInjector"]
    handles = [
        p.relative_to(SRC).as_posix()
        for p in _py_files()
        if "FaultHandle(" in p.read_text() and p.name not in ("instrument.py",)
    ]
    assert handles == ["training/trainer.py"]  # created there alone, for Instrument hooks


def test_a_hook_that_writes_into_the_step_it_was_shown_fails(tmp_path):
    """The batch and the StepOutput a hook is shown are the step's own tensors: a write into one
    in place is caught at the hook boundary (their version counters) and names the hook, the event
    and the tensor."""

    class Scaler(Hook):
        def on_step_end(self, run, out):
            out.loss.mul_(0.5)

    class Poisoner(Hook):
        def on_step_start(self, run, batch):
            batch.micro[0].inputs[0, 0] = 1

    with pytest.raises(HookWroteError, match=r"Scaler.on_step_end wrote into arg0.loss in place"):
        trimtab.train(_tiny(tmp_path / "a"), hooks=[Scaler()])
    with pytest.raises(HookWroteError, match=r"Poisoner.on_step_start wrote into arg0.micro\[0\].inputs"):
        trimtab.train(_tiny(tmp_path / "b"), hooks=[Poisoner()])

    class Reader(Hook):  # reading, and changing copies, is what hooks do
        def on_step_end(self, run, out):
            self.halved = out.loss.detach().clone().mul_(0.5).item()

    reader = Reader()
    assert trimtab.train(_tiny(tmp_path / "c"), hooks=[reader])["step"] == 3 and reader.halved > 0
