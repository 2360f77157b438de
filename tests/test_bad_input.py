"""Bad input gets a clear exception and changes nothing; it never aborts the process.

Every case runs in a fresh interpreter (an abort in native code would show as a signal exit, not
as a pytest crash) and checks afterwards that the context still holds exactly what it held and
still computes the same bits.
"""

from __future__ import annotations

import pytest

from conftest import run_isolated

SETUP = """
import numpy as np
import llama_shard as ls
from llama_shard import errors
path = {path!r}
head = ls.ShardModel(path, (0, 2), 2)
tail = ls.ShardModel(path, (3, 5), 2)
hc = ls.ShardContext(head, n_ctx=256, n_seq_max=2, n_batch=16)
tc = ls.ShardContext(tail, n_ctx=256, n_seq_max=2, n_batch=16)
n_embd = head.info.n_embd
h0 = hc.forward(0, 0, tokens=[3, 9, 27, 81])
l0 = tc.forward(0, 0, hidden=h0)
def state():
    return (hc.seq_pos_max(0), hc.seq_pos_max(1), hc.n_cells_used, tc.seq_pos_max(0), tc.seq_pos_max(1), tc.n_cells_used)
before = state()
"""

CHECK = """
try:
    {stmt}
except errors.{exc} as e:
    assert isinstance(e, errors.LlamaShardError)
    assert str(e), "the message must say what was wrong"
    print("RAISED", type(e).__name__, "|", e)
else:
    raise SystemExit("no exception")
assert state() == before, (state(), before)
# the sequences still compute the same bits as before
hc.seq_rm(0, 0); tc.seq_rm(0, 0)
h1 = hc.forward(0, 0, tokens=[3, 9, 27, 81])
assert h1.tobytes() == h0.tobytes()
assert tc.forward(0, 0, hidden=h1).tobytes() == l0.tobytes()
print("STATE OK")
"""

CONTEXT_CASES = {
    "token out of vocabulary": ("hc.forward(0, 4, tokens=[1, head.info.n_vocab])", "InvalidInputError"),
    "negative token": ("hc.forward(0, 4, tokens=[-1])", "InvalidInputError"),
    "token beyond int32": ("hc.forward(0, 4, tokens=[2**40])", "InvalidInputError"),
    "float tokens": ("hc.forward(0, 4, tokens=[1.5])", "InvalidInputError"),
    "2-D tokens": ("hc.forward(0, 4, tokens=[[1, 2]])", "InvalidInputError"),
    "empty tokens": ("hc.forward(0, 4, tokens=[])", "InvalidInputError"),
    "neither tokens nor hidden": ("hc.forward(0, 4)", "InvalidInputError"),
    "both tokens and hidden": (
        "hc.forward(0, 4, tokens=[1], hidden=np.zeros((1, n_embd), np.float32))",
        "InvalidInputError",
    ),
    "tokens to a non-head shard": ("tc.forward(0, 4, tokens=[1, 2])", "InvalidInputError"),
    "hidden to the head": ("hc.forward(0, 4, hidden=np.zeros((1, n_embd), np.float32))", "InvalidInputError"),
    "hidden of the wrong width": (
        "tc.forward(0, 4, hidden=np.zeros((2, n_embd - 1), np.float32))",
        "InvalidInputError",
    ),
    "hidden 1-D": ("tc.forward(0, 4, hidden=np.zeros(n_embd, np.float32))", "InvalidInputError"),
    "hidden 3-D": ("tc.forward(0, 4, hidden=np.zeros((1, 1, n_embd), np.float32))", "InvalidInputError"),
    "hidden float64": ("tc.forward(0, 4, hidden=np.zeros((2, n_embd), np.float64))", "InvalidInputError"),
    "hidden float16": ("tc.forward(0, 4, hidden=np.zeros((2, n_embd), np.float16))", "InvalidInputError"),
    "hidden non-contiguous": ("tc.forward(0, 4, hidden=np.zeros((4, n_embd), np.float32)[::2])", "InvalidInputError"),
    "hidden Fortran order": (
        "tc.forward(0, 4, hidden=np.asfortranarray(np.zeros((3, n_embd), np.float32)))",
        "InvalidInputError",
    ),
    "hidden as a list": ("tc.forward(0, 4, hidden=[[0.0] * n_embd])", "InvalidInputError"),
    "hidden with NaN": ("tc.forward(0, 4, hidden=np.full((1, n_embd), np.nan, np.float32))", "InvalidInputError"),
    "hidden with no rows": ("tc.forward(0, 4, hidden=np.zeros((0, n_embd), np.float32))", "InvalidInputError"),
    "batch longer than n_batch": ("hc.forward(0, 4, tokens=[1] * 17)", "InvalidInputError"),
    "hidden batch longer than n_batch": (
        "tc.forward(0, 4, hidden=np.zeros((17, n_embd), np.float32))",
        "InvalidInputError",
    ),
    "position gap": ("hc.forward(0, 6, tokens=[1])", "InvalidInputError"),
    "position overlapping the cache": ("hc.forward(0, 2, tokens=[1])", "InvalidInputError"),
    "negative position": ("hc.forward(1, -1, tokens=[1])", "InvalidInputError"),
    "seq id out of range": ("hc.forward(2, 0, tokens=[1])", "InvalidInputError"),
    "negative seq id": ("hc.forward(-1, 0, tokens=[1])", "InvalidInputError"),
    "seq_rm seq id out of range": ("hc.seq_rm(7, 0)", "InvalidInputError"),
    "seq_rm negative p0": ("hc.seq_rm(0, -3)", "InvalidInputError"),
    "context fills up": ("[hc.forward(1, 16 * i, tokens=[5] * 16) for i in range(64)]", "CapacityError"),
}


