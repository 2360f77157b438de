"""Structured output: the tail samples under llama.cpp's grammar sampler, and a JSON Schema becomes
GBNF by the pinned llama.cpp's own converter (common/json-schema-to-grammar, compiled natively).

What is shown here:
- the sampler: only what the grammar allows is sampled, then only end-of-generation tokens; at
  temperature 0 the argmax path picks the token the masked row picks; a sampler rebuilt from
  (params, history, draws, generated tokens) samples the same token (a retried step, a re-prefill,
  a failover); a token the grammar refuses is refused with nothing changed (llama.cpp itself would
  throw, or abort on an end-of-generation token);
- hostile grammars and schemas (deep nesting, {m,n} with m > n, huge repetitions, left recursion,
  NUL bytes, too large) are refused before llama.cpp's parser sees them or by it, in a subprocess
  that must survive them all;
- through a live route with the official `openai` client: 20 requests with a JSON Schema of our
  own (nested object, enum, array, required fields) all parse and validate (jsonschema), json_object
  parses, streamed equals not streamed at temperature 0, and every refusal names its parameter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from llama_shard._native import SamplingParams, ShardModel, TokenSampler, grammar_problem, json_schema_to_grammar
from llama_shard.errors import InvalidInputError

YES_NO = 'root ::= ("yes" | "no") "!"'


@pytest.fixture(scope="module")
def vocab(embedded_model):
    return ShardModel(str(embedded_model), (0, 0), 1)


def _sample_text(vocab, params: SamplingParams, n: int, seed: int = 0) -> tuple[list[int], str]:
    n_vocab = vocab.info.n_vocab
    rng = np.random.default_rng(seed)
    s = TokenSampler(n_vocab, params, 4096, model=vocab)
    out = []
    for _ in range(n):
        token = s.sample((rng.standard_normal(n_vocab) * 4).astype(np.float32))
        s.accept_sampled(token)
        out.append(token)
        if token in vocab.eog_tokens:
            break
    return out, vocab.detokenize([t for t in out if t not in vocab.eog_tokens])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_only_what_the_grammar_allows_is_sampled_then_the_end(vocab, temperature):
    for seed in range(4):
        tokens, text = _sample_text(
            vocab, SamplingParams(temperature=temperature, seed=seed + 1, grammar=YES_NO), 12, seed
        )
        assert text in ("yes!", "no!"), (tokens, text)
        assert tokens[-1] in vocab.eog_tokens  # complete: only the end may follow


def test_the_argmax_path_picks_what_the_masked_row_picks(vocab):
    """Temperature 0 tries the argmax first and masks the row only when the grammar refuses it:
    the same tokens as the whole chain over the masked row (top_k = n_vocab keeps every token and
    takes the whole chain)."""
    for seed in range(3):
        fast = _sample_text(vocab, SamplingParams(temperature=0.0, grammar=YES_NO), 12, seed)
        whole = _sample_text(vocab, SamplingParams(temperature=0.0, top_k=vocab.info.n_vocab, grammar=YES_NO), 12, seed)
        assert fast == whole


def test_a_rebuilt_sampler_replays_the_grammar_and_samples_the_same(vocab):
    n_vocab = vocab.info.n_vocab
    params = SamplingParams(
        temperature=0.9, seed=5, penalty_repeat=1.1, grammar='root ::= "[" [0-9]+ ("," [0-9]+)* "]"'
    )
    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((16, n_vocab)) * 3).astype(np.float32)
    prompt = [1, 2, 3]
    s = TokenSampler(n_vocab, params, 4096, history=prompt, model=vocab)
    tokens = []
    for row in rows:
        t = s.sample(row)
        s.accept_sampled(t)
        tokens.append(t)
    for k in (1, 5, 11):
        rebuilt = TokenSampler(
            n_vocab, params, 4096, history=(prompt + tokens[:k])[-64:], draws=k, model=vocab, generated=tokens[:k]
        )
        assert rebuilt.sample(rows[k]) == tokens[k]
    with pytest.raises(InvalidInputError, match="replays every sampled token"):
        TokenSampler(n_vocab, params, 4096, draws=3, model=vocab, generated=tokens[:2])
    with pytest.raises(InvalidInputError, match="vocabulary"):
        TokenSampler(n_vocab, params, 4096)  # a grammar needs the model's vocabulary


def test_a_model_without_a_tokenizer_refuses_a_grammar_cleanly(synthetic_model):
    model = ShardModel(str(synthetic_model), (0, 0), 1)
    assert "no tokenizer" in grammar_problem(model, 'root ::= "a"')
    with pytest.raises(InvalidInputError, match="no tokenizer"):
        TokenSampler(model.info.n_vocab, SamplingParams(grammar='root ::= "a"'), 4096, model=model)


RISKY_TOKENS = """
import numpy as np
from llama_shard._native import SamplingParams, ShardModel, TokenSampler
from llama_shard.errors import InvalidInputError
vocab = ShardModel({path!r}, (0, 0), 1)
n = vocab.info.n_vocab
eog = vocab.eog_tokens[0]
x = vocab.tokenize("x", add_special=False)[0]
yes = vocab.tokenize("yes", add_special=False)
s = TokenSampler(n, SamplingParams(temperature=0.0, grammar='root ::= "yes!"'), 4096, model=vocab)
refused = 0
for token in (eog, x, -1, n):  # an end before the grammar is complete aborts llama.cpp; x throws there
    try:
        s.accept_sampled(token)
    except InvalidInputError:
        refused += 1
