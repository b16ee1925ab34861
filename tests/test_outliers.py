"""Thinly spread bad data: each row's loss out of the training forward (the fused loss's per-token
side output, RowLosses) and the outlier-rows rule that names rows which stay far above the rest."""

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from trimtab.config import DataConfig
from trimtab.config.orchestrator import OrchestratorConfig
from trimtab.data.batches import BatchLoader
from trimtab.data.packing import ConcatRows, build_splits
from trimtab.data.sources import Document
from trimtab.orchestrator.monitors import StepMetrics
from trimtab.orchestrator.outliers import OutlierRows
from trimtab.orchestrator.policy import Policy
from trimtab.training.loss import cross_entropy_sum
from trimtab.training.runtime import RowLosses
from trimtab.training.view import RunView


def _inputs(b=3, t=40, d=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, d, generator=g, requires_grad=True)
    head = torch.randn(v, d, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (b, t), generator=g)
    targets[1, 30:] = -100  # a padded row
    return hidden, head, targets


def test_the_fused_loss_reports_each_tokens_loss_and_its_gradients_do_not_change():
    hidden, head, targets = _inputs()
    plain = F.cross_entropy((hidden @ head.T).flatten(0, 1), targets.flatten(), reduction="none")
    tokens = torch.full((targets.numel(),), float("nan"))
    loss = cross_entropy_sum(hidden, head, targets, chunk=16, token_losses=tokens)  # chunks cut across rows
    torch.testing.assert_close(tokens, plain.detach())  # 0 where ignored, as the plain loss's
    assert not tokens.requires_grad
    loss.backward()
    grads = hidden.grad.clone(), head.grad.clone()
    hidden.grad = head.grad = None
    cross_entropy_sum(hidden, head, targets, chunk=16).backward()
    torch.testing.assert_close(grads, (hidden.grad, head.grad), rtol=0, atol=0)
    with torch.no_grad():  # scoring: the same side output without gradients
        again = torch.zeros_like(tokens)
        total = cross_entropy_sum(hidden, head, targets, chunk=16, token_losses=again)
    torch.testing.assert_close(again, tokens)
    torch.testing.assert_close(total, loss.detach())


def test_row_losses_are_per_row_sums_placed_by_the_steps_rows():
    rows = RowLosses([7, 3, 9, 3], torch.device("cpu"))  # row 3 twice in one step (a tiny dataset wrapped)
    targets = torch.tensor([[1, 2, -100], [1, 1, 1]])
    rows.add([9, 3], torch.tensor([1.0, 3.0, 0.0, 2.0, 2.0, 2.0]), targets)
    rows.add([3], torch.tensor([4.0, 0.0, 0.0]), torch.tensor([[5, -100, -100]]))
    summed, counted = rows.values.T.tolist()
    assert summed == [0.0, 10.0, 4.0, 0.0] and counted == [0.0, 4.0, 2.0, 0.0]  # row 3: (6 + 4) / 4 targets


class Data:
    """Steps of 32 rows of 64 targets: text at ~N(4, 0.2) nats falling slowly, with chosen rows' losses set."""

    def __init__(self):
        self.rng, self.step, self.next_row = random.Random(0), 0, 0

    def step_metrics(self, special: dict[int, float] | None = None, targets: int = 64) -> StepMetrics:
        special = special or {}
        self.step += 1
        rows = list(range(self.next_row, self.next_row + 32 - len(special))) + list(special)
        self.next_row += 32 - len(special)
        base = 4.0 - 0.002 * self.step
        losses = {r: (special.get(r, self.rng.gauss(base, 0.2)), targets) for r in rows}
        return StepMetrics(step=self.step, loss=base, grad_norm=1.0, rows=rows, row_losses=losses)


