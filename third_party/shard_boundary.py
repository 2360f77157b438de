#!/usr/bin/env python3
"""The shard boundary in a llama.cpp graph builder: one uniform edit, and its checker.

Every certified family's graph builder (src/models/<file>.cpp) takes the same three edits in its
main graph (the one that starts from `build_inp_embd(model.tok_embd)`), and nothing else:

1. output rows:  `inp_out_ids = model.shard_is_tail() ? build_inp_out_ids() : nullptr`
   (only the tail selects output rows; a non-tail shard passes every token's residual on);
2. the layers:   `for (int il = model.shard_il_begin(); il < model.shard_il_end(); ++il)`;
3. the end:      right after the loop's `cur = inpL;`, a non-tail shard returns the residual
   (`build_shard_residual_output`, patch 0004) before the final norm and the LM head; where the
   loop is followed directly by code reading `inpL` (phi3), right after the loop, returning `inpL`.

The builder must carry the residual in `inpL` (the loop ends with `inpL = cur;`) and use the
embeddings (or the token ids) for nothing but the loop: a builder that computes something else
from them before the loop (gemma's unconditional scale, per-layer inputs, learned positions, an
embedding norm) is refused, since a non-head shard's input is the residual, not the embeddings.
PRE_LOOP_FAMILY_OK names the one exception, gemma4's per-layer inputs, which a load-time refusal
backs (a range on a file that has them is refused).

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
import re
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
    "phi3": "phi3.cpp",
    "qwen3next": "qwen3next.cpp",
    "nemotron_h_moe": "nemotron-h.cpp",  # nemotron_h's main graph (llama_model_nemotron_h_moe::graph)
    "gemma4": "gemma4.cpp",
}

#: edits one family needs besides the three: (file, upstream text, patched text)
FAMILY_EDITS = [
    # glm4moe refuses embeddings as input unless its rope is multimodal: a non-head shard's input
    # is the residual, passed as embeddings, so the refusal is for the head only
    (
        "glm4-moe.cpp",
        "    if (ubatch.embd && !use_mrope) {",
        "    if (ubatch.embd && !use_mrope && model.shard_is_head()) { // [llama-shard] a non-head shard's input is the residual",
    ),
]

MAIN_GRAPH = "inpL = build_inp_embd(model.tok_embd);"
OUT_IDS = "ggml_tensor * inp_out_ids = build_inp_out_ids();"
OUT_IDS_SHARD = (
    "// [llama-shard] only the tail selects output rows; a non-tail shard outputs every token\n"
    "    ggml_tensor * inp_out_ids = model.shard_is_tail() ? build_inp_out_ids() : nullptr;"
)
LOOP = "for (int il = 0; il < n_layer; ++il) {"
LOOP_SHARD = (
    "for (int il = model.shard_il_begin(); il < model.shard_il_end(); ++il) { // [llama-shard] owned layers only"
)
LOOP_END = "\n    cur = inpL;\n"
RESIDUAL_OUT = (
    "\n    if (!model.shard_is_tail()) {\n"
    "        // [llama-shard] a non-tail shard stops at the residual: no final norm, no LM head\n"
    "        build_shard_residual_output(cur);\n"
    "        return;\n"
    "    }\n"
)


class BoundaryError(Exception):
    pass


#: the residual stream: the variable the main graph's embeddings go into, which every layer reads
#: at its start and the loop's last statement writes (`inpL = cur;`)
STREAM = "inpL"
CARRY = f"{STREAM} = cur;"
#: what a builder may do with the embeddings between MAIN_GRAPH and the layer loop: anything else
#: (gemma3n/gemma4's per-layer inputs, gemma3n's altup streams) is computed from the embeddings for
#: use inside the loop, and a non-head shard, whose input is the residual, does not have them
PRE_LOOP_OK = (
    re.compile(r"inpL = ggml_scale\(ctx0, inpL, ubatch\.token \? [^:]+ : 1\.0f\);"),  # gemma3: x1 on the residual
    re.compile(r"cb\(inpL, \"[^\"]*\", -1\);"),
    re.compile(r"ggml_build_forward_expand\(gf, inpL\);"),
)


#: what else before the loop reads the tokens rather than the residual (a non-head shard has none)
TOKEN_INPUT = re.compile(r"build_inp_per_layer\(|ubatch\.token|inp->tokens")

#: a builder's own pre-loop use of the embeddings or tokens that the loader makes safe: gemma4's
#: per-layer inputs exist only in files with `embedding_length_per_layer_input` > 0, and a range on
#: such a file is refused at load (patch 0014 in llama.cpp, and the native header check), so on a
#: shard the branch is never taken
PRE_LOOP_FAMILY_OK = {
    "gemma4.cpp": (
        "inp_per_layer = build_inp_per_layer();",
        "inp_per_layer = project_per_layer_inputs(inpL, inp_per_layer);",
    ),
}


def _residual_out(var: str) -> str:
    return RESIDUAL_OUT.replace("build_shard_residual_output(cur);", f"build_shard_residual_output({var});")


def _close_brace(text: str, at: int) -> int:
    """Index of the `}` closing the first `{` at or after `at` (C++ comments and literals skipped)."""
    i, depth = text.index("{", at), 0
    while i < len(text):
        c = text[i]
        if text.startswith("//", i):
            i = text.find("\n", i)
            continue
        if text.startswith("/*", i):
            i = text.index("*/", i) + 2
            continue
        if c in "\"'":
            j = i + 1
            while text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise BoundaryError("unbalanced braces")


def _next_line(text: str, at: int) -> int:
    """The start of the line after the one holding `at`."""
    return text.index("\n", at) + 1


def _statements(chunk: str) -> list[str]:
    """The non-blank, non-comment lines of `chunk`, stripped."""
    return [line.strip() for line in chunk.splitlines() if line.strip() and not line.strip().startswith("//")]


def _boundary_site(body: str, name: str) -> tuple[int, str]:
    """Where a non-tail shard's return goes in `body` (the main graph, loop already edited) and the
    variable it returns. Either right after the loop's `cur = inpL;` (llama and most families:
    returns `cur`), or, where the loop is followed directly by code reading the stream (phi3, phi2,
    gpt2, starcoder, ...: `cur = build_norm(inpL, ...`), right after the loop's closing brace
    (returns `inpL`). Both need the loop to carry the stream in `inpL`."""
    loop = body.find(LOOP_SHARD)
    close = _close_brace(body, loop)
    inside = _statements(body[body.index("{", loop) + 1 : close])
    if not inside or inside[-1] != CARRY:
        raise BoundaryError(f"{name}: the layer loop does not end with {CARRY!r}")
    after = _next_line(body, close)
    m = re.compile(r"\n*" + re.escape(LOOP_END.lstrip("\n"))).match(body, after)
    if m:  # (nemotron_h has a blank line before it)
        return m.end(), "cur"
    nxt = _statements(body[after:])
    if not nxt or not re.search(rf"\b{STREAM}\b", nxt[0]) or nxt[0].startswith(f"{STREAM} ="):
        raise BoundaryError(f"{name}: neither {LOOP_END.strip()!r} nor a read of {STREAM} right after the layer loop")
    return after, STREAM


def _pre_loop_problems(body: str, name: str) -> list[str]:
    loop = body.find(LOOP_SHARD) if LOOP_SHARD in body else body.find(LOOP)
    if loop < 0:
        return [f"{name}: the main graph has no {LOOP!r}"]
    return [
        f"{name}: the embeddings feed more than the layer loop ({s!r}): a non-head shard would lack it"
        for s in _statements(body[len(MAIN_GRAPH) : loop])
        if (re.search(rf"\b{STREAM}\b", s) or TOKEN_INPUT.search(s))
        and not any(p.fullmatch(s) for p in PRE_LOOP_OK)
        and s not in PRE_LOOP_FAMILY_OK.get(name, ())
    ]


def apply_boundary(text: str, name: str = "graph") -> str:
    """`text` of a graph builder with the three edits made in its main graph."""
    start = text.find(MAIN_GRAPH)
    if start < 0:
        raise BoundaryError(f"{name}: no main graph ({MAIN_GRAPH!r})")
    head, body = text[:start], text[start:]
    if problems := _pre_loop_problems(body, name):
        raise BoundaryError(problems[0])
    for old, new in ((OUT_IDS, OUT_IDS_SHARD), (LOOP, LOOP_SHARD)):
        if old not in body:
            raise BoundaryError(f"{name}: the main graph has no {old!r}")
        body = body.replace(old, new, 1)
    at, var = _boundary_site(body, name)
    out = _residual_out(var) if var == "cur" else _residual_out(var) + "\n"
    return head + body[:at] + out + body[at:]


def check_boundary(text: str, name: str = "graph") -> list[str]:
    """What is wrong with a patched builder's main graph (empty: it has exactly the three edits)."""
    start = text.find(MAIN_GRAPH)
    if start < 0:
        return [f"{name}: no main graph"]
    body = text[start:]
    problems = _pre_loop_problems(body, name)
    if body.count(LOOP_SHARD) != 1:
        return problems + [f"{name}: the main graph does not loop over the owned layers once"]
    if LOOP in body.split(LOOP_SHARD, 1)[0]:
        problems.append(f"{name}: a loop over every layer before the owned-layer loop")
    if "model.shard_is_tail() ? build_inp_out_ids() : nullptr" not in body:
        problems.append(f"{name}: output rows are selected on every shard")
    # the return must sit exactly where apply_boundary puts it, returning the stream
    close = _close_brace(body, body.find(LOOP_SHARD))
    tail = body[_next_line(body, close) :].lstrip("\n")
    if not (
        tail.startswith(LOOP_END.lstrip("\n") + _residual_out("cur"))
        or tail.startswith(_residual_out(STREAM).lstrip("\n"))
    ):
        problems.append(f"{name}: a non-tail shard does not return its residual right after the layer loop")
    return problems


def apply_family_edits(source: str, text: str) -> str:
    for file, before, after in FAMILY_EDITS:
        if file == source and after not in text:
            if text.count(before) != 1:
                raise BoundaryError(f"{source}: {before.strip()!r} is not there once")
            text = text.replace(before, after)
    return text


def check_family_edits(source: str, text: str) -> list[str]:
    return [
        f"{source}: lacks {after.strip()!r}" for file, _, after in FAMILY_EDITS if file == source and after not in text
    ]


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