for kwargs in ({{"draws": 1, "generated": [eog]}}, {{"draws": 1, "generated": [x]}}):
    try:
        TokenSampler(n, SamplingParams(temperature=0.0, grammar='root ::= "yes!"'), 4096, model=vocab, **kwargs)
    except InvalidInputError:
        refused += 1
row = np.zeros(n, np.float32)
row[x] = 9.0  # the argmax is refused: the masked row decides
first = s.sample(row)
s.accept_sampled(first)
print("refused", refused, "then", vocab.detokenize([first]) in ("y", "ye", "yes", "yes!"))
"""


def test_tokens_the_grammar_refuses_are_refused_and_change_nothing(embedded_model):
    res = subprocess.run(
        [sys.executable, "-c", RISKY_TOKENS.format(path=str(embedded_model))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["refused", "6", "then", "True"], res.stdout


HOSTILE = """
from llama_shard._native import SamplingParams, ShardModel, grammar_problem, json_schema_to_grammar
from llama_shard.errors import InvalidInputError
vocab = ShardModel({path!r}, (0, 0), 1)
grammars = ["root ::= " + "(" * 100000 + '"a"' + ")" * 100000, 'root ::= "a"{{5,2}}', 'root ::= "a"{{1000000}}',
            'root ::= "a"{{3,1000000}}', "root ::= root \\"a\\"", 'rot ::= "a"', 'root ::= "a\\x00"',
            "\\n".join(f"r{{i}} ::= r{{i + 1}}" for i in range(5000)) + "\\nroot ::= r0",
            'root ::= "' + "a" * 70000 + '"', "root ::= [", 'root ::= "unterminated',
            # readings a looser check would get wrong: a comment ended by a carriage return, a <token>, counts with
            # leading zeros or a comment inside the braces
            'root ::= "a" # c\\rb ::= ' + "(" * 60000 + '"a"' + ")" * 60000,
            "root ::= <#> " + "(" * 60000 + '"a"' + ")" * 60000, 'root ::= "a"{{0000000000005,2}}',
            'root ::= ("a"{{5 #\\n,2}})', "", 'root ::= "a"{{2,}}']
verdicts = []
for g in grammars:
    verdicts.append(grammar_problem(vocab, g) is None)
    try:
        SamplingParams(grammar=g).check(vocab.info.n_vocab, 4096)
    except InvalidInputError:
        pass
schemas = ['{{"type": "foo"}}', '{{"$ref": "#/nope"}}', '{{"type": "string", "pattern": "("}}', '{{"properties": 5}}',
           '{{"enum": []}}', '{{"type": "array", "minItems": 5, "maxItems": 2}}',
           '{{"type": "string", "minLength": 1000000000000}}', '{{"$ref": "#", "properties": {{"a": {{"$ref": "#"}}}}}}',
           '{{"anyOf": []}}', '{{"type": "string", "format": "date"}}', '[1, 2]', 'not json', '{{"a": ' * 100 + '1' + '}}' * 100,
           '{{"type": "object", "properties": {{"a": {{"type": "integer", "minimum": 5, "maximum": 1}}}}}}',
           '{{"type": ["string", "null"]}}', '{{"allOf": [{{"type": "string"}}, {{"type": "integer"}}]}}',
           '{{"type": "string", "pattern": "^(a|b)*{{3,1}}$"}}', '{{"const": {{"a": [1, 2, {{"b": null}}]}}}}',
           '{{"type": "number", "multipleOf": 0}}', '{{"type": "object", "additionalProperties": {{"type": "integer"}}}}',
           '{{"type": "string", "pattern": "' + "(" * 5000 + "a" + ")" * 5000 + '"}}']
