"""`llama-shard demo`: the whole thing working, end to end, on the embedded model.

Starts two workers on loopback that split the model in half (each a `llama-shard serve` process),
runs four concurrent chat sessions through them (two micro-batches, pipelined), streams their text, shows each worker's sessions
and budget, releases the sessions and shows the budget returned, then shuts the workers down with
SIGTERM and reports their exit. Between, one chat turn through the head's OpenAI-compatible
endpoint, and two chats that begin with the same long system prompt: the second opens from the
prefix the first left on both workers (shared prefixes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from ._native import ShardModel
from .engine.models import gguf_layer_count
from .head.openai.chat_template import ModelChat
from .local_workers import free_port, start_worker, stop_worker, wait_serving
from .proto import shard_pb2 as pb
from .proto import shard_pb2_grpc as pb_grpc
from .route import RemoteStage, RouteClient
from .worker.prefixes import PREFIX_BLOCK_TOKENS

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]
# a system prompt of some 300 tokens: long enough for one shared block of 256
SYSTEM_PROMPT = " ".join(
    [
        "You are the help desk of a small public library. Answer in one or two short sentences, in plain words.",
        "The library opens at nine in the morning and closes at six in the evening, Monday to Saturday; it is",
        "closed on Sundays and public holidays. Anyone may read in the library; borrowing needs a free library",
        "card, which the front desk issues on the spot to anyone who shows an identity document and an address.",
        "A card holder may borrow up to eight items at a time: books for three weeks, films and music for one",
        "week, magazines for one week. Items can be renewed twice, online or at the desk, unless someone else has",
        "reserved them. Late returns cost ten cents a day per item, at most five euros per item; children's",
        "items are never fined. Lost or damaged items are charged at their replacement price. The reading room",
        "on the first floor is silent; the ground floor has a children's corner, computers that card holders may",
        "use for two hours a day, a printer (ten cents a page) and free wireless internet. Rooms for groups of up",
        "to twelve can be booked a week ahead. Volunteers help with computers on Tuesday and Thursday afternoons.",
        "If a question is not about the library, say politely that you can only help with the library.",
    ]
)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _start_route(
    model: Path, ranges: list[tuple[int, int]], threads: int, procs: list[tuple[subprocess.Popen, str]], http_port: int
) -> None:
    """Two workers, the head chained to the tail: the head forwards each step to the tail itself
    (serve --peer), so a token costs the client one round trip instead of one per worker. Two hot
    slots each for four sessions: the others wait in the warm tier (host memory) and come back
    without a re-prefill. Appends each worker to `procs` as it starts, so that the caller stops
    those that started if a later one fails."""
    t0 = time.perf_counter()
    tail_port = free_port()
    tiers = ("--max-sessions", "2", "--warm-memory", "64MiB", "--prefix-memory", "32MiB")
    head = ("--peer", f"127.0.0.1:{tail_port}", "--http-port", str(http_port))  # and the OpenAI-compatible API
    for (first, last), port, extra in [(ranges[0], None, head), (ranges[1], tail_port, ())]:
        proc, addr = start_worker(model, first, last, threads, extra=extra + tiers, port=port)
        procs.append((proc, addr))
        _say(
            f"  starting worker {first}-{last} on {addr} (2 hot slots, 64 MiB warm tier, 32 MiB for shared prefixes)"
            + (f", forwards to {extra[1]}, OpenAI API on :{http_port}" if extra else "")
            + " ..."
        )
    for (proc, addr), (first, last) in zip(procs, ranges):
        wait_serving(proc, addr)
        _say(f"  worker {first}-{last} is serving ({time.perf_counter() - t0:.1f}s)")


def _show_workers(stages) -> None:
    for st in stages:
        info = st.stats()
        sessions = ", ".join(f"{s.session_id}({s.seq_len}, {s.tier})" for s in info.sessions) or "none"
        _say(
            f"  worker {info.first:>2}-{info.last:<2} @ {st.address}: {info.live_sessions} live session(s) "
            f"[{sessions}]; {info.reserved_tokens} of {info.budget_tokens} budget tokens reserved "
            f"({info.reserved_tokens * info.kv_bytes_per_token / 2**20:.2f} MiB KV); warm tier: "
            f"{info.warm_sessions} session(s), {info.warm_bytes / 2**20:.2f} MiB, {info.spills} spills, "
            f"{info.restores} restores; shared prefixes: {info.prefix_entries} held "
            f"({info.prefix_bytes / 2**20:.2f} MiB), {info.prefix_hits} hit(s), {info.prefix_tokens_saved} tokens "
            f"not computed"
        )


class _Transcript:
    """Streams each session's text line by line as its tokens arrive (from the route's threads)."""

    def __init__(self, vocab: ShardModel, n: int):
        self.vocab, self.eos = vocab, vocab.token_eos
        self.lock = threading.Lock()
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.lines_done = [0] * n

    def on_token(self, i: int, token: int) -> None:
        with self.lock:
            self.tokens[i].append(token)
            lines = self.text(i).split("\n")
            for line in lines[self.lines_done[i] : -1]:
                _say(f"  [chat-{i + 1}] {line}")
            self.lines_done[i] = len(lines) - 1

    def text(self, i: int) -> str:
        return self.vocab.detokenize([t for t in self.tokens[i] if t != self.eos])

    def finish(self) -> None:
        for i in range(len(self.tokens)):  # the last (unterminated) line of each answer
            last = self.text(i).split("\n")[-1]
            if last.strip():
                _say(f"  [chat-{i + 1}] {last}")


def _chat(model: Path, stages: list[RemoteStage], max_tokens: int) -> None:
    client = RouteClient(stages)  # chained: every worker forwards to the next
    vocab = ShardModel(str(model), (0, 0), 1)  # tokenizer and chat template on the head side
    how = (
        "each a Generate stream: the head runs the loop, the tail picks each token"
        if client.chained
        else "client-relayed"
    )
    _say(f"\nfour concurrent chat sessions through both workers, {how} (greedy, up to {max_tokens} tokens):")
    sessions = [client.session(f"chat-{i + 1}") for i in range(len(QUESTIONS))]
    transcript = _Transcript(vocab, len(QUESTIONS))
    for i, q in enumerate(QUESTIONS):
        _say(f"  [chat-{i + 1}] user: {q}")
    chat = ModelChat(vocab)  # the endpoint's rendering: the same prompt for the same conversation
    prompts = [chat.tokens([{"role": "user", "content": q}]) for q in QUESTIONS]
    t0 = time.perf_counter()
    # the head groups the streams into two micro-batches: while the tail computes one, it computes the other
    client.generate_many(
        sessions, prompts, max_tokens, stop=(vocab.token_eos,), micro_batches=2, on_token=transcript.on_token
    )
    dt = time.perf_counter() - t0
    transcript.finish()
    finals = [s.last_final for s in sessions if s.last_final is not None]
    if finals:
        _say(
            "  per stream: "
            + "; ".join(
                f"chat-{i + 1} {f.finish_reason}, {f.completion_tokens} tokens, first after "
                f"{f.time_to_first_token_s * 1000:.0f} ms, {f.tokens_per_s:.1f} tok/s"
                for i, f in enumerate(finals)
            )
        )
    _say(
        f"\n{len(QUESTIONS)} sessions done in {dt:.1f}s; {sum(len(s.history) for s in sessions)} tokens held per "
        f"worker; {sum(s.reprefills for s in sessions)} re-prefill(s)"
    )
    _show_workers(stages)
    for s in sessions:
        s.release()
    _say("\nafter releasing the sessions:")
    _show_workers(stages)
    client.close()


def _http_turn(http_port: int, max_tokens: int) -> None:
    """One chat turn through the head's OpenAI-compatible endpoint, as curl or any OpenAI client sends it."""
    question = "Name three colours of the rainbow."
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}
    url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
    _say(
        f"\none chat turn through the head's OpenAI-compatible endpoint "
        f"(curl {url} -H 'Content-Type: application/json' -d '{{\"messages\": ...}}'):"
    )
    _say(f"  user: {question}")
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    usage = answer["usage"]
    _say(f"  assistant: {answer['choices'][0]['message']['content'].strip()}")
    _say(
        f"  {answer['choices'][0]['finish_reason']} after {usage['completion_tokens']} tokens, prompt "
        f"{usage['prompt_tokens']} tokens, in {time.perf_counter() - t0:.2f}s"
    )


