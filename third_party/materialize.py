#!/usr/bin/env python3
"""Materialise the pinned llama.cpp source and apply the project's patch series.

Steps (each one idempotent):
  1. find the sdist named in llama-cpp-pin.json (LLAMA_SHARD_SDIST, the cache, or `pip download`);
  2. verify its sha256;
  3. extract only `vendor/llama.cpp` into third_party/llama.cpp (or use LLAMA_SHARD_LLAMA_CPP_DIR);
  4. apply patches/NNNN-*.patch: a patch that applies is applied, one whose reverse applies is
     already there, anything else stops with a message. A stamp keyed by the series hash makes a
     repeated run free; a copy of the applied series lets a changed series be swapped in.

Prints the path of the patched tree on the last line of stdout (CMake reads it).
Only the standard library is used: this runs inside pip's isolated build environment.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PIN = json.loads((HERE / "llama-cpp-pin.json").read_text())
PATCH_DIR = ROOT / "patches"
CACHE_DIR = HERE / ".cache"
DEFAULT_TREE = HERE / "llama.cpp"
STAMP = ".llama-shard-series"
APPLIED_DIR = ".llama-shard-applied"


class MaterializeError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[llama-shard third_party] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# fetch and verify
# ---------------------------------------------------------------------------------------------


def _pip_command() -> list[str]:
    """pip of this interpreter, else the one on PATH (pip's build isolation may hide its own)."""
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "pip"]
    for name in ("pip3", "pip"):
        found = shutil.which(name)
        if found:
            return [found]
    raise MaterializeError(
        "pip is not available to download the pinned llama.cpp sdist; "
        "set LLAMA_SHARD_SDIST or LLAMA_SHARD_LLAMA_CPP_DIR"
    )


def fetch_sdist() -> Path:
    override = os.environ.get("LLAMA_SHARD_SDIST")
    if override:
        path = Path(override)
        if not path.is_file():
            raise MaterializeError(f"LLAMA_SHARD_SDIST={override} is not a file")
        return path
    cached = CACHE_DIR / PIN["sdist"]
    if cached.is_file() and sha256_file(cached) == PIN["sha256"]:
        return cached
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    spec = f"{PIN['package']}=={PIN['version']}"
    log(f"downloading the sdist of {spec} with pip")
    base = _pip_command() + ["download", "--no-deps", "--no-binary", PIN["package"], "-d", str(CACHE_DIR)]
    # --no-build-isolation skips installing build requirements just to read the sdist's metadata
    # when the backend is already importable here; otherwise let pip fetch them (as wheels).
    attempts = []
    try:
        import scikit_build_core  # noqa: F401

        attempts.append(base + ["--no-build-isolation", spec])
    except ImportError:
        pass
    attempts.append(base + [spec])
    for cmd in attempts:
        res = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        if res.returncode == 0 and cached.is_file():
            return cached
    raise MaterializeError(
        f"could not download {spec}; check access to the package index, or set LLAMA_SHARD_SDIST to a downloaded copy"
    )


def verify(sdist: Path) -> None:
    digest = sha256_file(sdist)
    if digest != PIN["sha256"]:
        raise MaterializeError(
            f"sha256 mismatch for {sdist}: got {digest}, the pin says {PIN['sha256']}. "
            "Delete the file (and third_party/.cache) and build again; if the package was "
            "re-published, update third_party/llama-cpp-pin.json only after reviewing the source."
        )


def extract(sdist: Path, dest: Path) -> None:
    prefix = f"{PIN['sdist'][: -len('.tar.gz')]}/{PIN['subdir']}/"
    tmp = Path(tempfile.mkdtemp(prefix="llama-cpp-", dir=dest.parent))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                if not m.name.startswith(prefix):
                    continue
                rel = m.name[len(prefix) :]
                # the sdist carries a submodule `.git` file pointing nowhere: drop it so git
                # commands never mistake the tree for a repository
                if rel in ("", ".git") or rel.startswith(".git/"):
                    continue
                m.name = rel
                members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


# ---------------------------------------------------------------------------------------------
# the patch series
# ---------------------------------------------------------------------------------------------


