"""The OpenAI-compatible endpoint of a head worker (`serve --http-port`), driven by the official
`openai` client and by raw HTTP, against a live two-worker route of the embedded SmolLM2 on loopback.

What is shown here:
- chat and completions, streamed and not; a seeded completion equals the `Generate` stream's
  tokens for the same prompt tokens and parameters, and a chat's prompt is the GGUF template
  rendered in jinja2's sandbox (the same tokens as llama.cpp's own rendering of it);
- stop sequences are not in the text; EOG tokens end a chat with finish_reason "stop";
- a 20-turn conversation computes only each turn's new tokens (usage.prompt_tokens_details);
- speculative decoding per request (max_drafts), its drafts counted in usage.completion_tokens_details;
- bad requests each get their status in OpenAI's error shape (400 naming the parameter, 404, 413,
  401, 429) and the worker still serves; unknown fields are ignored; a closed connection stops the
  stream's compute; 100 concurrent requests past the limit get 429 and leave no stream behind.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time

import grpc
import pytest

from llama_shard._native import ShardModel
from llama_shard.head.openai.chat_template import ChatTemplate
from llama_shard.head.openai.errors import HttpError
from llama_shard.head.openai.requests import sampling_from
from llama_shard.head.openai.responses import StopTrimmer as _StopTrimmer
from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_for_port, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc

from support.prompts import REPEAT  # a text to rewrite: its answer repeats the prompt, drafts pay

openai = pytest.importorskip("openai")
from support.http_route import HttpRoute  # noqa: E402 - after the openai check

pytestmark = pytest.mark.grpc

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def route(embedded_model):
    r = HttpRoute(embedded_model)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def vocab(embedded_model):
    return ShardModel(str(embedded_model), (0, 0), 1)


def test_models_and_health(route):
    assert [m.id for m in route.client.models.list().data] == [MODEL_ID]
    assert route.client.models.retrieve(MODEL_ID).id == MODEL_ID
    got, answer = route.raw("GET", "/v1/models/gpt-9")
    assert got == 404 and answer["error"]["code"] == "model_not_found"
    assert route.raw("GET", "/health") == (200, {"status": "ok"})


def test_the_endpoint_and_generate_chat_render_a_conversation_the_same(route, embedded_model):
    """One prompt for one conversation: `generate --chat` (one process, the whole model) and the
    endpoint (a two-worker route) render a chat with the model's own template, its system prompt
    included, and answer the same tokens at temperature 0."""
    import subprocess
    import sys

    question = "What is the capital of France?"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "generate",
            "--model",
            str(embedded_model),
            "--prompt",
            question,
            "--chat",
            "--max-tokens",
            "12",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    got, answer = route.raw(
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0}),
    )
    # where the answer ends is the model's choice on this CPU's kernels (8 tokens and EOS on zen4's):
    # both ways must end at the same token, whichever it is
    used, finish = answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]
    assert got == 200 and 1 <= used <= 12 and finish == ("length" if used == 12 else "stop"), answer
    assert cli.stdout.strip() == answer["choices"][0]["message"]["content"].strip()
    assert f"prompt {answer['usage']['prompt_tokens']} tokens" in cli.stderr


def test_logprobs_carry_each_tokens_own_bytes_and_text_offsets(route, vocab):
    """A token inside a UTF-8 character has no text of its own: its logprob's bytes are its own
    bytes, not U+FFFD's; a completion's text_offset is where each token starts in its text."""
    emoji = vocab.tokenize("🙂", add_special=False)
    partial = next(t for t in emoji if vocab.token_bytes(t) and vocab.detokenize([t]) == "\ufffd")
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": True,
        "logit_bias": {str(partial): 100},
    }
    got, answer = route.raw("POST", "/v1/chat/completions", json.dumps(chat))
    assert got == 200, answer
    (entry,) = answer["choices"][0]["logprobs"]["content"]
    assert entry["bytes"] == list(vocab.token_bytes(partial)) and entry["bytes"] != list("\ufffd".encode())
    got, answer = route.raw(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "The three primary colors are", "max_tokens": 6, "temperature": 0, "logprobs": 1}),
    )
    lp = answer["choices"][0]["logprobs"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert "".join(lp["tokens"]) == answer["choices"][0]["text"]
    # through a character split over tokens (the grammar makes the model spell it): each token's offset
    # is the character it belongs to, counted in the completion's text
    got, answer = route.raw(
        "POST",
        "/v1/completions",
        json.dumps(
            {"prompt": "Smile:", "max_tokens": 12, "temperature": 0, "logprobs": 0, "grammar": 'root ::= "a🙂🙂b"'}
        ),
    )
    assert got == 200, answer
    text, lp = answer["choices"][0]["text"], answer["choices"][0]["logprobs"]
    assert text == "a🙂🙂b"
    ids, same, _ = route.generate(
        vocab.tokenize("Smile:"),
        max_tokens=12,
        stop_token_ids=vocab.eog_tokens,
        sampling=pb.Sampling(temperature=0, grammar='root ::= "a🙂🙂b"'),
    )
    assert same.startswith(text) and len(ids) == len(lp["tokens"])  # the same tokens (the end's too): their bytes
    pieces = [vocab.token_bytes(t) for t in ids]
    expected = [len(b"".join(pieces[:i]).decode("utf-8", errors="ignore")) for i in range(len(pieces))]
    assert lp["text_offset"] == expected and len(set(expected)) < len(expected), (lp, expected)


def test_tokenize_and_detokenize_as_llama_server_has_them(route, vocab):
    text = "The capital of France is Paris."
    got, answer = route.raw("POST", "/tokenize", json.dumps({"content": text}))
    assert got == 200 and answer["tokens"] == vocab.tokenize(text, add_special=False)
    got, answer = route.raw(
        "POST", "/tokenize", json.dumps({"content": text, "add_special": True, "with_pieces": True})
    )
    assert got == 200 and [t["id"] for t in answer["tokens"]] == vocab.tokenize(text)
    assert "".join(t["piece"] for t in answer["tokens"] if t["id"] != vocab.token_bos_added) == text
    got, answer = route.raw("POST", "/detokenize", json.dumps({"tokens": vocab.tokenize(text, add_special=False)}))
    assert got == 200 and answer["content"] == text
    for path, body, param in (
        ("/tokenize", {"content": 5}, "content"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ):
        got, answer = route.raw("POST", path, json.dumps(body))
        assert got == 400 and answer["error"]["param"] == param, (path, body, answer)
    got, answer = route.raw("GET", "/tokenize")
    assert got == 405 and answer["error"]["type"] == "invalid_request_error"


def test_apply_template_props_and_metrics_as_llama_server_has_them(route, vocab):
    """/apply-template gives the prompt a chat request generates from, /props the context and the
    template, /metrics the worker's Prometheus metrics on the HTTP port too."""
    from llama_shard.head.openai.chat_template import ModelChat

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    got, answer = route.raw("POST", "/apply-template", json.dumps({"messages": messages}))
    assert got == 200 and answer["prompt"] == ModelChat(vocab).text(messages)
    for body, param in (
        ({"messages": "hi"}, "messages"),
        ({"messages": messages, "frob": 1}, "frob"),
        ({"messages": messages, "tools": 5}, "tools"),
    ):
        got, answer = route.raw("POST", "/apply-template", json.dumps(body))
        assert got == 400 and answer["error"]["param"] == param, (body, answer)
    got, props = route.raw("GET", "/props")
    assert got == 200 and props["n_ctx"] == 1024 and props["chat_template"] == vocab.chat_template
    assert props["model_alias"] == MODEL_ID and props["total_slots"] >= 1
    assert props["default_generation_settings"]["params"]["repeat_last_n"] == 64
    conn = http.client.HTTPConnection("127.0.0.1", route.http_port, timeout=30)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    assert "llama_shard_" in text and "# TYPE" in text


