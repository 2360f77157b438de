"""Configuration from the environment, and bad input through the manager: a clear exception and no
state change, on both engines (the native cases run in a subprocess so an abort would fail)."""

from __future__ import annotations

import pytest

from llama_shard import HotKvStateConfig, InvalidInputError

from conftest import run_isolated


def test_config_from_env_reads_every_variable():
    env = {
        "LLAMA_SHARD_MAX_SESSIONS": "12",
        "LLAMA_SHARD_CONTEXT_TOKENS": "1024",
        "LLAMA_SHARD_BUDGET_TOKENS": "4096",
        "LLAMA_SHARD_TTL_SECONDS": "2.5",
    }
    assert HotKvStateConfig.from_env(env) == HotKvStateConfig(
        max_sessions=12, context_tokens=1024, budget_tokens=4096, ttl_seconds=2.5
    )
    assert HotKvStateConfig.from_env({}) == HotKvStateConfig()
    assert HotKvStateConfig.from_env({"LLAMA_SHARD_FLASH_ATTN": "off"}).flash_attn is False
    assert HotKvStateConfig.from_env({"LLAMA_SHARD_FLASH_ATTN": "On"}).flash_attn is True


def test_the_old_environment_names_are_read_with_a_warning_and_the_new_ones_win(capsys):
    old = HotKvStateConfig.from_env({"MESHNET_HOT_KV_MAX_SESSIONS": "12"})
    assert old.max_sessions == 12
    assert "MESHNET_HOT_KV_MAX_SESSIONS is deprecated; set LLAMA_SHARD_MAX_SESSIONS" in capsys.readouterr().err
    both = HotKvStateConfig.from_env({"MESHNET_HOT_KV_MAX_SESSIONS": "12", "LLAMA_SHARD_MAX_SESSIONS": "3"})
    assert both.max_sessions == 3 and capsys.readouterr().err == ""


def test_flash_attention_is_a_checked_setting_of_the_cache_recipe(synthetic_model):
    """Without flash attention llama.cpp stores V transposed: another layout, so another recipe
    fingerprint (warm files and hops check it); the default keeps the fingerprints it always had;
    a quantized cache needs flash attention and is refused without it (not llama.cpp's abort)."""
    from llama_shard import ShardModel
    from llama_shard.engine.recipe import kv_recipe_for

    model = ShardModel(str(synthetic_model), None, 1)
    on, off = kv_recipe_for(model), kv_recipe_for(model, flash_attn=False)
    assert "flash_attn" not in on.canonical() and off.canonical()["flash_attn"] is False
    assert not on.is_compatible(off)
    for bad in ({"kv_type": "q8_0", "flash_attn": False}, {"flash_attn": "off"}, {"flash_attn": 0}):
        with pytest.raises(InvalidInputError, match="flash_attn"):
            HotKvStateConfig(**bad)
    from llama_shard._native import HotKvConfig, HotKvEngine

    with pytest.raises(InvalidInputError, match="needs flash_attn"):  # the engine's own check, not only Python's
        HotKvEngine(model, HotKvConfig(kv_type="q8_0", flash_attn=False))


@pytest.mark.parametrize(
    "key,value",
    [
        ("LLAMA_SHARD_MAX_SESSIONS", "many"),
        ("LLAMA_SHARD_MAX_SESSIONS", "0"),
        ("LLAMA_SHARD_MAX_SESSIONS", "1000"),
        ("LLAMA_SHARD_CONTEXT_TOKENS", "-5"),
        ("LLAMA_SHARD_BUDGET_TOKENS", "1.5"),
        ("LLAMA_SHARD_TTL_SECONDS", "nan"),
        ("LLAMA_SHARD_TTL_SECONDS", "-1"),
        ("LLAMA_SHARD_BUDGET_TOKENS", "99999999999"),
        ("LLAMA_SHARD_CONTEXT_TOKENS", "1048577"),
        ("LLAMA_SHARD_CONTEXT_TOKENS", "2147483648"),
        ("LLAMA_SHARD_WARM_BYTES", "-1"),
        ("LLAMA_SHARD_WARM_BYTES", "lots"),
        ("LLAMA_SHARD_WARM_DISK_BYTES", "-3"),
        ("LLAMA_SHARD_WARM_TTL_SECONDS", "inf"),
        ("LLAMA_SHARD_KV_TYPE", "f64"),
        ("LLAMA_SHARD_FLASH_ATTN", "maybe"),
    ],
)
def test_bad_env_value_is_a_clear_startup_error(key, value):
    with pytest.raises(InvalidInputError) as e:
        HotKvStateConfig.from_env({key: value})
    assert key.split("LLAMA_SHARD_")[1].lower() in str(e.value) or key in str(e.value)