def series_files(patch_dir: Path = PATCH_DIR) -> list[Path]:
    return sorted(p for p in patch_dir.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def series_hash(patches: list[Path]) -> str:
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _git_apply(tree: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    # outside any repository git apply works like patch(1) but without fuzz; the ceiling keeps
    # git from discovering the project's own repository above the tree
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    return subprocess.run(["git", "apply", *flags, str(patch)], cwd=tree, env=env, capture_output=True, text=True)


def apply_series(tree: Path, patches: list[Path]) -> None:
    want = series_hash(patches)
    stamp = tree / STAMP
    if stamp.is_file() and stamp.read_text().strip() == want:
        return
    applied_dir = tree / APPLIED_DIR
    if stamp.is_file() and applied_dir.is_dir():
        # a different series was applied before: take it out first
        old = series_files(applied_dir)
        for p in reversed(old):
            res = _git_apply(tree, p, "--reverse")
            if res.returncode != 0:
                raise MaterializeError(
                    f"could not reverse the previously applied {p.name}:\n{res.stderr}Delete {tree} and build again."
                )
        log(f"reversed the previous series ({len(old)} patches)")
    stamp.unlink(missing_ok=True)
    for p in patches:
        if _git_apply(tree, p, "--check").returncode == 0:
            res = _git_apply(tree, p)
            if res.returncode != 0:
                raise MaterializeError(f"{p.name} failed to apply:\n{res.stderr}")
            log(f"applied {p.name}")
        elif _git_apply(tree, p, "--reverse", "--check").returncode == 0:
            log(f"{p.name} is already applied")
        else:
            detail = _git_apply(tree, p, "--check").stderr
            raise MaterializeError(
                f"{p.name} does not apply to {tree}:\n{detail}"
                "The tree is not the pristine pin (or was edited). Delete it (or unset "
                "LLAMA_SHARD_LLAMA_CPP_DIR) and build again; on a new pin, regenerate the series as "
                "patches/README.md describes."
            )
    if applied_dir.exists():
        shutil.rmtree(applied_dir)
    applied_dir.mkdir()
    for p in patches:
        shutil.copy2(p, applied_dir / p.name)
    stamp.write_text(want + "\n")


def materialize() -> Path:
    patches = series_files()
    override = os.environ.get("LLAMA_SHARD_LLAMA_CPP_DIR")
    if override:
        tree = Path(override).resolve()
        if not (tree / "include" / "llama.h").is_file():
            raise MaterializeError(f"LLAMA_SHARD_LLAMA_CPP_DIR={override} is not a llama.cpp tree")
    else:
        tree = DEFAULT_TREE
        if not (tree / "include" / "llama.h").is_file():
            sdist = fetch_sdist()
            verify(sdist)
            log(f"extracting {PIN['subdir']} (upstream {PIN['upstream_commit']})")
            extract(sdist, tree)
    apply_series(tree, patches)
    return tree


def check_series() -> None:
    """Apply the series to a scratch pristine copy, reverse it, and compare with the pristine files."""
    sdist = fetch_sdist()
    verify(sdist)
    patches = series_files()
    with tempfile.TemporaryDirectory(prefix="llama-shard-series-") as tmp:
        tree = Path(tmp) / "llama.cpp"
        tree.parent.mkdir(exist_ok=True)
        extract(sdist, tree)
        before = {p: sha256_file(p) for p in tree.rglob("*") if p.is_file()}
        for p in patches:
            res = _git_apply(tree, p, "--check")
            if res.returncode != 0:
                raise MaterializeError(f"{p.name} does not apply to the pristine pin:\n{res.stderr}")
            _git_apply(tree, p)
        # every certified family's graph builder has exactly the uniform boundary edit
        import shard_boundary

        problems = []
        for source in shard_boundary.FAMILY_SOURCES.values():
            text = (tree / "src" / "models" / source).read_text()
            problems += shard_boundary.check_boundary(text, source) + shard_boundary.check_family_edits(source, text)
        if problems:
            raise MaterializeError("the shard boundary edit is incomplete:\n" + "\n".join(problems))
        for p in reversed(patches):
            res = _git_apply(tree, p, "--reverse")
            if res.returncode != 0:
                raise MaterializeError(f"{p.name} does not reverse cleanly:\n{res.stderr}")
        after = {p: sha256_file(p) for p in tree.rglob("*") if p.is_file()}
        if before != after:
            changed = sorted(
                str(p.relative_to(tree)) for p in set(before) | set(after) if before.get(p) != after.get(p)
            )
            raise MaterializeError(f"apply + reverse did not restore the pristine tree: {changed[:10]}")
    print(f"series OK: {len(patches)} patches apply to the pristine pin and reverse cleanly")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check-series", action="store_true", help="apply and reverse the series on a scratch pristine copy"
    )
    args = ap.parse_args(argv)
    try:
        if args.check_series:
            check_series()
        else:
            print(materialize())
    except MaterializeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
