"""Chat records through a Hugging Face tokenizer's own chat template (Jinja, as transformers'
apply_chat_template renders it), with the loss on the assistant's turns only.

The template knows nothing of trainable spans, so they are found by rendering prefixes: for an
assistant message i, render(messages[:i], add_generation_prompt=True) is the prompt the model
sees, and render(messages[:i + 1]) minus that prompt is what it must learn to write (its reply and
the template's end-of-turn tokens). A template whose renders are not prefixes of each other
(one that rewrites earlier turns, e.g. dropping past reasoning) is refused for that record.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

Turns = list[tuple[str, str]]  # (role, content)


@dataclass(frozen=True)
class ChatFormat:
    """How a Hugging Face tokenizer formats chats: its template (None: it has none) and the
    special tokens the template renders with (bos_token, eos_token, ...)."""

    template: str | None
    specials: dict[str, str]


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
        raise MissingTemplate("the tokenizer has no chat template (tokenizer_config.json 'chat_template'); add one")
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