def _shared_prefix(model: Path, head: str, tail: str, max_tokens: int) -> None:
    """Two chats that begin with the same system prompt: the first computes it and both workers keep
    its first whole blocks (keep_prefix); the second opens from them and computes only the rest."""
    vocab = ShardModel(str(model), (0, 0), 1)
    questions = ["Can I borrow a film for two weeks?", "Is the library open on Sunday?"]
    chat = ModelChat(vocab)
    system = len(chat.tokens([{"role": "system", "content": SYSTEM_PROMPT}], add_generation_prompt=False))
    keep = system // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
    _say(
        f"\ntwo chats that begin with the same {system}-token system prompt: the first keeps its first {keep} "
        f"tokens on both workers, the second opens from them:"
    )
    with grpc.insecure_channel(head) as ch:
        stub = pb_grpc.ShardServiceStub(ch)
        for i, q in enumerate(questions):
            prompt = chat.tokens([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}])
            req = pb.GenerateRequest(
                session_id=f"desk-{i + 1}",
                prompt=prompt,
                max_tokens=max_tokens,
                stop_token_ids=[vocab.token_eos],
                forward=[pb.Hop(address=tail)],
                keep_prefix=keep,
            )
            tokens, final = [], None
            for event in stub.Generate(req, timeout=120):
                if event.HasField("token"):
                    tokens.append(event.token.token_id)
                else:
                    final = event.final
            _say(f"  [desk-{i + 1}] user: {q}")
            _say(f"  [desk-{i + 1}] {vocab.detokenize([t for t in tokens if t != vocab.token_eos]).strip()}")
            _say(
                f"  [desk-{i + 1}] prompt {final.prompt_tokens} tokens, {final.prefix_tokens} from the shared prefix; "
                f"first token after {final.time_to_first_token_s * 1000:.0f} ms"
            )
    for address in (head, tail):  # the prefix stays: it is the store's copy, not the sessions'
        with grpc.insecure_channel(address) as ch:
            for i in range(len(questions)):
                pb_grpc.ShardServiceStub(ch).Release(pb.SessionRequest(session_id=f"desk-{i + 1}"), timeout=10)
    _show_workers([RemoteStage(head), RemoteStage(tail)])


