"""The served worker: one shard behind gRPC, and on a head the route's generation.

Inner walls (docs/design.md#module-map lists every module and its layer, tests/test_module_map.py
holds the imports to it): `worker` (the gRPC service) runs steps and builds the head's loop;
`generation/` (the loop) reaches its worker only through `HeadHost`; `openai/` (the HTTP endpoint)
and gRPC's `Generate` both open streams through the loop's interface and never touch the servicer.
"""

#: the longest a chained step may hold a worker's handler (and the next hop), whatever the caller's
#: deadline: a call with none, or a long one, cannot hold a worker (serve --max-hop-seconds)
DEFAULT_MAX_HOP_S = 60.0