@pytest.mark.parametrize("case", sorted(CONTEXT_CASES), ids=lambda c: c.replace(" ", "-"))
def test_bad_forward_input_raises_and_changes_nothing(synthetic_model, case):
    stmt, exc = CONTEXT_CASES[case]
    if case == "context fills up":
        # the refused call changes nothing, but the calls before it did fill sequence 1: clear it
        stmt = f"{stmt}\nexcept errors.CapacityError:\n    hc.seq_rm(1, 0)\n    raise"
        stmt = "try:\n        " + stmt.replace("\n", "\n    ")
    res = run_isolated(SETUP.format(path=str(synthetic_model)) + CHECK.format(stmt=stmt, exc=exc))
    assert res.returncode == 0, f"exit {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr[-2000:]}"
    assert f"RAISED {exc}" in res.stdout and "STATE OK" in res.stdout


LOAD_SETUP = """
import shutil
import llama_shard as ls
from llama_shard import errors
from llama_shard.testing.synthetic import SyntheticSpec, write_synthetic_gguf
path, scratch = {path!r}, {scratch!r}
data = open(path, 'rb').read()
"""

LOAD_CASES = {
    "missing file": ("ls.ShardModel(scratch + '/nope.gguf')", "ModelLoadError"),
    "a directory": ("ls.ShardModel(scratch)", "ModelLoadError"),
    "truncated header": (
        "open(scratch + '/t.gguf', 'wb').write(data[:48]); ls.ShardModel(scratch + '/t.gguf')",
        "ModelLoadError",
    ),
    "truncated data": (
        "open(scratch + '/t.gguf', 'wb').write(data[:len(data) // 2]); ls.ShardModel(scratch + '/t.gguf', (0, 1))",
        "ModelLoadError",
    ),
    "corrupt bytes": (
        "open(scratch + '/c.gguf', 'wb').write(bytes(range(256)) * 64); ls.ShardModel(scratch + '/c.gguf')",
        "ModelLoadError",
    ),
    "empty file": ("open(scratch + '/e.gguf', 'wb').close(); ls.ShardModel(scratch + '/e.gguf')", "ModelLoadError"),
    "range past the last layer": ("ls.ShardModel(path, (0, 6))", "InvalidInputError"),
    "reversed range": ("ls.ShardModel(path, (4, 2))", "InvalidInputError"),
    "negative range": ("ls.ShardModel(path, (-1, 2))", "InvalidInputError"),
    "negative threads": ("ls.ShardModel(path, None, -2)", "InvalidInputError"),
    "unsupported architecture with a range": (
        "write_synthetic_gguf(scratch + '/g.gguf', SyntheticSpec(n_layer=2, architecture='gpt2')); ls.ShardModel(scratch + '/g.gguf', (0, 0))",
        "UncertifiedArchitectureError",
    ),
    "context bigger batch than cells": (
        "ls.ShardContext(ls.ShardModel(path), n_ctx=16, n_batch=64)",
        "InvalidInputError",
    ),
    "context with no sequences": ("ls.ShardContext(ls.ShardModel(path), n_seq_max=0)", "InvalidInputError"),
    "context with too many sequences": ("ls.ShardContext(ls.ShardModel(path), n_seq_max=1000)", "InvalidInputError"),
    "tokenize without a tokenizer": ("ls.ShardModel(path).tokenize('hello')", "InvalidInputError"),
    "detokenize out of vocabulary": ("ls.ShardModel(path).detokenize([10**6])", "InvalidInputError"),
}


@pytest.mark.parametrize("case", sorted(LOAD_CASES), ids=lambda c: c.replace(" ", "-"))
def test_bad_model_or_context_raises_cleanly(synthetic_model, tmp_path, case):
    stmt, exc = LOAD_CASES[case]
    code = (
        LOAD_SETUP.format(path=str(synthetic_model), scratch=str(tmp_path))
        + f"""
try:
    {stmt}
except errors.{exc} as e:
    print("RAISED", type(e).__name__, "|", e)
else:
    raise SystemExit("no exception")
"""
    )
    res = run_isolated(code)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr[-2000:]}"
    assert f"RAISED {exc}" in res.stdout


