"""What users run over gRPC, measured: one worker with many clients, and two-stage routes in
four topologies. Shared by the table (bench.py) and the studies."""

from __future__ import annotations

import http.client as http_client
import json
import os
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
from common import cpu_seconds, log

from llama_shard import HotKvStateConfig, ShardModel, StepKind
from llama_shard.engine.models import compute_balanced_cut, gguf_layer_count
from llama_shard.errors import InvalidInputError
from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.proto.credentials import ClientSecurity
from llama_shard.proto.requests import DEFAULT_MAX_DRAFTS
from llama_shard.route import LocalStage, RemoteStage, RouteClient, RouteError

# name -> stages served by workers; "chained": the head worker forwards to the tail itself (serve --peer)
TOPOLOGIES = {"chained": 2, "two workers": 2, "local head": 1, "in process": 0}


@contextmanager
def _environment(env: dict[str, str] | None):
    """Variables set while a worker starts (it inherits them; this process has loaded its libraries)."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _decode_clients(
    addr: str, prompts: list[list[int]], ntg: int, ready: threading.Barrier, failures: list[str]
) -> list[threading.Thread]:
    """One thread per prompt, each a gRPC client driving its own session: Prefill, wait for
    `ready`, then ntg Decode calls. A client whose step fails adds the outcome to `failures`."""

    def client(j: int) -> None:
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.ShardServiceStub(channel)
            r = stub.Prefill(pb.StepRequest(session_id=f"c{j}", route_epoch=0, token_ids=prompts[j]), timeout=120)
            ready.wait()
            for _ in range(ntg):
                r = stub.Decode(pb.StepRequest(session_id=f"c{j}", route_epoch=0, token_ids=[r.token_id]), timeout=120)
                if r.outcome != pb.OUTCOME_OK:
                    failures.append(pb.Outcome.Name(r.outcome))
                    return

    return [threading.Thread(target=client, args=(j,)) for j in range(len(prompts))]


def ours_worker_clients(
    path: Path, threads: int, npp: int, ntg: int, n_clients: int, vocab: int, env: dict[str, str] | None = None
) -> float:
    """One `llama-shard serve` worker (the whole model, `threads` threads) and `n_clients` gRPC
    clients in this process, each driving its own session with Prefill and then Decode calls.
    The decode phase is timed. `env`: variables set for the worker process only."""
    context = npp + ntg + 8
    with _environment(env):
        proc, addr = start_worker(
            path,
            0,
            gguf_layer_count(path) - 1,
            threads,
            extra=(
                "--max-sessions",
                str(n_clients),
                "--context-tokens",
                str(context),
                "--budget-tokens",
                str(n_clients * context),
            ),
        )
    try:
        wait_serving(proc, addr)
        rng = np.random.default_rng(7)
        ready, failures = threading.Barrier(n_clients + 1), []
        prompts = [rng.integers(0, vocab, npp).tolist() for _ in range(n_clients)]
        clients = _decode_clients(addr, prompts, ntg, ready, failures)
        for t in clients:
            t.start()
        with grpc.insecure_channel(addr) as channel:
            info = pb_grpc.ShardServiceStub(channel).Info
            ready.wait()
            i0, cpu0 = info(pb.InfoRequest(), timeout=30), (cpu_seconds(proc.pid), cpu_seconds())
            t0 = time.perf_counter()
            for t in clients:
                t.join()
            wall = time.perf_counter() - t0
            i1, cpu1 = info(pb.InfoRequest(), timeout=30), (cpu_seconds(proc.pid), cpu_seconds())
        if failures:
            raise RuntimeError(f"worker clients failed: {failures[:3]}")
        steps, busy = i1.engine_steps - i0.engine_steps, i1.engine_busy_seconds - i0.engine_busy_seconds
        # where the time goes: the engine's share of the wall time, the requests per step, and the
        # CPU of the worker process (compute threads included) and of the clients
        log(
            f"worker profile, {n_clients} gRPC clients: {n_clients * ntg} tokens in {wall:.2f}s; engine busy "
            f"{busy:.2f}s ({busy / wall:.0%} of the wall time) in {steps} steps of "
            f"{(i1.engine_requests - i0.engine_requests) / max(steps, 1):.1f} requests, {busy / max(steps, 1) * 1e3:.1f} ms each; "
            f"CPU worker {cpu1[0] - cpu0[0]:.2f}s, clients {cpu1[1] - cpu0[1]:.2f}s"
        )
        return n_clients * ntg / wall
    finally:
        stop_worker(proc)


def _engine_counters(stage) -> tuple[float, int, int]:
    """(seconds busy, steps, requests) of a stage's engine: a worker's Info, or a local stage's loop."""
    if isinstance(stage, LocalStage):
        st = stage.manager.loop_stats()
        return st["busy_seconds"], st["steps"], st["requests"]
    info = stage.stats()
    return info.engine_busy_seconds, info.engine_steps, info.engine_requests


