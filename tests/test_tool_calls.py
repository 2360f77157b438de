"""OpenAI tool calls through a live route, with the official `openai` client, on SmolLM2 served with
the ChatML template that renders tools (`serve --chat-template-file`, shipped in the package):

- `tool_choice: "required"` and a named function: every answer is a `tool_calls` list
  (finish_reason `tool_calls`) whose arguments validate against the tool's parameters (jsonschema),
  sampled under the grammar of the calls;
- a conversation that sends the tool's result back gets a final text answer;
- streamed deltas assemble into the calls the whole answer holds (temperature 0);
- refusals: tools of the wrong shape, an unknown choice, a named function not in tools, and a
  template that renders no tools (SmolLM2's own: a 400 naming `tools`, never prose).
The parser and the stream's splitting are tested without a model too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import llama_shard
from llama_shard.head.openai.errors import HttpError
from llama_shard.head.openai.tool_calls import (
    ToolCallStream,
    ToolRequest,
    parse_calls,
    rename_rule,
    template_renders_tools,
)

TEMPLATE = Path(llama_shard.__file__).parent / "head" / "openai" / "templates" / "chatml-tools.jinja"

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 32}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


# --- without a model ----------------------------------------------------------------------------


def test_calls_are_parsed_and_what_is_not_a_call_stays_text():
    content, calls = parse_calls(
        'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}'
        '\n</tool_call>\n<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"timezone": "UTC"}),
        ("x", {"a": 1}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    text = "<tool_call>not json</tool_call> and <tool_call>[1]</tool_call>"
    assert parse_calls(text) == (text, [])
    assert parse_calls("plain") == ("plain", [])


def test_a_stream_sends_content_then_each_call_once_closed():
    s = ToolCallStream()
    out, deltas = [], []
    for piece in [
        "Su",
        "re. <tool",
        "_call>\n{\"name\": \"get_time\", ",
        "\"arguments\": {\"timezone\": \"UTC\"}}",
        "\n</tool_call>",
        "\n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>",
    ]:
        text, d = s.feed(piece)
        out.append(text)
        deltas += d
    assert "".join(out) == "Sure. "  # the marker's first characters were held back, never sent
    assert [d["index"] for d in deltas] == [0, 0, 1, 1]
    assert deltas[0]["function"] == {"name": "get_time", "arguments": ""} and deltas[0]["id"].startswith("call_")
    assert json.loads(deltas[1]["function"]["arguments"]) == {"timezone": "UTC"}
    assert s.flush() == ("", [])
    # under the grammar of the calls: the name as soon as it is complete, the arguments as written
    s = ToolCallStream(progressive=True)
    text = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo", "at": [1, 2]}}\n</tool_call>'
    deltas = []
    for i in range(len(text)):
        deltas += s.feed(text[i])[1]
        if i == text.index('"arguments": ') + 14:
            assert [d["function"]["name"] for d in deltas if "name" in d["function"]] == ["get_time"]
    assert len(deltas) > 10 and s.flush() == ("", [])
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"timezone": "Asia/Tokyo", "at": [1, 2]}'
    s = ToolCallStream()  # a block cut short stays text
    assert s.feed("<tool_call>{\"name\"") == ("", [])
    assert s.flush() == ("<tool_call>{\"name\"", [])


def _streamed(text: str, progressive: bool, step: int = 1) -> tuple[str, list[tuple[str, dict]]]:
    s = ToolCallStream(progressive)
    content, calls = [], {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for out in [s.feed(p) for p in pieces] + [s.flush()]:
        content.append(out[0])
        for d in out[1]:
            c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            c["name"] = d["function"].get("name") or c["name"]
            c["arguments"] += d["function"]["arguments"]
    return "".join(content), [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def test_streamed_and_whole_answers_read_the_same_calls_and_text():
    """What a stream sends, joined, is what the whole answer holds: calls whose strings hold the end
    marker, text between blocks and blocks that do not parse, and the grammar's whitespace before
    a block's end (held back, never sent as arguments)."""
    cases = [
        '<tool_call>\n{"name": "echo", "arguments": {"text": "a </tool_call> b"}}\n</tool_call>',
        'First. <tool_call>{"name": "a", "arguments": {}}</tool_call> Also: '
        '<tool_call>not json</tool_call> <tool_call>{"name": "b", "arguments": {"x": [1, {"y": 2}]}}</tool_call> End.',
        '<tool_call>\n{"name": "a", "arguments": {"x": {"y": 1}}              }\n</tool_call>',
        '<tool_call>{"name": "a", "arguments": {"q": "}}}"}}\n   \n</tool_call>\n<tool_call>{"name": "b", '
        '"arguments": {}}</tool_call>',
    ]
    for text in cases:
        content, calls = parse_calls(text)
        whole = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        for progressive in (False, True):
            for step in (1, 2, 5, 1000):
                got_text, got_calls = _streamed(text, progressive, step)
                assert got_calls == whole, (text, progressive, step)
                assert " ".join(got_text.split()) == " ".join((content or "").split()), (text, progressive, step)
    assert [c["function"]["name"] for c in parse_calls(cases[0])[1]] == ["echo"]
    assert json.loads(parse_calls(cases[0])[1][0]["function"]["arguments"]) == {"text": "a </tool_call> b"}


