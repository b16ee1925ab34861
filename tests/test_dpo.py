"""DPO (rl/dpo.py, rl/pairs.py, rl/preference.py, `trimtab dpo`): the loss is the papers' formula,
a step's gradient is the same however its pairs are split into micro-batches, a run from a
trained model's weights learns a preference that holds on held-out pairs, an interrupted run
resumes to the uninterrupted one's weights, and a bad pairs file is named by file and line."""

import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file

from helpers import trimtab_cli
from trimtab.config import ModelConfig, load_config
from trimtab.config.dpo import DPOConfig
from trimtab.data.batches import IGNORE_INDEX
from trimtab.data.chat import ChatFormat
from trimtab.errors import ConfigError, DataError
from trimtab.model import build_model
from trimtab.report import figures
from trimtab.report.run import read_run
from trimtab.rl.dpo import dpo_from_hidden, dpo_terms, pair_losses, reference_free_losses
from trimtab.rl.dpo_phase import build_dpo_phase
from trimtab.rl.loss import response_positions
from trimtab.rl.pairs import Pair, Tokens, arithmetic_pairs, read_pairs, tokenize
from trimtab.rl.preference import PairLoader
from trimtab.rl.reference import reference_logprobs
from trimtab.rundir import read_decisions

# one worker for the module (--dist loadgroup): its module-scoped base run is made once, not on each worker
pytestmark = pytest.mark.xdist_group("test_dpo")

log_sigmoid = lambda x: -math.log1p(math.exp(-x))  # noqa: E731


def test_the_loss_is_the_papers_formula_for_each_variant():
    """2 pairs: rows (chosen 1, chosen 2, rejected 1, rejected 2), log-probabilities summed
    over each response; h = (log pi_w - log ref_w) - (log pi_l - log ref_l)."""
    policy = torch.tensor([-3.0, -5.0, -4.0, -4.5])
    ref = torch.tensor([-3.5, -4.0, -3.0, -4.0])
    h = [(-3.0 + 3.5) - (-4.0 + 3.0), (-5.0 + 4.0) - (-4.5 + 4.0)]  # 1.5, -0.5
    beta = 0.5
    losses, chosen, rejected = pair_losses(policy, ref, beta)
    assert losses.tolist() == pytest.approx([-log_sigmoid(beta * x) for x in h])  # Rafailov et al. eq. 7
    assert chosen.tolist() == pytest.approx([0.25, -0.5]) and rejected.tolist() == pytest.approx([-0.5, -0.25])
    eps = 0.2  # cDPO
    smoothed, _, _ = pair_losses(policy, ref, beta, "sigmoid", eps)
    want = [-(1 - eps) * log_sigmoid(beta * x) - eps * log_sigmoid(-beta * x) for x in h]
    assert smoothed.tolist() == pytest.approx(want)
    ipo, _, _ = pair_losses(policy, ref, beta, "ipo")  # Azar et al. eq. 17
    assert ipo.tolist() == pytest.approx([(x - 1 / (2 * beta)) ** 2 for x in h])
    hinge, _, _ = pair_losses(policy, ref, beta, "hinge")
    assert hinge.tolist() == pytest.approx([max(0.0, 1 - beta * x) for x in h])
    # RPO: + alpha x the chosen responses' NLL per token (lengths 2 and 4); the figures are DPO's
    terms = dpo_terms(policy, ref, torch.tensor([2, 4, 3, 3]), DPOConfig(beta=beta, sft_coef=0.5))
    assert terms.objective.item() == pytest.approx(sum(-log_sigmoid(beta * x) for x in h) + 0.5 * (3 / 2 + 5 / 4))
    assert (terms.correct.item(), terms.margin.item(), terms.pairs) == (1.0, pytest.approx(0.75 - 0.25), 2)
    # the gradient raises the chosen response's log-probability and lowers the rejected one's
    x = policy.clone().requires_grad_()
    pair_losses(x, ref, beta)[0].sum().backward()
    assert (x.grad[:2] < 0).all() and (x.grad[2:] > 0).all()