def test_a_seeded_completion_equals_the_generate_stream(route, vocab):
    prompt = vocab.tokenize("Once upon a time, in a small village,")
    params = dict(temperature=0.8, top_p=0.9, seed=42, extra_body={"top_k": 40})  # top_k: llama.cpp's extension
    r = route.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, logprobs=1, **params)
    ids, text, final = route.generate(
        prompt,
        max_tokens=24,
        stop_token_ids=vocab.eog_tokens,
        sampling=pb.Sampling(temperature=0.8, top_p=0.9, top_k=40, seed=42),
    )
    assert r.choices[0].text == text
    assert r.choices[0].logprobs.tokens == [vocab.detokenize([t]) for t in ids]
    assert r.usage.completion_tokens == final.completion_tokens == len(ids)
    assert r.choices[0].finish_reason == ("length" if final.finish_reason == "length" else "stop")
    # the same request again, streamed: the same text
    chunks = route.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, stream=True, **params)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_chat_renders_the_gguf_template_and_streams_what_it_answers(route, vocab):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    rendered = ChatTemplate(vocab.chat_template, "", vocab.detokenize([vocab.token_eos])).render(messages)
    assert rendered == vocab.apply_chat_template([(m["role"], m["content"]) for m in messages], True)
    prompt = vocab.tokenize(rendered)
    r = route.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=40, temperature=0)
    ids, text, final = route.generate(prompt, max_tokens=40, stop_token_ids=vocab.eog_tokens)
    if final.finish_reason == "stop":  # an EOG token: its text is not part of the answer
        text = text[: len(text) - len(vocab.detokenize([ids[-1]]))]
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if final.finish_reason == "stop" else "length")
    assert r.usage.prompt_tokens == len(prompt) and r.id.startswith("chatcmpl-")
    stream = route.client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != r.id