def test_a_row_is_named_when_it_stays_far_out_and_a_hard_row_the_model_learns_is_not():
    rule, data = OutlierRows(OrchestratorConfig()), Data()
    for _ in range(5):  # 160 rows: the reference
        assert rule.observe(data.step_metrics()) is None
    # first sightings, one a step: garbage 2.2 nats out (a suspect), a hard file 2.0 out, garbage 4 nats out
    assert rule.observe(data.step_metrics({10_000: 6.2})) is None
    assert rule.observe(data.step_metrics({10_001: 6.0})) is None
    f = rule.observe(data.step_metrics({10_002: 8.1}))
    assert f.rule == "rows" and f.family == "data" and f.evidence["rows"] == [10_002]
    assert set(rule.suspects) == {"10000", "10001"}
    for _ in range(10):
        assert rule.observe(data.step_metrics()) is None
    # the next epoch: the garbage is as far out as before; the hard file was learned (1 nat out)
    f = rule.observe(data.step_metrics({10_000: 6.2, 10_001: 5.0}))
    assert f.evidence["rows"] == [10_000] and f.evidence["first_gaps"]["10000"] > 2
    assert set(rule.suspects) == {"10001"}
    # a row whose loss is not finite while the rest are is named at once
    assert rule.observe(data.step_metrics({10_003: math.nan})).evidence["rows"] == [10_003]
    # a broken forward (most rows not finite) is not the rows' fault
    step = data.step_metrics()
    step.row_losses = dict.fromkeys(step.row_losses, (math.inf, 64))
    assert rule.observe(step) is None
    # nor is one data-parallel rank's share (its weights gone NaN): half of the rows, or a quarter
    for share in (2, 4):
        step = data.step_metrics()
        rows = enumerate(step.row_losses.items())
        step.row_losses = {r: (math.nan, 64) if i % share == 1 else v for i, (r, v) in rows}
        assert rule.observe(step) is None, share
    # a short row's mean is noise: not judged, however high
    assert rule.observe(data.step_metrics({10_005: 20.0}, targets=8)) is None


def test_a_quarter_of_a_step_garbage_early_in_training_is_named_while_the_loss_falls_fast():
    """Early in training the loss falls ~0.08 nats a step (debug, steps 4-20: 5.7 to 5.0) while a
    step's rows lie within ~0.12 of their median: the last 16 steps' rows, as they were, put the bar
    ~2 nats over the step's median (debug, seeds 2-3, bad_rows@20: its garbage 1.3-2.9 nats over
    it, none judged an outlier). Measured from their step's median, a quarter of the step out at once
    is named; one hard row out alone stays a suspect, and no other row of the run is named."""
    rule, rng = OutlierRows(OrchestratorConfig()), random.Random(0)

    def step(n: int, special: dict[int, float]) -> StepMetrics:
        base = 6.6 - 0.08 * n
        losses = {n * 100 + i: (base + rng.gauss(0, 0.12), 64) for i in range(32 - len(special))}
        losses |= {r: (base + gap, 64) for r, gap in special.items()}
        return StepMetrics(step=n, loss=base, grad_norm=1.0, rows=list(losses), row_losses=losses)

    named = [f.evidence["rows"] for n in range(1, 20) if (f := rule.observe(step(n, {}))) is not None]
    garbage = {10_000 + i: 1.7 + 0.04 * i for i in range(8)}  # 1.7-2.0 nats over the step's median
    f = rule.observe(step(20, garbage))
    assert named == [] and f is not None and f.evidence["rows"] == sorted(garbage)
    policy = Policy(OrchestratorConfig())  # left out, the step blamed: the next steps' rows are watched
    policy.data.record(20, f.evidence["rows"])
    policy._watched(f, None).applied()
    assert policy.data.watch_until == 20 + policy.cfg.data.watch_steps
    assert rule.observe(step(21, {20_000: 1.8})) is None and set(rule.suspects) == {"20000"}
    assert all(rule.observe(step(n, {})) is None for n in range(22, 30))