def test_the_reference_free_losses_are_their_papers_formulas():
    """SimPO (Meng et al. eq. 6) and ORPO (Hong et al. eq. 6-7) on 2 pairs of summed
    log-probabilities and lengths in tokens: the reward is beta x the mean log-probability."""
    policy, lengths, beta = torch.tensor([-3.0, -5.0, -4.0, -4.5]), torch.tensor([2, 4, 4, 3]), 2.0
    mean = [-1.5, -1.25, -1.0, -1.5]
    losses, chosen, rejected = reference_free_losses(policy, lengths, beta, "simpo", 0.5)
    assert losses.tolist() == pytest.approx([-log_sigmoid(beta * (w - r) - 0.5) for w, r in zip(mean[:2], mean[2:])])
    assert chosen.tolist() == pytest.approx([-3.0, -2.5]) and rejected.tolist() == pytest.approx([-2.0, -3.0])
    odds = [m - math.log(1 - math.exp(m)) for m in mean]
    orpo, _, _ = reference_free_losses(policy, lengths, 0.1, "orpo")
    want = [-mean[i] - 0.1 * log_sigmoid(odds[i] - odds[i + 2]) for i in range(2)]
    assert orpo.tolist() == pytest.approx(want)
    # through dpo_terms with no reference; a certain response (log-probability 0) stays finite
    terms = dpo_terms(policy, None, lengths, DPOConfig(beta=beta, loss="simpo"))
    assert (terms.correct.item(), terms.margin.item()) == (1.0, pytest.approx(-1.0 + 0.5))
    x = torch.tensor([0.0, -5.0, -4.0, -4.5], requires_grad=True)
    reference_free_losses(x, lengths, 0.1, "orpo")[0].sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] < 0) and (x.grad[3] > 0)


def tokens(n: int, seed: int = 0) -> list[Tokens]:
    """n pairs of ragged prompts and responses over a vocabulary of 50."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(1, 50) for _ in range(k)]  # noqa: E731
    return [Tokens(ids(rng.randint(1, 5)), ids(rng.randint(1, 4)), ids(rng.randint(1, 4))) for _ in range(n)]


def test_a_step_split_into_micro_batches_has_the_gradient_of_the_whole():
    """8 pairs of ragged lengths through a tiny model: in one micro-batch, then in micro-batches
    of at most 24 tokens (whole pairs each: 4 or more of them), the step's loss (each
    micro-batch's sum over the step's pair count) has the same gradient; a per-micro-batch mean
    would not."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16))
    reference = build_model(model.cfg).requires_grad_(False)  # another model: the reference differs
    cfg = DPOConfig(pairs_per_step=8, beta=0.5, sft_coef=0.3)

    def grad(budget: int, per_micro_mean: bool = False) -> tuple[torch.Tensor, int]:
        loader = PairLoader(tokens(20), [], cfg, budget, seed=0, pad_id=0)
        batch = loader.next_batch()
        model.zero_grad()
        for micro in batch.micro:
            at = response_positions(micro.targets, torch.device("cpu"))
            ref = reference_logprobs(reference, micro.inputs, micro.targets, 1.0, at)
            terms = dpo_from_hidden(model.hidden(micro.inputs), model.lm_head.weight, micro.targets, ref, cfg, at)
            (terms.objective / (terms.pairs if per_micro_mean else batch.n_targets)).backward()
            assert micro.inputs.shape[0] == 2 * micro.n_targets  # whole pairs
        return torch.cat([p.grad.flatten() for p in model.parameters()]), len(batch.micro)

    whole, one = grad(10_000)
    split, several = grad(24)
    assert one == 1 and several >= 4
    assert torch.allclose(split, whole, atol=1e-6)
    naive, _ = grad(24, per_micro_mean=True)
    assert not torch.allclose(naive, whole, atol=1e-4)


