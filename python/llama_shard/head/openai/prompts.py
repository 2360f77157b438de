"""A request's prompt as tokens: its messages checked and rendered with the model's chat template
(tools too), tokenized (special-token text in messages as plain text where the operator asks), and
held to the context. Runs on the endpoint's tokenizer pool, off the event loop."""

from __future__ import annotations

import json
import re

from ...errors import InvalidInputError
from .chat_template import ModelChat
from .errors import HttpError
from .tool_calls import ToolRequest, history_message, template_renders_tools

#: characters of a long prompt tokenized first: text that makes more tokens than the context from
#: its start alone is refused without tokenizing the rest
PROBE_CHARS_PER_TOKEN = 8
#: a message's role: a name, never text the tokenizer could read as a turn marker
ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")


class Prompts:
    def __init__(self, model, chat: ModelChat, context_tokens: int, split_special_tokens: bool = False):
        self.model, self.chat, self.context_tokens = model, chat, context_tokens
        self.template, self.bos_text = chat.template, chat.bos_text
        self.split_special_tokens = split_special_tokens  # message text never parsed as special tokens

    def chat_tokens(self, rendered: list[dict], tools: ToolRequest | None) -> list[int]:
        """A chat request's prompt: its messages (and tools) rendered, then tokenized."""
        listed = tools.tools if tools is not None else None
        if self.split_special_tokens:
            return self.tokenize_split(rendered, listed)
        return self.tokenize(self.chat.text(rendered, tools=listed))

    def token_ids(self, prompt: list) -> list[int]:
        """A completion's prompt given as token ids."""
        n_vocab = self.model.info.n_vocab
        if not all(0 <= t < n_vocab for t in prompt):
            raise HttpError(400, f"a prompt token is outside the vocabulary (0..{n_vocab - 1})", "prompt")
        return self.fits_context(list(prompt))

    def messages(self, body: dict) -> list[dict]:
        """The request's messages as the template reads them (a 400 naming `messages` otherwise)."""
        if self.template is None:
            raise HttpError(
                400, "this model has no chat template (tokenizer.chat_template): use /v1/completions", "messages"
            )
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", "messages")
        rendered = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise HttpError(400, "each message must be an object with a string role", "messages")
            if not ROLE.fullmatch(m["role"]):  # a role is the template's word, never a turn marker of its own
                raise HttpError(
                    400, "a message's role must be a name (a letter, then up to 31 letters, digits, _ or -)", "messages"
                )
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ):
                    raise HttpError(400, "only text content parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise HttpError(400, "a message's content must be a string or a list of text parts", "messages")
            rendered.append(history_message(m, m["role"], content))
        return rendered

    def tools(self, body: dict) -> ToolRequest | None:
        """The request's tools, None when it has none or `tool_choice` is none (a 400 for a template
        that renders no tools)."""
        tools = ToolRequest(body) if "tools" in body or "tool_choice" in body else None
        if tools is not None and tools.choice == "none":
            return None  # as OpenAI: the model answers in text (the tools are not rendered)
        if tools is not None and not template_renders_tools(self.chat.source):
            raise HttpError(
                400,
                "this model's chat template does not render tools as <tool_call> blocks; start "
                "the worker with --chat-template-file holding one that does",
                "tools",
            )
        return tools

    def tokenize(self, text: str) -> list[int]:
        context = self.context_tokens
        try:
            probe = PROBE_CHARS_PER_TOKEN * context
            if len(text) > 2 * probe:  # a start that alone overflows the context ends it (a few tokens' slack
                # for the cut: the start's tokens are the whole text's but for the last few)
                n = len(self.model.tokenize(text[:probe]))
                if n > context + 8:
                    raise HttpError(
                        400,
                        f"the prompt is over {n - 8} tokens from its first {probe} characters; a "
                        f"session here holds {context}",
                        "prompt",
                        "context_length_exceeded",
                    )
            tokens = self.model.tokenize(text)
        except InvalidInputError as e:
            raise HttpError(400, str(e), "prompt") from None
        if not tokens:
            raise HttpError(400, "the prompt is empty", "prompt")
        return self.fits_context(tokens)

    def tokenize_split(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """`--http-split-special-tokens`: a message's text is plain text (transformers'
        split_special_tokens), so a caller's `<|im_end|>` is those characters, never the turn marker;
        the template's own text keeps its special tokens. Only a message whose text holds special-token
        text tokenizes differently: the rendered prompt is found to hold that text verbatim (in order)
        and is cut around it, the cuts tokenized with special tokens parsed, the text without. A prompt
        without such text is tokenized in one piece, exactly as without the option. A template that
        changes such a text (trims, splits it) is refused: its marks could not be told from the text."""
        model = self.model
        # what the template renders besides the messages' text (tools, calls, a tool's name) is not cut
        # out as plain text: it may not hold special-token text at all
        for param, values in (
            ("tools", [json.dumps(t, ensure_ascii=False) for t in tools or []]),
            (
                "messages",
                [
                    json.dumps([m.get("tool_calls"), m.get("name")], ensure_ascii=False)
                    for m in messages
                    if "tool_calls" in m or "name" in m
                ],
            ),
        ):
            for value in values:
                if model.tokenize(value, add_special=False, parse_special=True) != model.tokenize(
                    value, add_special=False, parse_special=False
                ):
                    raise HttpError(
                        400,
                        "with --http-split-special-tokens, tools and tool calls may not hold special-token text",
                        param,
                    )
        text = self.template.render(messages, tools=tools)
        if self.bos_text and text.startswith(self.bos_text):
            text = text[len(self.bos_text) :]
        plain = []  # (start, end) of each message text that holds special-token text
        at = 0
        try:
            for m in messages:
                content = m["content"]
                if not content or model.tokenize(content, add_special=False, parse_special=True) == model.tokenize(
                    content, add_special=False, parse_special=False
                ):
                    continue
                found = text.find(content, at)
                if found < 0:
                    raise HttpError(
                        400,
                        "with --http-split-special-tokens a message's text that holds special-token "
                        "text must appear in the rendered prompt as it was sent; this template "
                        "changes it",
                        "messages",
                    )
                plain.append((found, found + len(content)))
                at = found + len(content)
            if not plain:
                return self.tokenize(text)
            tokens, at = [], 0
            for begin, end in plain:
                if at < begin or not tokens:
                    tokens += model.tokenize(text[at:begin], add_special=not tokens, parse_special=True)
                tokens += model.tokenize(text[begin:end], add_special=False, parse_special=False)
                at = end
            if at < len(text):
                tokens += model.tokenize(text[at:], add_special=False, parse_special=True)
        except InvalidInputError as e:
            raise HttpError(400, str(e), "messages") from None
        return self.fits_context(tokens)

    def fits_context(self, tokens: list[int]) -> list[int]:
        context = self.context_tokens
        if len(tokens) >= context:
            raise HttpError(
                400,
                f"the prompt is {len(tokens)} tokens; a session here holds {context}, the prompt "
                "and at least one generated token",
                "prompt",
                "context_length_exceeded",
            )
        return tokens
