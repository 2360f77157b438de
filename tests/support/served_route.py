"""A route of real workers on loopback (each forwarding to the next), and the whole-model reference
its tokens are compared with: the helpers the served-route tests share."""

from __future__ import annotations

import grpc

from llama_shard._native import SamplingParams, TokenSampler
from llama_shard.engine.pipeline import LocalPipeline
from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc

N_TOKENS = 16


class Route:
    """Workers of one model started on loopback, each forwarding to the next."""

    def __init__(self, model, ranges, extra=()):
        self.model, self.ranges = model, ranges
        self.ports = [free_port() for _ in ranges]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs = [None] * len(ranges)
        for k in reversed(range(len(ranges))):
            self.start(k, extra)

    def start(self, k, extra=()):
        peer = ("--peer", self.addresses[k + 1]) if k + 1 < len(self.ranges) else ()
        first, last = self.ranges[k]
        self.procs[k], _ = start_worker(self.model, first, last, port=self.ports[k], extra=(*peer, *extra))
        wait_serving(self.procs[k], self.addresses[k])

    def stub(self, k=0):
        return pb_grpc.ShardServiceStub(grpc.insecure_channel(self.addresses[k]))

    def request(self, sid, prompt, max_tokens=N_TOKENS, sampling=None, **kw):
        req = pb.GenerateRequest(
            session_id=sid,
            prompt=prompt,
            max_tokens=max_tokens,
            forward=[pb.Hop(address=a) for a in self.addresses[1:]],
            **kw,
        )
        if sampling is not None:
            req.sampling.CopyFrom(sampling)
        return req

    def generate(self, sid, prompt, max_tokens=N_TOKENS, sampling=None, **kw):
        events = list(self.stub().Generate(self.request(sid, prompt, max_tokens, sampling, **kw), timeout=120))
        assert events and events[-1].HasField("final") and all(e.HasField("token") for e in events[:-1])
        return [e.token.token_id for e in events[:-1]], events[-1].final

    def info(self, k=0):
        return self.stub(k).Info(pb.InfoRequest(), timeout=10)

    def stop(self):
        for p in self.procs:
            if p is not None:
                stop_worker(p)


_WHOLE: dict = {}


def whole_model_tokens(model_path, prompt, params: SamplingParams | None, n=N_TOKENS):
    """The reference: the same chain on the whole model in this process (1 thread, as the workers),
    the prompt accepted first."""
    pipe = _WHOLE.get(str(model_path))
    if pipe is None:
        pipe = _WHOLE[str(model_path)] = LocalPipeline(model_path, None, n_ctx=512, n_seq_max=1, n_threads=1)
    sampler = None
    if params is not None:
        window = params.penalty_last_n
        sampler = TokenSampler(pipe.head.info.n_vocab, params, 512, history=prompt[-window:] if window else [])
    return [t for t, _ in pipe.generate(prompt, n, sampler=sampler)]