def test_stop_sequences_are_not_in_the_text(route):
    prompt = "The three primary colors are"
    full = route.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    r = route.client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "zzzz"]
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    chunks = route.client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut


def test_stop_trimmer_holds_back_what_may_begin_a_stop():
    t = _StopTrimmer(["END"])
    out = [t.feed(p) for p in ["abc E", "N", "x E", "ND more"]]
    assert "".join(out) == "abc ENx " and t.stopped and t.flush() == ""
    t = _StopTrimmer([])
    assert t.feed("a") + t.feed("b") + t.flush() == "ab"


def test_a_twenty_turn_chat_computes_only_each_turns_new_tokens(route):
    messages = [{"role": "system", "content": "You answer in one short sentence."}]
    computed, prompts = [], []
    for turn in range(20):
        messages.append({"role": "user", "content": f"Tell me fact number {turn + 1} about the sea."})
        r = route.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8, temperature=0)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        prompts.append(r.usage.prompt_tokens)
        computed.append(r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens)
    assert prompts[-1] > 300 and computed[0] == prompts[0]
    # each later turn: its new user message, the template's markers, and the end of the last answer
    assert all(c <= 30 for c in computed[1:]), computed


def test_bad_requests_get_their_status_and_the_worker_still_serves(route):
    ok = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2}
    cases = [
        (b"{not json", 400, None),
        (json.dumps([1, 2]), 400, None),
        (json.dumps(ok | {"temperature": "hot"}), 400, "temperature"),
        ('{"model": "%s", "prompt": "Hi", "temperature": NaN}' % MODEL_ID, 400, "temperature"),
        (json.dumps(ok | {"temperature": -0.5}), 400, "temperature"),
        (json.dumps(ok | {"top_p": 0}), 400, "top_p"),
        (json.dumps(ok | {"max_tokens": 0}), 400, "max_tokens"),
        (json.dumps(ok | {"max_tokens": True}), 400, "max_tokens"),
        (json.dumps(ok | {"n": 2}), 400, "n"),
        (json.dumps(ok | {"stop": ["x"] * 17}), 400, "stop"),
        (json.dumps(ok | {"prompt": ""}), 400, "prompt"),
        (json.dumps(ok | {"prompt": [1, 10**9]}), 400, "prompt"),
        (json.dumps(ok | {"logprobs": 21}), 400, "logprobs"),
        (json.dumps(ok | {"max_tokens": 5000}), 400, None),  # beyond the context: the Generate check
        (json.dumps(ok | {"model": "gpt-9"}), 404, "model"),
    ]
    for body, status, param in cases:
        got, answer = route.raw("POST", "/v1/completions", body)
        assert got == status, (body, got, answer)
        assert set(answer["error"]) >= {"message", "type", "param", "code"} and answer["error"]["message"]
        if param:
            assert answer["error"]["param"] == param, (body, answer)
    # lone surrogates ("\ud800" escapes) and a session id that is not printable ASCII: 400, not a 500
    for body in ('{"prompt": "hi \\ud800 there", "max_tokens": 2}', '{"prompt": "hi", "stop": ["\\udfff"]}'):
        got, answer = route.raw("POST", "/v1/completions", body)
        assert got == 400 and "Unicode" in answer["error"]["message"], (body, answer)
    got, answer = route.raw("POST", "/v1/completions", json.dumps(ok | {"max_tokens": 5000}))
    assert got == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    got, answer = route.raw("POST", "/v1/completions", json.dumps(ok), {"X-Session-Id": "\xff\xfe"})
    assert got == 400 and answer["error"]["param"] == "X-Session-Id"
    got, answer = route.raw("POST", "/v1/chat/completions", json.dumps({"model": MODEL_ID, "messages": "hi"}))
    assert got == 400 and answer["error"]["param"] == "messages"
    assert route.raw("GET", "/v2/anything")[0] == 404
    assert route.raw("GET", "/v1/chat/completions")[0] == 405
    got, answer = route.raw("POST", "/v1/completions", b"x" * (10 * 2**20))
    assert got == 413 and answer["error"]["type"] == "invalid_request_error"
    # nothing accepted that is not done: an unknown key, or one this endpoint does not do, is a 400
    # naming it (as OpenAI answers an unknown one), on both endpoints
    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for path, base in (("/v1/completions", ok), ("/v1/chat/completions", chat)):
        for extra in (
            {"frobnicate": {"a": 1}},
            {"response_format": {"type": "json"}},
            {"tools": []},
            {"tool_choice": "none"},
            {"grammar": "root ::= \"a\"{2,1}"},
            {"logit_bias": {"one": 1}},
            {"logit_bias": {"1": 101}},
            {"logit_bias": {"1": "x"}},
            {"logit_bias": {str(10**9): 1}},
            {"logit_bias": [[1, 1]]},
            {"logit_bias": {"-1": 1}},
            {"logit_bias": {"--5": 1}},
            {"logit_bias": {"1": 10**400}},
        ):
            got, answer = route.raw("POST", path, json.dumps(base | extra))
            (key,) = extra
            assert got == 400 and answer["error"]["param"] == key, (path, extra, answer)
            assert answer["error"]["type"] == "invalid_request_error" and key in answer["error"]["message"]
    # tools with a template that renders none (SmolLM2's own): a 400, never prose
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for choice in ("auto", "required"):
        got, answer = route.raw(
            "POST", "/v1/chat/completions", json.dumps(chat | {"tools": [tool], "tool_choice": choice})
        )
        assert got == 400 and answer["error"]["param"] == "tools" and "template" in answer["error"]["message"], answer
    for path, base, wrong in (("/v1/completions", ok, "top_logprobs"), ("/v1/chat/completions", chat, "echo")):
        got, answer = route.raw("POST", path, json.dumps(base | {wrong: 0}))  # the other endpoint's key
        assert got == 400 and answer["error"]["param"] == wrong, (path, answer)
    # those accepted without effect by nature; the worker served through all of it
    quiet = {
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "temperature": 0,
        "ignore_eos": True,
    }
    got, answer = route.raw("POST", "/v1/completions", json.dumps(ok | quiet))
    assert got == 200 and answer["usage"]["completion_tokens"] == 2
    got, answer = route.raw("POST", "/v1/chat/completions", json.dumps(chat | quiet))
    assert got == 200 and answer["usage"]["completion_tokens"] == 2
    assert route.info().generate_streams == 0