def test_a_rule_is_renamed_only_where_it_is_a_name():
    g = 'root ::= "{" space root-x "root" [root] # root\nroot-x ::= root | "a"'
    assert (
        rename_rule(g, "root", "tool-call")
        == 'tool-call ::= "{" space root-x "root" [root] # root\nroot-x ::= tool-call | "a"'
    )


def test_tool_requests_are_checked():
    req = ToolRequest({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert req.choice == "required" and req.named == "get_time"
    assert req.call_schema()["properties"]["name"] == {"const": "get_time"}
    assert "anyOf" in ToolRequest({"tools": TOOLS, "tool_choice": "required"}).call_schema()
    for body, param in (
        ({"tools": 5}, "tools"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tool_choice": "auto"}, "tool_choice"),
    ):
        with pytest.raises(HttpError) as e:
            ToolRequest(body)
        assert e.value.status == 400 and e.value.param == param, body
    assert template_renders_tools(TEMPLATE.read_text())
    assert not template_renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")


# --- through a route ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_route(embedded_model):
    from support.http_route import HttpRoute

    r = HttpRoute(embedded_model, head_extra=("--chat-template-file", str(TEMPLATE)))
    yield r
    r.stop()


ASK = [
    "What is the weather in Paris?",
    "Is it cold in Oslo right now?",
    "What time is it in Tokyo?",
    "Weather in Lyon, in fahrenheit please.",
    "What's the time in UTC?",
    "How warm is Rome today?",
]


def _validated(calls) -> list[tuple[str, dict]]:
    jsonschema = pytest.importorskip("jsonschema")
    out = []
    for call in calls:
        assert call.type == "function" and call.id
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


@pytest.mark.grpc
@pytest.mark.slow
def test_required_and_named_choices_answer_with_valid_calls(tool_route):
    client = tool_route.client
    model = client.models.list().data[0].id
    names = set()
    for i, question in enumerate(ASK):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=120,
            temperature=0 if i < 3 else 0.8,
            seed=i,
            parallel_tool_calls=i < 3,
        )  # sampled: one call (a small model
        # left to call on may fill max_tokens with calls)
        choice = r.choices[0]
        # parallel calls may fill max_tokens on some CPU's numerics: the calls that closed still count
        assert choice.finish_reason == "tool_calls" or (i < 3 and choice.finish_reason == "length"), (i, choice)
        calls = _validated(choice.message.tool_calls)
        assert calls
        names |= {n for n, _ in calls}
    assert names <= {"get_weather", "get_time"}
    for name in ("get_time", "get_weather"):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Paris, please."}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            max_tokens=120,
            temperature=0,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        assert [n for n, _ in _validated(r.choices[0].message.tool_calls)] == [name]


@pytest.mark.grpc
def test_a_tool_result_sent_back_gets_a_text_answer(tool_route):
    client = tool_route.client
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=0,
    )
    call = r.choices[0].message.tool_calls[0]
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=60, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert not choice.message.tool_calls and choice.message.content.strip()


@pytest.mark.grpc
def test_streamed_calls_assemble_into_the_whole_answers_calls(tool_route):
    client = tool_route.client
    model = client.models.list().data[0].id
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish, pieces, empty = None, 0, 0
    for i, chunk in enumerate(client.chat.completions.create(stream=True, **kw)):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        # the first chunk names the role (with OpenAI's empty content); no other sends empty content
        empty += i > 0 and delta.content == ""
        for d in delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            if d.function.name:
                c["name"] = d.function.name
            c["arguments"] += d.function.arguments or ""
            pieces += bool(d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and pieces > 1  # the arguments streamed as they were written
    assert empty == 0, f"{empty} chunks with empty content"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]


@pytest.mark.grpc
def test_tool_refusals_name_their_parameter(tool_route, embedded_model):
    for body, param in (
        ({"tools": 5}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ):
        status, reply = tool_route.raw(
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}),
        )
        assert status == 400 and reply["error"]["param"] == param, (body, reply)
        assert reply["error"]["type"] == "invalid_request_error"


