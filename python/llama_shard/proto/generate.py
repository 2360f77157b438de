"""Regenerates shard_pb2.py and shard_pb2_grpc.py from shard.proto (the source of truth).

    python -m llama_shard.proto.generate [--out DIR]

Without --out the files beside shard.proto are rewritten; tests generate into a scratch folder and
require the committed files to be identical.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent.parent  # the folder that holds llama_shard/
GENERATED = ("shard_pb2.py", "shard_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PACKAGE_ROOT}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(HERE.relative_to(PACKAGE_ROOT) / "shard.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            src = Path(tmp) / "llama_shard" / "proto" / name
            dst = out_dir / name
            shutil.copyfile(src, dst)
            written.append(dst)
        return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    for p in generate(args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
