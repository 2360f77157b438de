"""The flags' value types: each numeric flag is checked where it is parsed; old spellings warn."""

from __future__ import annotations

import argparse
import math

from .._native import MAX_BUDGET_TOKENS, MAX_CONTEXT_TOKENS
from ..engine.hot_kv import parse_size
from ..errors import InvalidInputError
from .common import status


def port_number(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    return count(0, 65535)(text)


def count(lo: int, hi: int = MAX_BUDGET_TOKENS):
    """An integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its message
    return parse


def seconds(text: str) -> float:
    """A finite, non-negative number of seconds (or milliseconds), at most a year."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 365 * 86400:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def milliseconds_within_a_second(text: str) -> float:
    """0 to 1000 ms (the step loop's bound on its wait, HotKvStateManager's gather_s <= 1 s)."""
    value = seconds(text)
    if value > 1000:
        raise argparse.ArgumentTypeError(f"must be at most 1000 ms, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """Seconds > 0 (at most a year)."""
    value = seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def share(text: str) -> float:
    """A share in [0, 1]."""
    value = finite(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


THREADS = count(1, 1024)


TOKENS = count(1)


CONTEXT_TOKENS = count(1, MAX_CONTEXT_TOKENS)  # one session's tokens


def finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def size(text: str) -> str:
    """A byte size (512MiB, 2GiB or bytes), checked as it is parsed; kept as written (parse_size reads it)."""
    try:
        parse_size(text)
    except (InvalidInputError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def int32(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not -(1 << 31) <= value < 1 << 31:
        raise argparse.ArgumentTypeError(f"{value} does not fit a 32-bit integer")
    return value


class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag, kept for one release: it sets the new flag's value and says so."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        status(f"llama-shard: {option_string} is deprecated; use {self.new}")
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    parser.add_argument(
        old,
        dest=new.lstrip("-").replace("-", "_"),
        action=_DeprecatedAlias,
        new=new,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kwargs,
    )
