"""Code only a head runs: the worker whose range starts at layer 0 and takes Generate streams and
OpenAI requests. `role.Head` sits on its worker's servicer; `generation/` is its loop, `openai/` its
HTTP endpoint, `replicas.py` its later stages and failover, `speculation.py` and `draft_model.py`
its drafts, `prefix_plans.py` its shared-prefix decisions. Every worker's code is `worker/`, which
never imports this package."""