def test_more_sequences_than_n_batch_does_not_abort(synthetic_model):
    """llama.cpp asserts when n_seq_max outputs exceed n_outputs_max (n_batch by default)."""
    res = run_isolated(f"""
import llama_shard as ls
m = ls.ShardModel({str(synthetic_model)!r}, (0, 2), 1)
c = ls.ShardContext(m, n_ctx=512, n_seq_max=40, n_batch=4)
for s in range(40):
    assert c.forward(s, 0, tokens=[s + 1]).shape == (1, 64)
mgr = ls.HotKvStateManager(m, ls.HotKvStateConfig(max_sessions=64, context_tokens=8, budget_tokens=512), ls.ManualClock(), n_batch=2)
ad = ls.KvBoundaryAdapter(m, mgr)
for s in range(64):
    ad.prefill(f"s{{s}}", 0, token_ids=[1, 2])
mgr.check_invariants()
print("OK")
""")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-2000:]


LOOP_SETUP = """
import numpy as np
import llama_shard as ls
from llama_shard import errors
path = {path!r}
m = ls.ShardModel(path, (0, 2), 2)
mgr = ls.HotKvStateManager(m, ls.HotKvStateConfig(max_sessions=4, context_tokens=64, budget_tokens=128),
                           ls.ManualClock(), n_batch=16)
ad = ls.KvBoundaryAdapter(m, mgr)
loop = mgr._loop
first = ad.prefill("keep", 0, token_ids=[3, 9, 27, 81]).hidden
class Fake:
    kind, session_id, route_epoch, token_ids, hidden, start_pos, expected_seq_len = ls.StepKind.DECODE, "f", 0, [1], None, None, None
def state():
    return (mgr.session_keys(), mgr.reserved_tokens, mgr.loop_stats()["pending"])
before = state()
"""

LOOP_CHECK = """
try:
    {stmt}
except errors.{exc} as e:
    assert str(e), "the message must say what was wrong"
    print("RAISED", type(e).__name__, "|", e)
else:
    raise SystemExit("no exception")
assert state() == before, (state(), before)
mgr.truncate("keep", 0, 0)
assert ad.prefill("keep", 0, token_ids=[3, 9, 27, 81]).hidden.tobytes() == first.tobytes()
print("STATE OK")
"""

LOOP_CASES = {
    # the first submission is a real step: its session is released before the state is taken
    "a ticket submitted twice": (
        "t = loop.ticket(ls.Step.prefill('x', 0, [1]), 0.0); loop.submit([t]); t.wait(); "
        "mgr.release('x', 0); before = state(); loop.submit([t])",
        "InvalidInputError",
    ),
    "the same ticket twice in one call": (
        "t = loop.ticket(ls.Step.prefill('y', 0, [1]), 0.0); loop.submit([t, t])",
        "InvalidInputError",
    ),
    "not a step": ("loop.ticket(object(), 0.0)", "InvalidInputError"),
    "a kind that is not StepKind": ("f = Fake(); f.kind = 'decode'; loop.ticket(f, 0.0)", "InvalidInputError"),
    "an epoch beyond int64": ("f = Fake(); f.route_epoch = 2**70; loop.ticket(f, 0.0)", "InvalidInputError"),
    "a position beyond int32": ("f = Fake(); f.expected_seq_len = 2**40; loop.ticket(f, 0.0)", "InvalidInputError"),
    "a token beyond the vocabulary": ("f = Fake(); f.token_ids = [10**9]; loop.ticket(f, 0.0)", "InvalidInputError"),
    "a decode longer than a step": ("ad.decode('keep', 0, token_ids=[1] * 17)", "InvalidInputError"),
    "hidden to the head": ("ad.decode('keep', 0, boundary=np.zeros((1, 64), np.float32))", "InvalidInputError"),
    "a blocking notify fd": (
        "import os; loop.ticket(ls.Step.prefill('z', 0, [1]), 0.0, os.pipe()[1])",
        "InvalidInputError",
    ),
    "a closed notify fd": ("loop.ticket(ls.Step.prefill('z', 0, [1]), 0.0, 999)", "InvalidInputError"),
}


@pytest.mark.parametrize("case", sorted(LOOP_CASES), ids=lambda c: c.replace(" ", "-"))
def test_bad_input_to_the_step_loop_raises_and_changes_nothing(synthetic_model, case):
    stmt, exc = LOOP_CASES[case]
    res = run_isolated(LOOP_SETUP.format(path=str(synthetic_model)) + LOOP_CHECK.format(stmt=stmt, exc=exc))
    assert res.returncode == 0, f"exit {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr[-2000:]}"
    assert f"RAISED {exc}" in res.stdout and "STATE OK" in res.stdout


def test_closing_from_two_threads_at_once_is_clean(synthetic_model):
    res = run_isolated(f"""
import threading
import llama_shard as ls
m = ls.ShardModel({str(synthetic_model)!r}, None, 2)
mgr = ls.HotKvStateManager(m, ls.HotKvStateConfig(max_sessions=4, context_tokens=512, budget_tokens=2048), n_batch=8)
tickets = mgr.submit([ls.Step.prefill(f"s{{i}}", 0, [1 + i] * 200) for i in range(4)])
closers = [threading.Thread(target=mgr.close) for _ in range(4)]
[t.start() for t in closers]; [t.join() for t in closers]
assert all(t.done() and t.result.status == ls.Status.OK for t in tickets)
mgr.close()
print("OK")
""")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-2000:]
