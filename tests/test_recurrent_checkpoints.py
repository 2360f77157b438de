"""A hybrid model's sessions cut back through recurrent-state checkpoints (recurrent_checkpoints.h).

A recurrent layer holds one state per session, which llama.cpp cannot cut back. The engine keeps a
few checkpoints per session (the state at a step's start and the inputs after it) and cuts by
restoring one and computing on: a next turn that re-renders the end of the last answer, a rejected
draft, a retried prefill each continue as the same session would have. A cut no checkpoint covers
is an explicit miss, never a wrong state.
"""

from __future__ import annotations

import pytest

from llama_shard import CacheMiss, CacheMissReason, HotKvStateConfig
from llama_shard.testing.synthetic_families import CERTIFICATION_SPECS, write_moe_gguf

from support.engine_route import PROMPT, Route

LAYOUT = [(0, 1), (2, 7)]  # the head: two recurrent layers; the tail: attention layers and recurrent ones


@pytest.fixture(
    scope="module", params=["nemotron_h", "qwen35", "qwen35moe", "granitehybrid", "qwen3next", "nemotron_h_moe"]
)
def hybrid(request, tmp_path_factory):
    """Mamba-2 beside attention and FFN layers (nemotron_h) or MoE layers (granitehybrid); gated
    delta-net beside M-RoPE attention, with dense FFNs (qwen35) or experts (qwen35moe), or beside a plain
    rope (qwen3next); Mamba-2 beside attention and MoE layers with an MTP block (nemotron_h_moe)."""
    return write_moe_gguf(
        tmp_path_factory.mktemp("hybrid") / f"{request.param}.gguf", CERTIFICATION_SPECS[request.param]
    )


@pytest.fixture
def route(hybrid):
    r = Route(hybrid, LAYOUT)
    yield r
    r.close()


def _turn(route, sid, n):
    """A turn: the prompt, then n greedy tokens; (tokens, the session's history held)."""
    tokens, _ = route.greedy(sid, PROMPT, n)
    return tokens, PROMPT + tokens[:-1]


@pytest.mark.parametrize("back", [1, 3, 9], ids=["the last token", "three tokens", "into the prompt"])
def test_a_next_turn_that_re_renders_the_last_answer_continues_as_a_fresh_session(route, back):
    """The next turn's prompt shares all but the last `back` tokens held: the head prefills from
    there, and the session gives what a fresh session of the whole new prompt gives (its tokens;
    its logits to rounding: a fresh prefill computes in other batch shapes)."""
    tokens, held = _turn(route, "chat", 12)
    next_turn = held[: len(held) - back] + [250, 251, 252, 253]
    start = len(held) - back
    got = route.prefill("chat", next_turn[start:], start_pos=start)
    assert not isinstance(got, CacheMiss), got
    fresh = route.prefill("fresh", next_turn, start_pos=0)
    assert got.seq_len == fresh.seq_len == len(next_turn)
    assert got.token_id == fresh.token_id
    g, f = route.greedy_from("chat", got, 8), route.greedy_from("fresh", fresh, 8)
    assert g == f
    for m in route.managers:
        assert m.stats()["checkpoint_restores"] >= 1
        m.check_invariants()


def test_a_cut_no_checkpoint_covers_is_a_miss_and_the_re_prefill_is_exact(hybrid):
    """Checkpoints cover the last steps, not the whole history: a cut far back drops the session
    (an EVICTED_LRU miss) and the head's re-prefill from 0 gives the fresh session's tokens."""
    route = Route(
        hybrid, LAYOUT, HotKvStateConfig(max_sessions=4, context_tokens=512, budget_tokens=2048, ttl_seconds=0)
    )
    try:
        route.prefill("long", PROMPT)
        last = route.prefill("long", list(range(20, 120)))  # a second prompt of 100 tokens: its start is a checkpoint
        tokens = route.greedy_from("long", last, 140)  # decodes: a checkpoint each 16 of them
        held = len(PROMPT) + 100 + 139
        for m in route.managers:
            assert m.stats()["checkpoints_taken"] >= 9  # at 0, 12, 112, then each 16 decodes: the first ones are gone
        out = route.adapters[0].prefill("long", 0, token_ids=[5, 6], start_pos=4)  # into the first prompt
        assert isinstance(out, CacheMiss) and out.reason == CacheMissReason.EVICTED_LRU, out
        assert "recurrent state cannot go back" in out.detail
        for m in route.managers:
            m.release("long", 0)
        again = route.prefill("long", PROMPT[:4] + [5, 6], start_pos=0)
        fresh = route.prefill("fresh", PROMPT[:4] + [5, 6], start_pos=0)
        assert again.logits.tobytes() == fresh.logits.tobytes()
        assert held > 4 and len(tokens) == 140
    finally:
        route.close()


def test_checkpoints_are_bounded_and_counted(hybrid):
    """However long the session, at most 8 checkpoints of a state and 16 inputs each."""
    route = Route(
        hybrid, LAYOUT, HotKvStateConfig(max_sessions=2, context_tokens=512, budget_tokens=1024, ttl_seconds=0)
    )
    try:
        route.prefill("s", PROMPT)
        route.greedy_from("s", route.decode("s", 1), 300)  # far more than the checkpoints' inputs
        for m, (first, _last) in zip(route.managers, LAYOUT):
            st, info = m.stats(), m.model.info
            rows = 4 if first == 0 else 4 * info.n_embd  # a token id, or a hidden row
            pages = lambda n: -(-n // 4096) * 4096  # noqa: E731 (a state lives in whole pages)
            assert 0 < st["checkpoint_bytes"] <= 8 * (pages(info.recurrent_bytes + 4096) + 16 * (rows + 4))
            m.check_invariants()
    finally:
        route.close()


def test_a_cut_between_steps_gives_the_state_the_session_had_byte_for_byte(route):
    """The recorded inputs are computed again step by step with the rows each had (qwen35's
    delta-net takes another kernel for one token than for several), so a session cut back between
    steps continues byte for byte as one that never went past the cut."""
    tokens, _ = route.greedy("a", PROMPT, 7)  # the prompt, then 6 one-token steps
    route.greedy("b", PROMPT, 4)  # the same prompt and first 3 steps
    for m in route.managers:
        assert m.truncate("a", 0, len(PROMPT) + 3).seq_len == len(PROMPT) + 3
    a, b = route.decode("a", 77), route.decode("b", 77)
    assert a.logits.tobytes() == b.logits.tobytes()
    assert [route.decode("a", t).logits.tobytes() for t in (5, 6)] == [
        route.decode("b", t).logits.tobytes() for t in (5, 6)
    ]