def test_thin_garbage_early_in_a_mixture_is_named_from_each_sources_level_within_its_step():
    """A mixture's rows were measured against their source's last 512 raw losses: while the loss falls
    ~0.08 nats a step, a bar ~2.4 nats over the step's rows (debug, email at 0.5 beside json,
    bad_rows@20, seeds 1-3: 0 of ~30 garbage rows named). Each row is now measured from its source's
    level within the step: a source with enough rows there its median, a thin one (b, 4-6 rows a
    step, 1 nat harder) its last level moved by the step's trend. The garbage of both, 1.7-2.0 nats
    over its source's level, blames the step; no clean row is named before or after."""
    rule, rng = OutlierRows(OrchestratorConfig()), random.Random(0)

    def step(n: int, special: dict[int, tuple[str, float]]) -> StepMetrics:
        base, thin = 6.6 - 0.08 * n, 4 + n % 3  # the mix moves: b's share of the step's 32 rows
        parts = {n * 100 + i: "b" if i < thin else "a" for i in range(32 - len(special))}
        parts |= {r: p for r, (p, _) in special.items()}
        level = {"a": base, "b": base + 1.0}
        losses = {r: (level[p] + rng.gauss(0, 0.12), 64) for r, p in parts.items()}
        losses |= {r: (level[p] + gap, 64) for r, (p, gap) in special.items()}
        return StepMetrics(step=n, loss=base, grad_norm=1.0, rows=list(losses), row_losses=losses, row_parts=parts)

    named = [f.evidence["rows"] for n in range(1, 40) if (f := rule.observe(step(n, {}))) is not None]
    garbage = {10_000 + i: ("a", 1.7 + 0.05 * i) for i in range(5)} | {10_010: ("b", 1.9), 10_011: ("b", 2.0)}
    f = rule.observe(step(40, garbage))
    assert named == [] and f is not None and f.evidence["blamed"] and f.evidence["rows"] == sorted(garbage)
    assert all(rule.observe(step(n, {})) is None for n in range(41, 50)) and not rule.suspects
    restored = OutlierRows(OrchestratorConfig())  # a source's level resumes with its reference
    restored.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert restored.part_levels == rule.part_levels and list(restored.levels) == list(rule.levels)


def test_garbage_met_again_after_its_like_was_trained_on_blames_its_step_under_min_gap():
    """Once the model trained on a step of garbage, its like met later stands 1.2-1.6 nats over the
    step's median (debug, bad_rows@20, seed 3, steps 22-23), under min_gap: 18 of 26 poisoned rows went
    unseen. step_outliers + 1 rows at once between blame_gap (1.0) and min_gap blame the step and are named, in one
    source or a mixture's; a clean step's hard rows there, one or two at a time, are not even suspects,
    nor is one beside fresh garbage over min_gap."""
    rule, rng = OutlierRows(blaming()), random.Random(1)

    def step(n: int, special: dict[int, float], parts: bool = False) -> StepMetrics:
        base = 6.0 - 0.05 * n
        losses = {n * 100 + i: (base + rng.gauss(0, 0.12), 64) for i in range(32 - len(special))}
        losses |= {r: (base + gap, 64) for r, gap in special.items()}
        sources = {r: "a" if r % 2 else "b" for r in losses} if parts else None
        return StepMetrics(step=n, loss=base, grad_norm=1.0, rows=list(losses), row_losses=losses, row_parts=sources)

    hard = {1: {20_000: 1.3}, 2: {20_001: 1.2, 20_002: 1.4}}  # clean steps' hard rows, over blame_gap
    named = [f for n in range(1, 20) if (f := rule.observe(step(n, hard.get(n % 8, {})))) is not None]
    assert named == [] and not rule.suspects
    garbage = {10_000 + i: 1.2 + 0.05 * i for i in range(6)}
    f = rule.observe(step(20, garbage))
    assert f is not None and f.evidence["blamed"] and f.evidence["rows"] == sorted(garbage)
    # fresh garbage over min_gap blames its step alone: a hard row there, between blame_gap and it, is no family
    fresh = {11_000: 1.7, 11_001: 1.9, 11_002: 2.0}
    f = rule.observe(step(21, fresh | {20_003: 1.3}))
    assert f is not None and f.evidence["blamed"] and f.evidence["rows"] == sorted(fresh)
    mixed = OutlierRows(blaming())  # a mixture: each source's rows from that source's level
    assert all(mixed.observe(step(n, hard.get(n % 8, {}), parts=True)) is None for n in range(1, 20))
    f = mixed.observe(step(20, {10_000 + 2 * i + 1: 1.3 + 0.05 * i for i in range(4)}, parts=True))
    assert f is not None and f.evidence["blamed"] and f.evidence["rows"] == [10_001, 10_003, 10_005, 10_007]