converted = refused = 0
for schema in schemas:  # a grammar the converter gives may still be refused by the checks: never a crash
    try:
        grammar = json_schema_to_grammar(schema)
        converted += 1
        grammar_problem(vocab, grammar)
    except InvalidInputError:
        refused += 1
print(" ".join("ok" if v else "no" for v in verdicts), converted + refused)
"""


def test_hostile_grammars_and_schemas_are_refused_and_the_process_survives(embedded_model):
    res = subprocess.run(
        [sys.executable, "-c", HOSTILE.format(path=str(embedded_model))], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    verdicts, count = res.stdout.split()[:-1], int(res.stdout.split()[-1])
    # only an empty grammar (no constraint) and an open repetition parse; {3,1000000} is refused here
    # (llama.cpp would read a most over 2000 as unbounded; a count has at most 4 digits)
    assert verdicts == ["no"] * 15 + ["ok", "ok"], res.stdout
    assert count == 21


EXPONENTIAL = """
import time
from llama_shard._native import SamplingParams, ShardModel, TokenSampler, grammar_problem
from llama_shard.errors import InvalidInputError
vocab = ShardModel({path!r}, (0, 0), 1)
n = 40
# each rule reaches the next twice: llama.cpp's left-recursion check walked every path (2^40); the
# grammar itself is harmless (two parse stacks)
walk = "root ::= r0\\n" + "\\n".join(f"r{{i}} ::= r{{i + 1}} | r{{i + 1}}" for i in range(n)) + f"\\nr{{n}} ::= \\"a\\""
# distinct tails at each level: 2^40 parse stacks before the first character
first = "root ::= r0\\n" + "\\n".join(f"r{{i}} ::= r{{i + 1}} \\"a\\" | r{{i + 1}} \\"b\\"" for i in range(n)) + f"\\nr{{n}} ::= \\"c\\""
t0 = time.monotonic()
print("walk", grammar_problem(vocab, walk) is None, "first", grammar_problem(vocab, first) is not None)
# the stacks double at every character read: "a" root "b" | "a" root "c" after k a's holds 2^k tails
doubling = 'root ::= "a" root "b" | "a" root "c" | "d"'
s = TokenSampler(vocab.info.n_vocab, SamplingParams(temperature=0.0, grammar=doubling), 4096, model=vocab)
a = vocab.tokenize("a", add_special=False)[0]
accepted = 0
try:
    for _ in range(64):
        s.accept_sampled(a)
        accepted += 1
except InvalidInputError as e:
    print("refused", "parse stacks" in str(e), 8 <= accepted <= 14)
try:
    s.accept_sampled(a)
except InvalidInputError:
    print("then", "refused")
# 65 stacks, but the mask walks 65^5 paths for a token like "machine" (refused at its 6th character)
import numpy as np
alts = " | ".join(["[a-m]"] * 64)
masked = TokenSampler(vocab.info.n_vocab, SamplingParams(temperature=0.8, seed=1, grammar=f"root ::= ({{alts}})*"),
                      4096, model=vocab)
try:
    masked.sample(np.zeros(vocab.info.n_vocab, np.float32))
    print("mask", "sampled")
except InvalidInputError as e:
    print("mask", "refused" if "parse steps" in str(e) else str(e).replace(" ", "_"))