def test_a_micro_batch_holds_each_pair_chosen_then_rejected_with_targets_on_the_responses():
    pairs = [Tokens([1, 2, 3], [4, 5], [6]), Tokens([7], [8], [9, 10, 11])]
    loader = PairLoader(pairs, [], DPOConfig(pairs_per_step=2), 1000, seed=0, pad_id=0)
    (micro,) = loader.next_batch().micro
    order = micro.rows[:2]  # longest first; the rejected rows in the same order after the chosen
    assert micro.rows == order * 2 and micro.n_targets == 2
    rows = [(i, side) for side in ("chosen", "rejected") for i in order]
    for b, (i, side) in enumerate(rows):
        pair = pairs[i]
        response = getattr(pair, side)
        where = (micro.targets[b] != IGNORE_INDEX).nonzero().flatten().tolist()
        assert where == list(range(len(pair.prompt) - 1, len(pair.prompt) - 1 + len(response)))
        assert micro.targets[b, where].tolist() == response
        assert micro.inputs[b, : len(pair.prompt)].tolist() == pair.prompt


def test_the_built_in_pairs_prefer_the_right_answer_and_keep_held_out_problems_out():
    train, held = arithmetic_pairs(500, seed=1), arithmetic_pairs(50, seed=1, split="held_out")
    for p in train + held:
        a, op, b = p.prompt.rstrip("=").partition("+") if "+" in p.prompt[1:] else p.prompt.rstrip("=").rpartition("-")
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert p.chosen == f" {right}" and p.rejected != p.chosen and 1 <= abs(int(p.rejected) - right) <= 9
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert arithmetic_pairs(50, seed=1, split="held_out") == held  # the same from the same seed


class CharTokenizer:
    eos_id = 0
    chat = None

    def encode_text(self, text: str, specials: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def encode_documents(self, docs: list) -> list[list[list[int]]]:
        return [[self.encode_text(text) for text, _ in doc.segments] for doc in docs]


def test_a_pair_is_tokenized_as_the_model_sees_it_with_or_without_a_chat_template():
    pair = Pair("2+3=", " 5", " 6")
    tok = CharTokenizer()
    assert tokenize(pair, tok) == Tokens([ord(c) for c in "2+3="], [ord(" "), ord("5"), 0], [ord(" "), ord("6"), 0])
    tok.chat = ChatFormat(
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}",
        {},
    )
    text = lambda ids: "".join(map(chr, ids))  # noqa: E731
    got = tokenize(pair, tok)
    assert (text(got.prompt), text(got.chosen), text(got.rejected)) == (
        "<s>user: 2+3=</s><s>assistant: ",
        " 5</s>",
        " 6</s>",
    )


def test_special_token_text_in_a_pair_is_text_as_in_training_documents():
    """A response quoting the end-of-text token does not end there, a prompt quoting a chat role
    is not one: the pair's texts are read as training reads a document's (encode_text); with a
    chat template only the template's own special tokens are special."""
    from trimtab.data.sources import Document
    from trimtab.data.tokenizer import EOS, TextTokenizer, train_tokenizer

    tok = train_tokenizer([Document([("the end is near 2+3= 5 <user> said so " * 20, True)])], 300)
    pair = Pair("<|user|> 2+3=", f" 5{EOS}", " 6")
    got = tokenize(pair, tok)
    assert got.chosen == tok.encode_text(f" 5{EOS}") + [tok.eos_id] and got.chosen.count(tok.eos_id) == 1
    assert got.prompt == tok.encode_text("<|user|> 2+3=") and tok.encode("<|user|>")[0] not in got.prompt
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    chat = TextTokenizer(tok._tok, hf={"eos_token": EOS, "chat_template": template})
    end = chat.encode("<|end|>")
    got = tokenize(Pair("2+3=", " 5<|end|>", " 6"), chat)
    assert got.chosen == chat.encode_text(" 5<|end|>") + end and got.chosen.count(end[0]) == 1
    assert got.rejected == chat.encode_text(" 6") + end
    assert got.prompt == chat.encode("<|user|>") + chat.encode_text("2+3=") + end + chat.encode("<|assistant|>")