@pytest.mark.grpc
def test_auto_answers_with_text_or_with_calls_that_parse(tool_route):
    """`auto` samples freely: whatever the model writes is either text or calls of the tools."""
    client = tool_route.client
    model = client.models.list().data[0].id
    for question in ("What is the weather in Paris?", "Say hello."):
        choice = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], tools=TOOLS, max_tokens=80, temperature=0
        ).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _validated(choice.message.tool_calls)
        else:
            assert "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"


def test_a_chat_template_file_is_checked(tmp_path):
    from llama_shard.cli import MAX_CHAT_TEMPLATE_BYTES, read_chat_template
    from llama_shard.errors import InvalidInputError

    assert "tool_call" in read_chat_template(str(TEMPLATE))
    cases = {
        "missing": None,
        "big": b"x" * (MAX_CHAT_TEMPLATE_BYTES + 1),
        "latin1": "{{ 'é' }}".encode("latin-1"),
        "syntax": b"{% for m in messages %}",
    }
    for name, data in cases.items():
        path = tmp_path / name
        if data is not None:
            path.write_bytes(data)
        with pytest.raises(InvalidInputError, match="chat-template-file"):
            read_chat_template(str(path))


@pytest.mark.grpc
def test_langchain_structured_output_and_bound_tools(tool_route):
    """langchain-openai against the endpoint: with_structured_output returns a validated object,
    bind_tools with a tool_choice returns a tool call."""
    langchain_openai = pytest.importorskip("langchain_openai")
    jsonschema = pytest.importorskip("jsonschema")
    model = tool_route.client.models.list().data[0].id
    llm = langchain_openai.ChatOpenAI(
        base_url=tool_route.base,
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=120,
        max_retries=0,
        timeout=120,
    )
    city = {
        "title": "city",
        "description": "A city and its country",
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}},
        "required": ["name", "country"],
        "additionalProperties": False,
    }
    answer = llm.with_structured_output(city).invoke("Name the capital of France as JSON.")
    jsonschema.validate(answer, city)
    message = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER)


def test_history_arguments_nested_past_the_recursion_limit_are_a_400():
    from llama_shard.head.openai.tool_calls import history_message

    deep = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "[" * 100000}}],
    }
    with pytest.raises(HttpError) as e:
        history_message(deep, "assistant", "")
    assert e.value.status == 400 and e.value.param == "messages"
