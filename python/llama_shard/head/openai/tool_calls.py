"""OpenAI tool calls (`tools`, `tool_choice`, `parallel_tool_calls`) for templates that write them as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks: Hermes 2/3, Qwen 2.5/3, SmolLM3
and the models trained on their format.

The model's own template renders the tools and the history (assistant `tool_calls`, `tool`
results) in the bounded sandbox, as every chat is rendered. `required` and a named function
constrain the output with a grammar: llama.cpp's JSON Schema converter writes the call (name and
arguments against the tool's `parameters`) and this module wraps it in the blocks, so even a small
model emits a valid call. `auto` samples freely and parses what comes.

Why not llama.cpp's `common/chat` (its template analysis, PEG parsers and lazy grammars): its own
Jinja engine renders the GGUF's template without the sandbox's bounds on size and time, and it is
30 more translation units in each of CI's four native builds (docs/design.md, "Tool calls").
The format here is the one open models share most; a template that renders no tools is refused
(400), never answered with prose."""

from __future__ import annotations

import json
import re
import uuid

from .errors import HttpError

#: at most this many tools per request, each name OpenAI's pattern
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_renders_tools(source: str | None) -> bool:
    """Whether a chat template renders `tools` and writes calls as <tool_call> blocks."""
    return bool(source) and "tools" in source and OPEN in source


