"""What a caller of a route with replicas sees when its workers come and go (bench.py's failover
section): the longest pause of a stream whose tail replica is killed, the time a drained worker
takes to hand a session over against the re-prefill it saves, and completions on the OpenAI
endpoint while replicas are killed and restarted at random. Every stream's tokens are compared with
the undisturbed route's; the figures say how many differed or failed (0 is the only good answer)."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from llama_shard.local_workers import free_port
from llama_shard.proto import shard_pb2 as pb
from llama_shard.testing.chaos import ChaosMonkey, Mesh

SEEDED = pb.Sampling(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05)


def _stream(mesh: Mesh, sid: str, prompt: list[int], n: int, seed: int | None, on_token=None) -> dict:
    req = pb.GenerateRequest(session_id=sid, prompt=prompt, max_tokens=n)
    if seed is not None:
        req.sampling.CopyFrom(SEEDED)
        req.sampling.seed = seed
    tokens, gaps, last, t0 = [], [], None, time.monotonic()
    for event in mesh.stub().Generate(req, timeout=600):
        now = time.monotonic()
        if event.HasField("final"):
            return {
                "tokens": tokens,
                "final": event.final,
                "stall": max(gaps, default=0.0),
                "ttft": event.final.time_to_first_token_s,
                "seconds": now - t0,
            }
        if last is not None:
            gaps.append(now - last)
        last = now
        tokens.append(event.token.token_id)
        if on_token is not None:
            on_token(sid, len(tokens))
    raise RuntimeError(f"stream {sid} ended without a final event")


def _streams(mesh: Mesh, tag: str, prompts: list[list[int]], n: int, on_token=None) -> list[dict]:
    out: list = [None] * len(prompts)

    def run(i: int) -> None:
        out[i] = _stream(mesh, f"{tag}-{i}", prompts[i], n, None if i % 2 == 0 else 100 + i, on_token)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in out):
        raise RuntimeError("a stream failed")
    return out


def killed_tail(path: Path, n_layer: int, vocab: int, npp: int, ntg: int, n_streams: int = 8) -> dict:
    """8 streams (half greedy, half seeded) on a head and two tail replicas; once every stream has
    a quarter of its tokens, the replica of the last to get there is killed (SIGKILL). Returns the
    longest stall of a stream that failed over, the time a fresh session of that stream's length
    takes to its first token (its re-prefill), and how many streams' tokens differed from the
    undisturbed run's."""
    cut = n_layer // 2
    context = str(npp + ntg + 16)
    sizing = (
        "--context-tokens",
        context,
        "--max-sessions",
        str(2 * n_streams),
        "--budget-tokens",
        str(2 * n_streams * int(context)),
    )
    mesh = Mesh(
        path,
        [(0, cut - 1), (cut, n_layer - 1), (cut, n_layer - 1)],
        [("--peer", "{1}", "--peer", "{2}", *sizing), sizing, sizing],
    )
    try:
        mesh.start(1).start(2).start(0)
        rng = np.random.default_rng(5)
        prompts = [rng.integers(0, vocab, npp).tolist() for _ in range(n_streams)]
        calm = _streams(mesh, "calm", prompts, ntg)
        counts: dict[str, int] = {}
        killed: list[int] = []
        lock = threading.Lock()

        def on_token(sid: str, n: int) -> None:
            with lock:
                counts[sid] = n
                if killed or len(counts) < n_streams or min(counts.values()) < max(2, ntg // 4):
                    return
                # the replica of the stream that has just got there: it is still running
                victim = next(k for k in (1, 2) if any(x.session_id == sid for x in mesh.info(k).sessions))
                mesh.procs[victim].send_signal(signal.SIGKILL)
                killed.append(victim)

        hit = _streams(mesh, "kill", prompts, ntg, on_token)
        moved = [i for i, r in enumerate(hit) if r["final"].failovers]
        worst = max(moved, key=lambda i: hit[i]["stall"]) if moved else 0
        # that stream's re-prefill: a fresh session of the tokens it held, to its first token
        held = prompts[worst] + hit[worst]["tokens"][: max(2, ntg // 4)]
        reprefill = _stream(mesh, "reprefill", held, 1, None)["ttft"]
        # (no stream failed over when the replica's streams had all ended: the longest stall of any)
        return {
            "stall": hit[worst]["stall"] if moved else max(r["stall"] for r in hit),
            "reprefill": reprefill,
            "calm_stall": max(r["stall"] for r in calm),
            "moved": len(moved),
            "streams": n_streams,
            "differed": sum(1 for a, b in zip(calm, hit) if a["tokens"] != b["tokens"]),
            "failed": sum(1 for r in hit if r["final"].finish_reason != "length"),
        }
    finally:
        mesh.stop()


def handover(path: Path, n_layer: int, vocab: int, tokens: int, ntg: int = 24) -> dict:
    """A stream on a session of `tokens` tokens whose tail replica is stopped (SIGTERM) after a few
    of its tokens: the worker hands the session to the other replica. Returns the hand-over's
    seconds per session (the worker's own report) against that session's re-prefill (a fresh session
    of the same tokens to its first token), the stream's re-prefills (0 is the point) and whether its
    tokens are those of an undisturbed twin."""
    cut = n_layer // 2
    context = str(tokens + ntg + 16)
    sizing = ("--context-tokens", context, "--max-sessions", "4", "--budget-tokens", str(4 * int(context)))
    mesh = Mesh(
        path,
        [(0, cut - 1), (cut, n_layer - 1), (cut, n_layer - 1)],
        [("--peer", "{1}", "--peer", "{2}", *sizing), ("--replica", "{2}", *sizing), ("--replica", "{1}", *sizing)],
    )
    try:
        mesh.start(1).start(2).start(0)
        rng = np.random.default_rng(7)
        prompt = rng.integers(0, vocab, tokens).tolist()
        twin = _stream(mesh, "twin", prompt, ntg, None)
        reprefill = min(_stream(mesh, f"cold-{i}", prompt + twin["tokens"][:4], 1, None)["ttft"] for i in range(2))
        stopped: list[int] = []

        def on_token(sid: str, n: int) -> None:
            if n == 4 and not stopped:
                holder = next(k for k in (1, 2) if any(s.session_id == "long" for s in mesh.info(k).sessions))
                mesh.procs[holder].send_signal(signal.SIGTERM)
                stopped.append(holder)

        moved = _stream(mesh, "long", prompt, ntg, None, on_token)
        code = mesh.reap(stopped[0])
        report = mesh.stderr[stopped[0]][-1]
        m = re.search(r"handed (\d+) session\(s\) to a replica in ([0-9.]+) s", report)
        if code != 0 or m is None:
            raise RuntimeError(f"the drained worker exited {code}: {report[-1500:]}")
        handed, seconds = int(m.group(1)), float(m.group(2))
        return {
            "per_session": seconds / max(1, handed),
            "handed": handed,
            "reprefill": reprefill,
            "reprefills": moved["final"].reprefills,
            "moves": moved["final"].moves,
            "same": moved["tokens"] == twin["tokens"],
        }
    finally:
        mesh.stop()


def _complete(port: int, model: str, prompt: list[int], n: int) -> str:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        answer = json.loads(resp.read())
    return answer["choices"][0]["text"]


def chaos(path: Path, n_layer: int, vocab: int, seconds: float, n_clients: int = 16, ntg: int = 12) -> dict:
    """n_clients loops of greedy /v1/completions on a head, two middle and two tail replicas, first
    undisturbed for seconds / 5, then for `seconds` while replicas are killed (or drained) and
    restarted at random: completions per minute in each phase, and how many failed or differed
    from the undisturbed answer."""
    third = n_layer // 3
    http_port = free_port()
    common = (
        "--ttl",
        "5",
        "--sweep-seconds",
        "1",
        "--context-tokens",
        "256",
        "--max-sessions",
        str(n_clients),
        "--budget-tokens",
        str(256 * n_clients),
    )
    mesh = Mesh(
        path,
        [
            (0, third - 1),
            (third, 2 * third - 1),
            (third, 2 * third - 1),
            (2 * third, n_layer - 1),
            (2 * third, n_layer - 1),
        ],
        [
            (
                "--peer",
                "{1}",
                "--peer",
                "{2}",
                "--peer",
                "{3}",
                "--peer",
                "{4}",
                "--http-port",
                str(http_port),
                *common,
            ),
            ("--peer", "{3}", "--peer", "{4}", "--replica", "{2}", *common),
            ("--peer", "{3}", "--peer", "{4}", "--replica", "{1}", *common),
            ("--replica", "{4}", *common),
            ("--replica", "{3}", *common),
        ],
    )
    try:
        for k in (3, 4, 1, 2, 0):
            mesh.start(k)
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, vocab, 24).tolist() for _ in range(8)]
        oracle = [_complete(http_port, path.stem, p, ntg) for p in prompts]

        def phase(duration: float, monkey: ChaosMonkey | None) -> dict:
            done, failed, differed = [0], [], [0]
            stop = threading.Event()

            def loop(i: int) -> None:
                j = i
                while not stop.is_set():
                    j += 1
                    try:
                        got = _complete(http_port, path.stem, prompts[j % len(prompts)], ntg)
                    except Exception as e:  # noqa: BLE001 - counted
                        failed.append(repr(e)[:200])
                        continue
                    done[0] += 1
                    differed[0] += got != oracle[j % len(prompts)]

            threads = [threading.Thread(target=loop, args=(i,)) for i in range(n_clients)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            if monkey is not None:
                monkey.start()
            time.sleep(duration)
            if monkey is not None:
                monkey.stop()
            stop.set()
            for t in threads:
                t.join()
            return {
                "per_min": 60 * done[0] / (time.monotonic() - t0),
                "done": done[0],
                "failed": failed,
                "differed": differed[0],
            }

        calm = phase(max(5.0, seconds / 5), None)
        monkey = ChaosMonkey(mesh, [[1, 2], [3, 4]], period=(2.0, 5.0), down_s=(1.0, 3.0))
        storm = phase(seconds, monkey)
        kills = sum(1 for e in monkey.events if e[2] in ("kill", "term"))
        return {
            "calm": calm,
            "storm": storm,
            "kills": kills,
            "errors": monkey.errors,
            "failovers": mesh.info(0).failovers,
        }
    finally:
        mesh.stop()