class TlsSetup:
    """Token over TLS for a benchmark's workers: a CA and a server certificate for localhost, a
    token for the client and one for a head worker forwarding to the tail on the client's behalf."""

    def __init__(self, directory: Path):
        from llama_shard.testing.certs import CertificateAuthority

        ca = CertificateAuthority.create(directory, "bench-ca")
        server = ca.issue("worker", server=True)
        tokens = {"client": "client-token-0123456789", "head": "head-token-0123456789ab"}
        (directory / "tokens").write_text("".join(f"{p}:{t}\n" for p, t in tokens.items()))
        for principal, token in tokens.items():
            (directory / f"{principal}.token").write_text(token)
        route_key = directory / "route.key"  # the head signs whom it forwards for; the tail checks it
        route_key.write_bytes(os.urandom(32))
        route_key.chmod(0o600)
        self.flags = (
            "--tls-cert",
            str(server.cert),
            "--tls-key",
            str(server.key),
            "--auth-token-file",
            str(directory / "tokens"),
            "--forwarder",
            "head",
            "--route-key-file",
            str(route_key),
        )
        self.peer_flags = ("--peer-tls-ca", str(ca.cert), "--peer-token-file", str(directory / "head.token"))
        self.client = ClientSecurity(tls_ca=str(ca.cert), token_file=str(directory / "client.token"))


def _start_stages(
    path: Path, ranges: list[tuple[int, int]], topology: str, tls: TlsSetup | None = None
) -> list[tuple[subprocess.Popen, str]]:
    """The worker processes of a topology (the last TOPOLOGIES[topology] stages), 1 thread each;
    with TLS their addresses name localhost, which the certificate covers."""
    n_local = len(ranges) - TOPOLOGIES[topology]
    flags, host = (tls.flags, "localhost") if tls else ((), "127.0.0.1")

    def start(first: int, last: int, extra: tuple = (), port: int | None = None) -> tuple[subprocess.Popen, str]:
        proc, addr = start_worker(path, first, last, 1, extra=flags + extra, port=port)
        return proc, f"{host}:" + addr.rsplit(":", 1)[1]

    if topology == "chained":
        tail_port = free_port()
        tail = start(*ranges[1], port=tail_port)
        return [start(*ranges[0], extra=("--peer", f"{host}:{tail_port}", *(tls.peer_flags if tls else ()))), tail]
    return [start(first, last) for first, last in ranges[n_local:]]


def _wait_stages(procs: list[tuple[subprocess.Popen, str]], tls: TlsSetup | None) -> None:
    """Each worker answers Info (over TLS with the client's token, when set)."""
    for proc, addr in procs:
        if tls is None:
            wait_serving(proc, addr)
            continue
        deadline = time.monotonic() + 120
        while True:
            try:
                RemoteStage(addr, security=tls.client, timeout_s=2).close()
                break
            except RouteError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