def blaming() -> OrchestratorConfig:
    """The second family on (orchestrator.rows.blame_gap 1.0; off by default)."""
    cfg = OrchestratorConfig()
    cfg.rows.blame_gap = 1.0
    return cfg


def test_its_state_is_json_and_resumes_the_same():
    rule, data = OutlierRows(OrchestratorConfig()), Data()
    for _ in range(5):
        rule.observe(data.step_metrics())
    rule.observe(data.step_metrics({10_000: 6.3}))
    state = json.loads(json.dumps(rule.state_dict()))
    again = OutlierRows(confirming())
    again.load_state_dict(state)
    assert again.references == rule.references and again.suspects == rule.suspects
    assert again.observe(data.step_metrics({10_000: 6.3})).evidence["rows"] == [10_000]


class View:
    """RunView.row_losses as the rule calls it: each asked row scored on the "current weights"."""

    def __init__(self, scores: dict[int, float]):
        self.scores, self.asked = scores, []

    def row_losses(self, rows: list[int]) -> dict[int, float]:
        self.asked.append(list(rows))
        return {r: self.scores[r] for r in rows}


def confirming() -> OrchestratorConfig:
    """orchestrator.rows.confirm_after on (off by default: config/row_rules.py says why)."""
    cfg = OrchestratorConfig()
    cfg.rows.confirm_after = 16
    return cfg


def test_a_suspect_scored_again_a_few_steps_later_is_named_when_it_stays_out():
    rule, data = OutlierRows(confirming()), Data()
    for _ in range(5):
        rule.observe(data.step_metrics())
    # first sightings 2 nats out: garbage, and a hard clean row the model learns from its one step
    assert rule.observe(data.step_metrics({10_000: 6.1, 10_001: 6.0})) is None
    first, after = data.step, rule.cfg.confirm_after
    assert rule.due == {"10000": first + after, "10001": first + after}
    view = View({10_000: 6.0, 10_001: 4.3})  # scored again: the garbage still 2 out, the hard row near the median
    state = None
    for _ in range(after):
        m = data.step_metrics()
        rule.observe(m)
        if m.step == first + 4:  # exact resume: the suspects and their due step are in the state
            state = json.loads(json.dumps(rule.state_dict()))
        f = rule.confirm(view, m)
        assert (f is None) == (m.step < first + after)
    assert view.asked == [[10_000, 10_001]]  # one scoring, both due together
    assert f.rule == "rows" and f.evidence["rows"] == [10_000] and f.evidence["rescored"] == 2
    assert f.evidence["first_gaps"]["10000"] > 1.5 and "scored again" in f.summary
    assert set(rule.suspects) == {"10001"} and rule.due == {}  # the hard row waits for its next epoch
    again = OutlierRows(confirming())
    again.load_state_dict(state)
    assert again.due == {"10000": first + after, "10001": first + after}
    for step in range(first + 5, first + after):
        assert again.confirm(view, StepMetrics(step=step, loss=4.0, grad_norm=1.0)) is None
    f = again.confirm(view, StepMetrics(step=first + after, loss=4.0, grad_norm=1.0))
    assert f.evidence["rows"] == [10_000]


def test_suspects_are_not_scored_again_while_the_model_is_unstable_nor_when_switched_off():
    rule, data = OutlierRows(confirming()), Data()
    for _ in range(5):
        rule.observe(data.step_metrics())
    rule.observe(data.step_metrics({10_000: 6.1}))
    view = View({10_000: 6.1})
    due = rule.due["10000"]
    unstable = StepMetrics(step=due, loss=4.0, grad_norm=1.0, unsettled=True)
    assert rule.confirm(view, unstable) is None and view.asked == [] and rule.due  # still due
    assert rule.confirm(view, StepMetrics(step=due + 1, loss=4.0, grad_norm=1.0)).evidence["rows"] == [10_000]
    rule, data = OutlierRows(OrchestratorConfig()), Data()  # the default: off
    for _ in range(5):
        rule.observe(data.step_metrics())
    rule.observe(data.step_metrics({10_000: 6.1}))
    assert rule.suspects and not rule.due


