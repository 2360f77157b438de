"""A layer range of a GGUF file as a file of its own (`llama-shard extract`): what a worker of that range
loads and nothing else, so a node that serves a tenth of a model stores a tenth of it.

The file keeps every metadata key of the source (the architecture's `block_count` included: a worker
loads it with the same `--layers` as the whole file) and adds where it came from:
`llama_shard.range.first` / `.last` and `llama_shard.source.digest` (the source's size and
XXH3-128, as `model_digest` names a file). It holds the range's layers' tensors and, of the rest,
what the range uses: the token embeddings on the head's range, the output norm and head on the
tail's (the embeddings again where the head is tied to them), and every other tensor outside the
layers (rope factors and the like). The tensors are copied byte for byte, in their own types.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

from .._native import model_digest
from ..errors import InvalidInputError, ModelLoadError

RANGE_FIRST = "llama_shard.range.first"
RANGE_LAST = "llama_shard.range.last"
SOURCE_DIGEST = "llama_shard.source.digest"

#: tensors only the head's range uses, and only the tail's
_HEAD_ONLY = ("token_embd.",)
_TAIL_ONLY = ("output.", "output_norm.")


def range_tensor_names(names: list[str], n_layer: int, first: int, last: int) -> list[str]:
    """Which of a file's tensors a range of layers first..last holds (see the module's docstring)."""
    head, tail = first == 0, last == n_layer - 1
    tied = not any(n.startswith("output.") for n in names)
    keep = []
    for name in names:
        if name.startswith("blk."):
            if first <= int(name.split(".")[1]) <= last:
                keep.append(name)
        elif name.startswith(_HEAD_ONLY):
            if head or (tail and tied):
                keep.append(name)
        elif name.startswith(_TAIL_ONLY):
            if tail:
                keep.append(name)
        else:
            keep.append(name)
    return keep


@dataclasses.dataclass(frozen=True)
class RangeTensor:
    name: str
    offset: int  # in the range's file
    data: object  # the source's bytes (a numpy view of its memory map)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclasses.dataclass(frozen=True)
class RangeLayout:
    """The file `write_range_file` writes for a range, before it is written: its header (metadata
    and tensor infos, padded to where the data starts), each tensor's place, the file's size."""

    first: int
    last: int
    header: bytes
    tensors: tuple[RangeTensor, ...]
    file_bytes: int


def range_layout(source: str | Path, first: int, last: int, reader=None, digest: str | None = None) -> RangeLayout:
    """Where each byte of the range's file comes from (InvalidInputError: a range outside the model).
    `reader` (a gguf.GGUFReader of `source`) and `digest` (its model_digest): what a caller that lays
    out many ranges read once."""
    import tempfile

    import gguf

    from .models import gguf_shape

    source = Path(source)
    shape = gguf_shape(source)
    if not 0 <= first <= last < shape.n_layer:
        raise InvalidInputError(f"layers {first}-{last} are not within 0-{shape.n_layer - 1} of {source.name}")
    try:
        reader = reader or gguf.GGUFReader(str(source))
        arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "header.gguf"
            writer = gguf.GGUFWriter(str(out), arch, endianess=reader.endianess)
            for field in reader.fields.values():
                if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith(("GGUF.", "llama_shard.")):
                    continue
                kind = field.types[0]
                sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
                if field.name == gguf.Keys.General.ALIGNMENT:  # the data's alignment is the file's own
                    writer.data_alignment = int(field.contents())
            writer.add_uint32(RANGE_FIRST, first)
            writer.add_uint32(RANGE_LAST, last)
            writer.add_string(SOURCE_DIGEST, digest or content_digest(source))
            keep = set(range_tensor_names([t.name for t in reader.tensors], shape.n_layer, first, last))
            kept = [t for t in reader.tensors if t.name in keep]
            for t in kept:
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            writer.close()
            header = out.read_bytes()
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"cannot lay out layers {first}-{last} of {source}: {e}") from e
    align = writer.data_alignment
    pad = lambda n: (n + align - 1) // align * align  # noqa: E731
    header += bytes(pad(len(header)) - len(header))
    offset, tensors = len(header), []
    for t in kept:
        tensors.append(RangeTensor(t.name, offset, t.data))
        offset += pad(int(t.data.nbytes))
    return RangeLayout(first, last, header, tuple(tensors), offset)


def write_range_file(source: str | Path, first: int, last: int, out: str | Path) -> Path:
    """Writes layers first..last of `source` (and what they use) to `out`; returns `out`."""
    source, out = Path(source), Path(out)
    if out.exists() and out.resolve() == source.resolve():
        raise InvalidInputError("the range's file must not be its source")
    layout = range_layout(source, first, last)
    try:
        with open(out, "wb") as f:
            f.write(layout.header)
            for t in layout.tensors:
                f.seek(t.offset)
                f.write(memoryview(t.data).cast("B"))
            f.truncate(layout.file_bytes)
    except OSError as e:
        out.unlink(missing_ok=True)
        raise ModelLoadError(f"cannot write layers {first}-{last} of {source} to {out}: {e}") from e
    return out


def content_digest(path: str | Path) -> str:
    """What a model file holds, as replicas and hand-overs compare it: a range file names its
    source's digest (its tensors are the source's bytes; the file is its operator's, or was checked
    tensor by tensor when a mesh's member fetched it), any other file its own size and XXH3-128.
    Read once per version of the file."""
    st = os.stat(path)
    return _content_digest(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    import gguf

    try:
        field = gguf.GGUFReader(path).get_field(SOURCE_DIGEST)
    except (OSError, ValueError, KeyError):
        field = None
    return str(field.contents()) if field is not None else model_digest(path)


def range_of(path: str | Path) -> tuple[int, int] | None:
    """The layer range a file written by `write_range_file` holds (None: a whole model's file)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    first, last = reader.get_field(RANGE_FIRST), reader.get_field(RANGE_LAST)
    return (int(first.contents()), int(last.contents())) if first is not None and last is not None else None
