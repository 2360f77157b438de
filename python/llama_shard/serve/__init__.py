"""The served worker: one shard behind gRPC.

- `worker`: `ShardWorker` (the gRPC service, metrics, health, forwarding to the next shard);
- `security`: TLS, tokens, principals, the exposure rule;
- `openai_http`: the OpenAI-compatible HTTP endpoint of a head; `http_guard`: its connections'
  timeouts and cap, from accept; `chat_template`: the bounded sandbox a GGUF's chat template runs in;
- `local_workers`: starting and stopping worker processes on this machine (the demo, benchmarks
  and tests use it).

The wire format (`llama_shard.proto`: the .proto, its generated code, `wire` for tensors and
reconnects) is shared with the route client.
"""

#: the longest a chained step may hold a worker's handler (and the next hop), whatever the caller's
#: deadline: a call with none, or a long one, cannot hold a worker (serve --max-hop-seconds)
DEFAULT_MAX_HOP_S = 60.0
