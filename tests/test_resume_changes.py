"""What a person changes between sessions takes effect as said: a new data.mix holds its weights
from the resume on, a micro-batch edit is journaled from the budget the run trained with, and a
session's summary counts the steps a rollback made it train again."""

import json
import random
import re

import pytest

import trimtab
from helpers import StopAt
from test_mixture import WORDS, rows_of
from test_trainer import debug_cfg
from trimtab.config import load_config
from trimtab.data.batches import BatchLoader
from trimtab.data.packing import ConcatRows
from trimtab.orchestrator import ctl
from trimtab.rundir import read_decisions
from trimtab.training.hooks import Hook
from trimtab.training.state import Rewound, TrainState

pytestmark = pytest.mark.usefixtures("one_thread")


def drawn_tokens(loader, rows, n_a, steps):
    """Tokens each source (a: the first n_a rows) gave over `steps` steps."""
    drawn = [0, 0]
    for _ in range(steps):
        for i in loader.next_batch().rows:
            drawn[int(i >= n_a)] += rows.length(i)
    return drawn


def test_new_weights_on_resume_hold_from_the_change_and_a_resume_without_one_is_exact(tokenizer):
    a, b = rows_of(tokenizer, 30, 0), rows_of(tokenizer, 10, 1)
    rows = ConcatRows([a, b])

    def loader(weights):
        return BatchLoader(rows, 160, 160, seed=3, pad_id=0, weights=weights, names=["a", "b"])

    first = loader([7, 3])
    drawn_tokens(first, rows, len(a), 40)
    state = json.loads(json.dumps(first.state_dict()))

    changed = loader([1, 1])
    changed.load_state_dict(state)
    after = [0, 0]
    for step in range(1, 21):  # every step after the change holds 50/50 to within one 16-token row
        for i, n in zip((0, 1), drawn_tokens(changed, rows, len(a), 1)):
            after[i] += n
        assert abs(after[0] - after[1]) <= 16, (step, after)
    ranks = [BatchLoader(rows, 160, 160, seed=3, pad_id=0, weights=[1, 1], rank=r, world=2) for r in (0, 1)]
    ranks.append(loader([1, 1]))  # every data-parallel rank draws one process's steps under the new weights
    for rank in ranks:
        rank.load_state_dict(json.loads(json.dumps(changed.state_dict())))
    steps = [[r.next_batch().rows for _ in range(3)] for r in ranks]
    assert steps[0] == steps[1] == steps[2]
    shares = changed.metrics()  # the mix in effect since the change, not the whole run's
    assert shares["data/a/share"] == pytest.approx(0.5, abs=0.02)
    assert shares["data/b/share"] == pytest.approx(0.5, abs=0.02)

    again = loader([1, 1])  # a checkpoint taken after the change resumes on the same rows
    again.load_state_dict(json.loads(json.dumps(changed.state_dict())))
    assert again.metrics() == changed.metrics()
    assert [again.next_batch().rows for _ in range(10)] == [changed.next_batch().rows for _ in range(10)]

    old = json.loads(json.dumps(state))  # a checkpoint from before the weights were saved: as it drew
    for part in old["parts"]:
        part.pop("weight", None), part.pop("since", None)
    resumed, same = loader([7, 3]), loader([7, 3])
    resumed.load_state_dict(old)
    same.load_state_dict(state)
    assert [resumed.next_batch().rows for _ in range(10)] == [same.next_batch().rows for _ in range(10)]


