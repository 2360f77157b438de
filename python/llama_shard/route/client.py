"""The pipeline client: drives route sessions through an ordered list of shards.

A route is a list of stages, in-process (`LocalStage`, an engine in this process) or remote
(`RemoteStage`, a worker's address). Their layer ranges must tile the model exactly and their
recipes must agree (checked up front). A `RouteSession` keeps its token history on the head side;
when any shard answers with a cache miss, it re-prefills the whole route from token zero (the
seeds' degrade rule) and carries on with the same tokens. Changing the route moves every session
to a new epoch, so state cached under the old route is superseded, never reused by mistake.

Several sessions can step together (`RouteClient.step_sessions`): each stage then gets one message
for the group (a micro-batch, one batched engine step). `RouteClient.generate_many` splits its
sessions into one micro-batch per stage, each driven by its own thread, so while the tail computes
one group the head computes the next: every worker is busy at once (pipelining).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from .._native import MAX_CONTEXT_TOKENS, SamplingParams, TokenSampler
from ..engine.hot_kv import Step, StepKind
from ..errors import InvalidInputError
from ..proto import shard_pb2 as pb
from ..proto.requests import MAX_REPREFILLS, sampling_to_wire
from .stages import RouteError, StepOutcome, can_chain, check_route, route_stage


def _run_threads(fn: Callable, args: Sequence, name: str, errors: list[Exception]) -> None:
    """fn(a) for each a, each on its own thread; then raises the first error they recorded."""
    threads = [threading.Thread(target=fn, args=(a,), name=f"{name}-{k}") for k, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class RouteClient:
    """An ordered route of stages and the sessions that run through it.

    `chained` (None: chosen per route): the client sends each step to the first worker only, and
    every worker forwards the rows to the next itself (one round trip per token from the client
    instead of one per stage); otherwise the client relays the rows from stage to stage. Chaining
    needs every stage to be a worker whose operator allowed the next one (`serve --peer`). On a
    chained route generation runs in the route (`Generate` on the head) unless `route_loop=False`
    (this client then sends every token's step itself, as before)."""

    def __init__(
        self,
        stages: Sequence,
        *,
        max_reprefills: int = MAX_REPREFILLS,
        chained: bool | None = None,
        route_loop: bool = True,
    ):
        self._chain_choice = chained
        self.route_loop = route_loop  # False: a chained route is still driven token by token from here
        self.max_reprefills = max_reprefills
        self.epoch = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._set_stages(stages)

    def _set_stages(self, stages: Sequence) -> None:
        check_route(stages)
        chained = can_chain(stages) if self._chain_choice is None else self._chain_choice
        if chained and not can_chain(stages):
            raise InvalidInputError("a chained route needs workers that each forward to the next (serve --peer)")
        self.stages, self.chained = list(stages), chained

    def change_route(self, stages: Sequence) -> None:
        """Moves to a new route; sessions continue under a new epoch (re-prefilled on their next step)."""
        with self._lock:
            self._set_stages(stages)
            self.epoch += 1

    def session(self, session_id: str | None = None) -> "RouteSession":
        return RouteSession(self, session_id or f"route-session-{next(self._ids)}")

    # --- stepping ----------------------------------------------------------------------------------

    @staticmethod
    def _step(kind: StepKind, session: "RouteSession", position: int, tokens, hidden) -> Step:
        """The step one stage runs: a prefill appends at `position`, a decode expects it."""
        if kind == StepKind.PREFILL:
            return Step.prefill(session.session_id, session.epoch, tokens, hidden, start_pos=position)
        return Step.decode(session.session_id, session.epoch, tokens, hidden, expected_seq_len=position)

    def _through_route(self, kind: StepKind, items: list[tuple]) -> list:
        """items: (session, position, tokens). Each stage gets one message for the sessions still
        going; a session stops at its first miss or error. One StepOutcome or RouteError each."""
        results: list = [None] * len(items)
        stages = list(self.stages)
        if self.chained:  # the first worker carries the step down the chain; the answers are the tail's
            steps = [self._step(kind, sess, position, tokens, None) for sess, position, tokens in items]
            try:
                return stages[0].step_many(steps, chain=stages[1:])
            except RouteError as e:
                return [e] * len(items)
        hidden: dict[int, np.ndarray] = {}
        going = list(range(len(items)))
        for k, stage in enumerate(stages):
            steps = [
                self._step(kind, items[i][0], items[i][1], items[i][2] if k == 0 else None, hidden[i] if k else None)
                for i in going
            ]
            try:
                outs = stage.step_many(steps)
            except RouteError as e:  # the worker is unreachable: every session in the message fails
                for i in going:
                    results[i] = e
                return results
            going_next = []
            for i, out in zip(going, outs):
                results[i] = out
                if isinstance(out, StepOutcome) and out.miss is None:
                    hidden[i] = out.hidden
                    going_next.append(i)
            going = going_next
        return results

    def step_sessions(
        self, kind: StepKind, sessions: Sequence["RouteSession"], new_tokens: Sequence[Sequence[int]]
    ) -> list:
        """One step of several sessions (distinct) through the route, one message per stage.

        Prefill appends `new_tokens` at, and decode expects, the length the route already holds.
        A session that misses anywhere (or whose route changed) is re-prefilled from token zero with
        its history plus its new tokens (the seeds' degrade rule), together with the others that
        missed. Returns one StepOutcome (the tail's) or RouteError per session, in order."""
        if len({id(s) for s in sessions}) != len(sessions) or len(new_tokens) != len(sessions):
            raise InvalidInputError("step_sessions takes distinct sessions and one token list each")
        new = [list(t) for t in new_tokens]
        results: list = [None] * len(sessions)
        missed, last_miss, normal = [], {}, []
        for i, sess in enumerate(sessions):
            if sess.epoch != self.epoch:
                sess.epoch = self.epoch  # the route changed: re-prefill under the new epoch
                missed.append(i)
                last_miss[i] = "SUPERSEDED_EPOCH"
            else:
                normal.append(i)

        def settle(indices: list[int], outs: list) -> list[int]:
            """Records answers (a success extends the history by the new tokens); returns the misses."""
            misses = []
            for i, out in zip(indices, outs):
                if isinstance(out, StepOutcome) and out.miss is not None:
                    misses.append(i)
                    last_miss[i] = out.miss
                else:
                    results[i] = out
                    if isinstance(out, StepOutcome):
                        sessions[i].history = sessions[i].history + new[i]
            return misses

        missed += settle(
            normal, self._through_route(kind, [(sessions[i], len(sessions[i].history), new[i]) for i in normal])
        )
        for _ in range(self.max_reprefills):
            if not missed:
                break
            for i in missed:
                sessions[i].reprefills += 1
            missed = settle(
                missed,
                self._through_route(StepKind.PREFILL, [(sessions[i], 0, sessions[i].history + new[i]) for i in missed]),
            )
        for i in missed:
            results[i] = RouteError(
                f"session {sessions[i].session_id}: still a cache miss ({last_miss[i]}) after "
                f"{self.max_reprefills} re-prefills"
            )
        return results

    def generate_many(
        self,
        sessions: Sequence["RouteSession"],
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        stop: Sequence[int] = (),
        micro_batches: int | None = None,
        on_token: Callable[[int, int], None] | None = None,
        *,
        sampling: SamplingParams | None = None,
    ) -> list[list[int]]:
        """Generation for several sessions at once (greedy, or each with `sampling`); returns each
        one's tokens.

        On a chained route each session is one `Generate` stream, and the head groups the streams
        into one micro-batch per stage itself. Otherwise the sessions are split into `micro_batches` groups (default: one per stage), each driven by
        its own thread, one message per stage per step: while one group is on the tail, the next is
        on the head, so every worker computes at once. on_token(index, token) is called as tokens
        arrive (from those threads). Raises the first RouteError after every group has finished."""
        if len(prompts) != len(sessions) or any(not p for p in prompts):
            raise InvalidInputError("generate_many takes one non-empty prompt per session")
        if (self.chained and self.route_loop) or sampling is not None:
            return self._generate_streams(sessions, prompts, max_tokens, stop, on_token, sampling)
        n = len(sessions)
        n_groups = max(1, min(n, micro_batches or len(self.stages)))
        # consecutive sessions per group: opened in one step, they get consecutive seq ids on every
        # worker, and a step over consecutive ids is one ubatch (one pass over the weights) there
        groups = [list(range(g * n // n_groups, (g + 1) * n // n_groups)) for g in range(n_groups)]
        generated: list[list[int]] = [[] for _ in sessions]
        errors: list[Exception] = []

        def drive(group: list[int]) -> None:
            try:
                run_group(group)
            except Exception as e:  # noqa: BLE001 - raised in the caller's thread below
                errors.append(e)

        def run_group(group: list[int]) -> None:
            going, kind, feed = list(group), StepKind.PREFILL, {i: list(prompts[i]) for i in group}
            while going:
                outs = self.step_sessions(kind, [sessions[i] for i in going], [feed[i] for i in going])
                still = []
                for i, out in zip(going, outs):
                    if isinstance(out, RouteError):
                        errors.append(out)
                        continue
                    token = int(out.token_id)
                    generated[i].append(token)
                    if on_token:
                        on_token(i, token)
                    if token not in stop and len(generated[i]) < max_tokens:
                        still.append(i)
                        feed[i] = [token]
                going, kind = still, StepKind.DECODE

        if max_tokens < 1:
            return generated
        _run_threads(drive, groups, "route-group", errors)
        return generated

    def _generate_streams(self, sessions, prompts, max_tokens, stop, on_token, sampling) -> list[list[int]]:
        """generate_many with one thread per session: Generate streams on a chained route (the head
        batches them), or client-driven sampled sessions (whose steps the workers' loops batch)."""
        generated: list[list[int]] = [[] for _ in sessions]
        errors: list[Exception] = []

        def run(i: int) -> None:
            try:
                for token in sessions[i].stream(prompts[i], max_tokens, stop, sampling=sampling):
                    generated[i].append(token)
                    if on_token:
                        on_token(i, token)
            except Exception as e:  # noqa: BLE001 - raised in the caller's thread below
                errors.append(e)

        _run_threads(run, range(len(sessions)), "route-stream", errors)
        return generated

    def close(self) -> None:
        for s in self.stages:
            s.close()


class RouteSession:
    """One route session: its token history lives here, on the head side."""

    def __init__(self, client: RouteClient, session_id: str):
        self.client = client
        self.session_id = session_id
        self.history: list[int] = []  # every token whose KV the route should hold
        self.epoch = client.epoch
        self.reprefills = 0
        self.last_final: pb.GenerateFinal | None = None  # the last Generate stream's final event

    def _step(self, kind: StepKind, new_tokens: list[int]) -> StepOutcome:
        (out,) = self.client.step_sessions(kind, [self], [new_tokens])
        if isinstance(out, RouteError):
            raise out
        return out

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        stop: Sequence[int] = (),
        on_token: Callable[[int], None] | None = None,
        *,
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        keep_prefix: int = 0,
        max_drafts: int | None = None,
    ) -> list[int]:
        """Generates after the tokens the session holds plus `prompt`: greedy, or with llama.cpp's
        sampler chain (`sampling`). Ends after a stop token (included), a stop string (chained
        routes) or max_tokens. See `stream`."""
        generated = []
        for token in self.stream(
            prompt,
            max_tokens,
            stop,
            sampling=sampling,
            stop_strings=stop_strings,
            keep_prefix=keep_prefix,
            max_drafts=max_drafts,
        ):
            generated.append(token)
            if on_token:
                on_token(token)
        return generated

    def stream(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        stop: Sequence[int] = (),
        *,
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        keep_prefix: int = 0,
        max_drafts: int | None = None,
    ) -> Iterator[int]:
        """`generate` as an iterator of tokens. On a chained route the head runs the loop (one
        `Generate` stream; its final event is kept in `last_final`); otherwise this client drives
        every step, sampling from the tail's logits (a RemoteStage tail needs return_logits=True).
        keep_prefix (chained routes): the first keep_prefix tokens of the session's whole prompt are a
        shared prefix to keep on every worker with a prefix store (see `events`). max_drafts (chained
        routes): speculative decoding's most drafts per step (0: off; None: the head's default)."""
        if not prompt:
            raise InvalidInputError("the prompt is empty")
        if max_tokens < 1:
            return
        if self.client.chained and self.client.route_loop:
            for event in self.events(
                prompt,
                max_tokens,
                stop,
                sampling=sampling,
                stop_strings=stop_strings,
                keep_prefix=keep_prefix,
                max_drafts=max_drafts,
            ):
                yield event.token_id
            return
        if stop_strings:
            raise InvalidInputError("stop strings need a chained route (the head detokenizes)")
        sampler = None
        out = self._step(StepKind.PREFILL, list(prompt))
        for i in range(max_tokens):
            if sampling is None:
                token = int(out.token_id)
            else:
                if out.logits is None:
                    raise InvalidInputError(
                        "sampling on a client-driven route needs the tail's logits: "
                        "RemoteStage(..., return_logits=True)"
                    )
                if sampler is None:  # the session's tokens so far are accepted first, as stock does
                    window = sampling.penalty_last_n
                    sampler = TokenSampler(
                        len(out.logits), sampling, MAX_CONTEXT_TOKENS, history=self.history[-window:] if window else []
                    )
                token = sampler.sample(np.ascontiguousarray(out.logits, dtype=np.float32))
                sampler.accept(token)
            yield token
            if token in stop or i + 1 == max_tokens:
                return
            out = self._step(StepKind.DECODE, [token])

    def events(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        stop: Sequence[int] = (),
        *,
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        logprobs: bool = False,
        top_logprobs: int = 0,
        keep_prefix: int = 0,
        max_drafts: int | None = None,
    ) -> Iterator[pb.GeneratedToken]:
        """The head's `Generate` stream on a chained route: one GeneratedToken per token (id, text
        piece, logprobs when asked). keep_prefix: the first keep_prefix tokens of the whole prompt
        (history + prompt; whole blocks of 256) are stored on first sight by every worker with
        `--prefix-memory` (a start seen twice is stored anyway) when this stream computes them from
        token zero (a session that already holds part of them does not store); sessions that begin
        with them open from the copy (`last_final.prefix_tokens`). The final event is kept in `last_final`; a stream that ends in
        an error raises (InvalidInputError for a refused request, RouteError naming the stage).
        Closing the iterator early cancels the stream; the session's KV stays."""
        client = self.client
        if not client.chained:
            raise InvalidInputError("Generate needs a chained route (workers that forward to each other)")
        if self.epoch != client.epoch:
            self.epoch = client.epoch  # the head's record is of the old epoch: it re-prefills from zero
        head, rest = client.stages[0], client.stages[1:]
        whole = self.history + list(prompt)
        req = pb.GenerateRequest(
            session_id=self.session_id,
            route_epoch=self.epoch,
            prompt=whole,
            max_tokens=max_tokens,
            stop_token_ids=list(stop),
            stop=list(stop_strings),
            forward=[pb.Hop(address=s.address, recipe_fingerprint=s.fingerprint) for s in rest],
            wire_dtype=head.wire_dtype,
            recipe_fingerprint=head.fingerprint,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            keep_prefix=keep_prefix,
        )
        if sampling is not None:
            req.sampling.CopyFrom(sampling_to_wire(sampling))
        if max_drafts is not None:
            req.max_drafts = max_drafts
        self.last_final = None
        call = head.stub.Generate(req)
        generated: list[int] = []
        try:
            for event in call:
                if event.HasField("token"):
                    generated.append(event.token.token_id)
                    yield event.token
                    continue
                final = self.last_final = event.final
                # the route holds the prompt and all but the last token; a failed or cut-short turn
                # leaves the history as it was (the head reuses whatever prefix it still holds)
                if final.finish_reason != "error" and final.seq_len >= len(whole):
                    self.history = (whole + generated)[: final.seq_len]
                self.reprefills += final.reprefills
                if final.finish_reason == "error":
                    if final.outcome == pb.OUTCOME_INVALID_ARGUMENT:
                        raise InvalidInputError(final.detail)
                    stage = route_stage(client.stages, final.stage)
                    raise RouteError(
                        f"worker {stage.info.name} (stage {final.stage} of the route): "
                        f"{pb.Outcome.Name(final.outcome)}: {final.detail}"
                    )
                return
        except grpc.RpcError as e:
            raise RouteError(f"worker {head.info.name} failed: {e.code().name}: {e.details()}") from None
        finally:
            call.cancel()  # no-op after the final event; otherwise the head stops the session's loop
            if self.last_final is None and generated:  # closed early: the conversation went on
                self.history = whole + generated[:-1]
        raise RouteError(f"worker {head.info.name} ended the stream without a final event")

    def release(self) -> None:
        for stage in self.client.stages:
            try:
                stage.release(self.session_id, self.epoch)
            except RouteError:
                pass  # a worker that is gone holds nothing
