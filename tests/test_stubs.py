"""The type stubs of the native module, checked against the built module."""

from __future__ import annotations


def test_the_native_stubs_match_the_module():
    """mypy's stubtest compares python/llama_shard/_native.pyi with the built module; the allowlist
    names only what pybind11 itself does differently."""
    import subprocess
    import sys
    from pathlib import Path

    allowlist = Path(__file__).with_name("stubtest-allowlist.txt")
    res = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "llama_shard._native", "--allowlist", str(allowlist)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
