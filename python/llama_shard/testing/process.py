"""What a process holds, for tests and benchmarks that measure memory."""

from __future__ import annotations


def resident_bytes(pid: int | None = None) -> int:
    """Resident set size (VmRSS) of a process, this one when pid is None, from /proc (Linux)."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