def _stop(procs: list[tuple[subprocess.Popen, str]]) -> bool:
    """SIGTERM to every worker; prints each one's exit code and shutdown report; True if all exit 0."""
    _say("\nshutting the workers down (SIGTERM):")
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, addr in procs:
        code, stderr = stop_worker(proc, send_sigterm=False)  # all were signalled above, to stop together
        report = [ln for ln in stderr.splitlines() if "shut down" in ln]
        _say(f"  worker {addr}: exit {code}" + (f" - {report[-1].split(': ', 1)[-1]}" if report else ""))
    return all(p.returncode == 0 for p, _ in procs)


def run_demo(model: Path, threads: int = 1, max_tokens: int = 48) -> int:
    n_layer = gguf_layer_count(model)
    half = n_layer // 2
    ranges = [(0, half - 1), (half, n_layer - 1)]
    _say(
        f"llama-shard demo: {model.name}, {n_layer} layers split {ranges[0][0]}-{ranges[0][1]} | {ranges[1][0]}-{ranges[1][1]}"
    )
    procs: list[tuple[subprocess.Popen, str]] = []
    http_port = free_port()
    try:
        _start_route(model, ranges, threads, procs, http_port)
        _chat(model, [RemoteStage(addr) for _, addr in procs], max_tokens)
        _http_turn(http_port, max_tokens)
        _shared_prefix(model, procs[0][1], procs[1][1], max_tokens)
    finally:
        ok = _stop(procs)
    return 0 if ok else 1


if __name__ == "__main__":
    from .engine.models import require_embedded_model

    raise SystemExit(
        run_demo(
            Path(os.environ.get("LLAMA_SHARD_MODEL", ""))
            if os.environ.get("LLAMA_SHARD_MODEL")
            else require_embedded_model()
        )
    )
