"""An out-of-memory error is raised inside a step, before its metrics are read: the decisions it
answers (a probe of a larger micro-batch, a shrink that did not fit) must count it in their
outcome. debug, oom@20 then a resume: the probe to 1,024 tokens at step 50 ran out of memory at
step 51 and was judged "recovered"."""

from types import SimpleNamespace

from helpers import FakeTrainer
from test_orchestrator_incidents import pending
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.orchestrator.core import Orchestrator
from trimtab.orchestrator.monitors import Finding, StepMetrics
from trimtab.orchestrator.outcomes import same_trouble
from trimtab.rundir import read_decisions


def _oom_decision(journal, step, tokens, kind):
    d = pending(journal, step, "oom", "set_micro_batch_tokens", family="memory")
    d.params, d.evidence = {"tokens": tokens}, {"kind": kind}
    return d


def test_a_probe_that_ran_out_of_memory_is_not_recovered(tmp_path):
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    shrink = _oom_decision(orchestrator.journal, 20, 512, "oom")  # 1,024 -> 512: held since
    probe = _oom_decision(orchestrator.journal, 50, 1024, "probe")  # 512 -> 1,024
    run = FakeTrainer(tmp_path)
    run.step, run.micro_batch_tokens, run.activation_checkpointing = 50, 1024, "off"
    run.min_micro_batch_tokens = 64
    orchestrator.on_oom(run, RuntimeError("CUDA out of memory (injected by oom@20)"), SimpleNamespace(rows=[1, 2]))
    for step in range(51, 80):
        orchestrator.outcomes.follow(StepMetrics(step=step, loss=4.2, grad_norm=1.0), [])
    results = {d["id"]: d["outcome"] for d in read_decisions(tmp_path)}
    assert results[probe.id]["result"] == "not recovered"
    assert results[probe.id]["found_after"] == ["oom@51"]
    assert results[shrink.id]["result"] == "recovered"  # its 512 tokens still fit: 1,024 failed


def test_rl_generation_and_micro_batch_errors_answer_their_own_decisions(tmp_path):
    orchestrator = Orchestrator(OrchestratorConfig(), tmp_path)
    micro = _oom_decision(orchestrator.journal, 20, 512, "oom")
    rows = pending(orchestrator.journal, 30, "oom", "set_generation_rows", family="memory")
    rows.params, rows.evidence = {"at_once": 8}, {"kind": "rollout_oom"}

    def error(kind, **evidence):
        return Finding(
            rule="oom", family="memory", step=40, evidence={"kind": kind, **evidence}, summary="", strength=1
        )

    assert not same_trouble(micro, error("rollout_oom", generation_rows=8))  # generation, not the micro-batch
    assert same_trouble(rows, error("rollout_oom", generation_rows=8))
    assert not same_trouble(rows, error("rollout_oom", generation_rows=16))  # above the size it set
    assert not same_trouble(rows, error("oom", micro_batch_tokens=512))
    assert same_trouble(micro, error("oom", micro_batch_tokens=512))