print("seconds", time.monotonic() - t0)
"""


def test_grammars_that_cost_llama_cpp_exponential_time_are_bounded(embedded_model):
    """Patch 0009: the left-recursion check walks each rule once, no advance keeps more than 4096
    parse stacks, and no mask or accept makes more than 2^20 stack visits (refused at the start,
    or the stream ends with an error), within seconds."""
    res = subprocess.run(
        [sys.executable, "-c", EXPONENTIAL.format(path=str(embedded_model))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    words = res.stdout.split()
    assert words[:-2] == [
        "walk",
        "True",
        "first",
        "True",
        "refused",
        "True",
        "True",
        "then",
        "refused",
        "mask",
        "refused",
    ], res.stdout
    assert float(words[-1]) < 30, res.stdout


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["city", "river", "mountain"]},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {
                "country": {"type": "string", "maxLength": 16},
                "population": {"type": "integer", "minimum": 0},
            },
            "required": ["country"],
        },
        "famous": {"type": "boolean"},
    },
    "required": ["name", "kind", "facts", "where"],
}


def test_the_converter_gives_a_grammar_llama_cpp_parses(vocab):
    grammar = json_schema_to_grammar(json.dumps(SCHEMA))
    assert "root ::=" in grammar and grammar_problem(vocab, grammar) is None
    for bad, why in (
        ("[1]", "object"),
        ("{", "JSON"),
        ('{"type": "array", "items": ' * 70 + "{}" + "}" * 70, "deeper"),
        ('{"description": "' + "x" * 70000 + '"}', "bytes"),
    ):
        with pytest.raises(InvalidInputError, match=why):
            json_schema_to_grammar(bad)


# --- through a route, with the official openai client -----------------------------------------


@pytest.fixture(scope="module")
def http_route(embedded_model):
    from support.http_route import HttpRoute

    r = HttpRoute(embedded_model)
    yield r
    r.stop()


PROMPTS = [
    "Describe Paris as JSON.",
    "Describe the Nile as JSON.",
    "Describe Mont Blanc as JSON.",
    "Describe Lyon as JSON.",
    "Describe the Rhine as JSON.",
]


@pytest.mark.grpc
@pytest.mark.slow
def test_twenty_answers_under_a_json_schema_parse_and_validate(http_route):
    jsonschema = pytest.importorskip("jsonschema")
    client = http_route.client
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    model = client.models.list().data[0].id
    answers = []
    for i in range(20):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            response_format=fmt,
            max_tokens=160,
            temperature=0 if i < 5 else 0.8,
            seed=i,
        )
        choice = r.choices[0]
        if choice.finish_reason == "length" and i >= 5:
            continue  # a sampled answer may ramble inside a string past max_tokens (where depends on the CPU)
        assert choice.finish_reason == "stop", (i, choice)
        answer = json.loads(choice.message.content)
        jsonschema.validate(answer, SCHEMA)
        answers.append(answer)
    assert len(answers) >= 15, len(answers)
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 1  # sampled, not one canned answer
    # json_object: any JSON object
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.grpc
def test_streamed_equals_whole_under_a_schema_at_temperature_zero(http_route):
    client = http_route.client
    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    messages = [{"role": "user", "content": "Describe Marseille as JSON."}]
    whole = client.chat.completions.create(
        model=model, messages=messages, response_format=fmt, max_tokens=160, temperature=0
    )
    parts = client.chat.completions.create(
        model=model, messages=messages, response_format=fmt, max_tokens=160, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert streamed == whole.choices[0].message.content
    json.loads(streamed)
    # completions, with llama-server's grammar key
    got, answer = http_route.raw(
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "prompt": "Is the sky blue? Answer:",
                "max_tokens": 8,
                "temperature": 0,
                "grammar": ' root ::= " " ("yes" | "no")',
            }
        ),
    )
    assert got == 200 and answer["choices"][0]["text"] in (" yes", " no"), answer


@pytest.mark.grpc
def test_structured_output_refusals_name_their_parameter(http_route):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    cases = [
        ({"response_format": {"type": "nope"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(" * 100 + "a" + ")" * 100}},
                }
            },
            "response_format",
        ),
        ({"grammar": 'root ::= "a"{5,2}'}, "grammar"),
        ({"grammar": 'root ::= "a" # c\r' + "(" * 1000 + '"a"' + ")" * 1000}, "grammar"),
        ({"grammar": "root ::= (\"a\""}, "grammar"),
        ({"grammar": 'rot ::= "a"'}, "grammar"),
        ({"grammar": 5}, "grammar"),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
    ]
    for extra, param in cases:
        got, answer = http_route.raw("POST", "/v1/chat/completions", json.dumps(chat | extra))
        assert got == 400 and answer["error"]["param"] == param, (extra, answer)
    assert http_route.info().generate_streams == 0


FUZZ = """
import json
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st
from llama_shard._native import SamplingParams, ShardModel, TokenSampler, grammar_problem, json_schema_to_grammar
from llama_shard.errors import InvalidInputError