def test_nothing_is_judged_before_the_reference_fills():
    rule, data = OutlierRows(OrchestratorConfig()), Data()
    assert rule.observe(data.step_metrics({10_000: 20.0})) is None  # 32 rows seen: under min_reference


def rows_run(tmp_path, steps: int, max_bytes: int, fault: str, **orchestrator) -> tuple[set[int], list[dict]]:
    """A debug run through the loop with `fault` (bad_rows): the rows it poisoned, and the rule
    rows' decisions."""
    import trimtab
    from trimtab.config import load_config
    from trimtab.rundir import read_decisions

    cfg = load_config(
        preset="debug",
        overrides={
            "out": str(tmp_path / "r"),
            "train": {"max_steps": steps, "eval_every": 0, "precision": "fp32"},
            "data": {"max_bytes": max_bytes},
            "checkpoint": {"every": 0},
            "log": {"progress": False, "tensorboard": False, "report": False},
            # the rows rule alone: the row gate would leave the garbage out at its first sighting, its own decision
            "orchestrator": {"throughput": {"enabled": False}, "row_gate": {"enabled": False}, **orchestrator},
            "faults": [fault],
        },
    )
    assert trimtab.train(cfg)["status"] == "completed"
    poisoned = set(json.loads((tmp_path / "r" / "faults.json").read_text())["poisoned"])
    return poisoned, [d for d in read_decisions(tmp_path / "r") if d["rule"] == "rows"]


def test_thinly_spread_garbage_rows_are_named_and_left_out_through_the_loop(tmp_path):
    """A quarter of two steps' rows turn to garbage for good (bad_rows): the rows are named, at once
    where they are far out and on their next sighting otherwise, and no clean row is (the corpus is
    repeated ~5 times, so every row is seen again). The loss of the two steps themselves rises over
    the spike rule's bar fitted from the warm-up's end (their updates withheld), and a later step's
    spike leaves some of them out too (rules spike, data): 18 of 18 left out, val 4.334 (4.401 with
    the spike rule's old bar, every row by the rows rule)."""
    from trimtab.rundir import read_decisions

    # the rows seen again: no step blamed at the first sighting (step_outliers over a step's 32 rows)
    poisoned, named = rows_run(tmp_path, 48, 60_000, "bad_rows@26:2", rows={"step_outliers": 33})
    left_out = {r for d in read_decisions(tmp_path / "r") for r in d["params"].get("rows", [])}
    assert len(poisoned) >= 8 and left_out <= poisoned and len(left_out) >= 0.75 * len(poisoned)
    assert len({r for d in named for r in d["params"]["rows"]}) >= 0.5 * len(poisoned)  # the rows rule's
    assert {d["action"] for d in named} == {"skip_data"} and all(d["mode"] == "auto" for d in named)
    assert any(d["evidence"]["first_gaps"] for d in named)  # some on their second sighting
    assert all("left out of training" in d["applied"][0] for d in named)


def test_thin_garbage_seen_once_is_named_by_scoring_the_suspects_again_through_the_loop(tmp_path):
    """Garbage rows the run sees only once (under one epoch after them): the old rule kept them as
    suspects for a next sighting that never came; scored again confirm_after steps later, they are
    named."""
    # the suspects scored again: no step blamed at the first sighting (step_outliers over a step's 32 rows)
    poisoned, named = rows_run(tmp_path, 38, 400_000, "bad_rows@20:1", rows={"confirm_after": 16, "step_outliers": 33})
    left_out = {r for d in named for r in d["params"]["rows"]}
    rescored = {r for d in named if d["evidence"]["rescored"] for r in d["params"]["rows"]}
    # none is named on its first sighting or a second (there is none): all by scoring them again
    assert len(poisoned) >= 4 and len(rescored & poisoned) >= 0.5 * len(poisoned) and rescored == left_out
    # one clean row of the debug corpus stays as far out as the garbage (2.2 nats, 16 steps on): named
    assert len(left_out - poisoned) <= 1
    assert all(d["mode"] == "auto" and "left out of training" in d["applied"][0] for d in named)


