"""The `llama-shard` command line.

    llama-shard serve --model PATH --layers A-B [--host --port --threads --max-sessions --context-tokens
                      --budget-tokens --ttl --metrics-port]
    llama-shard generate (--route A-B@host:port,C-D@host:port | [--model PATH] [--split 0-14,15-29])
                         --prompt TEXT [--chat] [--max-tokens N] [--compare-whole]
    llama-shard inspect [PATH] [--kv-memory SIZE] [--plan MEMBERS.json]
    llama-shard demo [--model PATH]
    llama-shard extract [--model PATH] --layers A-B --out FILE

Generated text goes to stdout as it is produced; status and figures go to stderr.
Every numeric flag is checked where it is parsed (its argparse type; the sampling flags by the
native check right after parsing, before anything loads). Renamed flags keep their old spelling for
one release, with a warning: generate --ctx (--context-tokens), --verify (--compare-whole); serve
--verify (--draft-verify); inspect --memory (--kv-memory).
"""

from __future__ import annotations

from ..errors import InvalidInputError, LlamaShardError
from .common import status
from .parser import build_parser
from .serve import MAX_CHAT_TEMPLATE_BYTES, read_chat_template, serve_config

__all__ = ["MAX_CHAT_TEMPLATE_BYTES", "build_parser", "main", "read_chat_template", "serve_config"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:  # what one flag's type cannot check alone, before anything loads
        try:
            check(args)
        except InvalidInputError as e:
            parser.error(str(e))
    try:
        return args.func(args)
    except (LlamaShardError, OSError) as e:
        status(f"error: {e}")
        return 2
