"""The patch series applies to the pristine pin and reverses cleanly; the build tree carries it."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_series_applies_to_the_pristine_pin_and_reverses_cleanly():
    res = subprocess.run([sys.executable, str(REPO / "third_party" / "materialize.py"), "--check-series"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "apply to the pristine pin and reverse cleanly" in res.stdout


def test_every_patch_has_a_header_saying_why():
    patches = sorted((REPO / "patches").glob("[0-9][0-9][0-9][0-9]-*.patch"))
    assert len(patches) >= 4
    for p in patches:
        head = p.read_text().split("diff --git", 1)[0]
        assert "Why:" in head, f"{p.name} has no header explaining why it exists"


def test_pin_names_package_version_hash_and_upstream_commit():
    pin = json.loads((REPO / "third_party" / "llama-cpp-pin.json").read_text())
    assert pin["package"] == "llama-cpp-python" and pin["version"] == "0.3.36"
    assert len(pin["sha256"]) == 64 and pin["upstream_commit"] == "0c1e57098"