vocab = ShardModel({path!r}, (0, 0), 1)
n_vocab = vocab.info.n_vocab
KEYS = ["type", "properties", "items", "required", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
        "definitions", "additionalProperties", "minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum", "pattern", "format", "prefixItems", "patternProperties", "not",
        "uniqueItems", "multipleOf", "description", "title", "default", "a"]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", "nope"]
scalars = (st.none() | st.booleans() | st.integers(-10 ** 13, 10 ** 13) | st.floats(allow_nan=False, allow_infinity=False)
           | st.sampled_from(TYPES) | st.sampled_from(["#", "#/$defs/a", "#/properties/a", "#/definitions/x", "date",
                                                        "uuid", "date-time", "email"])
           | st.text(alphabet="()[]{{}}|*+?.^$\\\\ab09,-:", max_size=12) | st.text(max_size=6))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), kids, max_size=5), max_leaves=25)
schemas = st.dictionaries(st.sampled_from(KEYS), values, min_size=1, max_size=6)
seen = {{"converted": 0, "refused": 0, "sampled": 0}}


@settings(max_examples={n}, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(schemas)
def run(schema):
    try:
        grammar = json_schema_to_grammar(json.dumps(schema))
    except InvalidInputError:
        seen["refused"] += 1
        return
    seen["converted"] += 1
    if grammar_problem(vocab, grammar) is not None:
        return
    try:
        s = TokenSampler(n_vocab, SamplingParams(temperature=0.7, seed=3, grammar=grammar), 4096, model=vocab)
        rng = np.random.default_rng(0)
        for _ in range(4):
            token = s.sample((rng.standard_normal(n_vocab) * 3).astype(np.float32))
            s.accept_sampled(token)
        seen["sampled"] += 1
    except InvalidInputError:
        pass  # e.g. a grammar that allows no token of this vocabulary: refused, never an abort


run()
print(seen["converted"], seen["refused"], seen["sampled"])
"""


def test_generated_schemas_never_crash_the_converter_or_the_sampler(embedded_model):
    """Hypothesis-generated schema-like JSON (the keywords, odd values, regex fragments, $refs) in a
    subprocess: each is converted or refused, each grammar parsed or refused, each sampled for a few
    tokens or refused; an abort anywhere in llama.cpp's converter or grammar fails the test."""
    n = int(os.environ.get("LLAMA_SHARD_FUZZ_SCHEMAS", "400"))  # 3,000 ran clean here in 66 s
    res = subprocess.run(
        [sys.executable, "-c", FUZZ.format(path=str(embedded_model), n=n)], capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    converted, refused, sampled = map(int, res.stdout.split()[-3:])
    print(
        f"\n  {converted + refused} generated schemas: {converted} converted ({sampled} sampled under their "
        f"grammar), {refused} refused"
    )
    assert converted and refused and sampled


def test_the_tail_keeps_a_grammars_state_and_a_step_names_it_by_digest(vocab):
    """The tail keeps each session's grammar state between steps: a step that names it by its digest
    samples what a step replaying every token samples (the protocol before), a step naming a state
    the tail does not hold (a new replica, an eviction, another history) is refused with nothing
    sampled, and the head's replay after that refusal goes on with the same tokens."""
    from llama_shard.proto import shard_pb2 as pb
    from llama_shard.proto.requests import sampling_to_wire
    from llama_shard.structured.replay import GrammarSync
    from llama_shard.worker.sampling import SamplerStateMissing, TailSamplers

    n_vocab = vocab.info.n_vocab
    params = SamplingParams(
        temperature=0.9,
        seed=5,
        penalty_repeat=1.1,
        penalty_last_n=8,
        grammar='root ::= "[" [0-9] "," [0-9] "," [0-9] "," [0-9] ("," [0-9]+)* "]"',
    )
    rows = (np.random.default_rng(3).standard_normal((24, n_vocab)) * 3).astype(np.float32)
    prompt = [1, 2, 3]

    def run(replay_every_step: bool, lose_at: int | None = None) -> tuple[list[int], int]:
        tail, sync, generated = TailSamplers(n_vocab, 4096, 4, model=vocab), GrammarSync(), []
        sync.by_digest = True  # a tail of this version (InfoReply.features)
        for i, row in enumerate(rows):
            if i == lose_at:
                tail = TailSamplers(n_vocab, 4096, 4, model=vocab)  # a failover to a replica of the tail
            state = pb.SamplerState(
                params=sampling_to_wire(params), draws=len(generated), recent=(prompt + generated)[-8:]
            )
            if replay_every_step:
                sync.lost()
            sync.fill(state, generated)
            try:
                token = tail.sample(("s", 0), params, state, row)
            except SamplerStateMissing:
                assert not replay_every_step and i == lose_at
                sync.lost()  # the head sends the step again with the tokens
                state = pb.SamplerState(
                    params=sampling_to_wire(params), draws=len(generated), recent=(prompt + generated)[-8:]
                )
                sync.fill(state, generated)
                token = tail.sample(("s", 0), params, state, row)
            sync.sampled()
            generated.append(token)
            if token in vocab.eog_tokens:
                break
        return generated, tail.grammar_replays

    every, replays = run(True)  # the protocol before: every token in every step
    assert replays == 1 and len(every) > 4
    kept, replays = run(False)
    assert kept == every and replays == 1
    lost, replays = run(False, lose_at=3)
    assert lost == every and replays == 1  # the new tail replayed once
    # a digest of another history, or one the tail never saw, is refused and nothing is sampled
    tail, sync = TailSamplers(n_vocab, 4096, 4, model=vocab), GrammarSync()
    sync.by_digest = True
    state = pb.SamplerState(params=sampling_to_wire(params), draws=0, recent=prompt)
    sync.fill(state, [])
    first = tail.sample(("s", 0), params, state, rows[0])
    assert first == every[0]
    sync.sampled()
    for other in ([first + 1], [first, first]):
        state = pb.SamplerState(params=sampling_to_wire(params), draws=len(other), recent=(prompt + other)[-8:])
        sync.fill(state, other)
        assert not state.generated and len(state.generated_digest) == 16
        with pytest.raises(SamplerStateMissing):
            tail.sample(("s", 0), params, state, rows[1])
    state = pb.SamplerState(params=sampling_to_wire(params), draws=1, recent=prompt + [first])
    sync.fill(state, [first])
    assert tail.sample(("s", 0), params, state, rows[1]) == every[1]  # the kept state survived the refusals


def test_a_grammar_streams_step_is_the_same_size_at_token_100_and_10000(vocab):
    """A step used to carry every token generated under a grammar (128 KB at 32,768 tokens, every
    token, every hop); it now carries their 16-byte digest, and the tokens only where the tail must
    replay them."""
    from llama_shard.head.generation.stream import Stream
    from llama_shard.proto import shard_pb2 as pb

    grammar = 'root ::= [a-z ]*'
    req = pb.GenerateRequest(
        session_id="s", prompt=[1, 2, 3], max_tokens=20000, sampling=pb.Sampling(temperature=0.0, grammar=grammar)
    )
    sizes = {}
    for n in (100, 10000):
        generated = [100 + i % 500 for i in range(n)]
        s = Stream("", "s", req, SamplingParams(temperature=0.0, grammar=grammar), 20000, 0, None, vocab.detokenize)
        s.pos.tokens, s.pos.generated, s.pos.draws = [1, 2, 3] + generated, generated, n
        s.pos.computed = s.pos.held = len(s.pos.tokens) - 1
        s.pos.first_step = False
        _, replayed = s.request(pb.DTYPE_FLOAT32)
        s.grammar.sampled()
        _, older = s.request(pb.DTYPE_FLOAT32)  # a tail of an earlier version gets every token, always
        s.grammar.by_digest = True  # one that lists grammar_digest in its Info
        _, named = s.request(pb.DTYPE_FLOAT32)
        assert list(replayed.sampler.generated) == list(older.sampler.generated) == generated
        assert not named.sampler.generated and len(named.sampler.generated_digest) == 16
        sizes[n] = (replayed.ByteSize(), named.ByteSize())
    print(
        f"\n  a grammar step's request: at token 100 {sizes[100][1]} bytes, at token 10,000 {sizes[10000][1]} bytes "
        f"(replaying every token, as every step did before: {sizes[100][0]} and {sizes[10000][0]} bytes)"
    )
    assert abs(sizes[10000][1] - sizes[100][1]) <= 4  # varints of positions and draws: a byte or two
    assert sizes[10000][0] > 10000