def test_every_parameter_is_in_the_readme_table():
    """The README's table of the endpoint's parameters names each one the endpoint takes."""
    from llama_shard.head.openai.requests import PARAMETERS

    from conftest import REPO

    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in PARAMETERS if f"| `{p.name}` |" not in readme]
    assert not missing, f"not in the README's parameter table: {missing}"


def test_drafts_per_request_and_their_counts_in_usage(route):
    """max_drafts (0 off, else the most per step) is a request's own, as in Generate; usage reports the
    drafts in OpenAI's fields for predicted tokens; greedy text is the same with drafts and without."""
    ask = dict(model=MODEL_ID, prompt=REPEAT, max_tokens=40, temperature=0)
    plain = route.client.completions.create(**ask, extra_body={"max_drafts": 0})
    spec = route.client.completions.create(**ask)  # the worker's default: prompt lookup, up to 8
    assert spec.choices[0].text == plain.choices[0].text
    details, off = spec.usage.completion_tokens_details, plain.usage.completion_tokens_details
    assert (off.accepted_prediction_tokens, off.rejected_prediction_tokens) == (0, 0)
    assert details.accepted_prediction_tokens > details.rejected_prediction_tokens  # a rewrite: mostly right
    chunks = list(
        route.client.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}, extra_body={"max_drafts": 4}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    for bad in (16, -1, 2.5, "4", True):
        got, answer = route.raw(
            "POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "max_drafts": bad})
        )
        assert got == 400 and answer["error"]["param"] == "max_drafts", (bad, answer)


