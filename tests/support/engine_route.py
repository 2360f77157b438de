"""A split route through the Hot KV engine in this process (what a worker runs, without the wire),
and the token prompt the family tests feed it."""

from __future__ import annotations

from llama_shard import CacheMiss, HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel
from llama_shard.engine.hot_kv import ManualClock

PROMPT = [1, 17, 42, 99, 5, 250, 3, 8, 9, 10, 11, 12]


class Route:
    """A split (the shards' `layout`: (first, last) ranges) through the Hot KV engine, as workers run
    it; one `config` for every shard's engine, or one each in `configs`."""

    def __init__(self, path, layout, config: HotKvStateConfig | None = None, configs: list | None = None):
        config = config or HotKvStateConfig(max_sessions=4, context_tokens=128, budget_tokens=512, ttl_seconds=0)
        self.models = [ShardModel(str(path), r, 1) for r in layout]
        self.managers = [
            HotKvStateManager(m, c, ManualClock(), n_batch=32)
            for m, c in zip(self.models, configs or [config] * len(layout))
        ]
        self.adapters = [KvBoundaryAdapter(m, mgr) for m, mgr in zip(self.models, self.managers)]

    def prefill(self, sid, tokens, start_pos=None):
        out = None
        for i, a in enumerate(self.adapters):
            out = (
                a.prefill(sid, 0, token_ids=tokens, start_pos=start_pos)
                if i == 0
                else a.prefill(sid, 0, boundary=out, start_pos=start_pos)
            )
            if isinstance(out, CacheMiss):
                return out
        return out

    def decode(self, sid, token):
        out = None
        for i, a in enumerate(self.adapters):
            out = a.decode(sid, 0, token_ids=[token]) if i == 0 else a.decode(sid, 0, boundary=out)
        return out

    def greedy(self, sid, prompt, n):
        out = self.prefill(sid, prompt)
        tokens, logits = [out.token_id], [out.logits.tobytes()]
        for _ in range(n - 1):
            out = self.decode(sid, tokens[-1])
            tokens.append(out.token_id)
            logits.append(out.logits.tobytes())
        return tokens, logits

    def greedy_from(self, sid, out, n):
        """n greedy tokens after a step's answer `out` (its token first)."""
        tokens = [out.token_id]
        for _ in range(n - 1):
            tokens.append(self.decode(sid, tokens[-1]).token_id)
        return tokens

    def truncate(self, sid, length):
        for mgr in self.managers:
            assert mgr.truncate(sid, 0, length).seq_len == length

    def close(self):
        for m in self.managers:
            m.close()
