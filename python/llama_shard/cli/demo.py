"""`llama-shard demo`: two workers on loopback, four chat sessions."""

from __future__ import annotations

import argparse

from .common import model_path


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    return run_demo(model_path(args.model), threads=args.threads, max_tokens=args.max_tokens)