def test_sampling_parameters_are_typed_here_and_ranged_once_by_the_native_check(route):
    s = sampling_from({"temperature": 0.5, "top_k": 3, "min_p": 0.1, "repeat_penalty": 1.1, "seed": 7}, 4096)
    assert (s.temperature, s.top_k, s.seed) == (0.5, 3, 7) and not s.HasField("top_p")
    for body in ({"top_k": 1.5}, {"seed": "x"}, {"min_p": float("inf")}, {"repeat_last_n": 1 << 40}):
        with pytest.raises(HttpError) as e:
            sampling_from(body, 4096)
        assert e.value.status == 400 and e.value.param == next(iter(body))
    # a range is the native check's alone (SamplingParams.problem), asked once when the stream opens;
    # its refusal names the request's own key (repeat_last_n is the wire's penalty_last_n)
    for key, bad in (
        ("temperature", -1),
        ("top_p", 0),
        ("presence_penalty", 300),
        ("repeat_last_n", -2),
        ("top_k", 1 << 30),
        ("repeat_penalty", 0),
    ):
        got, answer = route.raw("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, key: bad}))
        assert got == 400 and answer["error"]["param"] == key, (key, answer)
    for body, key in (({"stop": ["x"] * 17}, "stop"), ({"logprobs": 21}, "logprobs")):
        got, answer = route.raw("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, **body}))
        assert got == 400 and answer["error"]["param"] == key, (key, answer)
    got, answer = route.raw(
        "POST",
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 21}
        ),
    )
    assert got == 400 and answer["error"]["param"] == "top_logprobs", answer


def test_logit_bias_moves_the_sampled_tokens_at_the_tail(route, vocab):
    """logit_bias reaches the tail's chain: -100 on the greedy first token changes it, +100 on another
    makes it the first, on the wire and on both endpoints; a bias of 0 changes nothing."""
    ids = vocab.tokenize("The capital of France is")
    greedy, _, _ = route.generate(ids, max_tokens=1, sampling=pb.Sampling(temperature=0))
    (lyon,) = vocab.tokenize(" Lyon", add_special=False)[:1]
    assert lyon != greedy[0]

    def wire(bias: dict[int, float]) -> tuple[list[int], str]:
        out, text, final = route.generate(
            ids,
            max_tokens=1,
            sampling=pb.Sampling(temperature=0, logit_bias=[pb.TokenBias(token_id=t, bias=b) for t, b in bias.items()]),
        )
        assert final.finish_reason == "length", final
        return out, text

    assert wire({greedy[0]: 0.0})[0] == greedy
    assert wire({greedy[0]: -100.0})[0] != greedy
    forced, forced_text = wire({lyon: 100.0})
    assert forced == [lyon]

    def http(path: str, body: dict) -> str:
        got, answer = route.raw("POST", path, json.dumps(body | {"max_tokens": 1, "temperature": 0}))
        assert got == 200, answer
        choice = answer["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    plain = http("/v1/completions", {"prompt": ids})
    assert http("/v1/completions", {"prompt": ids, "logit_bias": {str(greedy[0]): 0}}) == plain
    assert http("/v1/completions", {"prompt": ids, "logit_bias": {str(greedy[0]): -100}}) != plain
    assert http("/v1/completions", {"prompt": ids, "logit_bias": {str(lyon): 100}}) == forced_text
    chat = {"messages": [{"role": "user", "content": "Name a city."}]}
    assert http("/v1/chat/completions", chat | {"logit_bias": {str(lyon): 100}}) == forced_text


def test_the_template_sandbox_refuses_reaching_python():
    template = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "", "")
    with pytest.raises(HttpError) as e:
        template.render([{"role": "user", "content": "x"}])
    assert e.value.status == 400
    raising = ChatTemplate("{{ raise_exception('roles must alternate') }}", "", "")
    with pytest.raises(HttpError, match="roles must alternate"):
        raising.render([])


