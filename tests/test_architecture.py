"""The package's import rules (docs/architecture.md section 1), checked on the source: imports flow one way."""

import ast
import re
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


def test_interop_reads_run_directories_and_never_trains():
    """hf, merge and evaluation read run directories (docs/architecture.md sections 1 and 4);
    none imports the trainer or the orchestrator, and transformers is no dependency of theirs
    (only the remote-code files exported beside the weights import it)."""
    remote = {"hf/remote/configuration_trimtab.py", "hf/remote/modeling_trimtab.py"}
    for package in ("hf", "merge", "evaluation"):
        assert offenders(package, ("trimtab.training", "trimtab.orchestrator", "trimtab.cli")) == []
        users = {m for m, names in modules(package).items() if "transformers" in {n.split(".")[0] for n in names}}
        assert users == (remote if package == "hf" else set())


def test_rl_parts_know_no_trainer():
    """rl/'s rollouts, rewards, objective and tasks sit below the loop that will drive them: the
    model, the data readers and sampling, never the trainer, the orchestrator or torch.distributed."""
    above = ("trimtab.training", "trimtab.orchestrator", "trimtab.distributed", "torch.distributed")
    assert offenders("rl", above) == []


def test_plan_knows_no_training_and_hardware_knows_nothing_above_it():
    """plan ↛ training: the planner and the trainer both take device and precision from
    trimtab/hardware.py, which imports no other trimtab module but errors, paths, rundir and
    extras (the optional packages' install commands; it imports only errors), and peak FLOP/s
    from trimtab/peaks.py, which sits just above it (hardware and paths only)."""
    assert offenders("plan", ("trimtab.training", "trimtab.orchestrator")) == []
    own = {n for n in imports_of(SRC / "hardware.py") if n.startswith("trimtab")}
    assert own <= {"trimtab.errors", "trimtab.paths", "trimtab.rundir", "trimtab.extras"}
    assert {n for n in imports_of(SRC / "extras.py") if n.startswith("trimtab")} <= {"trimtab.errors"}
    assert {n for n in imports_of(SRC / "peaks.py") if n.startswith("trimtab")} <= {"trimtab.hardware", "trimtab.paths"}


def test_the_run_directory_module_is_at_the_bottom_and_torch_free():
    """trimtab/rundir.py reads and writes a run's files (report tools, tune and benchmarks read runs
    with it without the training stack): it imports no torch and no trimtab module but errors."""
    own = {n for n in imports_of(SRC / "rundir.py") if n.startswith(("torch", "trimtab"))}
    assert own <= {"trimtab.errors"}


def test_object_storage_is_torch_free_and_low():
    """trimtab/storage.py (checkpoint.dir in object storage) moves files and knows nothing of their
    contents: no torch, and of trimtab only errors, extras (fsspec, s3fs), paths and rundir; the loop's
    side (the upload hook, the restore at start-up) is training/services/storage.py."""
    own = {n for n in imports_of(SRC / "storage.py") if n.startswith(("torch", "trimtab"))}
    assert own <= {"trimtab.errors", "trimtab.extras", "trimtab.paths", "trimtab.rundir"}


def test_resilience_is_torch_free_below_the_loop():
    """resilience/ (the watchdog, the goodput ledger, a lost session's files) runs while the main
    thread is stuck inside torch and is read by `trimtab runs`: no torch, and of trimtab only
    rundir and itself; the loop feeds the watchdog, the orchestrator's `Resilience` hook the ledger."""
    for name, names in modules("resilience").items():
        own = {n for n in names if n.startswith(("torch", "trimtab"))}
        assert {n for n in own if not n.startswith("trimtab.resilience")} <= {"trimtab.rundir"}, name


def _constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)}


def test_one_module_names_a_runs_files_and_writes_files_whole():
    """The run's JSON files are named in rundir.py only (everyone else reads and writes them through
    it), and the temp-file-and-rename dance is rundir.write_atomic's; the other renames install
    directories (a checkpoint, a snapshot, an export, a merge, a checkpoint downloaded from object storage)
    or files a library writes (a tokenizer, arrays, corpus shards), or move a file aside whole (a
    lost session's rank beat, kept for the restart's evidence)."""
    files = {"metrics.jsonl", "decisions.jsonl", "plan_status.jsonl", "summary.json", "goodput.json"}
    naming = {m for m in modules("") if _constants(SRC / m) & files}
    assert naming == {"rundir.py"}
    renaming = {m for m in modules("") if "os.replace(" in (SRC / m).read_text()}
    installs = {"checkpoint.py", "storage.py", "hf/export.py", "merge/merge.py", "data/tokenizer.py", "data/packing.py"}
    installs.add("resilience/watchdog.py")
    installs.add("data/junk_cache.py")  # arrays numpy writes (a source's junk verdicts)
    assert renaming <= {"rundir.py", "data/shards.py", *installs}, renaming - installs


