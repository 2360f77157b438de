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
    """The native module's list is the one the Python side reads; llama.cpp's own certification
    table (LLAMA_SHARD_CERTIFIED: patch 0011, grown by later patches) in the materialized tree must
    name the same architectures, and shard_boundary.py's table a graph builder for each."""
    from llama_shard import certified_architectures

    tree = REPO / "third_party" / "llama.cpp" / "src"
    if not (tree / "llama.cpp").is_file():
        pytest.skip("no materialized llama.cpp tree")
    table = re.search(r"^static const llm_arch LLAMA_SHARD_CERTIFIED\[\] = \{(.*?)^\};", (tree / "llama.cpp").read_text(),
                      re.M | re.S)
    assert table, "the series no longer has its certification table"
    printed = (tree / "llama-arch.cpp").read_text()
    in_table = sorted(re.search(rf"\{{\s*LLM_ARCH_{n},\s*\"([^\"]+)\"", printed).group(1)
                      for n in re.findall(r"LLM_ARCH_(\w+)", table.group(1)))
    sys.path.insert(0, str(REPO / "third_party"))
    try:
        import shard_boundary
    finally:
        sys.path.pop(0)
    assert in_table == sorted(certified_architectures()) == sorted(shard_boundary.FAMILY_SOURCES)


def test_every_certified_builder_has_the_uniform_boundary_edit():
    """The materialized tree's graph builders: exactly shard_boundary.py's three edits each."""
    import subprocess

    tree = REPO / "third_party" / "llama.cpp"
    if not (tree / "src" / "models").is_dir():
        pytest.skip("no materialized llama.cpp tree")
    res = subprocess.run([sys.executable, str(REPO / "third_party" / "shard_boundary.py"), str(tree), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
