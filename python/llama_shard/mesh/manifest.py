"""A range's file sent tensor by tensor (a mesh's fetch).

The head describes the file `llama-shard extract` would write for a range (`RangeSource.manifest`:
the header's bytes, each tensor's offset, size and SHA-256) and serves each tensor's bytes from its own
model file (`RangeSource.chunks`). A member writes the header, fetches each tensor, checks it
against the manifest before it writes a byte of it (`RangeCache.obtain`), and renames the file into
its cache only once every tensor checked: a tampered or cut fetch leaves nothing behind. A restart
finds the file and checks every tensor again before it is loaded, so it fetches nothing.

Invariants: a file in the cache is byte for byte the range file of the manifest it was checked
against (the same bytes `write_range_file` writes); the head serves only tensors of a manifest it
made, in chunks of at most CHUNK_BYTES.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from ..engine.range_file import RangeLayout, range_layout
from ..errors import LlamaShardError
from ..proto import shard_pb2 as pb

#: the most bytes one FetchChunk carries (well under a gRPC message's default limit)
CHUNK_BYTES = 1 << 20
#: the most tensors a manifest may list, and the most header bytes (a member refuses more)
MAX_TENSORS = 1 << 16
MAX_HEADER_BYTES = 64 << 20


class FetchRefused(LlamaShardError):
    """A fetch that cannot be used: a tensor whose bytes do not match the manifest, a manifest out of
    bounds, a connection that ended early (`transport`: worth trying again). Nothing was cached."""

    def __init__(self, message: str, transport: bool = False):
        super().__init__(message)
        self.transport = transport


class RangeSource:
    """The head's side: manifests of its model's ranges and their tensors' bytes. Thread-safe; each
    manifest is made once (its tensors hashed once) and kept."""

    def __init__(self, model_path: str):
        import gguf

        from ..engine.range_file import content_digest

        self.path = str(model_path)
        self._reader = gguf.GGUFReader(self.path)  # parsed once (a large tokenizer takes seconds)
        self._digest = content_digest(self.path)
        self._lock = threading.Lock()
        self._digests: dict[str, bytes] = {}
        self._layout_lock = threading.RLock()  # one manifest at a time: members asking at once wait for it
        self._manifests: dict[tuple[int, int], pb.RangeManifest] = {}

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one source per head, kept for its life
    def layout(self, first: int, last: int) -> RangeLayout:
        with self._layout_lock:
            return range_layout(self.path, first, last, self._reader, self._digest)

    def _sha256(self, name: str, data) -> bytes:
        with self._lock:
            known = self._digests.get(name)
        if known is None:
            known = hashlib.sha256(memoryview(data).cast("B")).digest()
            with self._lock:
                self._digests[name] = known
        return known

    def manifest(self, first: int, last: int) -> pb.RangeManifest:
        """The range's manifest (made once, by whoever asks first: its layout and every tensor's SHA-256)."""
        with self._layout_lock:
            known = self._manifests.get((first, last))
            if known is None:
                known = self._manifests[(first, last)] = self._make(first, last)
            return known

    def _make(self, first: int, last: int) -> pb.RangeManifest:
        layout = self.layout(first, last)
        return pb.RangeManifest(
            first=first,
            last=last,
            header=layout.header,
            file_bytes=layout.file_bytes,
            tensors=[
                pb.TensorEntry(name=t.name, offset=t.offset, nbytes=t.nbytes, sha256=self._sha256(t.name, t.data))
                for t in layout.tensors
            ],
        )

    def chunks(self, first: int, last: int, name: str, offset: int) -> Iterator[bytes] | None:
        """One tensor's bytes of the range first..last from `offset`, in chunks (None: the range
        holds no such tensor, or the offset is past its end)."""
        tensor = next((t for t in self.layout(first, last).tensors if t.name == name), None)
        if tensor is None or not 0 <= offset <= tensor.nbytes:
            return None
        view = memoryview(tensor.data).cast("B")

        def generate():
            for at in range(offset, tensor.nbytes, CHUNK_BYTES):
                yield bytes(view[at : at + CHUNK_BYTES])

        return generate()


def check_manifest(manifest: pb.RangeManifest, n_layer: int) -> None:
    """A manifest a member will write from (FetchRefused: out of bounds or self-contradicting)."""
    if not 0 <= manifest.first <= manifest.last < n_layer:
        raise FetchRefused(f"the manifest's layers {manifest.first}-{manifest.last} are not within 0-{n_layer - 1}")
    if len(manifest.tensors) > MAX_TENSORS or len(manifest.header) > MAX_HEADER_BYTES:
        raise FetchRefused("the manifest is larger than any model's")
    end = len(manifest.header)
    for t in sorted(manifest.tensors, key=lambda t: t.offset):
        if t.offset < end or len(t.sha256) != 32:
            raise FetchRefused(f"tensor {t.name!r} overlaps another or has no SHA-256")
        end = t.offset + t.nbytes
    if end > manifest.file_bytes:
        raise FetchRefused("the manifest's tensors end past its file")


def _file_name(model_digest: str, first: int, last: int) -> str:
    return f"{re.sub(r'[^0-9A-Za-z]+', '-', model_digest)[:80]}-layers-{first}-{last}.gguf"


class RangeCache:
    """A member's side: range files under `root`, each checked against its manifest. `fetch(name,
    offset)` yields a tensor's bytes (the head's Fetch stream)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.fetched_bytes = 0  # what this cache fetched over the wire (reused files count nothing)

    def path(self, model_digest: str, manifest: pb.RangeManifest) -> Path:
        return self.root / _file_name(model_digest, manifest.first, manifest.last)

    def obtain(
        self,
        model_digest: str,
        manifest: pb.RangeManifest,
        n_layer: int,
        fetch: Callable[[str, int], Iterator[bytes]],
    ) -> Path:
        """The range's file: the cached one if every tensor still matches, else fetched (FetchRefused
        when a tensor does not match: nothing is kept)."""
        check_manifest(manifest, n_layer)
        path = self.path(model_digest, manifest)
        if path.exists() and self._matches(path, manifest):
            return path
        self.root.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".partial-{os.getpid()}")
        try:
            with open(partial, "wb") as f:
                f.write(manifest.header)
                for t in manifest.tensors:
                    f.seek(t.offset)
                    self._fetch_tensor(f, t, fetch)
                f.truncate(manifest.file_bytes)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return path

    def _fetch_tensor(self, f, t: pb.TensorEntry, fetch: Callable[[str, int], Iterator[bytes]]) -> None:
        h, got = hashlib.sha256(), 0
        for chunk in fetch(t.name, 0):
            got += len(chunk)
            if got > t.nbytes:
                raise FetchRefused(f"tensor {t.name!r}: more than its {t.nbytes} bytes came")
            h.update(chunk)
            f.write(chunk)
            self.fetched_bytes += len(chunk)
        if got != t.nbytes:
            raise FetchRefused(f"tensor {t.name!r}: {got} of its {t.nbytes} bytes came")
        if h.digest() != t.sha256:
            raise FetchRefused(f"tensor {t.name!r} does not match the manifest's SHA-256: refused, nothing kept")

    @staticmethod
    def _matches(path: Path, manifest: pb.RangeManifest) -> bool:
        """Whether the file on disk is the manifest's, every tensor checked again."""
        if path.stat().st_size != manifest.file_bytes:
            return False
        with open(path, "rb") as f:
            if f.read(len(manifest.header)) != manifest.header:
                return False
            for t in manifest.tensors:
                f.seek(t.offset)
                h, left = hashlib.sha256(), t.nbytes
                while left:
                    block = f.read(min(left, CHUNK_BYTES))
                    if not block:
                        return False
                    h.update(block)
                    left -= len(block)
                if h.digest() != t.sha256:
                    return False
        return True