def test_a_closed_connection_stops_the_streams_compute(route):
    body = json.dumps(
        {
            "model": MODEL_ID,
            "prompt": "Count to a thousand:",
            "max_tokens": 900,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    sock = socket.create_connection(("127.0.0.1", route.http_port), timeout=60)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    received = b""
    while received.count(b"data: ") < 5:
        received += sock.recv(4096)
    assert route.info().generate_streams == 1
    sock.close()
    deadline = time.monotonic() + 10
    while route.info().generate_streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert route.info().generate_streams == 0
    steps = route.info().engine_steps
    time.sleep(0.5)
    assert route.info().engine_steps == steps  # nothing computes for the closed stream
    # the same without streaming: no write fails, the closed connection is seen at the next token
    body = json.dumps(
        {"model": MODEL_ID, "prompt": "Count to a thousand:", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    )
    sock = socket.create_connection(("127.0.0.1", route.http_port), timeout=60)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    deadline = time.monotonic() + 10
    while not route.info().generate_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    sock.close()
    deadline = time.monotonic() + 5  # 900 tokens would take far longer
    while route.info().generate_streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert route.info().generate_streams == 0


@pytest.mark.slow
def test_a_hundred_requests_past_the_limits_get_429_and_leave_nothing(embedded_model):
    r = HttpRoute(embedded_model, head_extra=("--max-concurrent-rpcs", "4", "--max-sessions", "4"))
    try:
        statuses: list[int] = []

        def call(i: int) -> None:
            statuses.append(
                r.raw(
                    "POST",
                    "/v1/completions",
                    json.dumps({"model": MODEL_ID, "prompt": f"Story {i}:", "max_tokens": 8, "temperature": 0}),
                )[0]
            )

        threads = [threading.Thread(target=call, args=(i,)) for i in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(statuses) <= {200, 429} and statuses.count(200) >= 4 and statuses.count(429) >= 1, statuses
        assert r.info().generate_streams == 0
        assert r.client.completions.create(model=MODEL_ID, prompt="Still there?", max_tokens=2).usage.completion_tokens
    finally:
        r.stop()


def test_a_model_without_a_chat_template_serves_completions_only(synthetic_model):
    port = free_port()
    proc, addr = start_worker(synthetic_model, 0, 5, 1, extra=("--http-port", str(port)))
    try:
        wait_serving(proc, addr)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as client:
            model_id = client.models.list().data[0].id
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}])
            r = client.completions.create(model=model_id, prompt=[1, 2, 3], max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4
    finally:
        stop_worker(proc)


@pytest.mark.slow
def test_bearer_tokens_over_tls(embedded_model, tmp_path):
    from llama_shard.testing.certs import CertificateAuthority

    ca = CertificateAuthority.create(tmp_path, "http-ca")
    server = ca.issue("worker", server=True)
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:alice-secret-token-123456\nbob:bob-secret-token-1234567890\n")
    port = free_port()
    proc, addr = start_worker(
        embedded_model,
        0,
        29,
        1,
        extra=(
            "--tls-cert",
            str(server.cert),
            "--tls-key",
            str(server.key),
            "--auth-token-file",
            str(tokens),
            "--http-port",
            str(port),
            "--context-tokens",
            "256",
            "--max-sessions-per-principal",
            "2",
        ),
    )
    try:
        wait_for_port(proc, port)  # a TLS worker's health check needs credentials: wait for the HTTP port
        base = f"https://localhost:{port}/v1"
        trust = ssl.create_default_context(cafile=str(ca.cert))

        def client(key: str):
            return openai.OpenAI(
                base_url=base, api_key=key, max_retries=0, http_client=openai.DefaultHttpxClient(verify=trust)
            )

        with client("wrong-token") as wrong, pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2)
        prompt = "A conversation only alice has had so far, about the sea and its tides."
        fixed = dict(model=MODEL_ID, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
        with client("alice-secret-token-123456") as alice, client("bob-secret-token-1234567890") as bob:
            assert alice.completions.create(prompt=prompt, **fixed).usage.completion_tokens == 2
            again = alice.completions.create(prompt=prompt + " More", **fixed)
            assert again.usage.prompt_tokens_details.cached_tokens > 10  # alice continues her own session
            # bob sends the same conversation: he never continues alice's session
            theirs = bob.completions.create(prompt=prompt + " More", **fixed)
            assert theirs.usage.prompt_tokens_details.cached_tokens == 0
            # at her cap of 2 sessions, alice's new conversations take over her least recently used
            # one (not a 429 until a TTL); bob's session is not hers to take
            for topic in ("mountains", "rivers", "deserts"):
                other = alice.completions.create(
                    prompt=f"An unrelated question about {topic}, far from the sea.", **fixed
                )
                assert other.usage.completion_tokens == 2
            assert (
                bob.completions.create(prompt=prompt + " More", **fixed).usage.prompt_tokens_details.cached_tokens > 10
            )
        status, answer = _https_status(port, ca.cert)
        assert status == 401 and answer["error"]["type"] == "authentication_error"
    finally:
        stop_worker(proc)


@pytest.mark.slow
def test_mutual_tls_and_certificates_followed_on_disk(embedded_model, tmp_path):
    """--tls-client-ca on the HTTP port: a client certificate is the credential (its CN the
    principal), a client without one does not get through the handshake; the port follows its
    files as the gRPC port does: after the server certificate and the client CA are replaced
    (another CA), new connections get the new certificate and the old CA's clients are refused."""
    import shutil

    from llama_shard.testing.certs import CertificateAuthority

    old, new = CertificateAuthority.create(tmp_path, "old-ca"), CertificateAuthority.create(tmp_path, "new-ca")
    live = {name: tmp_path / f"live-{name}" for name in ("cert", "key", "ca")}
    server = old.issue("worker", server=True)
    for name, src in (("cert", server.cert), ("key", server.key), ("ca", old.cert)):
        shutil.copy(src, live[name])
    port = free_port()
    proc, _ = start_worker(
        embedded_model,
        0,
        29,
        1,
        extra=(
            "--tls-cert",
            str(live["cert"]),
            "--tls-key",
            str(live["key"]),
            "--tls-client-ca",
            str(live["ca"]),
            "--http-port",
            str(port),
            "--context-tokens",
            "256",
        ),
    )
    try:
        wait_for_port(proc, port)

        def client(ca, identity=None):
            trust = ssl.create_default_context(cafile=str(ca.cert))
            if identity is not None:
                trust.load_cert_chain(identity.cert, identity.key)
            return openai.OpenAI(
                base_url=f"https://localhost:{port}/v1",
                api_key="unused",
                max_retries=0,
                http_client=openai.DefaultHttpxClient(verify=trust),
            )

        def tls12(identity):
            ctx = ssl.create_default_context(cafile=str(old.cert))
            ctx.maximum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(identity.cert, identity.key)
            return ctx

        def models_over_tls12(ctx, session=None):
            """GET /v1/models on a TLS 1.2 connection (resuming `session` if given): (status, its
            session, whether it was resumed)."""
            with (
                socket.create_connection(("127.0.0.1", port), timeout=30) as raw,
                ctx.wrap_socket(raw, server_hostname="localhost", session=session) as tls,
            ):
                tls.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := tls.recv(65536):
                    answer += chunk
                return int(answer.split(b" ", 2)[1]), tls.session, tls.session_reused

        fixed = dict(model=MODEL_ID, prompt="Hello", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
        carol_id = old.issue("carol")
        with client(old, carol_id) as carol:
            assert carol.completions.create(**fixed).usage.completion_tokens == 2
        carol_tls12 = tls12(carol_id)
        status, carol_session, _ = models_over_tls12(carol_tls12)
        assert status == 200
        with client(old) as anonymous, pytest.raises(openai.APIConnectionError):
            anonymous.completions.create(**fixed)
        # rotation: a new CA for the server certificate and for the clients
        rotated = new.issue("worker", server=True)
        time.sleep(0.01)  # a new modification time
        for name, src in (("cert", rotated.cert), ("key", rotated.key), ("ca", new.cert)):
            shutil.copy(src, live[name])
        with client(new, new.issue("dave")) as dave:
            assert dave.completions.create(**fixed).usage.completion_tokens == 2
        with client(new, old.issue("carol")) as stale, pytest.raises(openai.APIConnectionError):
            stale.completions.create(**fixed)  # the old CA's client is no longer trusted
        with client(old, old.issue("carol")) as carol, pytest.raises(openai.APIConnectionError):
            carol.completions.create(**fixed)  # nor is the old server certificate served
        try:  # nor does a TLS 1.2 session of the old CA's client resume past the change
            status, _, resumed = models_over_tls12(carol_tls12, carol_session)
            assert resumed and status == 401
        except ssl.SSLError:
            pass  # not resumed: a full handshake, refused
    finally:
        stop_worker(proc)


def _https_status(port: int, ca_cert) -> tuple[int, dict]:
    """A request without credentials over TLS."""
    conn = http.client.HTTPSConnection(
        "localhost", port, timeout=30, context=ssl.create_default_context(cafile=str(ca_cert))
    )
    try:
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_an_unreachable_tail_is_a_503_naming_the_stage(embedded_model):
    port = free_port()
    # the peer's port stays bound and never listens: refused for the whole test (a port only found
    # free could be taken meanwhile; once, a worker answered there and /health said ok)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    proc, addr = start_worker(
        embedded_model,
        0,
        14,
        1,
        extra=("--peer", f"127.0.0.1:{dead.getsockname()[1]}", "--http-port", str(port), "--max-hop-seconds", "5"),
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        wait_serving(proc, addr, route_up=False)  # NOT_SERVING: its only later stage never answered
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "Hi", "max_tokens": 2}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert resp.status == 503 and "stage 1" in answer["error"]["message"], answer
        assert answer["error"]["type"] == "server_error"
        conn.request("GET", "/health")  # the truth: the route cannot serve, and which stage is missing
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert resp.status == 503 and "stage 1 (layers 15-29)" in answer["error"]["message"], answer
    finally:
        conn.close()  # (a failure must not leave its socket to the next test's garbage collection)
        stop_worker(proc)
        dead.close()


def test_http_needs_the_head(embedded_model):
    proc, _ = start_worker(embedded_model, 15, 29, 1, extra=("--http-port", str(free_port())))
    code, stderr = stop_worker(proc, send_sigterm=False)
    assert code == 2 and "needs the head worker" in stderr


class _HostileTail(pb_grpc.ShardServiceServicer):
    """A 'tail' that answers every step OK with the token it is told to, and top log-probabilities
    naming ids outside the vocabulary: what a compromised or buggy peer could send the head."""

    def __init__(self):
        self.token = 42

    def _reply(self, step: pb.StepRequest) -> pb.StepReply:
        n = step.hidden.shape[0] if step.hidden.shape else 1
        alternatives = [pb.TokenLogprob(token_id=t, logprob=-1.0) for t in (-7, 10**9, 42, 3, 2**31 - 1)]
        return pb.StepReply(
            outcome=pb.OUTCOME_OK,
            token_id=self.token,
            seq_len=step.position + n,
            logprob=-0.5,
            top_logprobs=alternatives,
        )

    def StepBatch(self, request, context):
        return pb.StepBatchReply(replies=[self._reply(b.step) for b in request.steps])

    def Info(self, request, context):  # the head's probe: layers 15-29 of SmolLM2
        return pb.InfoReply(architecture="llama", n_layer=30, first=15, last=29, n_embd=576, max_sessions=8)

    def Prefill(self, request, context):
        return self._reply(request)

    def Decode(self, request, context):
        return self._reply(request)


def test_a_hostile_tail_cannot_make_the_endpoint_fail_or_lie(embedded_model, vocab):
    """Top log-probabilities naming ids outside the vocabulary are dropped (not detokenized); a
    token outside the vocabulary ends the request with a 500 in OpenAI's shape; the worker serves on."""
    from concurrent import futures

    tail = _HostileTail()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ShardServiceServicer_to_server(tail, server)
    tail_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    http_port = free_port()
    head, head_addr = start_worker(
        embedded_model,
        0,
        14,
        1,
        extra=("--context-tokens", "256", "--peer", f"127.0.0.1:{tail_port}", "--http-port", str(http_port)),
    )
    try:
        wait_serving(head, head_addr)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        fixed = dict(model=MODEL_ID, prompt="Hello there", max_tokens=3, extra_body={"ignore_eos": True})
        r = client.completions.create(logprobs=5, **fixed)
        assert r.choices[0].logprobs.tokens == [vocab.detokenize([42])] * 3
        assert all(
            set(alts) <= {vocab.detokenize([42]), vocab.detokenize([3])} for alts in r.choices[0].logprobs.top_logprobs
        )
        tail.token = 10**9
        with pytest.raises(openai.InternalServerError, match="outside the vocabulary"):
            client.completions.create(**fixed)
        tail.token = 42
        assert client.completions.create(**fixed).usage.completion_tokens == 3
        client.close()
    finally:
        stop_worker(head)
        server.stop(0)
