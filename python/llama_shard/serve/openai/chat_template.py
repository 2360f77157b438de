"""The GGUF's chat template, rendered in the bounded sandbox (`template_sandbox`)."""
from __future__ import annotations

import time

from jinja2 import TemplateError

from .errors import HttpError
from .template_sandbox import MAX_CHARS as MAX_RENDERED_CHARS
from .template_sandbox import MAX_SECONDS as MAX_RENDER_SECONDS
from .template_sandbox import BoundedSandbox, TemplateRefused, render_bounded


def _raise(message: str):
    raise TemplateError(message)


class ChatTemplate:
    """The GGUF's `tokenizer.chat_template`, rendered as transformers and llama-cpp-python render it:
    jinja2 in an immutable sandbox (a template cannot reach Python objects or change its inputs),
    with its values, output and time bounded (`chat_template`: a template is the model file's
    code; a hostile GGUF, or messages that drive a careless template, cost a 400, not the worker)."""

    def __init__(self, source: str, bos_token: str, eos_token: str, max_chars: int = MAX_RENDERED_CHARS,
                 max_seconds: float = MAX_RENDER_SECONDS):
        self.max_seconds = max_seconds
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                             max_chars=max_chars)
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: time.strftime(fmt))
        self.template = env.from_string(source)
        self.bos_token, self.eos_token, self.max_chars = bos_token, eos_token, max_chars

    def render(self, messages: list[dict]) -> str:
        try:
            return render_bounded(self.template, self.max_chars, self.max_seconds, messages=messages,
                                  add_generation_prompt=True,
                                  bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateRefused as e:
            raise HttpError(400, f"the model's chat template refused the messages: {e}", "messages") from None
