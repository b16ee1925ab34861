"""TrimtabLM: EleutherAI lm-evaluation-harness's model interface over a trimtab model, so every
model trimtab trains (Mixture-of-Depths and hybrids included) is scored by the harness's own
tasks and metrics, through the same request handling as its `hf` backend: TemplateLM splits
context and continuation (trailing spaces move to the continuation, the pair is encoded whole
and the context's tokens cut off), an empty context gets the start token, rolling windows come
from lm_eval.utils. Only the scoring and the generation are trimtab's (scoring.py, sampling.py).
"""

from __future__ import annotations

import sys
from typing import Any

from lm_eval import utils
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from trimtab.data import TextTokenizer
from trimtab.errors import DataError
from trimtab.evaluation.scoring import continuation_scores
from trimtab.model import Transformer
from trimtab.sampling import generate


class TrimtabLM(TemplateLM):
    def __init__(self, model: Transformer, tok: TextTokenizer, batch_size: int = 8):
        super().__init__()
        self.model, self.tok, self.batch_size = model.eval(), tok, batch_size

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """As the hf backend: the tokenizer's own specials (a bos) unless told otherwise or the
        text already starts with the start token."""
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tok.decode([self.prefix_token_id]))
        return self.tok.encode(string, specials=add_special_tokens)

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.tok.decode(tokens)

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's own request handling, without its "Tokenizing inputs" bar (instant: noise)."""
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None):
        for key, _, continuation in requests:
            if not continuation:
                raise DataError(_nothing_to_score(key))
        pairs = [(context, continuation) for _, context, continuation in requests]
        scores = continuation_scores(self.model, pairs, self.tok.pad_id, override_bs or self.batch_size)
        for (key, _, _), score in zip(requests, scores):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, score)
        return scores

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Sum of the log-likelihoods of every token of each text, in disjoint max_length windows."""
        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm or not _terminal()):
            windows = utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            pairs = [(None, *utils.make_disjoint_window(w)) for w in windows]
            total = sum(score for score, _ in self._loglikelihood_tokens(pairs, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample) continuation, cut at the first stop string;
        the end-of-text token stops it too."""
        out = []
        for context, kwargs in tqdm(
            [r.args for r in requests], desc="generating", disable=disable_tqdm or not _terminal()
        ):
            kwargs = dict(kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new) :]
            new = generate(
                self.model,
                ids,
                max_new,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                eos_id=self.tok.eos_id,
                vocab=self.tok.id_limit,  # no padded id of the head: it decodes to nothing
            )
            text = self.tok.decode([t for t in new if t != self.tok.eos_id])
            for stop in until:
                text = text.split(stop)[0] if stop else text
            self.cache_hook.add_partial("generate_until", (context, {"until": until}), text)
            out.append(text)
        return out


def _terminal() -> bool:
    """Whether progress bars go to a terminal: in a log file (a job's, CI's) every redraw of a bar
    is a line of its own, hundreds an evaluation, burying trimtab's output."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def _nothing_to_score(key: tuple[str, str] | None) -> str:
    """Why a request has no continuation token. Scoring none would give log-likelihood 0 and
    greedy, so that choice would always win; lm-eval's hf backend refuses it as well."""
    context, continuation = key or ("", "")
    if not continuation:
        return f"lm-eval request with context ...{context[-40:]!r}: the continuation is empty; fix the task's choices"
    return (
        f"lm-eval request with context ...{context[-40:]!r}: its continuation {continuation!r} adds no token, "
        "it merges into the context's last token when the two are tokenized together (scoring it would "
        "always win, and lm-eval's hf backend refuses it too); give the task a target_delimiter (e.g. ' ') "
        "or choices that begin a new token"
    )
