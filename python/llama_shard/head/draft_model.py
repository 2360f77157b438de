"""A draft model on the head (`serve --draft-model`): a small GGUF loaded whole, whose greedy tokens
are the drafts (speculation.py says how they are verified and how many are asked for).

- It must map token ids to the same text as the route's model (`check_vocabulary`): otherwise its
  ids mean other words and no draft would be accepted; the worker refuses to start, naming both.
- Each Generate stream has a session in the draft model's own engine: its own context, a slot of
  the worker's context length per stream the head runs at once (`engine.memory.draft_model_plan`,
  a line of serve's memory plan). `propose` brings it to the stream's tokens (the common prefix it holds is
  kept, the rest prefilled at that position, which cuts the drafts it guessed wrong last time),
  then decodes greedily, one token per draft. A session the engine dropped (evicted) is
  prefilled again from the start; nothing here changes what the route computes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..engine.adapter import KvBoundaryAdapter
from ..engine.hot_kv import CacheMiss
from ..engine.manager import HotKvStateManager
from ..engine.memory import draft_model_plan
from ..engine.models import gguf_vocabulary_digest
from ..errors import InvalidInputError, LlamaShardError


def check_vocabulary(draft_path: str | Path, model_path: str | Path) -> None:
    """InvalidInputError unless the draft model's tokenizer is the route model's, id for id."""
    (n_draft, d_draft), (n_model, d_model) = gguf_vocabulary_digest(draft_path), gguf_vocabulary_digest(model_path)
    if (n_draft, d_draft) != (n_model, d_model):
        raise InvalidInputError(
            f"the draft model {Path(draft_path).name} has a different vocabulary from {Path(model_path).name} "
            f"({n_draft} tokens against {n_model}{', the same count but other tokens' if n_draft == n_model else ''}): "
            f"its token ids would not mean the same text; give a draft model of the same tokenizer"
        )


class DraftModel:
    """The draft model's engine and each stream's session in it."""

    def __init__(
        self,
        path: str | Path,
        model_path: str | Path,
        context_tokens: int,
        max_sessions: int,
        threads: int | None = None,
    ):
        from .._native import ShardModel

        check_vocabulary(path, model_path)
        self.path = Path(path)
        self.model = ShardModel(str(path), None, threads)
        config = draft_model_plan(path, context_tokens, max_sessions).config(ttl_seconds=0)  # what serve's plan says
        self.manager = HotKvStateManager(self.model, config, n_threads=threads)
        self.adapter = KvBoundaryAdapter(self.model, self.manager)
        self._held: OrderedDict[str, list[int]] = OrderedDict()  # session -> the tokens its draft KV holds
        self._held_cap = 2 * max_sessions  # the engine holds at most max_sessions; older records only cost a prefill
        self._lock = threading.Lock()
        self.context_tokens = context_tokens

    def propose(self, session: str, tokens: list[int], k: int) -> list[int]:
        """Up to k greedy tokens of the draft model after `tokens` (fewer near the context's end;
        none if the draft engine failed: drafting is an optimisation, never an error)."""
        k = min(k, self.context_tokens - len(tokens))
        if k <= 0:
            return []
        with self._lock:
            held = self._held.pop(session, [])
        start = 0
        while start < min(len(held), len(tokens) - 1) and held[start] == tokens[start]:
            start += 1
        try:
            out = self.adapter.prefill(session, 0, tokens[start:], start_pos=start)
            if isinstance(out, CacheMiss):  # evicted: from the start
                out = self.adapter.prefill(session, 0, tokens, start_pos=0)
            drafts = []
            while isinstance(out, CacheMiss) is False and len(drafts) < k:
                drafts.append(int(np.argmax(out.logits)))
                if len(drafts) < k:
                    out = self.adapter.decode(session, 0, [drafts[-1]])
            if isinstance(out, CacheMiss):
                return []
        except LlamaShardError:
            return []
        with self._lock:
            self._held[session] = tokens + drafts[:-1]  # the last draft was not fed
            while len(self._held) > self._held_cap:
                self._held.popitem(last=False)
        return drafts

    def forget(self, session: str) -> None:
        with self._lock:
            self._held.pop(session, None)
        try:
            self.manager.release(session, 0)
        except LlamaShardError:
            pass

    def close(self) -> None:
        self.manager.close()
