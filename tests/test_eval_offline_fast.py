"""`trimtab eval --tasks` with a task whose dataset is on the Hugging Face Hub, where the Hub cannot be reached:
refused at once (evaluation/harness.py _hub_unreachable: one HEAD, then Hugging Face's offline mode), where
datasets tried the Hub 6 times over ~23 s first (arc_easy, no network: 30.4 s -> 3.8 s). A task with local
data still runs. The Hub is a closed port on this host (HF_ENDPOINT) and the cache an empty folder, so the
tests read the same with and without a network; a fresh interpreter each, as huggingface_hub reads
HF_ENDPOINT once, at its import."""

import json
import os
import subprocess
import sys

import pytest

from helpers import free_port

pytest.importorskip("lm_eval")

ROWS = [{"q": f"{i} + 1 =", "choices": [f" {i + 1}", f" {i}"], "answer": 0} for i in range(4)]
TASK = """task: {name}
dataset_path: {path}
{kwargs}test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """--include-path's folder: offline_hub (a Hub dataset, never fetched) and offline_local (a JSONL file)."""
    folder = tmp_path_factory.mktemp("tasks")
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "offline_hub.yaml").write_text(TASK.format(name="offline_hub", path="trimtab-tests/absent", kwargs=""))
    local = f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
    (folder / "offline_local.yaml").write_text(TASK.format(name="offline_local", path="json", kwargs=local))
    return folder


def eval_without_hub(tmp_path, run, tasks, task: str) -> subprocess.CompletedProcess:
    """`trimtab eval RUN --tasks TASK` with the Hub at a closed port and an empty cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    args = ["eval", str(run), "--tasks", task, "--include-path", str(tasks), "--out", str(tmp_path / "eval")]
    return subprocess.run([sys.executable, "-m", "trimtab", *args], env=env, capture_output=True, text=True)


def test_a_hub_task_is_refused_at_once_where_the_hub_is_unreachable(tmp_path, debug_run, tasks):
    done = eval_without_hub(tmp_path, debug_run, tasks, "offline_hub")
    assert done.returncode != 0, done.stderr[-2000:]
    assert "--tasks offline_hub: a task's dataset could not be fetched" in done.stderr, done.stderr[-2000:]
    assert "is unreachable" in done.stderr and "use a task with local data" in done.stderr
    # datasets' backoff (1 + 2 + 4 + 8 + 8 s) said so at each try; no bound on the seconds: a busy machine's
    # start-up (lm-eval's import, the model) took 4 to 13 s of it
    assert "Retrying in" not in done.stderr


def test_a_task_with_local_data_runs_where_the_hub_is_unreachable(tmp_path, debug_run, tasks):
    done = eval_without_hub(tmp_path, debug_run, tasks, "offline_local")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "offline_local (4 examples): acc " in done.stdout + done.stderr
