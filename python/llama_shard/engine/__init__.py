"""The engine's Python face: what one shard computes and holds, in process.

- `hot_kv`: the Hot KV State contract (keys, `Step`, the values a step returns, `HotKvStateConfig`,
  the KV recipe);
- `manager`: `HotKvStateManager`, the contract's session operations over the native `HotKvEngine`
  (or the engine a model brings: the numpy reference's), with its step loop;
- `adapter`: `KvBoundaryAdapter`, the shard boundary contract over a manager, for threads and
  asyncio (`asyncio_wakeup`: how asyncio callers learn that a step finished);
- `memory`: the memory plan (what `--kv-memory` buys); `models`: GGUF files read once
  (`GgufShape`) and the embedded models; `pipeline`: whole/split runs in one process.

The native module (`llama_shard._native`, described by `_native.pyi`) is below this package; the
served worker (`llama_shard.worker`) and the route client (`llama_shard.route`) are above it.
"""
