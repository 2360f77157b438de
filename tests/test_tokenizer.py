"""Tokenizer of the embedded model: llama.cpp's defaults (BOS when the vocabulary asks for it,
special tokens parsed) and a lossless round trip."""

from __future__ import annotations

import pytest

from llama_shard import ShardModel


@pytest.fixture(scope="module")
def smol(embedded_model):
    return ShardModel(str(embedded_model), (0, 0), 1)  # the vocabulary is the same on every shard


@pytest.mark.model
@pytest.mark.parametrize(
    "text", ["Hello world", "<|im_start|>user\nHi there<|im_end|>\n", "  leading spaces\tand tabs", "日本語のテキスト"]
)
def test_round_trip(smol, text):
    assert smol.detokenize(smol.tokenize(text)) == text


@pytest.mark.model
def test_special_tokens_are_parsed_as_one_id(smol):
    ids = smol.tokenize("<|im_start|>user")
    assert ids[0] == 1 and len(ids) == 2  # SmolLM2: <|im_start|> is id 1, no BOS added
    assert smol.detokenize([smol.token_eos]) == "<|im_end|>"


@pytest.mark.model
def test_tail_shard_has_the_same_vocabulary(embedded_model, smol):
    tail = ShardModel(str(embedded_model), (29, 29), 1)
    assert tail.tokenize("The capital of France") == smol.tokenize("The capital of France")
    assert tail.info.n_vocab == smol.info.n_vocab == 49152
