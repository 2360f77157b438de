"""Generation inside the route (`Generate` on the head): the tail samples with llama.cpp's chain,
its token comes back in the chained reply, the head runs the loop and streams.

What is shown here, on live workers over loopback:
- greedy Generate gives today's tokens (the client-driven loop's) and the whole model's argmax;
- seeded sampling through a route gives exactly the tokens of the same chain on the whole model
  (in-process, the prompt accepted first), for the whole model in one worker, 2 and 3 shards of
  SmolLM2, and 2 shards of Gemma 3; a miss in mid-stream is re-prefilled by the head and the
  stream goes on with the same tokens;
- a chat's next turn reuses the prefix the session holds (only the new tokens are computed);
- bad parameters get INVALID_ARGUMENT and change nothing; a cancelled stream stops computing and
  its session stays usable; a killed tail ends the stream naming stage 1, and after a restart the
  next Generate continues; 64 streams opened and dropped at random leave no stream and, once
  released, no KV; SIGTERM ends a running stream with a final event `shutdown`; the per-principal
  cap bounds concurrent streams.
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time

import pytest

from llama_shard._native import SamplingParams, ShardModel
from llama_shard.local_workers import stop_worker
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto.requests import sampling_to_wire as params_to_wire
from llama_shard.route import RemoteStage, RouteClient

from support.served_route import N_TOKENS, Route, whole_model_tokens

pytestmark = pytest.mark.grpc

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
PARAMS = {
    "top-k-p-min-p": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "penalties": dict(
        temperature=1.0,
        top_k=0,
        top_p=0.9,
        penalty_last_n=32,
        penalty_repeat=1.3,
        penalty_freq=0.2,
        penalty_present=0.3,
    ),
}
SEEDS = [1, 42, 1234]


@pytest.fixture(scope="module")
def smol_routes(embedded_model):
    routes = {}
    try:
        routes["whole"] = Route(embedded_model, [(0, 29)])
        routes["2 shards"] = Route(embedded_model, [(0, 14), (15, 29)])
        routes["3 shards"] = Route(embedded_model, [(0, 9), (10, 19), (20, 29)])
        yield routes
    finally:
        for r in routes.values():
            r.stop()


@pytest.fixture(scope="module")
def smol_prompts(embedded_model):
    vocab = ShardModel(str(embedded_model), (0, 0), 1)
    return [vocab.tokenize(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def smol_reference(embedded_model, smol_prompts):
    ref = {("greedy", None, i): whole_model_tokens(embedded_model, p, None) for i, p in enumerate(smol_prompts)}
    for name, kw in PARAMS.items():
        for seed in SEEDS:
            for i, p in enumerate(smol_prompts):
                ref[(name, seed, i)] = whole_model_tokens(embedded_model, p, SamplingParams(seed=seed, **kw))
    return ref


@pytest.mark.parametrize("layout", ["whole", "2 shards", "3 shards"])
@pytest.mark.slow
def test_greedy_generate_gives_todays_tokens_and_the_whole_models(smol_routes, smol_prompts, smol_reference, layout):
    route = smol_routes[layout]
    stages = [RemoteStage(a) for a in route.addresses]
    client = RouteClient(stages, chained=False)  # today's loop, driven by this client
    for i, prompt in enumerate(smol_prompts):
        todays = client.session(f"greedy-client-{layout}-{i}").generate(prompt, N_TOKENS)
        tokens, final = route.generate(f"greedy-{layout}-{i}", prompt)
        assert tokens == todays == smol_reference[("greedy", None, i)]
        assert final.finish_reason == "length" and final.completion_tokens == N_TOKENS and final.reprefills == 0
        assert final.seq_len == len(prompt) + N_TOKENS - 1
    client.close()


@pytest.mark.parametrize("layout", ["whole", "2 shards", "3 shards"])
@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.slow
def test_seeded_sampling_on_the_route_equals_the_chain_on_the_whole_model(
    smol_routes, smol_prompts, smol_reference, layout, name
):
    route = smol_routes[layout]
    for seed in SEEDS:
        wire = params_to_wire(SamplingParams(seed=seed, **PARAMS[name]))
        for i, prompt in enumerate(smol_prompts):
            tokens, final = route.generate(f"seeded-{layout}-{name}-{seed}-{i}", prompt, sampling=wire)
            assert tokens == smol_reference[(name, seed, i)], (seed, i)
            assert final.finish_reason == "length"


def test_a_miss_mid_stream_is_re_prefilled_by_the_head_and_gives_the_same_tokens(
    smol_routes, smol_prompts, embedded_model
):
    route = smol_routes["2 shards"]
    params = SamplingParams(seed=7, **PARAMS["penalties"])
    expected = whole_model_tokens(embedded_model, smol_prompts[1], params, 40)
    call = route.stub().Generate(
        route.request("miss-mid-stream", smol_prompts[1], 40, params_to_wire(params)), timeout=120
    )
    tokens, final = [], None
    for event in call:
        if event.HasField("final"):
            final = event.final
            break
        tokens.append(event.token.token_id)
        if len(tokens) == 5:  # the tail loses the session: its next step is a miss
            r = route.stub(1).Release(pb.SessionRequest(session_id="miss-mid-stream"), timeout=10)
            assert r.released
    assert final.finish_reason == "length" and final.reprefills >= 1
    assert tokens == expected


def test_the_next_turn_reuses_the_prefix_the_session_holds(smol_routes, smol_prompts):
    route = smol_routes["2 shards"]
    prompt = smol_prompts[0]
    first, final1 = route.generate("chat", prompt)
    assert final1.cached_tokens == 0
    before = route.info(1).engine_requests
    conversation = prompt + first + smol_prompts[2]
    _, final2 = route.generate("chat", conversation, max_drafts=0)  # one token per step (speculation: off)
    # the session held the prompt and all but the last generated token: only the rest is computed
    assert final2.cached_tokens == len(prompt) + len(first) - 1 and final2.reprefills == 0
    assert final2.seq_len == len(conversation) + N_TOKENS - 1
    assert route.info(1).engine_requests - before == N_TOKENS  # one prefill step, then 15 decodes
    # an edited conversation keeps only the common prefix (the rest is truncated by the prefill)
    edited = prompt + [first[0] + 1] + smol_prompts[2]
    _, final3 = route.generate("chat", edited)
    assert final3.cached_tokens == len(prompt) and final3.finish_reason == "length"


BAD = {
    "negative temperature": dict(sampling=pb.Sampling(temperature=-0.5)),
    "NaN temperature": dict(sampling=pb.Sampling(temperature=math.nan)),
    "top_p zero": dict(sampling=pb.Sampling(top_p=0.0)),
    "top_p above 1": dict(sampling=pb.Sampling(top_p=1.5)),
    "max_tokens beyond the context": dict(max_tokens=600),
    "too many stop strings": dict(stop=[f"s{i}" for i in range(17)]),
    "empty prompt": dict(prompt=[]),
    "token outside the vocabulary": dict(prompt=[1, 2, 10**6]),
    "top_logprobs 21": dict(top_logprobs=21),
    "negative max_tokens": dict(max_tokens=-1),
    "seed 0xFFFFFFFF": dict(sampling=pb.Sampling(seed=0xFFFFFFFF)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_parameters_get_invalid_argument_and_change_nothing(smol_routes, case):
    route = smol_routes["2 shards"]
    kw = dict(BAD[case])
    prompt = kw.pop("prompt", [1, 2, 3])
    max_tokens = kw.pop("max_tokens", 4)
    before = [route.info(k) for k in (0, 1)]
    tokens, final = route.generate(f"bad-{case}", prompt, max_tokens, **kw)
    assert tokens == [] and final.finish_reason == "error" and final.outcome == pb.OUTCOME_INVALID_ARGUMENT
    assert final.detail, final
    after = [route.info(k) for k in (0, 1)]
    for b, a in zip(before, after):
        assert (a.engine_requests, a.live_sessions, a.reserved_tokens) == (
            b.engine_requests,
            b.live_sessions,
            b.reserved_tokens,
        )


def test_a_cancelled_stream_stops_computing_and_its_session_goes_on(smol_routes, smol_prompts):
    route = smol_routes["2 shards"]
    before = route.info(1).engine_requests
    call = route.stub().Generate(route.request("cancel", smol_prompts[0], 400), timeout=120)
    got = []
    for event in call:
        got.append(event.token.token_id)
        if len(got) == 3:
            break
    call.cancel()
    deadline = time.monotonic() + 10
    while route.info().generate_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert route.info().generate_streams == 0
    settled = route.info(1).engine_requests
    time.sleep(0.5)
    assert route.info(1).engine_requests == settled  # no step after the stream ended
    assert settled - before < 3 + 100  # it stopped soon after the cancel (a loaded client reads late), far from 400
    tokens, final = route.generate("cancel", smol_prompts[0] + got, 4)
    assert final.finish_reason == "length" and final.cached_tokens >= len(smol_prompts[0]) and len(tokens) == 4


def test_releasing_a_session_mid_stream_ends_the_stream_and_it_stays_released(smol_routes, smol_prompts):
    """A Release on the head while a Generate stream runs on the session: the stream ends
    (cancelled) before the release, so no step built for it brings the session back (its next
    decode would have been a miss the head re-prefills)."""
    route = smol_routes["2 shards"]
    call = route.stub().Generate(route.request("released", smol_prompts[1], 400), timeout=120)
    events = iter(call)
    for _ in range(3):
        assert next(events).HasField("token")
    reply = route.stub().Release(pb.SessionRequest(session_id="released", route_epoch=0), timeout=30)
    assert reply.outcome == pb.OUTCOME_OK and reply.released
    rest = list(events)
    final = rest[-1].final
    assert final.finish_reason == "cancelled" and "released" in final.detail, final
    assert final.reprefills == 0 and len(rest) < 200  # far from 400 (the client may read late on a loaded machine)
    time.sleep(0.3)
    gone = route.stub().Resolve(pb.SessionRequest(session_id="released", route_epoch=0), timeout=10)
    assert gone.outcome == pb.OUTCOME_CACHE_MISS and gone.miss_reason == "RELEASED", gone
    assert "released" not in [s.session_id for s in route.info().sessions]


@pytest.mark.slow
def test_a_killed_tail_ends_the_stream_naming_its_stage_and_a_restart_continues(embedded_model, smol_prompts):
    route = Route(embedded_model, [(0, 14), (15, 29)], extra=("--max-hop-seconds", "5"))
    try:
        expected = whole_model_tokens(embedded_model, smol_prompts[0], None, 8)
        call = route.stub().Generate(route.request("killed", smol_prompts[0], 400), timeout=120)
        final, n = None, 0
        for event in call:
            if event.HasField("final"):
                final = event.final
                break
            n += 1
            if n == 3:
                route.procs[1].send_signal(signal.SIGKILL)
        assert final is not None and final.finish_reason == "error" and final.stage == 1, final
        assert final.outcome == pb.OUTCOME_UNAVAILABLE and "could not be reached" in final.detail
        stop_worker(route.procs[1])
        route.start(1)
        tokens, final = route.generate("killed", smol_prompts[0], 8)
        assert final.finish_reason == "length" and tokens == expected
    finally:
        route.stop()


def test_sigterm_ends_a_running_stream_with_a_shutdown_event(embedded_model, smol_prompts):
    route = Route(embedded_model, [(0, 29)])
    try:
        call = route.stub().Generate(route.request("sigterm", smol_prompts[0], 480), timeout=120)
        events = []
        for event in call:
            events.append(event)
            if len(events) == 2:
                route.procs[0].send_signal(signal.SIGTERM)
        assert events[-1].HasField("final") and events[-1].final.finish_reason == "shutdown", events[-1]
        assert 2 <= events[-1].final.completion_tokens < 480
        code, _ = stop_worker(route.procs[0], send_sigterm=False)
        route.procs[0] = None
        assert code == 0
    finally:
        route.stop()


@pytest.mark.slow
def test_64_streams_opened_and_dropped_at_random_leave_nothing_behind(embedded_model):
    route = Route(embedded_model, [(0, 14), (15, 29)])
    try:
        rng = random.Random(5)
        plans = [
            (f"churn-{i}", [1 + rng.randrange(500) for _ in range(rng.randrange(1, 40))], rng.randrange(0, 12))
            for i in range(64)
        ]
        outcomes: list[str] = []
        refused: list[str] = []  # attempts refused while every session was streaming (retried, as a client would)

        def run(sid, prompt, keep):
            deadline = time.monotonic() + 90
            while True:
                # one token per step (speculation off): the waves' timing, not the drafts, is what this churns
                call = route.stub().Generate(route.request(sid, prompt, 60, max_drafts=0), timeout=120)
                n = 0
                for event in call:
                    if event.HasField("final"):
                        outcome = event.final.finish_reason + ":" + pb.Outcome.Name(event.final.outcome)
                        if event.final.outcome == pb.OUTCOME_BUDGET_EXCEEDED and time.monotonic() < deadline:
                            refused.append(outcome)
                            time.sleep(0.05 + 0.1 * random.random())
                            break
                        outcomes.append(outcome)
                        return
                    n += 1
                    if n >= keep:
                        call.cancel()
                        outcomes.append("dropped")
                        return

        threads = [threading.Thread(target=run, args=p) for p in plans]
        for k, t in enumerate(threads):
            t.start()
            if k % 8 == 7:  # in waves: most are served, some find every session streaming
                time.sleep(0.3)
        for t in threads:
            t.join(150)
        assert len(outcomes) == 64
        # every stream ran in the end (refused ones retried) and was cancelled after its first `keep` tokens
        assert outcomes.count("dropped") == 64, outcomes
        # past the worker's 8 sessions a stream is refused before it computes anything
        assert all(o == "error:OUTCOME_BUDGET_EXCEEDED" for o in refused), refused
        deadline = time.monotonic() + 10
        while route.info().generate_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert route.info().generate_streams == 0
        for sid, _, _ in plans:
            for k in (0, 1):
                route.stub(k).Release(pb.SessionRequest(session_id=sid), timeout=10)
        for k in (0, 1):
            info = route.info(k)
            assert info.live_sessions == 0 and info.reserved_tokens == 0, info
        tokens, final = route.generate("after-churn", [1, 2, 3], 4)  # still serving
        assert final.finish_reason == "length" and len(tokens) == 4
    finally:
        route.stop()


def test_the_per_principal_cap_bounds_concurrent_streams(embedded_model):
    route = Route(embedded_model, [(0, 29)], extra=("--max-sessions-per-principal", "2"))
    try:
        calls = [route.stub().Generate(route.request(f"capped-{i}", [1, 2, 3], 400), timeout=120) for i in range(2)]
        firsts = [next(iter(c)) for c in calls]  # both running
        assert all(f.HasField("token") for f in firsts)
        tokens, final = route.generate("capped-2", [1, 2, 3], 4)
        assert (
            tokens == []
            and final.outcome == pb.OUTCOME_BUDGET_EXCEEDED
            and "max-sessions-per-principal" in final.detail
        )
        for c in calls:
            c.cancel()
    finally:
        route.stop()


def test_a_new_session_over_the_cap_ends_only_its_own_stream(embedded_model):
    """A finished stream's session still counts against the cap (its KV stays): a new stream over
    the cap is refused at its first step, and the stream it was batched with goes on."""
    route = Route(embedded_model, [(0, 29)], extra=("--max-sessions-per-principal", "2"))
    try:
        _, final = route.generate("held", [1, 2, 3], 4)
        assert final.finish_reason == "length"
        running = route.stub().Generate(route.request("running", [4, 5, 6], 400), timeout=120)
        events = iter(running)
        assert next(events).HasField("token")
        tokens, refused = route.generate("over", [7, 8, 9], 4)
        assert tokens == [] and refused.outcome == pb.OUTCOME_BUDGET_EXCEEDED, refused
        assert all(next(events).HasField("token") for _ in range(5))  # still streaming
        running.cancel()
    finally:
        route.stop()


def test_route_client_uses_generate_on_a_chained_route(smol_routes, smol_prompts, smol_reference):
    route = smol_routes["2 shards"]
    params = SamplingParams(seed=42, **PARAMS["top-k-p-min-p"])
    chained = RouteClient([RemoteStage(a) for a in route.addresses])
    assert chained.chained
    s = chained.session("client-chained")
    assert s.generate(smol_prompts[0], N_TOKENS, sampling=params) == smol_reference[("top-k-p-min-p", 42, 0)]
    assert s.last_final is not None and s.last_final.finish_reason == "length"
    assert len(s.history) == len(smol_prompts[0]) + N_TOKENS - 1
    many = chained.generate_many(
        [chained.session(f"many-{i}") for i in range(3)], smol_prompts, N_TOKENS, sampling=params
    )
    assert many == [smol_reference[("top-k-p-min-p", 42, i)] for i in range(3)]
    # the client-driven loop samples the tail's logits itself: the same tokens
    stages = [RemoteStage(route.addresses[0]), RemoteStage(route.addresses[1], return_logits=True)]
    unchained = RouteClient(stages, chained=False)
    assert (
        unchained.session("client-unchained").generate(smol_prompts[0], N_TOKENS, sampling=params)
        == smol_reference[("top-k-p-min-p", 42, 0)]
    )
    # stop strings and logprobs through the client
    # a stop string the sampled text holds on this CPU (its text is the kernels' choice): a character
    # from its second half
    text = "".join(e.piece for e in chained.session("client-plain").events(smol_prompts[0], N_TOKENS))
    stop = next(c for c in text[len(text) // 2 :] if not c.isspace())
    s2 = chained.session("client-stop")
    events = list(s2.events(smol_prompts[0], N_TOKENS, stop_strings=[stop], top_logprobs=2))
    assert s2.last_final.finish_reason == "stop" and s2.last_final.stop == stop
    assert stop in "".join(e.piece for e in events)
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in events)
    assert all(e.top_logprobs[0].logprob >= e.logprob for e in events)  # greedy: the chosen one is the best
    chained.close()
    unchained.close()


@pytest.mark.slow
def test_seeded_sampling_on_gemma3_in_two_shards_equals_the_whole_model(gemma3_model):
    vocab = ShardModel(str(gemma3_model), (0, 0), 1)
    n_layer = vocab.info.n_layer
    route = Route(gemma3_model, [(0, n_layer // 2 - 1), (n_layer // 2, n_layer - 1)])
    try:
        for i, text in enumerate(PROMPTS):
            prompt = vocab.tokenize(text)
            for name, kw in PARAMS.items():
                for seed in SEEDS:
                    params = SamplingParams(seed=seed, **kw)
                    tokens, final = route.generate(f"gemma-{name}-{seed}-{i}", prompt, sampling=params_to_wire(params))
                    assert tokens == whole_model_tokens(gemma3_model, prompt, params), (name, seed, i)
            greedy, _ = route.generate(f"gemma-greedy-{i}", prompt)
            assert greedy == whole_model_tokens(gemma3_model, prompt, None)
    finally:
        route.stop()
