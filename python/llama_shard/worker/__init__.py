"""Code every worker runs: one shard behind gRPC (`servicer.ShardServicer`), its steps, admission,
peers, tail sampling, hand-over, shared-prefix names, security and metrics.

A head's code (head/) sits on a worker through one seam, `head_slot.HeadSlot`, and imports this
package; this package never imports the head's (docs/design.md#module-map, tests/test_module_map.py).
"""

#: the longest a chained step may hold a worker's handler (and the next hop), whatever the caller's
#: deadline: a call with none, or a long one, cannot hold a worker (serve --max-hop-seconds)
DEFAULT_MAX_HOP_S = 60.0