def texts(folder, seed, n):
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(60))}) for _ in range(n)]
    (folder / "part.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder / "part.jsonl")


def test_a_mix_changed_on_resume_trains_both_sources_at_the_new_weights(tmp_path):
    a, b = texts(tmp_path / "a", 0, 120), texts(tmp_path / "b", 1, 30)

    def cfg(wa, wb, steps):
        mix = [{"source": a, "weight": wa, "name": "a"}, {"source": b, "weight": wb, "name": "b"}]
        data = {"mix": mix, "seq_len": 32, "max_bytes": 0}
        return debug_cfg(
            tmp_path / "r",
            steps=steps,
            data=data,
            train={"batch_tokens": 256, "micro_batch_tokens": 256, "log_every": 1},
        )

    trimtab.train(cfg(0.7, 0.3, 12), hooks=[StopAt(8)])
    trimtab.train(cfg(0.5, 0.5, 12))
    lines = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    kept = {m["step"]: m for m in lines if "data/a/epochs" in m}
    assert kept[8]["data/a/share"] == pytest.approx(0.7, abs=0.05)
    # a source's tokens from its passes: share x tokens = its tokens at step 8, over its epochs then
    size = {n: kept[8][f"data/{n}/share"] * kept[8]["tokens"] / kept[8][f"data/{n}/epochs"] for n in "ab"}
    after = {n: (kept[12][f"data/{n}/epochs"] - kept[8][f"data/{n}/epochs"]) * size[n] for n in "ab"}
    # 4 steps of 8 rows of 32 tokens: each source gave half, to within a row a step (cumulative
    # 0.5 over all 12 steps would have left `a` a fifth of them)
    assert after["a"] == pytest.approx(after["b"], abs=4 * 32)
    assert kept[12]["data/a/share"] == pytest.approx(0.5, abs=0.05)  # the mix in effect since the change


def test_a_micro_batch_edited_between_sessions_is_journaled_from_the_budget_it_trained_with(tmp_path):
    def cfg(micro, steps):
        return debug_cfg(tmp_path / "r", steps=steps, train={"batch_tokens": 1024, "micro_batch_tokens": micro})

    trimtab.train(cfg(1024, 2))
    trimtab.train(cfg(512, 3))
    [decision] = [d for d in read_decisions(tmp_path / "r") if d["action"] == "set_micro_batch_tokens"]
    assert decision["summary"] == "train.micro_batch_tokens 1024 -> 512 on resume at step 2"
    assert decision["applied"] == ["micro-batch 1024 -> 512 tokens"]


def test_a_checkpointing_mode_edited_between_sessions_is_not_journaled_as_from_itself(tmp_path):
    def cfg(mode, steps):
        return debug_cfg(tmp_path / "r", steps=steps, train={"activation_checkpointing": mode})

    trimtab.train(cfg("off", 2))
    trimtab.train(cfg("full", 3))
    [decision] = [d for d in read_decisions(tmp_path / "r") if d["action"] == "set_activation_checkpointing"]
    assert decision["summary"] == "train.activation_checkpointing off -> full on resume at step 2"
    assert decision["applied"] == ["activation checkpointing full"]  # the model was built in it: not "full -> full"


def test_config_yaml_edited_in_place_is_named_on_resume(tmp_path):
    """A person edits RUN/config.yaml's optim.lr and resumes with it (`trimtab train RUN/config.yaml --out
    RUN`): the resume compared that file with itself, and the change went unsaid in the log and the journal.
    The checkpoint keeps the config it was trained with (state.json "config"): that is compared."""
    run = tmp_path / "r"
    trimtab.train(debug_cfg(run, steps=2))
    path = run / "config.yaml"
    path.write_text(path.read_text().replace("\n  lr: 0.003\n", "\n  lr: 0.001\n", 1))
    trimtab.train(load_config(path, overrides={"train": {"max_steps": 3}}))
    [decision] = [d for d in read_decisions(run) if d["summary"].startswith("optim.lr")]
    assert decision["summary"] == "optim.lr 0.003 -> 0.001 on resume at step 2"
    assert decision["reasoning"].startswith(f"changed in the config by a person (set by the config file {path})")


class RollbackOnce(Hook):
    """A person's queued `trimtab ctl RUN rollback TO`, taken after step `at` (once: steps repeat)."""

    def __init__(self, run_dir, at, to):
        self.run_dir, self.at, self.to = run_dir, at, to

    def on_step_end(self, run, out):
        if out.step == self.at and self.at:
            ctl.send(self.run_dir, ctl.parse_command("rollback", [str(self.to)]))
            self.at = 0


def test_a_sessions_summary_counts_the_steps_a_rollback_made_it_train_again(tmp_path):
    run = tmp_path / "r"
    cfg = debug_cfg(run, steps=12, checkpoint={"every": 4})
    trimtab.train(cfg, hooks=[StopAt(8)])
    summary = trimtab.train(cfg, hooks=[RollbackOnce(run, 9, 4)])
    [rollback] = [d for d in read_decisions(run) if d["action"] == "rollback"]
    start, end = map(int, re.search(r"from step (\d+) to step (\d+)", rollback["applied"][0]).groups())
    assert start > 8 and end == 4
    # steps 9..start trained, thrown away, then steps 5..12 trained: (start - 8) + 8 steps
    assert (summary["step"], summary["steps_this_session"]) == (12, start - 8 + 8)
    assert summary["steps_replayed"] == start - 4  # steps 5..start trained a second time
    assert summary["tokens_per_s"] > 0


def test_replayed_steps_are_those_at_positions_reached_before_a_rollback():
    rewound = Rewound()
    rewound.add(TrainState(step=10, tokens=100, train_seconds=5.0), TrainState(step=4, tokens=40, train_seconds=2.0))
    assert rewound.replayed(7) == 3  # stopped before reaching step 10 again
    rewound.add(TrainState(step=8, tokens=80, train_seconds=4.0), TrainState(step=2, tokens=20, train_seconds=1.0))
    assert (rewound.steps, rewound.tokens, rewound.seconds) == (12, 120, 6.0)
    assert rewound.replayed(12) == 4 + 8  # 5..8 after the first, 3..10 after the second (11, 12: new)
