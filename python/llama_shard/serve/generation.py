"""The head's generation loop: `Generate` streams run inside the route, not in the client.

- Each stream is one session: the head keeps its tokens (the prompt, then every sampled token),
  how many of them the route holds, and its sampler's draw count. A step sends the tokens the
  route lacks (a prompt chunk of at most GENERATE_CHUNK, or the last sampled token) down the chain
  with the sampler state; the tail samples and its token comes back in the reply of the chained
  call; the head submits the next step itself.
- Streams of one principal on one route share a `_RouteLoop`: its streams are spread over one
  group per stage, each driven by its own thread, one StepBatch per step per group. While one
  group is on the tail the next is on the head (the pipelining `RouteClient.generate_many` does
  from the client side). A new stream joins the smallest group at its next step.
- A miss anywhere re-prefills the route from token zero with the same tokens and the same draw
  count, so it samples what it would have sampled anyway (MAX_REPREFILLS in a row, then an error).
- A stream whose client went away, or whose deadline passed, stops before its next step; its KV
  stays. The prompt may be the whole conversation: the longest prefix of it the session holds (by
  the head's record of its last stream) is kept, the rest truncated by the prefill's position.
- The final event is always the last one a stream gets: stop, length, cancelled, shutdown, error.
- Speculative decoding (speculation.py): past the prompt, a stream stepping alone in its group may
  carry drafts after the last sampled token; the tail answers the drafts it accepted and one token of its own, so a step yields
  1 to k + 1 tokens. The route then holds the rejected drafts' positions too (`held`): the next
  step is a prefill at the position after the accepted ones, which cuts them on every shard.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict

from prometheus_client import Counter, Gauge, Histogram

from ..engine.hot_kv import StepKind, check_key
from ..errors import InvalidInputError
from ..proto import shard_pb2 as pb
from .prefixes import PREFIX_BLOCK_TOKENS
from .sampling import MAX_TOP_LOGPROBS, params_from_wire
from .speculation import MAX_DRAFTS, NGRAM_LONG, DraftControl, NgramDrafter, StepCost

#: prompt tokens per step: a long prompt does not hold up the decoders grouped with it for long
GENERATE_CHUNK = 256
# a shared prefix ends where a chunk of a prompt computed from position 0 ends (prefixes.py says why)
assert PREFIX_BLOCK_TOKENS % GENERATE_CHUNK == 0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKENS = 64
#: re-prefills in a row after misses before a stream ends with an error (as RouteClient)
MAX_REPREFILLS = 3
#: a group's thread waits this long for a new stream before it ends
IDLE_S = 2.0


def max_generate_streams(config) -> int:
    """Streams a worker runs at once: one per hot session, or two with a warm tier (the sessions of
    the group not computing wait there); more would evict each other at every step."""
    return config.max_sessions * (2 if config.warm_bytes else 1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Stream:
    """One Generate call: its session's tokens on the head, and the events for its handler."""

    def __init__(self, principal: str, key: str, req: pb.GenerateRequest, params, max_tokens: int,
                 cached: int, deadline: float | None, detokenize, events=None, max_drafts: int = 0,
                 draft_model=None, row_by_row: bool = True):
        self.principal, self.key, self.req = principal, key, req
        self.params = params
        self.max_tokens = max_tokens
        self.tokens = list(req.prompt)       # every token; the route holds the first `computed`
        self.computed = cached
        self.held = cached                   # positions the route holds (more than computed after rejected drafts)
        self.cached = cached
        self.first_step = True               # a prefill (at `computed`: truncating what follows)
        self.draws = 0
        self.generated: list[int] = []
        self.reprefills = 0
        self.misses_in_row = 0
        self.deadline = deadline
        self.detokenize = detokenize
        self.text = ""
        self.events = events if events is not None else queue.SimpleQueue()  # put(event): its reader's queue
        self.stop_reason: str | None = None  # set from the handler's thread: the loop ends the stream
        self.done = False
        self.t_start = time.monotonic()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.sent = (0, False, [])            # the step in flight: (tokens sent, whether the tail samples, drafts)
        self.control = DraftControl(max_drafts)  # speculative decoding: drafts per step, counters
        self.draft_model = draft_model if max_drafts else None  # draft_model.DraftModel, or prompt lookup:
        self.drafter = NgramDrafter() if max_drafts and draft_model is None else None
        self.long_match = True                # the kind of match the step's drafts came from
        self.row_by_row = row_by_row          # how the route computes its verifications
        self.unsent: int | None = None        # a draft not sent (k was 0), to learn from
        self.unsent_accepted = 0              # of the last verification's accepted drafts, those not yet sent
        self.group = 0                        # the loop's group (a run of head seq ids)
        self.in_flight = False                # in a group's step now
        self.prefix = None                    # its PrefixPlan (prefixes.py), made at its first step
        self.planned = False
        self.may_open = True                  # False after a shard lacked the prefix: the re-prefill computes it
        self.prefix_tokens = 0                # prompt tokens opened from a shared prefix

    def cancel(self, reason: str) -> None:
        if not self.done and self.stop_reason is None:
            self.stop_reason = reason

    def plan_prefix(self, prefixes) -> None:
        """At a (re-)prefill's first step: open from the longest shared prefix the head holds, and
        store the one to keep (prefixes.PrefixNames.plan)."""
        self.planned = True
        self.prefix = prefixes.plan(self.principal, self.tokens, self.computed, self.req.keep_prefix, self.may_open)
        if self.prefix is not None and self.prefix.open_tokens:
            self.computed = self.prefix.open_tokens

    def drafts(self, cost: list[float]) -> list[int]:
        """The drafts for a step that continues generation (none while the prompt is being sent): as
        many as DraftControl finds worth it at the route's step cost, never past max_tokens."""
        if (self.drafter is None and self.draft_model is None) or self.first_step \
                or self.computed != len(self.tokens) - 1:
            return []
        room = min(self.control.max_drafts, self.max_tokens - len(self.generated) - 1)
        if self.draft_model is not None:  # each draft costs a step of the draft model: k first
            k = min(self.control.k(cost), room)
            return self.draft_model.propose(self.key, self.tokens, k) if k > 0 else []
        candidates, n = self.drafter.propose(self.tokens, room)
        self.long_match = n >= NGRAM_LONG
        k = self.control.k(cost, self.long_match) if candidates else 0
        self.unsent = candidates[0] if candidates and k == 0 else None  # checked against the step's token
        return candidates[:k]

    def request(self, wire_dtype: int, cost: list[float] | None = None) -> tuple[StepKind, pb.StepRequest]:
        start = self.computed
        end = start + GENERATE_CHUNK
        plan = self.prefix
        if plan is not None and plan.store_tokens > start:
            end = min(end, plan.store_tokens)  # the step that stores a prefix ends with it
        drafts = self.drafts(cost) if cost is not None else []
        chunk = self.tokens[start:end] + drafts
        final = start + len(chunk) - len(drafts) == len(self.tokens)
        opening = plan.open_tokens if plan is not None and self.first_step and start == plan.open_tokens else 0
        storing = plan.store_tokens if plan is not None and not drafts and start + len(chunk) == plan.store_tokens else 0
        # a prefill at `start` also cuts positions the route holds past it (rejected drafts)
        kind = (StepKind.PREFILL if self.first_step or len(chunk) > 1 or opening or storing or self.held > start
                else StepKind.DECODE)
        req = pb.StepRequest(session_id=self.req.session_id, route_epoch=self.req.route_epoch, token_ids=chunk,
                             reply_dtype=wire_dtype, position=start, draft_tokens=drafts,
                             row_by_row=bool(drafts) and self.row_by_row)
        if opening or storing:
            req.prefix.keys.extend(plan.keys)
            req.prefix.open_tokens, req.prefix.store_tokens = opening, storing
        if final:
            req.logprobs, req.top_logprobs = self.req.logprobs, self.req.top_logprobs
            if self.params is not None:
                window = self.params.penalty_last_n
                req.sampler.params.CopyFrom(self.req.sampling)
                req.sampler.draws = self.draws
                req.sampler.recent.extend(self.tokens[-window:] if window else [])
        self.sent = (len(chunk), final, drafts)
        return kind, req


