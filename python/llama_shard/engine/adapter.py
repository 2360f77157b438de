"""KvBoundaryAdapter: the shard boundary contract (token ids or a boundary bundle in; a bundle,
the tail's output or a CacheMiss out) over a HotKvStateManager's step loop, for threads and asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidInputError, LlamaShardError
from .asyncio_wakeup import ticket_waiter
from .hot_kv import BoundaryBundle, Step, TailOutput
from .manager import HotKvStateManager
from .recipe import KvCacheRecipe


class KvBoundaryAdapter:
    """Runs cached prefill/decode steps through a manager with the shard boundary contract.

    The head takes `token_ids`; other shards take `boundary` (a BoundaryBundle, or a float32
    (n_tokens, n_embd) array). A non-tail shard returns a BoundaryBundle for the next shard, the tail
    a TailOutput with the last token's logits and its greedy token; a step that cannot be served
    from cache returns a CacheMiss.

    Concurrent callers are batched: every step goes to the manager's step loop, which runs the
    steps of different sessions that are pending together in one engine step (continuous
    batching) and cuts long prefills into chunks. A lone caller pays no wait. Threads wait without
    the GIL; `prefill_async` / `decode_async` / `step_many_async` await the same steps from asyncio.
    """

    def __init__(self, model, manager: HotKvStateManager):
        if manager.model is not model:
            raise InvalidInputError("the adapter's model must be the manager's model")
        self.model = model
        self.manager = manager
        self._is_tail = bool(model.info.is_tail)

    @staticmethod
    def _hidden(boundary) -> np.ndarray | None:
        if boundary is None:
            return None
        return boundary.hidden if isinstance(boundary, BoundaryBundle) else boundary

    def finish(self, step: Step, r, out):
        """The contract's value for a completed step: TailOutput / BoundaryBundle / CacheMiss (or raises)."""
        sid, epoch = step.session_id, step.route_epoch
        miss = self.manager.outcome(sid, epoch, r)
        if miss is not None:
            return miss
        if self._is_tail:
            rows = None
            if step.logit_rows > 1:
                rows = out.reshape(step.logit_rows, -1)
                out = rows[-1]
            return TailOutput(
                session_id=sid,
                route_epoch=epoch,
                seq_len=r.seq_len,
                logits=out,
                token_id=int(np.argmax(out)),
                rows=rows,
            )
        return BoundaryBundle(session_id=sid, route_epoch=epoch, start_pos=r.seq_len - out.shape[0], hidden=out)

    def _answer(self, step, ticket):
        if isinstance(ticket, LlamaShardError):
            return ticket
        try:
            return self.finish(step, ticket.result, ticket.output)
        except LlamaShardError as e:
            return e

    # --- public API -------------------------------------------------------------------------------

    def prefill(
        self,
        session_id: str,
        route_epoch: int,
        token_ids: Sequence[int] | np.ndarray | None = None,
        boundary=None,
        start_pos: int | None = None,
        recipe: KvCacheRecipe | None = None,
        logit_rows: int = 1,
        row_by_row: bool = False,
    ):
        """Appends a prompt chunk at start_pos (default: the cached length; 0 re-prefills from scratch;
        an earlier start cuts what follows first). logit_rows, row_by_row: see Step (TailOutput.rows)."""
        self.manager.check_recipe(recipe)
        return self._one(
            Step.prefill(session_id, route_epoch, token_ids, self._hidden(boundary), start_pos, logit_rows, row_by_row)
        )

    def decode(
        self,
        session_id: str,
        route_epoch: int,
        token_ids: Sequence[int] | np.ndarray | None = None,
        boundary=None,
        expected_seq_len: int | None = None,
        recipe: KvCacheRecipe | None = None,
        logit_rows: int = 1,
    ):
        """Appends decode token(s) at the cached length; expected_seq_len must match it when given."""
        self.manager.check_recipe(recipe)
        return self._one(
            Step.decode(session_id, route_epoch, token_ids, self._hidden(boundary), expected_seq_len, logit_rows)
        )

    def _one(self, step: Step):
        (ticket,) = self.manager.submit([step])
        if isinstance(ticket, LlamaShardError):
            raise ticket
        ticket.wait()
        return self.finish(step, ticket.result, ticket.output)

    def _submit_micro_batch(self, steps: Sequence[Step], notify_fd: int = -1) -> list:
        """Queues a micro-batch: one step per session (a repeated session's later step is refused)."""
        seen, valid, tickets = set(), [], [None] * len(steps)
        for i, step in enumerate(steps):
            sid = getattr(step, "session_id", None)
            if isinstance(sid, str) and sid in seen:
                tickets[i] = InvalidInputError(f"session {sid!r} has more than one step in this batch")
                continue
            seen.add(sid)
            valid.append(i)
        for i, t in zip(valid, self.manager.submit([steps[i] for i in valid], notify_fd)):
            tickets[i] = t
        return tickets

    def step_many(self, steps: Sequence[Step], on_queued=None) -> list:
        """Several sessions' steps queued together (a micro-batch, one step per session); returns,
        in order, what `prefill`/`decode` would have returned for each, or the LlamaShardError it
        would have raised. `on_queued(queued)`, when given, is called once they are queued (the
        engine runs a session's steps in the order they were queued), before they are computed, with
        the steps that were (not those refused at once)."""
        tickets = self._submit_micro_batch(steps)
        if on_queued is not None:
            on_queued([step for step, t in zip(steps, tickets) if not isinstance(t, LlamaShardError)])
        for t in tickets:
            if not isinstance(t, LlamaShardError):
                t.wait()
        return [self._answer(step, t) for step, t in zip(steps, tickets)]

    # --- asyncio ----------------------------------------------------------------------------------

    async def step_many_async(self, steps: Sequence[Step]) -> list:
        """`step_many` for asyncio callers: the event loop is never blocked, and no thread waits."""
        waiter = ticket_waiter()
        tickets = self._submit_micro_batch(steps, waiter.fd)
        # every ticket is tracked before the first await: a cancelled caller leaves none untracked,
        # so the pipe is not closed while a queued ticket can still write to it
        waits = [waiter.wait(t) for t in tickets if not isinstance(t, LlamaShardError)]
        for w in waits:
            await w
        return [self._answer(step, t) for step, t in zip(steps, tickets)]

    async def _one_async(self, step: Step):
        (out,) = await self.step_many_async([step])
        if isinstance(out, LlamaShardError):
            raise out
        return out

    async def prefill_async(
        self,
        session_id: str,
        route_epoch: int,
        token_ids=None,
        boundary=None,
        start_pos: int | None = None,
        recipe: KvCacheRecipe | None = None,
    ):
        """`prefill` for asyncio callers."""
        self.manager.check_recipe(recipe)
        return await self._one_async(
            Step.prefill(session_id, route_epoch, token_ids, self._hidden(boundary), start_pos)
        )

    async def decode_async(
        self,
        session_id: str,
        route_epoch: int,
        token_ids=None,
        boundary=None,
        expected_seq_len: int | None = None,
        recipe: KvCacheRecipe | None = None,
    ):
        """`decode` for asyncio callers."""
        self.manager.check_recipe(recipe)
        return await self._one_async(
            Step.decode(session_id, route_epoch, token_ids, self._hidden(boundary), expected_seq_len)
        )
