"""The patch series applies to the pristine pin and reverses cleanly; the build tree carries it."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.skipif(shutil.which("git") is None, reason="applying the series needs git (a build machine's tool)")
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
    assert pin["package"] == "llama-cpp-python" and re.fullmatch(r"\d+\.\d+\.\d+", pin["version"])
    assert pin["sdist"] == f"llama_cpp_python-{pin['version']}.tar.gz"
    assert re.fullmatch(r"[0-9a-f]{64}", pin["sha256"]) and re.fullmatch(r"[0-9a-f]{7,40}", pin["upstream_commit"])


def test_the_graph_patch_certifies_the_architectures_the_native_module_lists():
    """The native module's list is the one the Python side reads; llama.cpp's own check (patch
    0001, extended by later patches) must name the same architectures, in its condition and in
    its message."""
    from llama_shard import certified_architectures

    # the last patch that writes the check holds its final form
    patch = [p.read_text() for p in sorted((REPO / "patches").glob("0*.patch")) if "does not support a shard layer range" in p.read_text()][-1]
    condition = re.search(r"^\+\s*if \((\s*model->arch != LLM_ARCH_\w+\s*(&&\s*\+?\s*)?)+\)", patch, re.M)
    assert condition, "the series no longer has its architecture check"
    in_condition = sorted(a.lower() for a in re.findall(r"LLM_ARCH_(\w+)", condition.group(0)))
    message = re.search(r"^\+.*does not support a shard layer range \(supported: ([a-z0-9, ]+)\)", patch, re.M)
    in_message = sorted(message.group(1).split(", "))
    assert in_condition == in_message == sorted(certified_architectures())

