"""A two-worker route whose head serves the OpenAI-compatible HTTP endpoint, reached with the
official `openai` client or raw HTTP: the helper the HTTP tests share."""

from __future__ import annotations

import http.client
import json
import time

import grpc
import openai

from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc


class HttpRoute:
    """Two workers (0-14, 15-29); the head serves HTTP and forwards to the tail."""

    def __init__(self, model, head_extra=()):
        self.tail, self.tail_addr = start_worker(model, 15, 29, 1, extra=("--context-tokens", "1024"))
        self.http_port = free_port()
        self.head, self.head_addr = start_worker(
            model,
            0,
            14,
            1,
            extra=(
                "--context-tokens",
                "1024",
                "--peer",
                self.tail_addr,
                "--http-port",
                str(self.http_port),
                *head_extra,
            ),
        )
        wait_serving(self.tail, self.tail_addr)
        wait_serving(self.head, self.head_addr)
        self.base = f"http://127.0.0.1:{self.http_port}/v1"
        self.client = openai.OpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=120)

    def raw(self, method: str, path: str, body: bytes | str | None = None, headers=None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=120)
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, json.loads(data) if data else {}

    def info(self) -> pb.InfoReply:
        with grpc.insecure_channel(self.head_addr) as ch:
            return pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10)

    def generate(self, prompt: list[int], **kw) -> tuple[list[int], str, pb.GenerateFinal]:
        req = pb.GenerateRequest(
            session_id=f"grpc-{time.monotonic_ns()}", prompt=prompt, forward=[pb.Hop(address=self.tail_addr)], **kw
        )
        with grpc.insecure_channel(self.head_addr) as ch:
            events = list(pb_grpc.ShardServiceStub(ch).Generate(req, timeout=120))
        return ([e.token.token_id for e in events[:-1]], "".join(e.token.piece for e in events[:-1]), events[-1].final)

    def stop(self):
        self.client.close()
        stop_worker(self.head)
        stop_worker(self.tail)
