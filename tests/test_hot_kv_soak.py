"""Soak: 10,000 open/prefill/release cycles with random session ids leave nothing behind: reserved
tokens at zero, every seq id back in the pool, the dropped-key table bounded, resident memory flat."""

from __future__ import annotations

import json

from conftest import run_isolated

SOAK = """
import json, random, time
import numpy as np
import llama_shard as ls
from llama_shard.testing.process import resident_bytes as rss
model = ls.ShardModel({path!r}, (0, 2), 1)
mgr = ls.HotKvStateManager(model, ls.HotKvStateConfig(max_sessions=16, context_tokens=64, budget_tokens=512), ls.ManualClock(),
                           n_batch=16, recent_capacity=1024)
ad = ls.KvBoundaryAdapter(model, mgr)
rng = random.Random(5)
def cycles(n):
    for _ in range(n):
        sid = "s-%016x" % rng.getrandbits(64)
        mgr.open(sid, rng.randrange(4))
        ep = mgr.session_keys()[-1][1]
        ad.prefill(sid, ep, token_ids=[rng.randrange(320) for _ in range(rng.randrange(1, 16))])
        assert mgr.release(sid, ep)
cycles(500)                      # warm up allocator pools
r0 = rss(); t0 = time.perf_counter()
cycles(10000)
dt = time.perf_counter() - t0; r1 = rss()
mgr.check_invariants()
st = mgr.stats()
# every slot came back: 16 new sessions take the 16 sequence ids (a leaked id would leave one out)
for i in range(16):
    ad.prefill(f"after-{{i}}", 0, token_ids=[1, 2])
free_ids = {{s[2] for s in mgr.engine.sessions()}}
print(json.dumps(dict(seconds=dt, rss_before=r0, rss_after=r1, reserved=st["reserved_tokens"], live=st["live_sessions"],
                      recent=st["recent_keys"], releases=st["releases"], free_ids=len(free_ids))))
"""


def test_ten_thousand_cycles_leave_nothing_behind(synthetic_model):
    res = run_isolated(SOAK.format(path=str(synthetic_model)), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    print(
        f"10,000 cycles in {r['seconds']:.2f}s; RSS {r['rss_before'] / 2**20:.1f} -> {r['rss_after'] / 2**20:.1f} MiB"
    )
    assert r["reserved"] == 0 and r["live"] == 0 and r["free_ids"] == 16
    assert r["releases"] == 10500
    assert r["recent"] <= 1024
    assert r["rss_after"] - r["rss_before"] < 8 * 2**20, "resident memory grew"