def tiny_rows_run(tmp_path, faults: list[str], **rows) -> tuple[set[int], list[dict], int]:
    """A 9-step run of a one-layer debug model at twice the preset's LR (its loss 6.2 to ~5.0 by step 8):
    the rows poisoned, the rule rows' decisions, and the last step the data watch scores (-1: none)."""
    import trimtab
    from trimtab.checkpoint import list_checkpoints
    from trimtab.config import load_config
    from trimtab.rundir import read_decisions

    out = tmp_path / "r"
    cfg = load_config(
        preset="debug",
        overrides={
            "out": str(out),
            "model": {"n_layers": 1},
            "optim": {"lr": 6e-3, "warmup_steps": 4},
            "train": {"max_steps": 9, "eval_every": 0, "precision": "fp32"},
            "data": {"max_bytes": 20_000},
            "checkpoint": {"every": 0},
            "log": {"progress": False, "tensorboard": False, "report": False},
            "orchestrator": {"throughput": {"enabled": False}, "row_gate": {"enabled": False}, "rows": rows},
            "faults": faults,
        },
    )
    assert trimtab.train(cfg)["status"] == "completed"
    poisoned = set(json.loads((out / "faults.json").read_text())["poisoned"]) if faults else set()
    state = json.loads((list_checkpoints(out)[-1] / "state.json").read_text())
    watch = state["hooks"]["Orchestrator"]["policy"]["data"]["watch_until"]  # attribution.py's data watch
    return poisoned, [d for d in read_decisions(out) if d["rule"] == "rows"], watch


def test_a_step_with_several_outliers_is_blamed_and_watched_through_the_loop(tmp_path):
    """A quarter of step 8's rows turn to garbage while the loss still falls fast: each stands ~1.6-1.8
    nats over the step's median, an outlier but for the first time, which alone makes it only a
    suspect (and under certain_gap); several at once blame the step (orchestrator.rows.step_outliers):
    they are named at once and the next steps watched (orchestrator.data.watch_steps). Without the
    blamed path none is named and nothing is watched; a clean run names no row."""
    poisoned, named, watch = tiny_rows_run(tmp_path / "bad", ["bad_rows@8:1"])
    left_out = {r for d in named for r in d["params"]["rows"]}
    assert len(poisoned) >= 6 and left_out <= poisoned and len(left_out) >= 0.75 * len(poisoned)
    assert [d["step"] for d in named] == [8] and named[0]["evidence"]["blamed"]
    assert named[0]["evidence"]["first_gaps"] == {}  # first sightings: no suspect seen again
    gaps = [x - named[0]["evidence"]["median"] for x in named[0]["evidence"]["losses"].values()]
    assert max(gaps) < OrchestratorConfig().rows.certain_gap  # not named for being certain: for the blame
    assert "0 an outlier when last seen too, 0 by 4 nats or more" in named[0]["summary"]
    assert f"{len(named[0]['params']['rows'])} of its rows outliers at once blame the step" in named[0]["summary"]
    assert watch == 8 + OrchestratorConfig().data.watch_steps
    _, named, watch = tiny_rows_run(tmp_path / "clean", [])
    assert named == [] and watch == -1


def test_a_rare_sources_fresh_rows_are_judged_among_their_own_not_against_a_memorised_one():
    """Soak (debug, data.mix of three stdlib files at 0.1 and 6 KB of abc.py at 0.9, 3 epochs):
    abc.py, repeated ~45 times, was memorised (its rows ~1.1 nats) while the stdlib rows, each
    fresh, scored ~5.4 (held-out 4.8); judged against the mixture's median, 8 of them were left
    out as 4 nats above it. Each row is judged among its own source's rows (StepMetrics.row_parts);
    garbage in either source is still named."""
    rule, rng = OutlierRows(OrchestratorConfig()), random.Random(0)

    def step(n: int, special: dict[int, tuple[str, float]] | None = None) -> StepMetrics:
        rows = {r: ("a", rng.gauss(5.4, 0.3)) for r in range(3 * n, 3 * n + 3)}  # fresh: never seen again
        rows |= {10_000 + 29 * n + i: ("d", rng.gauss(1.1, 0.1)) for i in range(29)}  # memorised
        rows |= special or {}
        losses = {r: (loss, 64) for r, (_, loss) in rows.items()}
        parts = {r: part for r, (part, _) in rows.items()}
        return StepMetrics(step=n, loss=1.5, grad_norm=1.0, rows=list(rows), row_losses=losses, row_parts=parts)

    assert all(rule.observe(step(n)) is None for n in range(1, 61))  # a's 180 rows: none named
    f = rule.observe(step(61, {900: ("a", 10.5), 20_000: ("d", 7.0)}))  # garbage in each: 5 nats above its own
    assert f.evidence["rows"] == [900, 20_000] and f.evidence["sources"] == {"900": "a", "20000": "d"}
    assert f.evidence["references"]["a"]["median"] == pytest.approx(5.4, abs=0.15)
    assert f.evidence["references"]["d"]["median"] == pytest.approx(1.1, abs=0.05)