def test_the_services_serve_the_loop():
    """training/services/ (trackers, signals, CPU precision, compile) are called by the loop; of
    training they import only the loss (cpu_precision times a step as the trainer runs it) and the
    hook boundary, the Trainer only as a type (`if TYPE_CHECKING:`)."""
    allowed = {"trimtab.training.loss", "trimtab.training.hooks", "trimtab.training.view"}
    bad = []
    for path in (SRC / "training" / "services").glob("*.py"):
        tree = ast.parse(path.read_text())
        guarded = _type_checking_imports(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and id(node) not in guarded:
                if node.module.startswith("trimtab.training") and node.module not in allowed:
                    bad.append(f"{path.relative_to(SRC)}:{node.lineno} imports {node.module}")
    assert bad == []
    loop = {p.name for p in (SRC / "training").glob("*.py")}
    assert {"trainer.py", "setup.py", "loss.py", "optim.py", "schedule.py", "state.py", "resume.py"} <= loop
    assert not loop & {"tracking.py", "signals.py", "cpu_precision.py", "compiling.py"}


def test_nothing_imports_the_cli():
    bad = [
        f"{m} imports trimtab.cli"
        for m, names in modules("").items()
        if "trimtab.cli" in names and m not in ("cli.py", "__main__.py")
    ]
    assert bad == []


def test_torch_distributed_lives_in_one_package():
    """Process groups, meshes, wrapping, tensor parallelism and collectives are the trimtab/distributed
    package's; checkpoint.py writes the sharded format and checkpoint_load.py reads it; doctor.py only
    asks which backends exist. The model and the training loop are single-device."""
    allowed = ("checkpoint.py", "checkpoint_load.py", "doctor.py")
    bad = [
        f"{m} imports {n}"
        for m, names in modules("").items()
        for n in names
        if n.startswith("torch.distributed") and m not in allowed and not m.startswith("distributed/")
    ]
    assert bad == []
    assert offenders("model", ("trimtab.distributed",)) == []


def _type_checking_imports(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside an `if TYPE_CHECKING:` block (names for annotations only)."""
    blocks = [
        n.body
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and "TYPE_CHECKING" in (getattr(n.test, "id", None), getattr(n.test, "attr", None))
    ]
    inside = (n for body in blocks for stmt in body for n in ast.walk(stmt))
    return {id(n) for n in inside if isinstance(n, ast.Import | ast.ImportFrom)}


def _imports_of_the_trainer(tree: ast.AST) -> list[tuple[ast.AST, list[str]]]:
    """(node, names imported) for each import of trimtab.training.trainer, by any spelling."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("trimtab.training.trainer")]
            found += [(node, names)] if names else []
        elif isinstance(node, ast.ImportFrom) and node.module == "trimtab.training.trainer":
            found.append((node, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.module == "trimtab.training":
            found += [(node, ["trainer"])] if any(a.name == "trainer" for a in node.names) else []
    return found


def test_hooks_see_the_view_and_control_never_the_trainer():
    """Outside training/ only api.py (which builds the Trainer) imports trimtab.training.trainer;
    elsewhere an `if TYPE_CHECKING:` import of the StepOutput type is the one exception."""
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("training/") or rel == "api.py":
            continue
        tree = ast.parse(path.read_text())
        guarded = _type_checking_imports(tree)
        for node, names in _imports_of_the_trainer(tree):
            if id(node) not in guarded or set(names) - {"StepOutput"}:
                bad.append(f"{rel}:{node.lineno} imports {', '.join(names)} from trimtab.training.trainer")
    assert bad == []


def test_every_hook_method_takes_the_run_view_first():
    """Every event of the Hook protocol (training/hooks.py), and every override of one in the
    package, takes `run: RunView` first; state_dict / load_state_dict are the hook's own state."""
    own_state = {"state_dict", "load_state_dict"}
    tree = ast.parse((SRC / "training" / "hooks.py").read_text())
    (base,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Hook"]
    events = {f.name for f in base.body if isinstance(f, ast.FunctionDef)} - own_state
    assert {"on_step_end", "on_log", "on_eval", "on_rollback", "update_gate", "on_oom"} <= events
    bad = []
    for path in SRC.rglob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            is_hook = isinstance(cls, ast.ClassDef) and (
                cls.name == "Hook" or any(getattr(b, "id", None) == "Hook" for b in cls.bases)
            )
            for fn in cls.body if is_hook else []:
                if isinstance(fn, ast.FunctionDef) and fn.name in events:
                    first = fn.args.args[1] if len(fn.args.args) > 1 else None
                    if first is None or getattr(first.annotation, "id", None) != "RunView":
                        bad.append(f"{path.relative_to(SRC)}: {cls.name}.{fn.name}")
    assert bad == []


def test_the_report_reads_files_only():
    """report (trimtab report, trimtab runs) reads run directories (trimtab/rundir.py, and runlock.py
    for the run lock's liveness probe) and imports no torch, nothing of training or the
    orchestrator: it runs wherever a run directory is copied to, and no import runs back up."""
    assert offenders("report", ("torch", "trimtab.training", "trimtab.orchestrator")) == []


REPO = SRC.parent.parent
MAP = REPO / "docs" / "architecture.md"


def _repo_text_files() -> list[Path]:
    roots = [REPO / d for d in ("src", "tests", "docs", "bench", "configs")]
    files = [p for r in roots for p in r.rglob("*") if p.suffix in {".py", ".md", ".yaml", ".yml", ".sh", ".toml"}]
    return files + [REPO / n for n in ("README.md", "BENCHMARKS.md", "pyproject.toml") if (REPO / n).is_file()]


def test_the_repo_cites_its_own_map_not_notes_a_clone_lacks():
    """Design notes kept outside the repository (DESIGN.md and the others of the shared/ folder)
    are not in a clone: files cite docs/architecture.md and the other docs/ instead."""
    outside = re.compile(r"\b(?:DESIGN|PRIOR_ART|INTEROP_NOTES)\.md\b|\bshared/[A-Za-z_]+\.md\b")
    here = Path(__file__).resolve()
    bad = [
        f"{p.relative_to(REPO)}:{i}"
        for p in _repo_text_files()
        if p.resolve() != here
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if outside.search(line)
    ]
    assert bad == []


def test_every_orchestrator_rule_is_on_the_map():
    """Each rule name the orchestrator journals (a Finding's rule in orchestrator/, every rule of
    OrchestratorConfig.RULES and actions.RULE_NAMES) has its row in docs/architecture.md's rule
    table: detector, family, remedy, actions, effect, config."""
    from trimtab.config.orchestrator import OrchestratorConfig
    from trimtab.training.actions import RULE_NAMES

    found = set()
    for path in (SRC / "orchestrator").glob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r'\brule="(\w+)"', text))
        found |= set(re.findall(r'\brule, (?:f\.)?family = "(\w+)"', text))
    table = MAP.read_text().split("\n## 3.")[1].split("\n## 4.")[0]
    rows = set(re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE))
    assert {"spike", "rows", "disk"} <= found  # the scan still finds rules
    assert set(OrchestratorConfig.RULES) | set(RULE_NAMES) | found <= rows, sorted(
        (set(OrchestratorConfig.RULES) | set(RULE_NAMES) | found) - rows
    )


def test_yaml_is_read_and_written_through_config_s_libyaml_helpers():
    """parse_yaml and dump_yaml (config/__init__.py) take libyaml's loader and dumper where PyYAML has them
    (8x the pure ones); the report read config.yaml, tune and plan wrote their files, with the pure ones, and
    so did bench/tune.py its space files."""
    pure = re.compile(r"yaml\.(safe_load|safe_dump|load|dump)\(|SafeLoader|SafeDumper")
    own, root = SRC / "config" / "__init__.py", SRC.parent.parent
    files = [*SRC.rglob("*.py"), *(root / "bench").rglob("*.py")]
    assert [str(p.relative_to(root)) for p in files if p != own and pure.search(p.read_text())] == []


def test_a_store_of_the_durations_drops_the_tests_deleted_or_renamed_since(tmp_path):
    """`pytest --store-durations` merged this session's times into tests/durations.json: a test deleted or
    renamed kept its entry for good (28 of 1,558 named no test). The store keeps only entries that still
    name a test (conftest.still_a_test), a parametrized one's or a class's method's too."""
    from conftest import still_a_test

    (tmp_path / "tests").mkdir()
    module = "def test_kept(a):\n    pass\n\n\nclass TestC:\n    def test_m(self): ...\n"
    (tmp_path / "tests" / "test_x.py").write_text(module)
    names = ["test_kept", "test_kept[1-True]", "TestC::test_m", "test_renamed", "test_kep"]
    assert [still_a_test(f"tests/test_x.py::{n}", tmp_path) for n in names] == [True, True, True, False, False]
    assert not still_a_test("tests/test_gone.py::test_kept", tmp_path)
