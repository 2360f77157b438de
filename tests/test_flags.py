"""Every numeric flag is range-checked before anything loads: a bad value exits 2 with a line that
names the flag (argparse's own message), for each command that takes it."""

from __future__ import annotations

import subprocess
import sys

import pytest

BAD = {
    "serve": [
        ("--port", "99999"),
        ("--port", "-1"),
        ("--metrics-port", "70000"),
        ("--threads", "-2"),
        ("--threads", "0"),
        ("--batch", "0"),
        ("--batch", "15"),
        ("--gather-ms", "-1"),
        ("--gather-ms", "nan"),
        ("--max-step-sessions", "0"),
        ("--prefill-chunk", "0"),
        ("--max-sessions", "0"),
        ("--max-sessions", "257"),
        ("--context-tokens", "0"),
        ("--context-tokens", "x"),
        ("--context-tokens", "1048577"),
        ("--budget-tokens", "-5"),
        ("--ttl", "-1"),
        ("--ttl", "inf"),
        ("--sweep-seconds", "-0.5"),
        ("--warm-ttl", "nan"),
        ("--max-sessions-per-principal", "0"),
        ("--max-concurrent-rpcs", "0"),
    ],
    "generate": [("--max-tokens", "-1"), ("--threads", "-1"), ("--ctx", "0"), ("--batch", "0")],
    "demo": [("--threads", "0"), ("--max-tokens", "-3")],
    "inspect": [("--context-tokens", "0"), ("--context-tokens", "2147483648")],
}


@pytest.mark.parametrize(
    "command,flag,value",
    [(c, f, v) for c, cases in BAD.items() for f, v in cases],
    ids=[f"{c} {f} {v}" for c, cases in BAD.items() for f, v in cases],
)
@pytest.mark.slow
def test_a_bad_numeric_flag_exits_2_naming_it(command, flag, value):
    res = subprocess.run(
        [sys.executable, "-m", "llama_shard.cli", command, f"{flag}={value}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert f"argument {flag}" in res.stderr, res.stderr


def test_port_zero_and_the_limits_are_accepted_by_the_parser():
    from llama_shard.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--port", "0", "--metrics-port", "65535", "--max-sessions", "256", "--ttl", "0", "--gather-ms", "0"]
    )
    assert (args.port, args.metrics_port, args.max_sessions, args.ttl, args.gather_ms) == (0, 65535, 256, 0.0, 0.0)
