"""log.mlflow.uri=file:/path, as docs/tracking.md offers, with an MLflow that no longer opens its
file store by default: refused before training, naming the key and the fix (tracking.py)."""

import pytest

from trimtab.config import load_config
from trimtab.errors import ConfigError
from trimtab.training.services import tracking

mlflow_env = pytest.importorskip("mlflow.environment_variables")


@pytest.mark.skipif(
    not hasattr(mlflow_env, "MLFLOW_ALLOW_FILE_STORE"), reason="this MLflow opens its file store without opting in"
)
def test_an_mlflow_file_store_is_refused_before_training_unless_opted_in(tmp_path, monkeypatch):
    """mlflow 3.18: the tracker's start failed ("The filesystem tracking backend ... is in maintenance
    mode"), warned, and the run trained untracked; and it tried 5 times, 5 s, first."""
    cfg = load_config(preset="debug", sets=[f"log.mlflow.uri=file:{tmp_path / 'store'}", "log.mlflow.enabled=true"])
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match=r"log\.mlflow\.uri: file:.*MLFLOW_ALLOW_FILE_STORE=true"):
        tracking.tracking_hooks(cfg.log, tmp_path / "run")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    hooks = tracking.tracking_hooks(cfg.log, tmp_path / "run")
    assert [type(h).__name__ for h in hooks] == ["MlflowTracker"]
