"""The head on a worker: what a worker whose range starts at layer 0 adds to serve Generate streams
and the OpenAI endpoint. Built over its worker's servicer (`Head(servicer, options, registry)`) and
attached to it as its `HeadSlot`; the worker package never imports this one.

Holds the head's parts: its later stages' replicas (probed from `start`), its prefix plans, the
draft model, and the generation loops whose steps the worker runs (`HeadHost`)."""

from __future__ import annotations

import queue

from ..proto import shard_pb2 as pb
from ..worker.servicer import ShardServicer
from .generation import GenerationLoops, HeadHost, Refusal, max_generate_streams
from .options import HeadOptions
from .prefix_plans import PrefixPlanner
from .proofs import RouteProofs
from .replicas import Replicas


class Head:
    def __init__(self, servicer: ShardServicer, options: HeadOptions, registry, threads: int | None = None):
        info, config = servicer.info, servicer.manager.config
        options.check(info.first, info.last)
        self.options = options
        self.peers = servicer.peers
        # the later stages and their replicas (the worker's --peer workers), probed from start
        self.replicas = (
            Replicas(
                info,
                config.numerics,
                servicer.model_digest,
                servicer.instance_id,
                servicer.route,
                servicer.peers.info,
                registry,
                wire_dtype=servicer.wire_dtype,
            )
            if info.first == 0 and (servicer.route or options.mesh is not None)
            else None
        )
        if self.replicas is not None and options.mesh is not None:
            self.replicas.restoring = options.mesh.restoring
        draft_model = None
        if options.draft_model is not None:
            from .draft_model import DraftModel  # a second model loads only where one is asked for

            draft_model = DraftModel(
                options.draft_model,
                servicer.model.path,
                config.context_tokens,
                max_generate_streams(config.max_sessions, config.warm_bytes),
                threads,
            )
        self.proofs = (
            None
            if not options.receipts
            else RouteProofs(
                servicer.own_receipts,
                servicer.steps.receipts,
                servicer.receipt_signer.key.public,
                self.replicas,
                servicer.peers,
                options.spot_check_rate,
                registry,
            )
        )
        host = HeadHost(
            info=info,
            fingerprint=servicer.fingerprint,
            context_tokens=config.context_tokens,
            max_sessions=config.max_sessions,
            warm_bytes=config.warm_bytes,
            detokenize=servicer.model.detokenize,
            security=servicer.security,
            prefixes=PrefixPlanner(servicer.prefixes),
            session_cap=servicer.owners.cap,
            stopping=servicer.stopping,
            max_hop_s=servicer.max_hop_s,
            forward_refusal=servicer.steps.forward_refusal,
            admit=servicer.owners.admit,
            caller_full=servicer.owners.full,
            run_steps=servicer.run_own_steps,
            sessions=servicer.manager.sessions,
            replicas=self.replicas,
            vocab_model=servicer.model,
            wire_dtype=servicer.wire_dtype,
            proofs=self.proofs,
        )
        self.generation = GenerationLoops(
            host, registry, options.draft, options.max_drafts, draft_model, row_by_row=options.verify == "exact"
        )

    # --- the worker's HeadSlot ------------------------------------------------------------------

    def serve_generate(self, principal: str, request: pb.GenerateRequest, context):
        remaining = context.time_remaining()
        stream = self.generation.open(
            principal, request, remaining if remaining is not None and remaining < 1e8 else None
        )
        if isinstance(stream, Refusal):  # refused before anything was computed
            yield pb.GenerateEvent(final=stream.final)
            return
        context.add_callback(lambda: stream.cancel("the client closed the stream"))
        try:
            while True:
                try:
                    event = stream.out.events.get(timeout=0.25)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                yield event
                if event.HasField("final"):
                    return
        finally:  # a closed stream stops before its next step (its KV stays)
            stream.cancel("the client closed the stream")

    def forget(self, key: str) -> None:
        self.generation.forget(key)

    def has_records(self) -> bool:
        return self.generation.has_records()

    def stop_stream(self, key: str, why: str, timeout: float) -> None:
        self.generation.stop_stream(key, why, timeout)

    def admit_member(self, address: str) -> None:
        """A mesh's member serves its range at `address`: the route may use it, and forward to it."""
        self.peers.allow([address])
        if self.replicas is not None:
            self.replicas.add(address)

    def info_fields(self) -> dict:
        g, r, mesh = self.generation, self.replicas, self.options.mesh
        return {
            **({"mesh_plan": mesh.describe(), "mesh_members": mesh.members()} if mesh is not None else {}),
            "generate_streams": len(g.streams),
            "draft_source": g.draft_source,
            "drafted_tokens": g.metrics.drafted_total,
            "accepted_tokens": g.metrics.accepted_total,
            "replicas": r.info() if r is not None else [],
            "failovers": r.failovers_total if r is not None else 0,
            **(self.proofs.info_fields() if self.proofs is not None else {}),
        }

    # --- the process's ---------------------------------------------------------------------------

    def start(self, set_health) -> None:
        """SERVING while every later stage has a healthy replica (a head without --peer: at once)."""
        if self.replicas is None:
            set_health(True, "")
        else:
            self.replicas.start(set_health)

    def wait_idle(self, grace_s: float) -> None:
        """Every stream ends with a final event saying so after its step in flight."""
        self.generation.wait_idle(grace_s)

    def close(self) -> None:
        if self.generation.draft_model is not None:
            self.generation.draft_model.close()
        if self.replicas is not None:
            self.replicas.stop()
        if self.proofs is not None:
            self.proofs.close()
