"""A command that needs an optional package names the pyproject.toml extra that installs it
(trimtab/extras.py), when the package is missing: issue #30's new user met ImportErrors and
README steps that needed extras it never named."""

import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from trimtab import extras
from trimtab.data.formats import records
from trimtab.errors import ConfigError, DataError
from trimtab.evaluation.harness import run_tasks
from trimtab.tune import tune

ROOT = Path(__file__).parent.parent


def test_every_extra_named_exists_and_is_in_dev():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = " ".join(optional["dev"])
    for module, (package, extra) in extras.EXTRAS.items():
        assert extra in optional, f"{module}: no [{extra}] extra in pyproject.toml"
        if module != "pyarrow":  # pyarrow comes with datasets
            assert any(module.replace("_", "-") in req or package in req for req in optional[extra]), module
            assert module.replace("_", "-") in dev or package in dev, module
    assert any(req.startswith("transformers") for req in optional["hf"])


def test_a_missing_package_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it raises
    hint = r"^loading it needs transformers: pip install -c constraints.txt -e '\.\[hf\]'$"
    with pytest.raises(ConfigError, match=hint):
        extras.require("transformers", "loading it")
    assert not extras.installed("transformers")
    assert extras.installed("yaml")


@pytest.mark.parametrize(("module", "name"), [("zstandard", "a.jsonl.zst"), ("datasets", "a.parquet")])
def test_reading_a_file_that_needs_the_data_extra_says_so(monkeypatch, tmp_path, module, name):
    (tmp_path / name).write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, module, None)
    hint = rf"{name}: reading .* needs {module}: pip install -c constraints.txt -e '\.\[data\]'"
    with pytest.raises(DataError, match=hint):
        list(records(tmp_path / name))


def test_eval_tasks_without_lm_eval_names_the_eval_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(ConfigError, match=r"--tasks needs lm-evaluation-harness: .*-e '\.\[eval\]'"):
        run_tasks(None, None, ["trimtab_tiny"], None, None, None, 1)


def test_tune_with_mlflow_on_and_not_installed_fails_before_any_trial(monkeypatch, tmp_path):
    """configs/tune-debug.yaml turns MLflow on: without [track] every trial failed on its own."""
    doc = yaml.safe_load((ROOT / "configs" / "tune-debug.yaml").read_text())
    space = tmp_path / "tune.yaml"
    space.write_text(yaml.safe_dump(doc))
    monkeypatch.setitem(sys.modules, "mlflow", None)
    hint = r"tune.yaml: base.log.mlflow.enabled is true but mlflow is not installed; .*\[track\]"
    with pytest.raises(ConfigError, match=hint):
        tune(space, out=tmp_path / "study")
    assert not (tmp_path / "study").exists()
