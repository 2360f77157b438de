"""`llama-shard extract`: a layer range of a GGUF as a file of its own, which a worker of that range serves."""

from __future__ import annotations

import argparse

from ..engine.pipeline import parse_split
from ..engine.range_file import write_range_file
from ..errors import InvalidInputError
from .common import model_path, status


def cmd_extract(args: argparse.Namespace) -> int:
    ranges = parse_split(args.layers)
    if len(ranges) != 1:
        raise InvalidInputError(f"--layers takes one range FIRST-LAST, got {args.layers!r}")
    source = model_path(args.model)
    first, last = ranges[0]
    out = write_range_file(source, first, last, args.out)
    status(
        f"wrote layers {first}-{last} of {source.name} to {out}: {out.stat().st_size / 2**20:.1f} MiB of "
        f"{source.stat().st_size / 2**20:.1f} MiB (serve it with --model {out} --layers {first}-{last})"
    )
    return 0