class ToolRequest:
    """A request's tools and choice, checked (HttpError 400 naming the parameter otherwise)."""

    def __init__(self, body: dict):
        tools = body.get("tools")
        if tools is None:
            raise HttpError(400, "tool_choice needs tools", "tool_choice")
        if not isinstance(tools, list) or not tools:
            raise HttpError(400, "tools must be a non-empty list of {type: function, function: {...}}", "tools")
        if len(tools) > MAX_TOOLS:
            raise HttpError(400, f"at most {MAX_TOOLS} tools", "tools")
        self.tools: list[dict] = []  # OpenAI's shape, as templates read it
        self.parameters: dict[str, dict] = {}
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
                raise HttpError(400, "each tool must be {type: function, function: {name, parameters}}", "tools")
            name = fn.get("name")
            if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise HttpError(400, "a tool's name must be 1 to 64 letters, digits, _ or -", "tools")
            if name in self.parameters:
                raise HttpError(400, f"two tools are named {name!r}", "tools")
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise HttpError(400, f"tool {name!r}: parameters must be a JSON Schema object", "tools")
            description = fn.get("description", "")
            if not isinstance(description, str):
                raise HttpError(400, f"tool {name!r}: description must be a string", "tools")
            self.parameters[name] = params
            self.tools.append(
                {"type": "function", "function": {"name": name, "description": description, "parameters": params}}
            )
        choice = body.get("tool_choice", "auto")
        self.named: str | None = None
        if isinstance(choice, dict):
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise HttpError(
                    400, "tool_choice must be none, auto, required or {type: function, function: {name}}", "tool_choice"
                )
            if fn["name"] not in self.parameters:
                raise HttpError(400, f"tool_choice names {fn['name']!r}, which is not in tools", "tool_choice")
            self.named, choice = fn["name"], "required"
        if choice not in ("none", "auto", "required"):
            raise HttpError(
                400, "tool_choice must be none, auto, required or {type: function, function: {name}}", "tool_choice"
            )
        self.choice = choice
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise HttpError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
        self.parallel = parallel

    def call_schema(self) -> dict:
        """The JSON Schema of one call the choice allows: {"name": <a tool>, "arguments": <its parameters>}."""

        def one(name: str) -> dict:
            return {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": self.parameters[name]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }

        names = [self.named] if self.named else list(self.parameters)
        return one(names[0]) if len(names) == 1 else {"anyOf": [one(n) for n in names]}

    def grammar(self, call_grammar: str) -> str:
        """The GBNF of the output `required` or a named function allows: one block (or several, with
        parallel calls), each holding a call as `call_grammar` (the converter's, its `root` renamed)."""
        call = rename_rule(call_grammar, "root", "tool-call")
        blocks = 'block ("\\n" block)*' if self.parallel and not self.named else "block"
        return f"root ::= {blocks}\nblock ::= \"{OPEN}\\n\" tool-call \"\\n{CLOSE}\"\n" + call


def rename_rule(grammar: str, old: str, new: str) -> str:
    """GBNF with rule `old` renamed `new` where it is a name (not inside a "literal", a [class] or a
    comment)."""
    out, i, n = [], 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c in "\"[":
            end = "\"" if c == "\"" else "]"
            j = i + 1
            while j < n and grammar[j] != end:
                j += 2 if grammar[j] == "\\" else 1
            out.append(grammar[i : j + 1])
            i = j + 1
        elif c == "#":
            j = grammar.find("\n", i)
            j = n if j < 0 else j
            out.append(grammar[i:j])
            i = j
        elif c.isalnum() or c in "-_":
            j = i
            while j < n and (grammar[j].isalnum() or grammar[j] in "-_"):
                j += 1
            word = grammar[i:j]
            out.append(new if word == old else word)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def history_message(m: dict, role: str, content: str) -> dict:
    """One message as the template reads it: an assistant's `tool_calls` with their arguments as
    objects (templates write them with `tojson`), a tool result with its call's id and name."""
    out = {"role": role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise HttpError(400, "tool_calls is a list, on an assistant's message", "messages")
        rendered = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if (
                not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", "{}"), str)
            ):
                raise HttpError(
                    400,
                    "each tool call must be {id, type: function, function: {name, arguments: a JSON string}}",
                    "messages",
                )
            try:
                arguments = json.loads(fn.get("arguments", "{}"))
            except (ValueError, RecursionError):  # RecursionError: "[" * 100000, not JSON we take
                raise HttpError(400, f"the arguments of a call to {fn['name']!r} are not JSON", "messages") from None
            rendered.append(
                {"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}
            )
        out["tool_calls"] = rendered
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise HttpError(400, "tool_call_id must be a string", "messages")
        out["tool_call_id"] = call_id or ""
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def _block(text: str, begin: int, final: bool) -> tuple[str, int, dict | None]:
    """The <tool_call> block at `begin`: ("call", end, call) when it holds one JSON call and closes;
    ("text", end, None) when it closes without holding one (it stays text); ("open", -1, None) when
    more text could still make it either (never when `final`). The JSON is read as JSON, so a
    `</tool_call>` inside one of its strings does not end the block."""
    at = _SPACE.match(text, begin + len(OPEN)).end()
    try:
        obj, after = _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        if not final:
            return "open", -1, None  # a call still being written reads as broken JSON too
        close = text.find(CLOSE, at)
        return ("text", close + len(CLOSE), None) if close >= 0 else ("open", -1, None)
    rest = _SPACE.match(text, after).end()
    if text.startswith(CLOSE, rest):
        call = _call_of(obj)
        return ("call", rest + len(CLOSE), call) if call is not None else ("text", rest + len(CLOSE), None)
    if not final and CLOSE.startswith(text[rest:]):
        return "open", -1, None  # the end marker is on its way
    close = text.find(CLOSE, rest)
    return ("text", close + len(CLOSE), None) if close >= 0 else ("open", -1, None)


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """A completion's content (None when only calls) and its calls in OpenAI's shape. A block that
    does not hold {"name": ..., "arguments": {...}} stays in the content as text."""
    calls, kept, at = [], [], 0
    begin = text.find(OPEN)
    while begin >= 0:
        kind, end, call = _block(text, begin, final=True)
        if kind == "open":
            break
        if kind == "call":
            kept.append(text[at:begin])
            at = end
            calls.append(call)
        begin = text.find(OPEN, end)
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call_of(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


#: the start of a call as the grammar of `required` writes it: its name, then its arguments
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class ToolCallStream:
    """A streamed answer's text split as a client reads it: content outside the <tool_call> blocks,
    and the calls as OpenAI's deltas (id and name, then the arguments). `progressive` (the output is
    under the grammar of the calls, so each block is `{"name": ..., "arguments": ...}`): a call's id
    and name go out as soon as its name is complete and its arguments as they are written;
    otherwise each call goes out once its block is closed and parses. What is sent, joined, is what
    `parse_calls` gives the whole text (content up to whitespace)."""

    def __init__(self, progressive: bool = False):
        self.progressive = progressive
        self.text, self.sent = "", 0
        self.calls = 0
        self.args_at = self.args_sent = -1  # progressive: the current call's arguments, sent up to
        self.pending = ""  # whitespace held back after the first call

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now)."""
        self.text += piece
        content: list[str] = []
        deltas: list[dict] = []
        while True:
            begin = self.text.find(OPEN, self.sent)
            if begin < 0:  # no block: all but what could begin the marker is content
                safe = len(self.text)
                for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                    if OPEN.startswith(self.text[-k:]):
                        safe = len(self.text) - k
                        break
                content.append(self.text[self.sent : safe])
                self.sent = safe
                break
            content.append(self.text[self.sent : begin])
            self.sent = begin
            kind, end, call = _block(self.text, begin, final=False)
            if self.progressive:
                deltas += self._progress(begin, end if kind == "call" else -1, call)
                if kind != "open":
                    if kind == "text" and self.args_at >= 0:
                        self.calls += 1  # its arguments went out, then it broke: its index is spent
                        kind = "spent"
                    self.args_at = self.args_sent = -1
            if kind == "open":
                break
            if kind == "call" and not self.progressive:
                deltas += self._deltas(call)
            elif kind == "text":
                content.append(self.text[begin:end])
            self.sent = end
        return self._content("".join(content)), deltas

    def _content(self, text: str) -> str:
        """Content to send: once there are calls, whitespace waits for text after it (the whole answer's
        content is stripped, so whitespace between or after calls is not sent on its own)."""
        if not self.calls:
            return text
        text, self.pending = self.pending + text, ""
        if not text.strip():
            self.pending = text
            return ""
        return text

    def _progress(self, begin: int, end: int, call: dict | None) -> list[dict]:
        """The current block's deltas so far (`end`: where it closed with `call`, -1 while open)."""
        out = []
        if self.args_at < 0:  # the call's name not yet sent
            head = _HEAD.match(self.text, begin + len(OPEN))
            if head is None:  # not written as the grammar writes it: whole, once it parses
                return self._deltas(call) if end >= 0 else out
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return out
            self.args_at = self.args_sent = head.end()
            out.append(
                {
                    "index": self.calls,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )
        if end < 0:  # held back: whitespace and braces that may close the call, and a part of the end marker
            stop = len(self.text)
            for k in range(min(len(CLOSE), stop - self.args_sent), 0, -1):
                if CLOSE.startswith(self.text[stop - k :]):
                    stop -= k
                    break
            while stop > self.args_sent and self.text[stop - 1] in " \t\r\n}":
                stop -= 1
        else:  # closed: the arguments end before the call's own closing brace
            close = self.text.rindex(CLOSE, begin, end)
            stop = self.text.rindex("}", self.args_at, close)
            stop = len(self.text[:stop].rstrip())
        if stop > self.args_sent:
            out.append({"index": self.calls, "function": {"arguments": self.text[self.args_sent : stop]}})
            self.args_sent = stop
        if end >= 0:
            self.calls += 1
        return out

    def _deltas(self, call: dict) -> list[dict]:
        i = self.calls
        self.calls += 1
        return [
            {
                "index": i,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            },
            {"index": i, "function": {"arguments": call["function"]["arguments"]}},
        ]

    def flush(self) -> tuple[str, list[dict]]:
        """At the end: what is left, read as the whole text is (a block still open is text; a call cut
        short while its arguments streamed: nothing more)."""
        rest, self.sent = self.text[self.sent :], len(self.text)
        if self.args_at >= 0:
            return "", []
        content, calls = parse_calls(rest)
        deltas = [d for call in calls for d in self._deltas(call)]
        return self._content(content or ""), deltas