def test_a_bad_pairs_file_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    good = json.dumps({"prompt": "2+3=", "chosen": " 5", "rejected": " 6"})
    path.write_text(good + "\n" + json.dumps({"prompt": "1+1=", "chosen": " 2"}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:2: a preference pair needs 'rejected'"):
        read_pairs(path)
    path.write_text(good + "\n" + good + "\n{not json\n")
    with pytest.raises(DataError, match=rf"{path}:3: invalid JSON"):
        read_pairs(path)
    path.write_text(json.dumps({"prompt": "x", "chosen": "y", "rejected": "y"}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: its chosen and rejected responses are the same"):
        read_pairs(path)
    path.write_text(json.dumps({"prompt": "", "chosen": " 2", "rejected": " 3"}) + "\n")  # crashed collating
    with pytest.raises(DataError, match=rf'{path}:1: an empty "prompt"'):
        read_pairs(path)
    path.write_text(good + "\n")
    assert read_pairs(path) == [Pair("2+3=", " 5", " 6", f"{path}:1")]


@pytest.mark.parametrize(
    "sets, key",
    [
        ({"dpo": {"loss": "kto"}}, "dpo.loss"),
        ({"dpo": {"beta": 0}}, "dpo.beta"),
        ({"dpo": {"sft_coef": -1}}, "dpo.sft_coef"),
        ({"dpo": {"loss": "ipo", "label_smoothing": 0.1}}, "dpo.label_smoothing"),
        ({"dpo": {"enabled": True}, "rl": {"enabled": True}}, "dpo.enabled"),
    ],
)
def test_dpo_settings_are_checked(sets, key):
    with pytest.raises(ConfigError, match=key):
        load_config(preset="debug", overrides=sets)


DPO = [
    "--preset", "debug",
    "--set", "log.progress=false", "--set", "log.report=false", "--set", "train.log_every=1",
    "--set", "optim.warmup_steps=0", "--set", "optim.lr=1e-2", "--set", "checkpoint.every=3",
    "--set", "checkpoint.keep=1", "--set", "dpo.held_out=32", "--set", "dpo.pairs_per_step=16",
]  # fmt: skip


@pytest.fixture(scope="module")
def base(debug_run):
    """A debug run of two steps: a tokenizer and weights to start DPO from (the session's, conftest.py)."""
    return debug_run


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """600 pairs whose preference holds for any prompt: the sum chosen, a letter rejected."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("dpo") / "pairs.jsonl"
    lines = []
    for _ in range(600):
        a, b = rng.randrange(100), rng.randrange(100)
        wrong = rng.choice("abcdefgh")
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "chosen": f" {a + b}", "rejected": f" {wrong}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def dpo(out, base, steps: int, *extra: str, code: int = 0) -> list[dict]:
    done = trimtab_cli(
        ["dpo", *DPO, "--out", str(out), "--max-steps", str(steps), "--set", f"train.init_from={base}", *extra],
        out.parent,
    )
    assert done.returncode == code, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_dpo_run_learns_a_preference_that_holds_on_held_out_pairs(tmp_path, base, pairs):
    """From a model that knows nothing of the pairs (step 0: the policy is the reference, every
    margin 0), 12 steps at lr 1e-2 prefer the chosen response on every held-out pair, the margin
    grows between evaluations, the rejected response's reward falls below 0; the step-0
    checkpoint (the reference) and the best evaluation's are kept with checkpoint.keep=1; a clean
    run takes no action."""
    lines = dpo(tmp_path / "d", base, 12, "--set", f"dpo.pairs={pairs}", "--set", "train.eval_every=6")
    evals = [m for m in lines if "dpo/held_out_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 6, 12]
    assert evals[0]["dpo/held_out_accuracy"] == 0 and evals[0]["dpo/held_out_loss"] == pytest.approx(math.log(2))
    assert evals[-1]["dpo/held_out_accuracy"] == 1.0
    margins = [m["dpo/held_out_margin"] for m in evals]
    assert margins[0] == 0 and 0 < margins[1] < margins[2], margins
    assert evals[-1]["dpo/held_out_rejected_reward"] < 0 < evals[-1]["dpo/held_out_chosen_reward"]
    steps = [m for m in lines if "dpo/accuracy" in m]
    assert len(steps) == 12 and steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference
    assert steps[-1]["loss"] < 0.4 and steps[-1]["dpo/accuracy"] > 0.9 and steps[-1]["phase"] == "dpo"
    for key in ("dpo/margin", "dpo/chosen_reward", "dpo/rejected_reward"):
        assert key in steps[-1], key
    assert read_decisions(tmp_path / "d") == []
    # kept with checkpoint.keep=1: the reference (step 0) and the best evaluation's (its accuracy first 1)
    best = next(m["step"] for m in evals if m["dpo/held_out_accuracy"] == 1.0)
    kept = {p.name for p in (tmp_path / "d/checkpoints").glob("step_*")}
    assert {"step_000000", f"step_{best:06d}"} <= kept and "step_000003" not in kept, kept
    summary = json.loads((tmp_path / "d/summary.json").read_text())
    assert summary["status"] == "completed" and summary["dpo/held_out_accuracy"] == 1.0
    # the report's DPO figure
    traces = {t.name for t in figures.dpo_preference([read_run(tmp_path / "d")]).data}
    assert {"d train accuracy", "d held-out accuracy", "d train margin", "d held-out margin"} <= traces, traces
    assert figures.dpo_preference([read_run(base)]) is None


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_a_reference_free_loss_learns_the_preference_with_no_reference_kept(tmp_path, base, pairs, loss):
    """SimPO and ORPO compare the policy's own likelihoods: 12 steps prefer the chosen response on
    every held-out pair, and with checkpoint.keep=1 the step-0 checkpoint (a reference's) is not
    kept: nothing reads it."""
    sets = ["--set", f"dpo.pairs={pairs}", "--set", "train.eval_every=6", "--set", f"dpo.loss={loss}"]
    lines = dpo(tmp_path / loss, base, 12, *sets, "--set", f"dpo.beta={2.0 if loss == 'simpo' else 0.1}")
    evals = [m for m in lines if "dpo/held_out_accuracy" in m]
    assert evals[-1]["dpo/held_out_accuracy"] == 1.0 > evals[0]["dpo/held_out_accuracy"], evals
    assert evals[-1]["dpo/held_out_margin"] > evals[0]["dpo/held_out_margin"]
    kept = {p.name for p in (tmp_path / loss / "checkpoints").glob("step_*")}
    assert "step_000000" not in kept and "step_000012" in kept, kept
    assert read_decisions(tmp_path / loss) == []


def test_an_interrupted_dpo_run_resumes_to_the_uninterrupted_weights(tmp_path, base, pairs):
    """...and logs its figures: stopped at step 4 of a log window of 3 steps, the line at step 6
    averages steps 4-6 as the uninterrupted run's (the resumed session's alone before)."""
    sets = ("--set", f"dpo.pairs={pairs}", "--set", "dpo.held_out=0", "--set", "train.log_every=3")
    figures = lambda lines: [{k: v for k, v in m.items() if k.startswith("dpo/")} for m in lines if "dpo/margin" in m]  # noqa: E731
    whole = figures(dpo(tmp_path / "whole", base, 6, *sets))
    dpo(tmp_path / "parts", base, 6, *sets, "--inject", "sigterm@4", code=143)  # stopped: 128 + SIGTERM
    both = figures(dpo(tmp_path / "parts", base, 6, *sets))
    assert both == whole and len(whole) == 2
    a = load_file(tmp_path / "whole/checkpoints/step_000006/model.safetensors")
    b = load_file(tmp_path / "parts/checkpoints/step_000006/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_data_parallel_pairs_train_as_one_process_and_agree_on_every_figure(tmp_path, base, pairs):
    """DPO under torchrun's data parallelism (2 ranks, DDP): each rank trains 8 of a step's 16
    pairs, the loss normalised by the step's 16 and the gradients summed, so both ranks end with
    one process's weights and log its figures (summed over the ranks); a pair count the ranks
    cannot split, or a sharded model, is refused naming the key."""
    from types import SimpleNamespace

    from helpers import assert_close, run
    from trimtab.cli_train import RL_OFF
    from trimtab.training.setup import check_policy_ranks

    dpo = {"enabled": True, "pairs": str(pairs), "pairs_per_step": 16, "held_out": 16}
    job = dict(
        dpo=dpo,
        train={"init_from": str(base), "max_steps": 6, "eval_every": 3},
        optim={"lr": 1e-2, "warmup_steps": 0},
        orchestrator={rule: {"enabled": False} for rule in RL_OFF},  # as `trimtab dpo` turns them off
    )
    (one,) = run(tmp_path / "one", 1, **job)
    a, b = run(tmp_path / "dp", 2, **job)
    assert a["weights"] == b["weights"] and a["decisions"] == b["decisions"] == one["decisions"] == []
    assert_close(a["weights"], one["weights"], rel=1e-4)
    assert all(len(s["rows"]) == 8 for s in a["steps"] + b["steps"])  # 8 pairs a rank
    for x, y, z in zip(a["steps"], b["steps"], one["steps"], strict=True):
        assert sorted(x["rows"] + y["rows"]) == sorted(z["rows"])  # the same pairs, split
    lines = {name: (tmp_path / name / "metrics.jsonl").read_text().splitlines() for name in ("one", "dp")}
    logged = {name: [m for m in map(json.loads, text) if "dpo/loss" in m] for name, text in lines.items()}
    for key in ("dpo/loss", "dpo/accuracy", "dpo/margin", "loss"):
        assert_close([m[key] for m in logged["dp"]], [m[key] for m in logged["one"]], rel=1e-4)
    cfg = load_config(preset="debug", overrides={"dpo": {"enabled": True, "pairs_per_step": 16}})
    with pytest.raises(ConfigError, match="dpo.pairs_per_step=16 must be a multiple of the 3"):
        check_policy_ranks(cfg, SimpleNamespace(sharded=False, dp_world=3))
    with pytest.raises(ConfigError, match="data parallelism only"):
        check_policy_ranks(cfg, SimpleNamespace(sharded=True, dp_world=2))


def test_dpo_needs_a_model_to_start_from_and_a_readable_pairs_file(tmp_path, base):
    done = trimtab_cli(["dpo", "--preset", "debug", "--out", str(tmp_path / "r"), "--max-steps", "2"], tmp_path)
    assert done.returncode == 2 and "dpo: the tokenizer of the model to train is unknown" in done.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": " 2"}\n')
    done = trimtab_cli(
        ["dpo", *DPO, "--out", str(tmp_path / "b"), "--max-steps", "2"]
        + ["--set", f"train.init_from={base}", "--set", f"dpo.pairs={bad}"],
        tmp_path,
    )
    assert done.returncode == 2 and f"{bad}:1: a preference pair needs 'rejected'" in done.stderr, done.stderr[-2000:]


def test_a_step_out_of_memory_is_trained_again_in_micro_batches_of_whole_pairs(tmp_path, base, pairs):
    """oom@2: step 2's forward no longer fits; the orchestrator halves the micro-batch budget and
    the step is trained again on the same pairs in smaller micro-batches: the same figures and
    weights as a run that never ran out (to float rounding)."""
    sets = ("--set", f"dpo.pairs={pairs}", "--set", "dpo.held_out=0")
    whole = [m for m in dpo(tmp_path / "whole", base, 3, *sets) if "dpo/margin" in m]
    healed = [m for m in dpo(tmp_path / "oom", base, 3, *sets, "--inject", "oom@2") if "dpo/margin" in m]
    decisions = [d for d in read_decisions(tmp_path / "oom") if d["rule"] == "oom"]
    assert decisions and {(d["step"], d["action"]) for d in decisions} == {(2, "set_micro_batch_tokens")}
    assert healed[-1]["micro_batch_tokens"] < whole[-1]["micro_batch_tokens"]
    for a, b in zip(whole, healed):
        assert a["dpo/margin"] == pytest.approx(b["dpo/margin"], rel=1e-4, abs=1e-6)
    a = load_file(tmp_path / "whole/checkpoints/step_000003/model.safetensors")
    b = load_file(tmp_path / "oom/checkpoints/step_000003/model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_a_pair_longer_than_the_model_reads_is_named_before_training(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [{"prompt": f"{i}+1=", "chosen": f" {i + 1}", "rejected": " x"} for i in range(40)]
    lines[7]["rejected"] = " x" * 5000
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = load_config(preset="debug", overrides={"dpo": {"pairs": str(path)}, "train": {"max_steps": 2}})
    with pytest.raises(DataError, match=rf"{path}:8: a pair of 10005 tokens .* exceeds model.max_seq_len="):
        build_dpo_phase(cfg, CharTokenizer())
    sets = {"dpo": {"pairs": str(tmp_path / "no.jsonl")}, "train": {"max_steps": 2}}
    cfg = load_config(preset="debug", overrides=sets)
    with pytest.raises(ConfigError, match="dpo.pairs '.*no.jsonl' is no file"):
        build_dpo_phase(cfg, CharTokenizer())


def test_the_built_in_pairs_train_offline_and_their_problems_are_answered_at_evaluations(tmp_path, base):
    """dpo.pairs' default, builtin:arithmetic: the held-out pairs scored and their problems
    answered greedily (pass@1) before the first step and at the end."""
    lines = dpo(tmp_path / "b", base, 2, "--set", "dpo.held_out=8", "--set", "rl.max_new_tokens=4")
    evals = [m for m in lines if "dpo/held_out_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2]
    assert all(0 <= m["dpo/held_out_pass@1"] <= 1 for m in evals)
    assert [m["step"] for m in lines if "dpo/accuracy" in m] == [1, 2]


def test_pairs_a_rollback_blamed_are_never_drawn_again_and_the_order_resumes_exactly():
    cfg = DPOConfig(pairs_per_step=3)
    loader = PairLoader(tokens(10), [], cfg, 1000, seed=0, pad_id=0)
    loader.next_batch()
    assert loader.skip_rows([2, 5]) == 2 and loader.skip_rows([5]) == 0
    state = loader.state_dict()
    drawn = [loader.next_batch().rows for _ in range(6)]  # into the next epochs
    assert all(2 not in rows and 5 not in rows for rows in drawn)
    again = PairLoader(tokens(10), [], cfg, 1000, seed=0, pad_id=0)
    again.load_state_dict(state)
    assert [again.next_batch().rows for _ in range(6)] == drawn
    with pytest.raises(DataError, match="would leave none to train on"):
        loader.skip_rows(range(10))
    with pytest.raises(DataError, match="had 10 pairs but dpo.pairs now has 9"):
        PairLoader(tokens(9), [], cfg, 1000, seed=0, pad_id=0).load_state_dict(state)
    # as many pairs, other ones (an edited file): the indices, and the pairs left out, would be others'
    with pytest.raises(DataError, match="drew from other pairs than dpo.pairs holds now"):
        PairLoader(tokens(10, seed=1), [], cfg, 1000, seed=0, pad_id=0).load_state_dict(state)


@pytest.mark.parametrize("section", ["rl", "dpo"])
def test_rl_and_dpo_from_a_model_that_does_not_exist_say_so(tmp_path, section):
    """It read 'the tokenizer of the model to train is unknown; set train.init_from', set already."""
    from trimtab.training.setup import setup

    overrides = {"out": str(tmp_path / "r"), section: {"enabled": True}, "train": {"init_from": str(tmp_path / "no")}}
    with pytest.raises(ConfigError, match=r"config key 'train.init_from' = '.*/no' does not exist; point it at"):
        setup(load_config(preset="debug", overrides=overrides))