def test_the_run_view_names_each_training_rows_mixture_source(tokenizer):
    """RunView.row_parts (StepMetrics.row_parts: the rows rule's per-source references) reads the
    loader's numbering of a mixture's rows: each row of a step maps to the source it came from."""
    docs = [[Document([(f"{word} " * 40, True)]) for _ in range(n)] for word, n in (("red", 12), ("blue", 4))]
    a, b = (build_splits(DataConfig(seq_len=16, eval_fraction=0.0), tokenizer, d, None, seed=0)[0] for d in docs)
    rows = ConcatRows([a, b])
    loader = BatchLoader(rows, 160, 160, seed=3, pad_id=0, weights=[7, 3], names=["a", "b"])
    control = SimpleNamespace(request=None)  # the view's requests: none made here
    view = RunView(SimpleNamespace(loader=loader), control)
    batch = loader.next_batch()
    parts = view.row_parts(batch.rows)
    assert parts == {r: "ab"[rows.locate(r)[0]] for r in batch.rows} and set(parts.values()) == {"a", "b"}
    one = BatchLoader(a, 160, 160, seed=3, pad_id=0)
    assert RunView(SimpleNamespace(loader=one), control).row_parts([0]) is None  # one source: no parts


def test_a_rare_sources_first_rows_are_judged_once_its_reference_fills():
    """A source at 3 rows a step fills its reference (min_reference) at step 43: the rows it showed
    before were not judged and went into it. They are held and scored again once it fills, and
    judged as a first sighting: garbage 5 nats out named then, garbage 2 out a suspect; clean not."""
    rule, rng = OutlierRows(confirming()), random.Random(0)

    def step(n: int) -> StepMetrics:
        rows = {r: ("a", rng.gauss(5.4, 0.3)) for r in range(3 * n, 3 * n + 3)}  # fresh rows of the rare source
        rows |= {10_000 + 29 * n + i: ("d", rng.gauss(1.1, 0.1)) for i in range(29)}  # a memorised one's
        rows |= {r: ("a", loss) for r, loss in ((3, 10.5), (4, 7.4)) if r in rows}  # garbage among a's first
        losses = {r: (loss, 64) for r, (_, loss) in rows.items()}
        parts = {r: part for r, (part, _) in rows.items()}
        return StepMetrics(step=n, loss=1.5, grad_norm=1.0, rows=list(rows), row_losses=losses, row_parts=parts)

    view = View({r: 5.3 for r in range(200)} | {3: 10.4, 4: 7.3} | {r: 1.1 for r in range(10_000, 12_000)})
    named = []
    for n in range(1, 50):
        assert rule.observe(step(n)) is None
        if (f := rule.confirm(view, StepMetrics(step=n, loss=1.5, grad_norm=1.0))) is not None:
            named.append((n, f.evidence["rows"]))
    assert named == [(43, [3])]  # a's reference filled at step 43
    # its 128 earlier rows scored in two forwards of confirm_rows (64), as d's were at steps 5 and 6
    assert [len(rows) for rows in view.asked] == [64] * 4 and {3, 4} <= set(view.asked[2]) and not rule.held
    assert set(rule.suspects) == {"4"} and rule.due == {"4": 43 + rule.cfg.confirm_after}