class _RouteLoop:
    """The streams of one principal on one route: a group per stage, a thread per group.

    Groups are contiguous runs of the head's seq ids (llama.cpp computes consecutive ids in one
    ubatch: one pass over the weights per group step, not one per session). The partition is
    recomputed when a stream joins, leaves or gets a new id; a stream moves to its new group once
    its step in flight is back (`in_flight`: never in two steps at once)."""

    def __init__(self, owner: "GenerationLoops", principal: str, forward: tuple, wire_dtype: int):
        self.owner, self.principal, self.wire_dtype = owner, principal, wire_dtype
        self.forward = [pb.Hop(address=a, recipe_fingerprint=f) for a, f in forward]
        self.n_groups = 1 + len(forward)
        self.cost = StepCost()  # the route's step time by tokens per step (what a draft costs)
        self.streams: list[_Stream] = []  # in arrival order
        self.threads: list[threading.Thread | None] = [None] * self.n_groups
        self._dirty = True

    def add(self, stream: _Stream) -> None:  # under the owner's lock
        self.streams.append(stream)
        self._dirty = True
        for g, t in enumerate(self.threads):
            if t is None:
                self.threads[g] = threading.Thread(target=self._run, args=(g,), name=f"generate-{g}", daemon=True)
                self.threads[g].start()
        self.owner.cond.notify_all()

    def idle(self) -> bool:
        return all(t is None for t in self.threads)

    def _partition(self) -> None:  # under the owner's lock
        if not self._dirty:
            return
        ids = self.owner.seq_ids()
        order = sorted(range(len(self.streams)),
                       key=lambda i: (ids.get(self.streams[i].key, 1 << 30), i))  # new ones: after, in arrival order
        n, k = len(order), self.n_groups
        for g in range(k):
            for i in order[g * n // k:(g + 1) * n // k]:
                self.streams[i].group = g
        self._dirty = False

    def _run(self, g: int) -> None:
        owner = self.owner
        idle_since = None
        while True:
            with owner.cond:
                self._partition()
                mine = [s for s in self.streams if s.group == g and not s.in_flight]
                if not mine:
                    now = time.monotonic()
                    idle_since = idle_since or now
                    if not self.streams and now - idle_since >= IDLE_S:
                        self.threads[g] = None
                        owner.drop_if_idle(self)
                        return
                    owner.cond.wait(IDLE_S)
                    continue
                idle_since = None
                for s in mine:
                    s.in_flight = True
                owner.busy += 1
            opening = [s.first_step for s in mine]
            try:
                self._step(mine)
            except Exception as e:  # noqa: BLE001 - a bug must end its streams, not leave them waiting
                for s in mine:
                    owner.finish(s, "error", outcome=pb.OUTCOME_INTERNAL, detail=f"the head failed: {e!r}")
            finally:
                with owner.cond:
                    owner.busy -= 1
                    for s, was_opening in zip(mine, opening):
                        s.in_flight = False
                        if s.done:
                            self.streams.remove(s)
                            self._dirty = True
                        elif was_opening and not s.first_step:  # it has a seq id now
                            self._dirty = True
                    owner.cond.notify_all()

    def _step(self, streams: list[_Stream]) -> None:
        owner = self.owner
        now = time.monotonic()
        live = []
        for s in streams:
            if owner.servicer.stopping.is_set():
                owner.finish(s, "shutdown", detail="the worker is shutting down")
            elif s.stop_reason is not None:
                owner.finish(s, "cancelled", detail=s.stop_reason)
            elif s.deadline is not None and now >= s.deadline:
                owner.finish(s, "cancelled", detail="the stream's deadline passed")
            else:
                live.append(s)
        if not live:
            return
        # a new session is admitted on its own: one over the principal's cap ends its stream only
        admitted = []
        for s in live:
            refused = owner.servicer.owners.admit(self.principal, [s.key]) if s.first_step else None
            if refused is None:
                admitted.append(s)
            else:
                owner.finish(s, "error", outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=refused)
        live = admitted
        if not live:
            return
        for s in live:
            if s.first_step and not s.planned:
                s.plan_prefix(owner.servicer.prefixes)
        # drafts only for a stream stepping alone: streams sharing a step already share its compute,
        # which a verification's extra rows would take from them
        cost = self.cost.relative() if len(live) == 1 else None
        t0 = time.perf_counter()  # a draft model's time counts in the step's cost
        items = [s.request(self.wire_dtype, cost) for s in live]
        from .worker import _Refused  # the worker module imports this one
        generating = all(not s.first_step and s.sent[1] for s in live)  # steps past the prompt: timed
        try:
            replies = owner.servicer.run_steps(self.principal, (), items, self.forward,
                                               now + owner.servicer.max_hop_s, batch=True, own_loop=True)
            if generating:  # timed by the largest stream's step (what the batch's size follows)
                self.cost.observe(max(s.sent[0] for s in live), time.perf_counter() - t0)
        except _Refused as e:
            for s in live:
                owner.finish(s, "error", outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=str(e))
            return
        for s, reply in zip(live, replies):
            owner.settle(s, reply)


class GenerationLoops:
    """Every Generate stream of a head worker, and the record of what each session holds."""

    def __init__(self, servicer, registry, draft_source: str = "ngram", max_drafts: int = 0, draft_model=None,
                 row_by_row: bool = True):
        self.servicer = servicer
        self.row_by_row = row_by_row       # verifications computed row by row on every shard (serve --verify exact)
        self.draft_model = draft_model     # draft_model.DraftModel (serve --draft-model), or None
        self.draft_source = (f"model {draft_model.path.name}" if draft_model is not None
                             else draft_source)  # speculative decoding: where drafts come from ("off": none)
        self.max_drafts = max_drafts if draft_source != "off" else 0  # a request's default
        self.cond = threading.Condition()
        self.loops: dict[tuple, _RouteLoop] = {}
        self.streams: dict[str, _Stream] = {}          # engine key -> its running stream
        self.busy = 0                                   # group steps in progress
        # engine key -> (epoch, tokens the route holds): what the next stream of the session may reuse
        self._records: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()
        config = servicer.manager.config
        self._records_cap = 2 * config.max_sessions
        self.max_streams = max_generate_streams(config)
        self.active = Gauge("llama_shard_generate_streams", "Generate streams running on this head", registry=registry)
        self.active.set_function(lambda: len(self.streams))
        self.ttft = Histogram("llama_shard_generate_time_to_first_token_seconds",
                              "Time from a Generate call to its first token", registry=registry,
                              buckets=(.01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30))
        self.drafted = Counter("llama_shard_draft_tokens", "Drafts Generate streams sent to be verified",
                               registry=registry)
        self.accepted = Counter("llama_shard_draft_accepted_tokens", "Drafts the tail accepted", registry=registry)
        self.drafted_total = self.accepted_total = 0
        self.itl = Histogram("llama_shard_generate_inter_token_seconds", "Time between a stream's tokens",
                             registry=registry, buckets=(.002, .005, .01, .02, .05, .1, .2, .5, 1, 2))

    # --- opening ---------------------------------------------------------------------------------

    def open(self, principal: str, req: pb.GenerateRequest, time_remaining: float | None,
             events=None) -> _Stream | pb.GenerateFinal:
        """A running stream, or the final event of one refused before anything was computed. Its
        events go to `events.put` (default: a SimpleQueue the gRPC handler reads)."""
        try:
            params, max_tokens, max_drafts = self._check(req)
            key = self.servicer.security.engine_key(principal, req.session_id)
        except InvalidInputError as e:
            return pb.GenerateFinal(finish_reason="error", outcome=pb.OUTCOME_INVALID_ARGUMENT, detail=str(e),
                                    prompt_tokens=len(req.prompt))
        cap = self.servicer.owners.cap
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        with self.cond:
            if key in self.streams:
                return pb.GenerateFinal(finish_reason="error", outcome=pb.OUTCOME_INVALID_ARGUMENT,
                                        detail=f"session {req.session_id!r} already has a Generate stream running",
                                        prompt_tokens=len(req.prompt))
            mine = sum(1 for s in self.streams.values() if s.principal == principal)
            limit = self.max_streams
            if cap is not None and mine >= cap:
                return pb.GenerateFinal(finish_reason="error", outcome=pb.OUTCOME_BUDGET_EXCEEDED,
                                        detail=f"this caller has {mine} streams running; the cap is {cap} per caller "
                                               f"(serve --max-sessions-per-principal)", prompt_tokens=len(req.prompt))
            if len(self.streams) >= limit:
                return pb.GenerateFinal(finish_reason="error", outcome=pb.OUTCOME_BUDGET_EXCEEDED,
                                        detail=f"this worker runs at most {limit} Generate streams at once (its hot "
                                               f"sessions{', twice over with its warm tier' if limit > 1 and self.servicer.manager.config.warm_bytes else ''})",
                                        prompt_tokens=len(req.prompt))
            record = self._records.get(key)
            cached = 0
            if record is not None and record[0] == req.route_epoch:
                cached = min(_common_prefix(record[1], list(req.prompt)), len(req.prompt) - 1)
            stream = _Stream(principal, key, req, params, max_tokens, cached, deadline, self.servicer.model.detokenize,
                             events, max_drafts, self.draft_model, self.row_by_row)
            route = tuple((h.address, h.recipe_fingerprint) for h in req.forward)
            loop_key = (principal, route, req.wire_dtype)
            loop = self.loops.get(loop_key)
            if loop is None:
                loop = self.loops[loop_key] = _RouteLoop(self, principal, route, req.wire_dtype)
            self.streams[key] = stream
            loop.add(stream)
        return stream

    def _check(self, req: pb.GenerateRequest):
        """(sampling params or None, max_tokens, max drafts per step); InvalidInputError says what is wrong."""
        sv = self.servicer
        info, context = sv.info, sv.manager.config.context_tokens
        check_key(req.session_id, req.route_epoch)
        if req.recipe_fingerprint and req.recipe_fingerprint != sv.fingerprint:
            raise InvalidInputError("the request's KV recipe fingerprint does not match this worker's")
        if info.first != 0:
            raise InvalidInputError(f"Generate runs on the head of a route; this worker holds layers "
                                    f"{info.first}-{info.last}")
        if not req.forward and not info.is_tail:
            raise InvalidInputError(f"this worker holds layers {info.first}-{info.last} of {info.n_layer}: name the "
                                    f"rest of the route in forward")
        refusal = sv._forward_refusal(req.forward)
        if refusal is not None:
            raise InvalidInputError(refusal)
        if req.wire_dtype not in (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16):
            raise InvalidInputError(f"unknown wire_dtype {req.wire_dtype}")
        n = len(req.prompt)
        if n == 0:
            raise InvalidInputError("the prompt is empty")
        if n >= context:
            raise InvalidInputError(f"the prompt has {n} tokens; a session holds at most {context} (context_tokens), "
                                    f"the prompt and at least one generated token")
        if any(not 0 <= t < info.n_vocab for t in req.prompt):
            raise InvalidInputError(f"a prompt token is outside the vocabulary (0..{info.n_vocab - 1})")
        room = context - n
        if req.max_tokens < 0 or req.max_tokens > room:
            raise InvalidInputError(f"max_tokens is {req.max_tokens}; with a {n}-token prompt the context "
                                    f"({context} tokens) leaves room for 1..{room} (0: all of it)")
        if len(req.stop_token_ids) > MAX_STOP_TOKENS or any(not 0 <= t < info.n_vocab for t in req.stop_token_ids):
            raise InvalidInputError(f"stop_token_ids takes at most {MAX_STOP_TOKENS} tokens of the vocabulary")
        if len(req.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in req.stop):
            raise InvalidInputError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                                    f"{MAX_STOP_CHARS} characters")
        if not 0 <= req.keep_prefix <= n:
            raise InvalidInputError(f"keep_prefix is {req.keep_prefix}; it counts prompt tokens (0..{n})")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidInputError(f"top_logprobs is {req.top_logprobs}; it must be 0..{MAX_TOP_LOGPROBS}")
        if req.HasField("max_drafts") and not 0 <= req.max_drafts <= MAX_DRAFTS:
            raise InvalidInputError(f"max_drafts is {req.max_drafts}; it must be 0 (off) to {MAX_DRAFTS}")
        params = params_from_wire(req.sampling, info.n_vocab, context) if req.HasField("sampling") else None
        max_drafts = req.max_drafts if req.HasField("max_drafts") else self.max_drafts
        if self.draft_source == "off" or req.logprobs or req.top_logprobs:  # a verification returns no logprobs
            max_drafts = 0
        return params, req.max_tokens or room, max_drafts

    # --- the loop's outcomes -------------------------------------------------------------------

    def settle(self, s: _Stream, reply: pb.StepReply) -> None:
        """What one step's reply means for its stream (called by the stream's group thread)."""
        n_sent, final, drafts = s.sent
        if reply.outcome == pb.OUTCOME_CACHE_MISS:
            s.reprefills += 1
            s.misses_in_row += 1
            if s.misses_in_row > MAX_REPREFILLS:
                self.finish(s, "error", outcome=reply.outcome, stage=reply.stage, miss_reason=reply.miss_reason,
                            detail=f"still a cache miss after {MAX_REPREFILLS} re-prefills: {reply.detail}")
            else:
                if reply.miss_reason == "PREFIX_EVICTED":  # a shard lacks the prefix: this time it is computed
                    s.may_open = False
                s.computed, s.held, s.first_step, s.cached = 0, 0, True, 0
                s.planned, s.prefix, s.prefix_tokens = False, None, 0
            return
        if reply.outcome != pb.OUTCOME_OK:
            self.finish(s, "error", outcome=reply.outcome, stage=reply.stage, detail=reply.detail)
            return
        if s.first_step and s.prefix is not None and s.prefix.open_tokens:
            s.prefix_tokens = s.prefix.open_tokens
        s.first_step = False
        s.misses_in_row = 0
        if not final:
            s.computed += n_sent
            s.held = s.computed
            return
        tokens = list(reply.tokens) if drafts else [reply.token_id]
        n_vocab = self.servicer.info.n_vocab
        # a tail must not make the head crash: its answer is checked against what was asked
        if not 1 <= len(tokens) <= len(drafts) + 1 or tokens[:-1] != drafts[:len(tokens) - 1]:
            self.finish(s, "error", outcome=pb.OUTCOME_INTERNAL, stage=reply.stage,
                        detail=f"the tail answered {len(tokens)} tokens that do not verify the {len(drafts)} drafts sent")
            return
        if not 0 <= tokens[-1] < n_vocab:
            self.finish(s, "error", outcome=pb.OUTCOME_INTERNAL, stage=reply.stage,
                        detail=f"the tail answered token {tokens[-1]}, outside the vocabulary")
            return
        accepted = len(tokens) - 1
        s.held = s.computed + n_sent            # the rejected drafts' positions too, until the next step cuts them
        s.computed += n_sent - len(drafts) + accepted
        if s.unsent is not None:
            s.control.unsent(tokens[0] == s.unsent, s.long_match)
            s.unsent = None
        s.control.update(len(drafts), accepted, s.long_match)
        for i, token in enumerate(tokens):
            s.unsent_accepted = max(0, accepted - i - 1)  # accepted drafts behind this token: a stop here drops them
            if not self._emit(s, token, reply):
                break
        if drafts:  # counted as the client got them (accepted never exceeds the completion's tokens)
            shown = accepted - s.unsent_accepted
            self.drafted.inc(len(drafts))
            self.accepted.inc(shown)
            with self.cond:  # streams of several route loops count here (Info reads these)
                self.drafted_total += len(drafts)
                self.accepted_total += shown

    def _emit(self, s: _Stream, token: int, reply: pb.StepReply) -> bool:
        """One sampled token to the stream's client; False once the stream has finished."""
        if s.params is not None:
            s.draws += 1
        now = time.monotonic()
        if s.t_first is None:
            s.t_first = now
            self.ttft.observe(now - s.t_start)
        else:
            self.itl.observe(now - s.t_last)
        s.t_last = now
        s.generated.append(token)
        s.tokens.append(token)
        text = s.detokenize(s.generated).rstrip("\ufffd")  # an incomplete character comes with a later token
        piece = text[len(s.text):] if text.startswith(s.text) else ""
        start = max(0, len(s.text) - MAX_STOP_CHARS)
        s.text = text
        event = pb.GeneratedToken(token_id=token, piece=piece)
        if s.req.logprobs or s.req.top_logprobs:
            event.logprob = reply.logprob
            n_vocab = self.servicer.info.n_vocab  # no more than asked, and only tokens, whatever the tail sent
            event.top_logprobs.extend(a for a in reply.top_logprobs[:s.req.top_logprobs] if 0 <= a.token_id < n_vocab)
        s.events.put(pb.GenerateEvent(token=event))
        if token in s.req.stop_token_ids:
            self.finish(s, "stop", stop=f"token {token}")
            return False
        hit = next((x for x in s.req.stop if x in text[start:]), None)
        if hit is not None:
            self.finish(s, "stop", stop=hit)
        elif len(s.generated) >= s.max_tokens:
            self.finish(s, "length")
        return not s.done

    def finish(self, s: _Stream, reason: str, *, outcome: int = pb.OUTCOME_OK, stage: int = 0, detail: str = "",
               miss_reason: str = "", stop: str = "") -> None:
        if s.done:
            return
        s.done = True
        n = len(s.generated)
        rate = (n - 1) / (s.t_last - s.t_first) if n > 1 and s.t_last > s.t_first else 0.0
        sv = self.servicer
        # a prefix shared among principals (--share-prefixes all) is someone else's start: how much of
        # a prompt it covered is reported to admins only (it says what other callers sent)
        told = s.prefix_tokens if sv.prefixes.share != "all" or s.principal in sv.security.admins else 0
        final = pb.GenerateFinal(
            finish_reason=reason, outcome=outcome, stage=stage, detail=detail, miss_reason=miss_reason,
            prompt_tokens=len(s.req.prompt), cached_tokens=s.cached, completion_tokens=n, reprefills=s.reprefills,
            time_to_first_token_s=(s.t_first - s.t_start) if s.t_first is not None else 0.0, tokens_per_s=rate,
            seq_len=min(s.computed, len(s.tokens)), stop=stop, prefix_tokens=told,
            drafted_tokens=s.control.drafted, accepted_tokens=s.control.accepted - s.unsent_accepted)
        with self.cond:
            if self.streams.get(s.key) is s:
                del self.streams[s.key]
            if reason == "error":
                self._records.pop(s.key, None)  # the route's state is unknown: the next stream starts over
            else:
                self._records[s.key] = (s.req.route_epoch, s.tokens[:s.computed])  # (drafts past it: cut by the next prefill)
                self._records.move_to_end(s.key)
                while len(self._records) > self._records_cap:
                    self._records.popitem(last=False)
            self.cond.notify_all()  # a Release waiting for this stream to end (stop_stream)
        s.events.put(pb.GenerateEvent(final=final))

    # --- bookkeeping -----------------------------------------------------------------------------

    def longest_prefix(self, principal: str, tokens: list[int]) -> tuple[str, int] | None:
        """(session id, epoch) of the principal's session, with no stream running, whose record
        shares the longest common prefix with `tokens`; None if none does. A session is continued
        only where the prefix covers at least half of what it holds: a new chat that shares only a
        system prompt with another does not cut that one's tail (it gets a session of its own)."""
        security = self.servicer.security
        tag = security.tag(principal) if security.authenticated else None
        with self.cond:  # the candidates only: the group threads need this lock at every step
            mine = [(key, epoch, held) for key, (epoch, held) in self._records.items()
                    if key not in self.streams
                    and (security.split_key(key)[0] if security.authenticated else None) == tag]
        best, best_n = None, 0
        for key, epoch, held in mine:  # a record's list is replaced, never changed: safe to read here
            n = _common_prefix(held, tokens)
            if n > best_n and 2 * n >= len(held):
                best, best_n = (security.split_key(key)[1] if security.authenticated else key, epoch), n
        return best

    def least_recent(self, principal: str, prefix: str) -> tuple[str, int] | None:
        """(session id, epoch) of the principal's least recently finished session that the engine
        still holds, with no stream running, whose id begins with `prefix`; None if there is none
        (a record outlives a session the engine evicted: continuing that one would be a new session)."""
        security = self.servicer.security
        tag = security.tag(principal) if security.authenticated else None
        held = {r.session_id for r in self.servicer.manager.sessions()}
        with self.cond:
            for key, (epoch, _) in self._records.items():  # oldest first
                owner, sid = security.split_key(key) if security.authenticated else (None, key)
                if key in held and key not in self.streams and owner == tag and sid.startswith(prefix):
                    return sid, epoch
        return None

    def stop_stream(self, key: str, reason: str, timeout: float) -> bool:
        """Ends the stream running on engine key `key`, if any, and waits (at most `timeout`
        seconds) until it has ended: a step already built for it must not run after a Release,
        or it would bring the session back. False if it had not ended in time."""
        end = time.monotonic() + timeout
        with self.cond:
            s = self.streams.get(key)
            if s is None:
                return True
            s.cancel(reason)
            self.cond.notify_all()  # an idle group thread picks it up at once
            while self.streams.get(key) is s:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def has_records(self) -> bool:
        return bool(self._records)

    def forget(self, key: str) -> None:
        """The session was stepped, truncated or released from outside a stream: its record is stale."""
        if key in self._records:
            with self.cond:
                self._records.pop(key, None)

    def seq_ids(self) -> dict[str, int]:
        """Engine key -> seq id of the head's hot sessions ({} when the engine cannot say: closing)."""
        try:
            return {r.session_id: r.seq_id for r in self.servicer.manager.sessions() if r.seq_id >= 0}
        except Exception:  # noqa: BLE001 - the partition falls back to arrival order
            return {}

    def drop_if_idle(self, loop: _RouteLoop) -> None:  # under self.cond
        if loop.idle() and not loop.streams:
            for k, v in list(self.loops.items()):
                if v is loop:
                    del self.loops[k]

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no stream is left and no group step is running (shutdown)."""
        end = time.monotonic() + timeout
        with self.cond:
            while self.streams or self.busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True
