"""A grammar's checks, each bound stated once: its size (`MAX_GRAMMAR_BYTES`, the native check's
own constant), then llama.cpp's parser over the model's vocabulary. The parser's verdict is kept per
model (weakly: a model that is gone takes its verdicts with it), so the endpoint's check on its pool,
the head loop's and each tail's find it made once."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from .._native import MAX_GRAMMAR_BYTES, SamplingParams, grammar_problem
from ..errors import InvalidInputError

#: verdicts kept per model, the most recent
VERDICTS_KEPT = 256

_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> OrderedDict[grammar, why or None]
_lock = threading.Lock()


def check_grammar_size(grammar: str) -> None:
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidInputError(f"grammar: at most {MAX_GRAMMAR_BYTES} bytes", param="grammar")


def check_grammar(params: SamplingParams, model) -> None:
    """llama.cpp's parser on the params' grammar over `model`'s vocabulary (a ShardModel), once a
    stream or a session's params are new: InvalidInputError naming `grammar` if it refuses it."""
    if not params.grammar:
        return
    check_grammar_size(params.grammar)
    with _lock:
        kept = _verdicts.get(model)
        found = kept is not None and params.grammar in kept
        why = kept[params.grammar] if found else None
    if not found:
        why = grammar_problem(model, params.grammar)
        with _lock:
            kept = _verdicts.setdefault(model, OrderedDict())
            kept[params.grammar] = why
            while len(kept) > VERDICTS_KEPT:
                kept.popitem(last=False)
    if why is not None:
        raise InvalidInputError(f"grammar: {why}", param="grammar")
