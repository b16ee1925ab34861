"""The package's import rules (DESIGN.md section 1), checked on the source: imports flow one way."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "trimtab"


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def modules(package: str) -> dict[str, set[str]]:
    root = SRC / package if package else SRC
    files = root.rglob("*.py") if root.is_dir() else [root.with_suffix(".py")]
    return {str(p.relative_to(SRC)): imports_of(p) for p in files}


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{mod} imports {name}"
        for mod, names in modules(package).items()
        for name in names
        if name.startswith(forbidden)
    ]


def test_config_imports_nothing_but_itself_and_errors():
    bad = [
        f"{m} imports {n}"
        for m, names in modules("config").items()
        for n in names
        if n.startswith("trimtab") and not n.startswith(("trimtab.config", "trimtab.errors"))
    ]
    assert bad == []


def test_model_is_single_device_and_knows_no_training():
    assert offenders("model", ("torch.distributed", "trimtab.training", "trimtab.orchestrator", "trimtab.data")) == []


def test_training_never_imports_the_orchestrator():
    assert offenders("training", ("trimtab.orchestrator",)) == []
    assert offenders("data", ("trimtab.training", "trimtab.orchestrator", "trimtab.model")) == []


def test_plan_knows_no_training_and_hardware_knows_nothing_above_it():
    """plan ↛ training: the planner and the trainer both take device, precision and peak FLOP/s
    from trimtab/hardware.py, which imports no other trimtab module but errors and paths."""
    assert offenders("plan", ("trimtab.training", "trimtab.orchestrator")) == []
    own = {n for n in imports_of(SRC / "hardware.py") if n.startswith("trimtab")}
    assert own <= {"trimtab.errors", "trimtab.paths"}


def test_the_metrics_reader_reads_files_only():
    """Report tools and benchmarks read metrics.jsonl with trimtab/metrics.py, without the training stack."""
    assert {n for n in imports_of(SRC / "metrics.py") if n.startswith(("torch", "trimtab"))} == set()


def test_nothing_imports_the_cli():
    bad = [
        f"{m} imports trimtab.cli"
        for m, names in modules("").items()
        if "trimtab.cli" in names and m not in ("cli.py", "__main__.py")
    ]
    assert bad == []


def test_torch_distributed_lives_in_one_module():
    """Process groups, wrapping and collectives are trimtab/distributed.py's; checkpoint.py reads and
    writes the sharded format; doctor.py only asks which backends exist. The model is single-device."""
    allowed = ("distributed.py", "checkpoint.py", "doctor.py")
    bad = [
        f"{m} imports {n}"
        for m, names in modules("").items()
        for n in names
        if n.startswith("torch.distributed") and m not in allowed
    ]
    assert bad == []
    assert offenders("model", ("trimtab.distributed",)) == []
