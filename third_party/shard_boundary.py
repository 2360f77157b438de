#!/usr/bin/env python3
"""The shard boundary in a llama.cpp graph builder: one uniform edit, and its checker.

Every certified family's graph builder (src/models/<file>.cpp) takes the same three edits in its
main graph (the one that starts from `build_inp_embd(model.tok_embd)`), and nothing else:

1. output rows:  `inp_out_ids = model.shard_is_tail() ? build_inp_out_ids() : nullptr`
   (only the tail selects output rows; a non-tail shard passes every token's residual on);
2. the layers:   `for (int il = model.shard_il_begin(); il < model.shard_il_end(); ++il)`;
3. the end:      right after the loop's `cur = inpL;`, a non-tail shard returns the residual
   (`build_shard_residual_output`, patch 0004) before the final norm and the LM head.

A family whose graph refuses embeddings as input takes one more edit (FAMILY_EDITS). Otherwise
the input needs no edit: on a non-head shard `model.tok_embd` is null (patch 0002), and
`build_inp_embd(nullptr)` builds the residual input (patch 0004). Dense lead layers, per-layer
attention kinds, shared experts and MTP blocks are all per-layer choices inside the loop, so the
same edit serves them at any cut.

On a new pin: `python third_party/shard_boundary.py --apply TREE` makes the edits in a tree that
has the rest of the series (then export the diff as the patch), and `--check TREE` says whether a
patched tree has exactly these edits for every family in FAMILY_SOURCES. materialize.py's
--check-series runs the check on its scratch tree.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: the certification table's graph builders: architecture name -> src/models/<file>. It must name
#: the architectures of the LLAMA_SHARD_CERTIFIED table in src/llama.cpp (patch 0011).
FAMILY_SOURCES = {
    "llama": "llama.cpp",
    "qwen2": "qwen2.cpp",
    "qwen3": "qwen3.cpp",
    "gemma3": "gemma3.cpp",
    "qwen3moe": "qwen3moe.cpp",
    "gpt-oss": "openai-moe.cpp",
    "deepseek2": "deepseek2.cpp",
    "glm4moe": "glm4-moe.cpp",
    "nemotron_h": "nemotron-h.cpp",
    "qwen35": "qwen35.cpp",
    "qwen35moe": "qwen35moe.cpp",
    "granitehybrid": "granite-hybrid.cpp",
    "llama4": "llama4.cpp",
    "mistral3": "mistral3.cpp",
    "minimax-m2": "minimax-m2.cpp",
}

#: edits one family needs besides the three: (file, upstream text, patched text)
FAMILY_EDITS = [
    # glm4moe refuses embeddings as input unless its rope is multimodal: a non-head shard's input
    # is the residual, passed as embeddings, so the refusal is for the head only
    ("glm4-moe.cpp", "    if (ubatch.embd && !use_mrope) {",
     "    if (ubatch.embd && !use_mrope && model.shard_is_head()) { // [llama-shard] a non-head shard's input is the residual"),
]

MAIN_GRAPH = "inpL = build_inp_embd(model.tok_embd);"
OUT_IDS = "ggml_tensor * inp_out_ids = build_inp_out_ids();"
OUT_IDS_SHARD = ("// [llama-shard] only the tail selects output rows; a non-tail shard outputs every token\n"
                 "    ggml_tensor * inp_out_ids = model.shard_is_tail() ? build_inp_out_ids() : nullptr;")
LOOP = "for (int il = 0; il < n_layer; ++il) {"
LOOP_SHARD = "for (int il = model.shard_il_begin(); il < model.shard_il_end(); ++il) { // [llama-shard] owned layers only"
LOOP_END = "\n    cur = inpL;\n"
RESIDUAL_OUT = ("\n    if (!model.shard_is_tail()) {\n"
                "        // [llama-shard] a non-tail shard stops at the residual: no final norm, no LM head\n"
                "        build_shard_residual_output(cur);\n"
                "        return;\n"
                "    }\n")


class BoundaryError(Exception):
    pass


def apply_boundary(text: str, name: str = "graph") -> str:
    """`text` of a graph builder with the three edits made in its main graph."""
    start = text.find(MAIN_GRAPH)
    if start < 0:
        raise BoundaryError(f"{name}: no main graph ({MAIN_GRAPH!r})")
    head, body = text[:start], text[start:]
    for old, new in ((OUT_IDS, OUT_IDS_SHARD), (LOOP, LOOP_SHARD)):
        if old not in body:
            raise BoundaryError(f"{name}: the main graph has no {old!r}")
        body = body.replace(old, new, 1)
    at = body.find(LOOP_END, body.find(LOOP_SHARD))
    if at < 0:
        raise BoundaryError(f"{name}: no {LOOP_END.strip()!r} after the layer loop")
    at += len(LOOP_END)
    return head + body[:at] + RESIDUAL_OUT + body[at:]


def check_boundary(text: str, name: str = "graph") -> list[str]:
    """What is wrong with a patched builder's main graph (empty: it has exactly the three edits)."""
    start = text.find(MAIN_GRAPH)
    if start < 0:
        return [f"{name}: no main graph"]
    body = text[start:]
    problems = []
    if body.count(LOOP_SHARD) != 1:
        problems.append(f"{name}: the main graph does not loop over the owned layers once")
    if LOOP in body.split(LOOP_SHARD, 1)[0]:
        problems.append(f"{name}: a loop over every layer before the owned-layer loop")
    if "model.shard_is_tail() ? build_inp_out_ids() : nullptr" not in body:
        problems.append(f"{name}: output rows are selected on every shard")
    if "build_shard_residual_output(cur);" not in body:
        problems.append(f"{name}: a non-tail shard does not return its residual")
    return problems


def apply_family_edits(source: str, text: str) -> str:
    for file, before, after in FAMILY_EDITS:
        if file == source and after not in text:
            if text.count(before) != 1:
                raise BoundaryError(f"{source}: {before.strip()!r} is not there once")
            text = text.replace(before, after)
    return text


def check_family_edits(source: str, text: str) -> list[str]:
    return [f"{source}: lacks {after.strip()!r}" for file, _, after in FAMILY_EDITS if file == source and after not in text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", type=Path, help="a llama.cpp tree")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--apply", action="store_true", help="make the edits where a builder lacks them")
    mode.add_argument("--check", action="store_true", help="check every family's builder")
    a = ap.parse_args(argv)
    problems = []
    for arch, source in FAMILY_SOURCES.items():
        path = a.tree / "src" / "models" / source
        text = path.read_text()
        if a.apply and (check_boundary(text, source) or check_family_edits(source, text)):
            try:
                if check_boundary(text, source):
                    text = apply_boundary(text, source)
                path.write_text(apply_family_edits(source, text))
            except BoundaryError as e:
                problems.append(str(e))
                continue
            print(f"edited {source} ({arch})")
        text = path.read_text()
        problems += check_boundary(text, source) + check_family_edits(source, text)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if not problems:
        print(f"boundary OK: {len(FAMILY_SOURCES)} graph builders")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
