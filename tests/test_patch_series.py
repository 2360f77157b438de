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
    res = subprocess.run(
        [sys.executable, str(REPO / "third_party" / "materialize.py"), "--check-series"],
        capture_output=True,
        text=True,
        timeout=600,
    )
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
    table = re.search(
        r"^static const llm_arch LLAMA_SHARD_CERTIFIED\[\] = \{(.*?)^\};", (tree / "llama.cpp").read_text(), re.M | re.S
    )
    assert table, "the series no longer has its certification table"
    printed = (tree / "llama-arch.cpp").read_text()
    in_table = sorted(
        re.search(rf"\{{\s*LLM_ARCH_{n},\s*\"([^\"]+)\"", printed).group(1)
        for n in re.findall(r"LLM_ARCH_(\w+)", table.group(1))
    )
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
    res = subprocess.run(
        [sys.executable, str(REPO / "third_party" / "shard_boundary.py"), str(tree), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("builder", ["gemma.cpp", "gpt2.cpp", "bloom.cpp", "gemma4.cpp"])
def test_the_boundary_edit_refuses_a_builder_that_uses_the_embeddings_before_the_loop(builder):
    """An unconditional scale (gemma), learned positions (gpt2), an embedding norm (bloom) or
    per-layer inputs (gemma4's, allowed in gemma4.cpp only, where the loader refuses a range on
    files that have them) are computed from the token embedding, which a non-head shard does not
    have: the edit would apply textually and be silently wrong, so it is refused."""
    shard_boundary = _shard_boundary()
    source = REPO / "third_party" / "llama.cpp" / "src" / "models" / builder
    if not source.is_file():
        pytest.skip("no materialized llama.cpp tree")
    with pytest.raises(shard_boundary.BoundaryError, match="embeddings feed more than the layer loop"):
        shard_boundary.apply_boundary(
            source.read_text().replace(shard_boundary.LOOP_SHARD, shard_boundary.LOOP), "another-" + builder
        )


def test_the_boundary_check_wants_the_residual_returned_where_the_loop_leaves_it():
    """phi3's loop leaves the residual in `inpL` (no `cur = inpL;`): its return must be `inpL`,
    right after the loop; the checker flags the same return moved or naming `cur`."""
    shard_boundary = _shard_boundary()
    source = REPO / "third_party" / "llama.cpp" / "src" / "models" / "phi3.cpp"
    if not source.is_file():
        pytest.skip("no materialized llama.cpp tree")
    patched = source.read_text()
    assert shard_boundary.check_boundary(patched, "phi3.cpp") == []
    assert shard_boundary.check_boundary(
        patched.replace("build_shard_residual_output(inpL);", "build_shard_residual_output(cur);"), "phi3.cpp"
    )
    block = patched[
        patched.index("\n    if (!model.shard_is_tail()) {") : patched.index("return;\n    }\n")
        + len("return;\n    }\n")
    ]
    end = "    ggml_build_forward_expand(gf, cur);\n}"
    moved = patched.replace(block, "", 1).replace(end, block.lstrip("\n") + end, 1)  # after the LM head
    assert moved.count("build_shard_residual_output(inpL);") == 1
    assert shard_boundary.check_boundary(moved, "phi3.cpp")


def _shard_boundary():
    sys.path.insert(0, str(REPO / "third_party"))
    try:
        import shard_boundary
    finally:
        sys.path.pop(0)
    return shard_boundary