class _MicroBatches:
    """pl sessions of a route dealt into groups of consecutive sessions; each group steps through
    the route on its own thread, so while the tail computes one group the head computes another."""

    def __init__(self, client: RouteClient, pl: int, micro_batches: int):
        self.client = client
        self.sessions = [client.session(f"pipe-{pl}-{j}") for j in range(pl)]
        n = max(1, min(micro_batches, pl))
        self.groups = [list(range(g * pl // n, (g + 1) * pl // n)) for g in range(n)]
        self.last_token: dict[int, int] = {}

    def step(self, kind: StepKind, group: list[int], feeds: list[list[int]]) -> None:
        outs = self.client.step_sessions(kind, [self.sessions[i] for i in group], feeds)
        for i, out in zip(group, outs):
            if isinstance(out, RouteError):
                raise out
            self.last_token[i] = int(out.token_id)

    def prefill(self, rng, vocab: int, npp: int) -> None:
        for group in self.groups:  # sessions open in order: each group holds consecutive seq ids
            self.step(StepKind.PREFILL, group, [rng.integers(0, vocab, npp).tolist() for _ in group])

    def decode(self, ntg: int) -> float:
        """ntg decode steps of every group, the groups on threads of their own; the wall seconds."""
        failures: list[RouteError] = []

        def run(group: list[int]) -> None:
            try:
                for _ in range(ntg):
                    self.step(StepKind.DECODE, group, [[self.last_token[i]] for i in group])
            except RouteError as e:
                failures.append(e)

        threads = [threading.Thread(target=run, args=(g,)) for g in self.groups]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        return time.perf_counter() - t0

    def release(self) -> None:
        for s in self.sessions:
            s.release()


def ours_two_stages(
    path: Path,
    n_layer: int,
    npp: int,
    ntg: int,
    npl: list[int],
    vocab: int,
    micro_batches: int = 2,
    topology: str = "two workers",
    tls: bool = False,
) -> dict[int, float]:
    """Decode tokens/s of `pl` sessions through two 1-thread stages split where per-token compute
    balances (the tail also runs the LM head). Topologies: "chained", two `serve` processes, the
    head forwarding to the tail; "two workers", the same driven by this process; "local head", the
    head in this process (a LocalStage, as llama-batched-bench keeps its half local) and the tail
    a worker; "in process", both stages LocalStages: no gRPC and no second process, which shows
    what the transport costs. Sessions step in `micro_batches` groups (pipelining). Like
    llama-batched-bench, prompts are prefilled first and only the decode is timed. `tls`: the
    workers use token over TLS (TlsSetup)."""
    cut = compute_balanced_cut(path)
    ranges = [(0, cut - 1), (cut, n_layer - 1)]
    n_local = len(ranges) - TOPOLOGIES[topology]  # the first n_local stages run in this process
    tmp = tempfile.TemporaryDirectory() if tls else None
    setup = TlsSetup(Path(tmp.name)) if tmp else None
    procs = _start_stages(path, ranges, topology, setup)
    res = {}
    try:
        _wait_stages(procs, setup)
        config = HotKvStateConfig(max_sessions=8, context_tokens=512, budget_tokens=2048)  # as the workers'
        security = setup.client if setup else ClientSecurity()
        stages = [LocalStage(ShardModel(str(path), r, 1), config) for r in ranges[:n_local]] + [
            RemoteStage(addr, security=security) for _, addr in procs
        ]
        client = RouteClient(stages, chained=topology == "chained")
        rng = np.random.default_rng(5)
        for pl in npl:
            batches = _MicroBatches(client, pl, micro_batches)
            batches.prefill(rng, vocab, npp)
            cpu0 = [cpu_seconds(proc.pid) for proc, _ in procs] + [cpu_seconds()]
            eng0 = [_engine_counters(s) for s in client.stages]
            wall = batches.decode(ntg)
            cpu = [b - a for a, b in zip(cpu0, [cpu_seconds(proc.pid) for proc, _ in procs] + [cpu_seconds()])]
            eng = [tuple(b - a for a, b in zip(before, _engine_counters(s))) for before, s in zip(eng0, client.stages)]
            res[pl] = pl * ntg / wall
            _log_route_profile(topology, n_local, pl, len(batches.groups), ntg, wall, cpu, eng)
            batches.release()
        client.close()
    finally:
        for proc, _ in procs:
            stop_worker(proc)
        if tmp:
            tmp.cleanup()
    return res


def _log_route_profile(
    topology: str, n_local: int, pl: int, n_groups: int, ntg: int, wall: float, cpu: list[float], eng: list[tuple]
) -> None:
    """Where the time went: CPU seconds of each process during the decode, and how long each
    stage's engine was busy, in how many steps of how many requests."""
    names = ["head", "tail"][n_local:] + [" + ".join(["client", *["head", "tail"][:n_local]])]
    log(
        f"pipeline profile ({topology}), {pl} session(s) in "
        f"{n_groups} micro-batch(es), {pl * ntg} tokens in {wall:.2f}s wall ({wall / ntg * 1e3:.1f} ms per round): CPU "
        + ", ".join(f"{n} {c:.2f}s" for n, c in zip(names, cpu))
        + f" ({sum(cpu) / (wall * (os.cpu_count() or 1)):.0%} of {os.cpu_count()} cores); engine busy "
        + ", ".join(
            f"{stage} {b:.2f}s in {n} steps ({r / max(n, 1):.1f} req/step)"
            for stage, (b, n, r) in zip(("head", "tail"), eng)
        )
    )


def ours_generate_streams(
    path: Path,
    ranges: list[tuple[int, int]],
    threads: int,
    npp: int,
    ntg: int,
    n_streams: int,
    vocab: int,
    http: bool = False,
    worker_flags: tuple = (),
    sampling: pb.Sampling | None = None,
    http_extra: dict | None = None,
    tail_replicas: int = 1,
    head_flags: tuple = (),
    receipts: list | None = None,
) -> float:
    """Aggregate decode tokens/s of `n_streams` Generate streams on a route of workers (`ranges`,
    each worker `threads` threads, each forwarding to the next): every stream asks for ntg tokens
    after a random npp-token prompt, at once, as users call it. Like batched-bench's S_TG, the
    decode phase is what is timed: from the moment every stream has its first token to the last
    token, counting the tokens that arrived in between. http=True: the same requests as streamed
    /v1/completions through the head's OpenAI-compatible endpoint (one event per token);
    worker_flags: more `serve` flags for every worker (`--flash-attn off`); sampling: what the
    Generate streams ask the tail for (None: the greedy token without a sampler chain);
    http_extra: more keys of every HTTP request (a response_format); tail_replicas: workers of the
    last range (the head peers them all and places the streams on them: its own route); head_flags:
    more flags of the head only; receipts: where each stream's receipt is appended (then asked for)."""
    context = npp + ntg + 8
    procs: list[tuple[subprocess.Popen, str]] = []
    http_port = free_port()
    try:
        later: list[str] = []  # the next stage's workers (each one's --peer)
        for first, last in reversed(ranges):
            peers = tuple(f for a in later for f in ("--peer", a))
            head = (*(("--http-port", str(http_port)) if http else ()), *head_flags) if first == 0 else ()
            copies = tail_replicas if last == ranges[-1][1] else 1
            started = [
                start_worker(
                    path,
                    first,
                    last,
                    threads,
                    extra=(
                        "--max-sessions",
                        str(n_streams),
                        "--context-tokens",
                        str(context),
                        "--budget-tokens",
                        str(n_streams * context),
                        *peers,
                        *head,
                        *worker_flags,
                    ),
                )
                for _ in range(copies)
            ]
            procs[:0] = started
            later = [a for _, a in started]
        for proc, addr in procs:
            wait_serving(proc, addr)
        rng = np.random.default_rng(11)
        prompts = [rng.integers(0, vocab, npp).tolist() for _ in range(n_streams)]
        forward = [pb.Hop(address=addr) for _, addr in procs[1:]] if tail_replicas == 1 else []
        arrivals: list[list[float]] = [[] for _ in range(n_streams)]
        failures: list[str] = []
        ready = threading.Barrier(n_streams)

        def stream(i: int) -> None:
            if http:
                return http_stream(i)
            with grpc.insecure_channel(procs[0][1]) as ch:
                stub = pb_grpc.ShardServiceStub(ch)
                ready.wait()
                req = pb.GenerateRequest(
                    session_id=f"bench-{i}",
                    prompt=prompts[i],
                    max_tokens=ntg,
                    forward=forward,
                    sampling=sampling,
                    receipt=receipts is not None,
                )
                for event in stub.Generate(req, timeout=600):
                    if event.HasField("token"):
                        arrivals[i].append(time.perf_counter())
                    elif event.final.finish_reason != "length":
                        failures.append(str(event.final))
                    elif receipts is not None:
                        receipts.append(event.final.receipt)

        def http_stream(i: int) -> None:
            conn = http_client.HTTPConnection("127.0.0.1", http_port, timeout=600)
            body = json.dumps(
                {
                    "prompt": prompts[i],
                    "max_tokens": ntg,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                    **(http_extra or {}),
                }
            )
            ready.wait()
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                failures.append(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            for line in resp:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk or not chunk["choices"]:
                        failures.append(str(chunk)[:300])
                    elif chunk["choices"][0]["finish_reason"] is None:
                        arrivals[i].append(time.perf_counter())
                    elif chunk["choices"][0]["finish_reason"] != "length":
                        failures.append(str(chunk)[:300])
            conn.close()

        threads_ = [threading.Thread(target=stream, args=(i,)) for i in range(n_streams)]
        cpu0, wall0 = [cpu_seconds(proc.pid) for proc, _ in procs], time.perf_counter()
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        if failures:
            raise RuntimeError(f"Generate streams failed: {failures[:3]}")
        start = max(a[0] for a in arrivals)
        end = max(a[-1] for a in arrivals)
        tokens = sum(1 for a in arrivals for t in a if t > start)
        cpu = [cpu_seconds(proc.pid) - c for (proc, _), c in zip(procs, cpu0)]
        log(
            f"Generate profile, {len(ranges)} worker(s), {n_streams} streams: {tokens} tokens decoded in "
            f"{end - start:.2f}s after the last first token; CPU per worker {', '.join(f'{c:.2f}s' for c in cpu)} "
            f"in {time.perf_counter() - wall0:.2f}s from the first request to the last token"
        )
        return tokens / (end - start)
    finally:
        for proc, _ in procs:
            stop_worker(proc)


def ours_chat_reuse(
    path: Path, threads: int, turns: int = 20, answer_tokens: int = 16, flash_attn: bool = True
) -> dict[str, float]:
    """A `turns`-turn greedy chat through one worker's OpenAI-compatible endpoint, every request the
    whole conversation: 1 / time to first token of the last turn (continuing the session that
    holds the conversation), and of the same request cold (a new session: X-Session-Id); the
    worker runs with or without flash attention (`--flash-attn`)."""
    http_port = free_port()
    proc, addr = start_worker(
        path,
        0,
        gguf_layer_count(path) - 1,
        threads,
        extra=(
            "--http-port",
            str(http_port),
            "--context-tokens",
            "4096",
            "--max-sessions",
            "2",
            "--flash-attn",
            "on" if flash_attn else "off",
        ),
    )
    try:
        wait_serving(proc, addr)

        def ask(messages: list[dict], session: str | None = None) -> tuple[float, str, dict]:
            conn = http_client.HTTPConnection("127.0.0.1", http_port, timeout=600)
            body = json.dumps(
                {
                    "messages": messages,
                    "max_tokens": answer_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
            t0 = time.perf_counter()
            conn.request(
                "POST",
                "/v1/chat/completions",
                body,
                {"Content-Type": "application/json", **({"X-Session-Id": session} if session else {})},
            )
            first, text, usage = None, "", {}
            for line in conn.getresponse():
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    elif (
                        chunk["choices"]
                        and chunk["choices"][0]["delta"].get("content") is not None
                        and chunk["choices"][0]["delta"].get("role") is None
                    ):
                        first = first or time.perf_counter()
                        text += chunk["choices"][0]["delta"]["content"]
            conn.close()
            return (first or time.perf_counter()) - t0, text, usage

        messages = [{"role": "system", "content": "You are a patient teacher who answers briefly."}]
        for turn in range(turns):
            messages.append(
                {
                    "role": "user",
                    "content": f"Question {turn + 1}: tell me one fact about the number "
                    f"{turn * 7 + 3} and why it matters.",
                }
            )
            warm, answer, usage = ask(messages)
            messages.append({"role": "assistant", "content": answer})
        cold, _, cold_usage = ask(messages[:-1], session=f"cold-{time.monotonic_ns()}")
        log(
            f"chat reuse: turn {turns} prompt {usage['prompt_tokens']} tokens, {usage['prompt_tokens_details']['cached_tokens']} "
            f"reused, first token after {warm * 1e3:.0f} ms; cold: {cold_usage['prompt_tokens_details']['cached_tokens']} "
            f"reused, first token after {cold * 1e3:.0f} ms"
        )
        return {"warm": 1 / warm, "cold": 1 / cold}
    finally:
        stop_worker(proc)


def ours_shared_prefix(
    path: Path,
    ranges: list[tuple[int, int]],
    sessions: int = 64,
    system_tokens: int = 512,
    own_tokens: int = 32,
    answer_tokens: int = 8,
    prefix_memory: str | None = "64MiB",
    worker_flags: tuple = (),
) -> dict:
    """`sessions` Generate streams on a route of workers (1 thread each), one after another, each
    prompt the same system_tokens-token start (the caller marks it: keep_prefix) and own_tokens of
    its own, answer_tokens generated: what a chat service with one system prompt does. With
    prefix_memory None, today's route (no prefix store). Returns the time to first token of the
    first session, of the others on average and at most (as rates, 1/s), the most tokens a worker
    computed, the prefix tokens the streams opened, and the generated tokens per second of the
    whole run."""
    rng = np.random.default_rng(17)
    vocab = ShardModel(str(path), (0, 0), 1).info.n_vocab
    system = rng.integers(100, vocab, system_tokens).tolist()
    prompts = [system + rng.integers(100, vocab, own_tokens).tolist() for _ in range(sessions)]
    context = system_tokens + own_tokens + answer_tokens + 8
    procs: list[tuple[subprocess.Popen, str]] = []
    store = ("--prefix-memory", prefix_memory) if prefix_memory else ()
    try:
        for first, last in reversed(ranges):
            peer = ("--peer", procs[-1][1]) if procs else ()
            procs.append(
                start_worker(
                    path,
                    first,
                    last,
                    1,
                    extra=(
                        "--max-sessions",
                        "8",
                        "--context-tokens",
                        str(context),
                        "--budget-tokens",
                        str(8 * context),
                        *peer,
                        *store,
                        *worker_flags,
                    ),
                )
            )
        procs.reverse()
        for proc, addr in procs:
            wait_serving(proc, addr)
        forward = [pb.Hop(address=addr) for _, addr in procs[1:]]
        ttft, opened, generated = [], 0, 0
        with grpc.insecure_channel(procs[0][1]) as ch:
            stub = pb_grpc.ShardServiceStub(ch)
            t0 = time.perf_counter()
            for i, prompt in enumerate(prompts):
                req = pb.GenerateRequest(
                    session_id=f"chat-{i}",
                    prompt=prompt,
                    max_tokens=answer_tokens,
                    forward=forward,
                    keep_prefix=system_tokens,
                )
                final = None
                for event in stub.Generate(req, timeout=600):
                    if event.HasField("final"):
                        final = event.final
                if final is None or final.finish_reason != "length":
                    raise RuntimeError(f"a Generate stream failed: {final}")
                ttft.append(final.time_to_first_token_s)
                opened += final.prefix_tokens
                generated += final.completion_tokens
            wall = time.perf_counter() - t0
            computed = []
            for _, addr in procs:
                with grpc.insecure_channel(addr) as c:
                    computed.append(pb_grpc.ShardServiceStub(c).Info(pb.InfoRequest(), timeout=10).tokens_computed)
        log(
            f"shared prefix {prefix_memory or 'off'} {' '.join(worker_flags)}: {sessions} sessions in {wall:.1f}s, "
            f"first token {ttft[0] * 1e3:.0f} ms then mean {np.mean(ttft[1:]) * 1e3:.0f} ms (max "
            f"{max(ttft[1:]) * 1e3:.0f}), tokens computed per worker {computed}, {opened} prompt tokens opened"
        )
        # figures where more is better (bench's `best` keeps each one's best over repeats)
        return {
            "first_rate": 1 / ttft[0],
            "others_rate": 1 / float(np.mean(ttft[1:])),
            "others_max_rate": 1 / max(ttft[1:]),
            "computed": max(computed),
            "opened": opened,
            "tok_s": generated / wall,
        }
    finally:
        for proc, _ in procs:
            stop_worker(proc)


#: the speculation rows' prompt sets: texts to rewrite or quote (their answers repeat the prompt),
#: and open questions (their answers do not)
REPEAT_TEXTS = [
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow up to five "
    "books at a time for three weeks. Late returns cost ten cents per book per day, and lost books must be "
    "replaced or paid for at the price printed inside the cover.",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. When the green light "
    "stops blinking, open the settings page, sign in with the password on the label, and choose a new network "
    "name and a new password.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / len(values)\n\n"
    "def variance(values):\n    m = mean(values)\n    total = 0\n    for value in values:\n        total += (value - m) ** 2\n"
    "    return total / len(values)\n",
    "Dear team, the quarterly review moves from Tuesday to Thursday at two o'clock in the large meeting room. "
    "Please bring your project updates, your budget figures for the next quarter, and a list of the risks you "
    "see. Lunch will be served before the meeting.",
]
REPEAT_ASK = [
    "Rewrite the following text exactly as it is written.\n\nText: {}\n\nRewritten text: ",
    "Quote the following text word for word.\n\n{}\n\nQuote: ",
]
OPEN_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in simple words why the sky is blue during the day and red at sunset.",
    "List some ideas for a birthday party for a ten year old who loves dinosaurs.",
    "Describe how bread is made, from the wheat field to the bakery shelf.",
]


def speculation_prompts(vocab_model: ShardModel) -> dict[str, list[list[int]]]:
    """The two prompt sets, tokenized: 'repetitive' (rewrite or quote a text) and 'open' (questions);
    for a model without a tokenizer (the tests' synthetic ones), ids: a run repeated, and random ids."""
    repeat = [REPEAT_ASK[i % 2].format(t) for i, t in enumerate(REPEAT_TEXTS)]
    try:
        return {
            "repetitive": [vocab_model.tokenize(p) for p in repeat],
            "open": [vocab_model.tokenize(p) for p in OPEN_QUESTIONS],
        }
    except InvalidInputError:
        rng = np.random.default_rng(23)
        n_vocab = vocab_model.info.n_vocab
        runs = [rng.integers(1, n_vocab, 24).tolist() for _ in REPEAT_TEXTS]
        return {
            "repetitive": [r + r for r in runs],
            "open": [rng.integers(1, n_vocab, 48).tolist() for _ in OPEN_QUESTIONS],
        }


def ours_speculation(
    path: Path,
    ranges: list[tuple[int, int]],
    delay_ms: float,
    tokens: int = 64,
    repeat: int = 1,
    worker_flags: tuple = (),
    prompts_per_set: int | None = None,
) -> dict:
    """One Generate stream at a time on two chained 1-thread workers, greedy, `tokens` each, with
    speculative decoding (the worker's default drafts) and without (max_drafts 0), the two taking
    turns on the same workers (each prompt both ways in a row, which first alternating); with
    delay_ms > 0 the head reaches the tail through a proxy that delays each direction by that much.
    Returns per prompt set: tokens/s of whole requests with and
    without (best of `repeat`), the acceptance rate, and how many prompts' greedy tokens differed
    (with --draft-verify exact, the default, none may: that raises)."""
    from delay_proxy import DelayProxy

    vocab = ShardModel(str(path), (0, 0), 1)
    sets = {name: ps[:prompts_per_set] for name, ps in speculation_prompts(vocab).items()}
    context = max(len(p) for ps in sets.values() for p in ps) + tokens + 16
    common = (
        "--max-sessions",
        "4",
        "--context-tokens",
        str(context),
        "--budget-tokens",
        str(4 * context),
        *worker_flags,
    )
    tail, tail_addr = start_worker(path, *ranges[1], 1, extra=common)
    procs = [tail]
    proxy = DelayProxy(tail_addr, delay_ms / 1000) if delay_ms > 0 else None
    try:
        wait_serving(tail, tail_addr)
        peer = tail_addr
        if proxy is not None:
            peer = proxy.__enter__().address
        head, head_addr = start_worker(path, *ranges[0], 1, extra=("--peer", peer, *common))
        procs.append(head)
        wait_serving(head, head_addr)
        forward = [pb.Hop(address=peer)]
        out = {}
        with grpc.insecure_channel(head_addr) as ch:
            stub = pb_grpc.ShardServiceStub(ch)

            def request(prompt, max_drafts, tag):
                """One greedy Generate stream: (seconds, its final event, its tokens)."""
                req = pb.GenerateRequest(
                    session_id=f"{tag}-{time.monotonic_ns()}",
                    prompt=prompt,
                    max_tokens=tokens,
                    forward=forward,
                    max_drafts=max_drafts,
                )
                t0 = time.perf_counter()
                events = list(stub.Generate(req, timeout=600))
                seconds = time.perf_counter() - t0
                final = events[-1].final
                if final.finish_reason != "length":
                    raise RuntimeError(f"a Generate stream failed: {final}")
                stub.Release(pb.SessionRequest(session_id=req.session_id), timeout=10)
                return seconds, final, [e.token.token_id for e in events[:-1]]

            request(sets["open"][0], 0, "warm-up")
            exact = "batched" not in worker_flags
            for name, prompts in sets.items():
                best_on = best_off = 0.0
                differed = drafted = accepted = windows = kept = 0
                for r in range(repeat):
                    # each prompt with and without drafts one after the other, which first alternating:
                    # the machine's drift (several percent from one second to the next here) falls on both
                    seconds, generated, differed_now = {0: 0.0, DEFAULT_MAX_DRAFTS: 0.0}, 0, 0
                    for i, prompt in enumerate(prompts):
                        order = (0, DEFAULT_MAX_DRAFTS) if (r + i) % 2 == 0 else (DEFAULT_MAX_DRAFTS, 0)
                        got = {md: request(prompt, md, f"{name}-{md}-{i}") for md in order}
                        for md, (t, _, _) in got.items():
                            seconds[md] += t
                        final = got[DEFAULT_MAX_DRAFTS][1]
                        generated += final.completion_tokens
                        if r == repeat - 1:  # the counts of one run
                            drafted += final.drafted_tokens
                            accepted += final.accepted_tokens
                            windows += final.pipelined_windows
                            kept += final.pipelined_kept
                        if got[DEFAULT_MAX_DRAFTS][2] != got[0][2]:
                            differed_now += 1
                            if exact:  # greedy, verified row by row: not a token may change
                                raise RuntimeError(f"speculative decoding changed the greedy tokens of the {name} set")
                    best_on = max(best_on, generated / seconds[DEFAULT_MAX_DRAFTS])
                    best_off = max(best_off, generated / seconds[0])
                    differed = max(differed, differed_now)
                out[name] = {
                    "on": best_on,
                    "off": best_off,
                    "rate": accepted / max(drafted, 1),
                    "drafted": drafted,
                    "accepted": accepted,
                    "differed": differed,
                    "prompts": len(prompts),
                    "windows": windows,
                    "kept": kept,
                }
                log(
                    f"speculation {name}, delay {delay_ms:g} ms {' '.join(worker_flags)}: {best_on:.1f} vs "
                    f"{best_off:.1f} tok/s, {accepted}/{drafted} drafts accepted, {differed} of {len(prompts)} "
                    f"prompts' tokens differed; {windows} windows sent ahead, {kept} kept"
                )
        return out
    finally:
        for proc in procs:
            stop_worker(proc)
        if proxy is not None:
            proxy.__exit__(None, None, None)


# --- the wire's bytes ----------------------------------------------------------------------------

#: the benchmark's links between a head and its tail: (label, one-way delay in ms, bits per second or None)
LINKS = (("loopback", 0.0, None), ("1 Gbit/s + 5 ms", 5.0, 1e9), ("100 Mbit/s + 5 ms", 5.0, 100e6))
WIRE_NAMES = {"f32": pb.DTYPE_FLOAT32, "f16": pb.DTYPE_FLOAT16, "q8_0": pb.DTYPE_Q8_0}


def _first_token_seconds(stub, prompt: list[int], tag: str, **request) -> float:
    """Client-side time from a Generate call to its first token (the session released after)."""
    req = pb.GenerateRequest(
        session_id=f"{tag}-{time.monotonic_ns()}", prompt=prompt, max_tokens=1, max_drafts=0, **request
    )
    t0 = time.perf_counter()
    first = None
    for event in stub.Generate(req, timeout=600):
        if event.HasField("token") and first is None:
            first = time.perf_counter() - t0
        elif event.HasField("final") and event.final.finish_reason != "length":
            raise RuntimeError(f"a Generate stream failed: {event.final}")
    stub.Release(pb.SessionRequest(session_id=req.session_id), timeout=10)
    return first


def ours_long_prompt_ttft(
    path: Path,
    ranges: list[tuple[int, int]],
    prompt_tokens: int = 2048,
    repeat: int = 1,
    links=LINKS,
    wire_types=tuple(WIRE_NAMES),
) -> dict:
    """Time to first token of one `prompt_tokens`-token prompt: through two chained 1-thread workers
    over each link (the head reaches the tail through a DelayProxy) for each wire type, and on the
    whole model in one 2-thread worker (the same threads in all). Every run sends new random tokens
    (a shared prefix of an earlier run would make it cheaper). Best of `repeat`, in seconds:
    {"whole": s, (link label, wire name): s}."""
    from delay_proxy import DelayProxy

    n_vocab = ShardModel(str(path), (0, 0), 1).info.n_vocab
    rng = np.random.default_rng(29)
    prompt = lambda: rng.integers(100, n_vocab, prompt_tokens).tolist()  # noqa: E731
    common = ("--max-sessions", "2", "--context-tokens", str(prompt_tokens + 64))
    out = {}
    whole, whole_addr = start_worker(path, ranges[0][0], ranges[-1][1], 2, extra=common)
    try:
        wait_serving(whole, whole_addr)
        with grpc.insecure_channel(whole_addr) as ch:
            stub = pb_grpc.ShardServiceStub(ch)
            _first_token_seconds(stub, prompt()[:64], "warm-up")
            out["whole"] = min(_first_token_seconds(stub, prompt(), "whole") for _ in range(repeat))
        log(
            f"long prompt: {prompt_tokens} tokens on the whole model (2 threads): {out['whole']:.3f} s to the first token"
        )
    finally:
        stop_worker(whole)
    tail, tail_addr = start_worker(path, *ranges[1], 1, extra=common)
    try:
        wait_serving(tail, tail_addr)
        for label, delay_ms, bits in links:
            proxy = DelayProxy(tail_addr, delay_ms / 1000, bits) if delay_ms or bits else None
            peer = proxy.__enter__().address if proxy is not None else tail_addr
            head, head_addr = start_worker(path, *ranges[0], 1, extra=("--peer", peer, *common))
            try:
                wait_serving(head, head_addr)
                with grpc.insecure_channel(head_addr) as ch:
                    stub = pb_grpc.ShardServiceStub(ch)
                    _first_token_seconds(stub, prompt()[:64], "warm-up")
                    for name in wire_types:
                        t = min(
                            _first_token_seconds(stub, prompt(), name, wire_dtype=WIRE_NAMES[name])
                            for _ in range(repeat)
                        )
                        out[(label, name)] = t
                        log(
                            f"long prompt: {prompt_tokens} tokens, 2 workers x 1 thread, {label}, {name} rows: "
                            f"{t:.3f} s to the first token"
                        )
            finally:
                stop_worker(head)
                if proxy is not None:
                    proxy.__exit__(None, None, None)
    finally:
        stop_worker(tail)
    return out


def wire_agreement(
    path: Path,
    split: list[tuple[int, int]],
    n_prompts: int = 50,
    prompt_tokens: int = 64,
    generate: int = 32,
    threads: int = 2,
    wire_types=("f16", "q8_0"),
) -> dict:
    """What rounding the hidden rows between two shards (as the wire type would) does to the tail's
    output, in process: `n_prompts` windows of `prompt_tokens` tokens of docs/design.md, each
    generating `generate` greedy tokens with exact rows and with each type's. Per type: the prompts
    whose greedy tokens all equal the exact ones, the positions whose greedy token equals the exact
    one when both follow the exact tokens (teacher forced), and the mean KL(exact || rounded) of the
    tail's distributions over those positions; plus the bytes of one step's request per token and of
    a prompt_tokens=2048 prefill."""
    from llama_shard.engine.pipeline import LocalPipeline
    from llama_shard.proto.wire import decode_tensor, encode_tensor

    pipe = LocalPipeline(
        path, split, n_ctx=prompt_tokens + generate + 8, n_seq_max=1, n_batch=prompt_tokens, n_threads=threads
    )
    text = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    try:
        ids = pipe.head.tokenize(text)
    except InvalidInputError:  # a model without a tokenizer (the tests' synthetic ones): random ids
        ids = np.random.default_rng(31).integers(1, pipe.head.info.n_vocab, n_prompts * prompt_tokens).tolist()
    prompts = [ids[i * prompt_tokens : (i + 1) * prompt_tokens] for i in range(n_prompts)]
    if len(prompts[-1]) < prompt_tokens:
        raise RuntimeError(f"docs/design.md has fewer than {n_prompts} x {prompt_tokens} tokens")
    n_embd = pipe.head.info.n_embd

    def run(tokens: list[int], wire: int | None) -> np.ndarray:
        """The tail's logits after each of `tokens` from position 0 (rows rounded through `wire`)."""
        pipe.seq_rm(0, 0)
        rows = []
        out = pipe.contexts[0].forward(0, 0, tokens=tokens[:prompt_tokens])  # the prompt
        steps = [(0, tokens[:prompt_tokens])] + [(p, [t]) for p, t in enumerate(tokens[prompt_tokens:], prompt_tokens)]
        for k, (pos, chunk) in enumerate(steps):
            if k:
                out = pipe.contexts[0].forward(0, pos, tokens=chunk)
            if wire is not None:
                out = decode_tensor(encode_tensor(out, wire), n_embd, len(chunk))
            rows.append(pipe.contexts[1].forward(0, pos, hidden=out))
        return np.stack(rows)

    def greedy(prompt: list[int], wire: int | None) -> list[int]:
        pipe.seq_rm(0, 0)
        out = pipe.contexts[0].forward(0, 0, tokens=prompt)
        got, pos = [], len(prompt)
        for _ in range(generate):
            if wire is not None:
                out = decode_tensor(encode_tensor(out, wire), n_embd, out.shape[0])
            token = int(np.argmax(pipe.contexts[1].forward(0, pos - out.shape[0], hidden=out)))
            got.append(token)
            out = pipe.contexts[0].forward(0, pos, tokens=[token])
            pos += 1
        return got

    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    exact = [greedy(p, None) for p in prompts]
    ref_logits = [log_softmax(run(p + g[:-1], None)) for p, g in zip(prompts, exact)]
    out = {}
    for name in wire_types:
        wire = WIRE_NAMES[name]
        same_prompts = same_positions = positions = 0
        kl = 0.0
        for p, g, ref in zip(prompts, exact, ref_logits):
            same_prompts += greedy(p, wire) == g
            lp = log_softmax(run(p + g[:-1], wire))
            kl += float((np.exp(ref) * (ref - lp)).sum(axis=-1).sum())
            same_positions += int((lp.argmax(axis=-1) == ref.argmax(axis=-1)).sum())
            positions += lp.shape[0]
        out[name] = {
            "same_prompts": same_prompts,
            "prompts": n_prompts,
            "same_positions": same_positions,
            "positions": positions,
            "mean_kl": kl / positions,
        }
        log(
            f"wire {name}: {same_prompts}/{n_prompts} prompts' {generate} greedy tokens equal f32's; "
            f"{same_positions}/{positions} teacher-forced positions agree; mean KL {kl / positions:.3g} nats"
        )
    for name, wire in WIRE_NAMES.items():

        def request_bytes(n: int) -> int:
            rows = np.random.default_rng(0).standard_normal((n, n_embd)).astype(np.float32)
            req = pb.StepRequest(
                session_id="s", route_epoch=1, hidden=encode_tensor(rows, wire), reply_dtype=wire, position=4096
            )
            return req.ByteSize()

        out.setdefault(name, {}).update(token_bytes=request_bytes(1), prefill_bytes=request_bytes(2048))
    return out
