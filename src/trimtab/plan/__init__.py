"""The Chinchilla planner: how long to train a model, on how much data, with what memory and
time, and (during training) how far the loss curve has come. docs/planner.md.

    chinchilla.py  parameters, compute-optimal tokens, epochs over the data, budgets
    memory.py      memory per device (and doctor's micro-batch) and time on the detected or named hardware
    curve.py       the live planner's loss-curve fit, status and run-length recommendation
    layout.py      the parallel layout for a cluster (tp, FSDP2, pp, ep, micro-batch, checkpointing)
    layout_text.py the layout as `trimtab plan` prints it
    report.py      `trimtab plan`: the whole plan as text and JSON

Imports config, model (sizing on the meta device), hardware (the GPU table), peaks (peak FLOP/s) and,
lazily, data (token counting); never training, and training never imports it: the live planner
is a hook (orchestrator/planner.py), and its run-length changes are orchestrator decisions.
"""

from trimtab.plan.chinchilla import effective_tokens
from trimtab.plan.curve import LossFit, RunProgress, Status, fit_loss_curve, format_status, live_status
from trimtab.plan.memory import Hardware, detect_hardware, named_gpu
from trimtab.plan.report import Plan, format_plan, make_plan, plan_command, save_plan

__all__ = [
    "Hardware",
    "LossFit",
    "Plan",
    "RunProgress",
    "Status",
    "detect_hardware",
    "effective_tokens",
    "fit_loss_curve",
    "format_plan",
    "format_status",
    "live_status",
    "make_plan",
    "named_gpu",
    "plan_command",
    "save_plan",
]
