"""A worker decides how it computes each verification size before it serves.

With `row_by_row` (serve --draft-verify exact) a verification's tokens must get the bytes of
one-token steps. The engine computes them in one llama_decode call only where it has shown that
gives those bytes and is faster (shard_context's whole_rows_verdicts); the first verification of
each size is computed both ways and compared, which costs about that size's rows as one-token steps
more. `decide_verification_sizes` runs those first verifications on a scratch session at start-up
(ShardWorker), so that no request pays them (sizes 2..16 of SmolLM2's two bench shards, layers 0-18
and 19-29, one thread: 0.38 s and 0.45 s). Where the engine never tries one call (no verdict after
the first size) it stops there.
"""

from __future__ import annotations

import time

import numpy as np

from .._native import MAX_LOGIT_ROWS
from ..errors import LlamaShardError
from .adapter import KvBoundaryAdapter
from .hot_kv import CacheMiss
from .manager import HotKvStateManager

#: the scratch session's id (a client's would have to guess it while the worker is not serving yet)
SCRATCH_SESSION = "llama-shard/verification-sizes"
#: the cells before the verifications (the comparison at one depth holds at every depth: see
#: whole_rows_verdicts; a few cells make the steps' shapes those of a session's)
DEPTH = 32


def decide_verification_sizes(
    manager: HotKvStateManager, max_rows: int = MAX_LOGIT_ROWS
) -> tuple[dict[int, str], float]:
    """Runs a verification of each size 2..max_rows on a scratch session (released after); returns
    the engine's verdicts and the seconds it took. Nothing is run where the manager has no room for
    the scratch session. A failure raises LlamaShardError (the caller serves on: requests then
    decide, as before)."""
    model = manager.model
    info, config = model.info, manager.config
    depth = min(DEPTH, config.context_tokens - max_rows, config.budget_tokens - max_rows)
    if depth < 1 or config.max_sessions < 1 or max_rows < 2:
        return {}, 0.0
    adapter = KvBoundaryAdapter(model, manager)
    rng = np.random.default_rng(0)

    def rows(n: int) -> dict:
        if info.is_head:
            return {"token_ids": rng.integers(0, info.n_vocab, n).tolist()}
        return {"boundary": rng.standard_normal((n, info.n_embd)).astype(np.float32)}

    def step(**kw) -> None:
        if isinstance(adapter.prefill(SCRATCH_SESSION, 0, **kw), CacheMiss):
            raise LlamaShardError("the scratch session was lost (a cache miss)")

    t0 = time.perf_counter()
    try:
        step(**rows(depth), start_pos=0)
        for m in range(2, max_rows + 1):
            step(**rows(m), start_pos=depth, row_by_row=True, **({"logit_rows": m} if info.is_tail else {}))
            if not manager.engine.whole_rows_verdicts:  # this engine computes rows alone: nothing to decide
                break
    finally:
        manager.release(SCRATCH_SESSION, 0)
    return dict(manager.engine.whole_rows_verdicts), time.perf_counter() - t0


#: the engine's verdict for a size computed in one call (the others say why rows stay alone)
ONE_CALL = "one call"


def describe(verdicts: dict[int, str], seconds: float) -> str:
    """One line for a worker's log: which sizes are one call, which row by row."""

    def spans(sizes: list[int]) -> str:  # 3, 4, 5, 7 -> "3-5, 7"
        out, start = [], None
        for i, n in enumerate(sizes):
            start = n if start is None else start
            if i + 1 == len(sizes) or sizes[i + 1] != n + 1:
                out.append(f"{start}-{n}" if n > start else str(n))
                start = None
        return ", ".join(out) or "none"

    one_call = sorted(n for n, v in verdicts.items() if v == ONE_CALL)
    alone = sorted(n for n, v in verdicts.items() if v != ONE_CALL)
    return (
        f"verifications of {spans(one_call)} tokens in one call, {spans(alone)} row by row (decided in {seconds:.2f} s)"
    )
