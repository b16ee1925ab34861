"""Chat records through a Hugging Face tokenizer's own chat template (Jinja, as transformers'
apply_chat_template renders it), with the loss on the assistant's turns only.

The template knows nothing of trainable spans, so they are found by rendering prefixes: for an
assistant message i, render(messages[:i], add_generation_prompt=True) is the prompt the model
sees, and render(messages[:i + 1]) minus that prompt is what it must learn to write (its reply and
the template's end-of-turn tokens). A template whose renders are not prefixes of each other
(one that rewrites earlier turns, e.g. dropping past reasoning) is refused for that record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

Turns = list[tuple[str, str]]  # (role, content)
Spans = tuple[tuple[int, int], ...]  # [start, end) character ranges of a text
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")  # a message's content, rendered in its place (_markup)


@dataclass(frozen=True)
class ChatFormat:
    """How a Hugging Face tokenizer formats chats: its template (None: it has none) and the
    special tokens the template renders with (bos_token, eos_token, ...)."""

    template: str | None
    specials: dict[str, str]
    settings: str = "tokenizer_config.json"  # where the template belongs, for the message that it is missing


class TemplateError(ValueError):
    """The chat template cannot render this record, or renders it in a way trimtab cannot mask."""


class MissingTemplate(TemplateError):
    """The tokenizer has no chat template: no chat record can be rendered (not one record's fault)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    """The sandboxed environment transformers renders chat templates in (trim_blocks,
    lstrip_blocks, raise_exception, strftime_now)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_segments(chat: ChatFormat, turns: Turns) -> list[tuple[str, bool]]:
    """(text, trainable) segments of the record: assistant replies trainable, the rest not."""
    if chat.template is None:
        raise MissingTemplate(
            f"the tokenizer has no chat template: add the Jinja template of the chat format the model is to learn "
            f"as 'chat_template' in {chat.settings} (or as chat_template.jinja beside it), or train on text records"
        )
    compiled, specials = _compile(chat.template), chat.specials
    messages = [{"role": role, "content": content} for role, content in turns]

    def render(upto: int, prompt: bool) -> str:
        try:
            return compiled.render(messages=messages[:upto], add_generation_prompt=prompt, **specials)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template fails on it ({exc})") from None

    segments: list[tuple[str, bool]] = []
    done = ""
    for i, (role, _) in enumerate(turns):
        if role != "assistant":
            continue
        prompt, full = render(i, True), render(i + 1, False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise TemplateError("the chat template re-renders earlier turns, so the reply cannot be told apart")
        segments += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full
    whole = render(len(turns), False)
    if not whole.startswith(done):
        raise TemplateError("the chat template re-renders earlier turns, so the reply cannot be told apart")
    segments.append((whole[len(done) :], False))
    return [(text, trainable) for text, trainable in segments if text]


def render_document(chat: ChatFormat, turns: Turns) -> tuple[list[tuple[str, bool]], Spans]:
    """render_segments' segments, and where in their text the template wrote (its markup, all of
    the text outside the messages' contents): special-token text there is the template's special
    token, inside a content plain text (data/tokenizer.py: encode_documents)."""
    segments = render_segments(chat, turns)
    return segments, _markup(chat, turns, "".join(text for text, _ in segments))


def _markup(chat: ChatFormat, turns: Turns, whole: str) -> Spans:
    """The template's spans of `whole` (the record rendered), found by rendering it again with
    each content replaced by a placeholder. A template that does more with a content than write
    it (trims it, tests it) renders something else around the placeholders: then all of `whole`
    is its markup, its special-token text matched wherever it is, as transformers does."""
    marks = [{"role": role, "content": f"\ue000{i}\ue001"} for i, (role, _) in enumerate(turns)]
    try:
        shape = _compile(chat.template).render(messages=marks, add_generation_prompt=False, **chat.specials)
    except (jinja2.TemplateError, TemplateError):
        return ((0, len(whole)),)
    pieces, spans, text = _PLACEHOLDER.split(shape), [], ""
    for i, piece in enumerate(pieces):  # markup, a content's number, markup, ...
        if i % 2:
            index = int(piece)
            text += turns[index][1] if index < len(turns) else piece
        else:
            spans.append((len(text), len(text) + len(piece)))
            text += piece
    return tuple((a, b) for a, b in spans if b > a) if text == whole else ((0, len(whole)),)