CASES = """
import numpy as np
import llama_shard as ls
from llama_shard import errors
{make}
mgr = ls.HotKvStateManager(shard, ls.HotKvStateConfig(max_sessions=4, context_tokens=32, budget_tokens=64), ls.ManualClock())
ad = ls.KvBoundaryAdapter(shard, mgr)
ad.prefill("s", 1, token_ids=[1, 2, 3])
tail = ls.KvBoundaryAdapter(tshard, ls.HotKvStateManager(tshard, None, ls.ManualClock()))
def snapshot():
    return (mgr.session_keys(), mgr.stats())
before = snapshot()
cases = {{
    "empty token list": lambda: ad.prefill("s", 1, token_ids=[]),
    "negative length": lambda: mgr.truncate("s", 1, -1),
    "huge length": lambda: mgr.truncate("s", 1, 2**40),
    "truncate beyond the length": lambda: mgr.truncate("s", 1, 4),
    "non-string session id": lambda: mgr.open(17, 1),
    "bytes session id": lambda: mgr.open(b"s", 1),
    "empty session id": lambda: mgr.open("", 1),
    "overlong session id": lambda: mgr.open("x" * 300, 1),
    "negative epoch": lambda: ad.decode("s", -1, token_ids=[1]),
    "bool epoch": lambda: mgr.resolve("s", True),
    "float epoch": lambda: mgr.resolve("s", 1.0),
    "negative start_pos": lambda: ad.prefill("s", 1, token_ids=[1], start_pos=-3),
    "negative expected length": lambda: ad.decode("s", 1, token_ids=[1], expected_seq_len=-2),
    "token out of vocabulary": lambda: ad.decode("s", 1, token_ids=[10**6]),
    "tokens to a non-head shard": lambda: tail.prefill("s", 1, token_ids=[1]),
    "hidden of the wrong width": lambda: tail.prefill("s", 1, boundary=np.zeros((2, 63), np.float32)),
    "hidden of the wrong dtype": lambda: tail.prefill("s", 1, boundary=np.zeros((2, 64), np.float64)),
    "hidden to the head": lambda: ad.decode("s", 1, boundary=np.zeros((1, 64), np.float32)),
    "batch longer than n_batch": lambda: ad.decode("s", 1, token_ids=[1] * 513),
    "recipe of the wrong type": lambda: mgr.open("s", 1, recipe="llama"),
}}
for name, call in cases.items():
    try:
        call()
    except errors.InvalidInputError as e:
        assert str(e)
        print("OK", name, "|", e)
    else:
        raise SystemExit("no exception for " + name)
    assert snapshot() == before, name
mgr.check_invariants()
print("ALL", len(cases))
"""

MAKE = {
    "native": "shard = ls.ShardModel({path!r}, None, 1)\ntshard = ls.ShardModel({path!r}, (3, 5), 1)",
    "reference": (
        "from llama_shard.reference import ReferenceModel, ReferenceShard\n"
        "ref = ReferenceModel.from_gguf({path!r})\nshard = ReferenceShard(ref)\ntshard = ReferenceShard(ref, 3, 5)"
    ),
}


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_bad_input_through_the_manager_changes_nothing(synthetic_model, engine):
    code = CASES.format(make=MAKE[engine].format(path=str(synthetic_model)))
    res = run_isolated(code)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    assert "ALL 20" in res.stdout
