"""The GGUF's chat template, rendered in the bounded sandbox (`template_sandbox`), and a model's
conversations as prompts, one way for every entry point (`ModelChat`)."""

from __future__ import annotations

import json
import time

from jinja2 import TemplateError

from ...errors import InvalidInputError
from .errors import HttpError
from .template_sandbox import MAX_CHARS as MAX_RENDERED_CHARS
from .template_sandbox import MAX_SECONDS as MAX_RENDER_SECONDS
from .template_sandbox import BoundedSandbox, TemplateRefused, render_bounded


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: plain JSON text in the caller's key order (jinja2's own returns Markup,
    so `'<tool_call>' + (x | tojson)` would HTML-escape the text around it, and sorts the keys)."""
    if indent is not None and not (isinstance(indent, int) and 0 <= indent <= 16):
        raise TemplateError("tojson: indent must be an integer in [0, 16]")  # every line would carry it
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """The GGUF's `tokenizer.chat_template`, rendered as transformers and llama-cpp-python render it:
    jinja2 in an immutable sandbox (a template cannot reach Python objects or change its inputs),
    with its values, output and time bounded (`chat_template`: a template is the model file's
    code; a hostile GGUF, or messages that drive a careless template, cost a 400, not the worker)."""

    def __init__(
        self,
        source: str,
        bos_token: str,
        eos_token: str,
        max_chars: int = MAX_RENDERED_CHARS,
        max_seconds: float = MAX_RENDER_SECONDS,
    ):
        self.max_seconds = max_seconds
        env = BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], max_chars=max_chars
        )
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: time.strftime(fmt))
        env.filters["tojson"] = env._bounded(_tojson)
        self.template = env.from_string(source)
        self.bos_token, self.eos_token, self.max_chars = bos_token, eos_token, max_chars

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        extra = {"tools": tools} if tools else {}  # as transformers passes them: absent when none
        try:
            return render_bounded(
                self.template,
                self.max_chars,
                self.max_seconds,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateRefused as e:
            raise HttpError(400, f"the model's chat template refused the messages: {e}", "messages") from None


class ModelChat:
    """A model's conversations as prompts, the one way every entry point renders them (the HTTP
    endpoint, `generate --chat`, the demo): the GGUF's own template in the sandbox, with whatever
    system prompt it adds itself, and without the BOS the tokenizer adds again."""

    def __init__(self, model, template_source: str | None = None):
        """`template_source`: a template that replaces the GGUF's (`serve --chat-template-file`)."""
        self.model = model
        bos, eos = model.token_bos_added, model.token_eos
        self.bos_text = model.detokenize([bos]) if bos >= 0 else ""
        source = template_source or model.chat_template
        self.source = source
        self.template = (
            ChatTemplate(source, self.bos_text, model.detokenize([eos]) if eos >= 0 else "") if source else None
        )

    def text(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The rendered conversation (HttpError 400 when the template refuses it; InvalidInputError
        when the model has no template)."""
        if self.template is None:
            raise InvalidInputError("this model has no chat template (tokenizer.chat_template)", param="messages")
        text = self.template.render(messages, add_generation_prompt, tools)
        if self.bos_text and text.startswith(self.bos_text):
            text = text[len(self.bos_text) :]  # the tokenizer adds BOS itself
        return text

    def tokens(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """text(), tokenized (special tokens parsed: the template's turn markers); outside HTTP a
        template's refusal is InvalidInputError."""
        try:
            return self.model.tokenize(self.text(messages, add_generation_prompt))
        except HttpError as e:
            raise InvalidInputError(e.message, param="messages") from None
