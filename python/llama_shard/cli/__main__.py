"""`python -m llama_shard.cli`: the `llama-shard` command."""

from . import main

raise SystemExit(main())
