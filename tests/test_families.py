"""Certification, family by family: each cell of docs/families.md's table is a test here.

Every family runs on a tiny random-weight file of its own (testing/synthetic_families.py) written with
each kind of layer it has: dense lead layers, sliding-window and full layers, latent attention, a
shared expert, an MTP block. Each test compares a split route with the whole model (which runs
upstream's code path: patch 0001's gate) or a session's later state with a fresh run, byte for byte.
"""

from __future__ import annotations

import numpy as np
import pytest

from llama_shard import (
    CacheMiss,
    HotKvStateConfig,
    ModelLoadError,
    ShardModel,
    Tier,
)
from llama_shard.engine.pipeline import LocalPipeline
from llama_shard.testing.synthetic_families import (
    CERTIFICATION_SPECS,
    MoeSpec,
    moe_layers,
    recurrent_layers,
    write_moe_gguf,
)

from support.engine_route import PROMPT, Route

FAMILIES = list(CERTIFICATION_SPECS)


def cuts(spec: MoeSpec) -> list[list[tuple[int, int]]]:
    """2- and 3-shard layouts with a cut at each kind of boundary the family has."""
    L = spec.n_layer
    layouts = [
        [(0, L // 2 - 1), (L // 2, L - 1)],  # the middle
        [(0, 0), (1, L - 2), (L - 1, L - 1)],  # one-layer shards at both ends (the tail next to MTP)
        [(0, 1), (2, 3), (4, L - 1)],
    ]
    if spec.n_dense_lead:
        layouts.append([(0, spec.n_dense_lead - 1), (spec.n_dense_lead, L - 1)])  # dense lead | MoE
        if spec.n_dense_lead > 1:
            layouts.append([(0, 0), (1, L - 1)])  # inside the dense lead
    if spec.family == "gpt-oss":
        layouts += [[(0, 2), (3, L - 1)], [(0, 1), (2, L - 1)]]  # after a full layer, after a sliding one
    if spec.family in ("nemotron_h", "nemotron_h_moe"):  # after a recurrent / an attention layer
        for kinds in ("MA", "AF", "FM"):
            at = spec.layer_kinds.find(kinds)
            layouts.append([(0, at), (at + 1, L - 1)])
        layouts.append([(0, 0), (1, 1), (2, L - 1)])  # a shard of one recurrent layer only
    if spec.family in ("qwen35", "qwen35moe", "qwen3next"):  # layers 3 and 7 are attention
        layouts += [[(0, 2), (3, L - 1)], [(0, 3), (4, L - 1)], [(0, 2), (3, 3), (4, L - 1)]]
    if spec.family == "granitehybrid":  # MMAMMMAM: after M, after A, A alone
        layouts += [[(0, 1), (2, L - 1)], [(0, 2), (3, L - 1)], [(0, 1), (2, 2), (3, L - 1)]]
    if spec.family == "gemma4":  # layers 2 and 5 are full attention (another head size, K as V), the rest sliding
        layouts += [[(0, 1), (2, L - 1)], [(0, 2), (3, L - 1)], [(0, 1), (2, 2), (3, L - 1)]]
    if spec.family == "llama4":  # layer 3 is full attention without rope; odd layers MoE, even dense
        layouts += [[(0, 2), (3, L - 1)], [(0, 3), (4, L - 1)], [(0, 0), (1, L - 1)], [(0, 1), (2, 2), (3, L - 1)]]
    return layouts


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: write_moe_gguf(root / f"{f}.gguf", spec) for f, spec in CERTIFICATION_SPECS.items()}


@pytest.fixture(params=FAMILIES)
def family(request, family_models):
    return request.param, family_models[request.param], CERTIFICATION_SPECS[request.param]


def fresh_atol(spec: MoeSpec, default: float) -> float:
    """How far a fresh prefill's logits may be from the same tokens computed in other batch shapes.
    The whole model itself (upstream's path) moves this much: gemma4 by up to 3.1e-3 (measured on
    the dense fixture: 12 tokens and then 7 one at a time, against 19 at once; 1.7e-3 without flash
    attention), the others by less than 1e-4."""
    return 5e-3 if spec.family == "gemma4" else default


def halves(spec: MoeSpec):
    return [(0, spec.n_layer // 2 - 1), (spec.n_layer // 2, spec.n_layer - 1)]


def test_split_equals_whole_bit_for_bit_at_every_kind_of_cut(family):
    name, path, spec = family
    whole = LocalPipeline(path, None, n_ctx=256, n_seq_max=2, n_batch=32, n_threads=2)
    assert whole.head.info.n_layer == spec.n_layer  # the trunk: an MTP block is no shard's layer
    prompts = {0: PROMPT[:7], 1: [7, 300, 12, 64, 128]}
    calls, expected = [], []
    pending, pos = dict(prompts), {0: 0, 1: 0}
    for _ in range(9):
        for seq in (0, 1):
            logits = whole.step(seq, pos[seq], pending[seq])
            calls.append((seq, pos[seq], pending[seq]))
            expected.append(logits.tobytes())
            pos[seq] += len(pending[seq])
            pending[seq] = [int(np.argmax(logits))]
    for layout in cuts(spec):
        pipe = LocalPipeline(path, layout, n_ctx=256, n_seq_max=2, n_batch=32, n_threads=2)
        got = [pipe.step(seq, p, toks).tobytes() for seq, p, toks in calls]
        assert got == expected, f"{name}: {layout} differs from the whole model"


def test_greedy_tokens_equal_the_whole_models(family):
    name, path, spec = family
    whole = LocalPipeline(path, None, n_ctx=128, n_seq_max=1, n_batch=32, n_threads=1)
    expected = list(whole.generate(PROMPT, 16))
    route = Route(path, halves(spec))
    try:
        tokens, logits = route.greedy("s", PROMPT, 16)
    finally:
        route.close()
    assert tokens == [t for t, _ in expected]
    assert logits == [row.tobytes() for _, row in expected]
    assert len(set(tokens)) >= 3, tokens  # the experts make varied text


def test_rejected_drafts_leave_no_trace(family):
    """What speculation does: a step appends drafts, the verdict cuts back to the accepted length.
    Two sessions that computed the same accepted draft among different rejected ones continue
    byte for byte alike for six steps, and the first step is a fresh run's (its token; its logits
    to rounding: a fresh prefill computes in other batch shapes, which an expert matmul rounds
    differently, and a near tie in a router then picks other experts later on)."""
    name, path, spec = family
    route = Route(path, halves(spec))
    try:
        tokens, _ = route.greedy("a", PROMPT, 6)
        assert route.greedy("b", PROMPT, 6)[0] == tokens
        history = PROMPT + tokens[:-1]
        outs = []
        for sid, drafts in (("a", [3, 4, 5, 6]), ("b", [3, 250, 9, 1])):
            route.prefill(sid, drafts)  # the drafts, computed
            for m in route.managers:
                assert m.truncate(sid, 0, len(history) + 1).seq_len == len(history) + 1  # one accepted
            outs.append([route.decode(sid, 77)])
            outs[-1] += [route.decode(sid, outs[-1][-1].token_id) for _ in range(5)]
        assert [o.logits.tobytes() for o in outs[0]] == [o.logits.tobytes() for o in outs[1]]
        fresh = route.prefill("fresh", history + [3, 77], start_pos=0)
        assert outs[0][0].token_id == fresh.token_id
        np.testing.assert_allclose(outs[0][0].logits, fresh.logits, rtol=1e-4, atol=fresh_atol(spec, 1e-4))
    finally:
        route.close()


def test_a_prefix_open_continues_as_the_prefix_owner_does(family):
    """A stored prefix opened by another session holds the owner's bytes: both continue alike,
    and with a fresh run's greedy tokens."""
    name, path, spec = family
    config = HotKvStateConfig(
        max_sessions=4, context_tokens=128, budget_tokens=512, ttl_seconds=0, prefix_bytes=16 << 20
    )
    route = Route(path, halves(spec), config)
    try:
        route.prefill("a", PROMPT[:8])
        assert all(m.store_prefix("a", 0, 42, 8) for m in route.managers)
        for m in route.managers:
            assert not isinstance(m.open_prefix("b", 0, 42, 8), CacheMiss)
        suffix = [200, 201, 202]
        got, owner = route.prefill("b", suffix, start_pos=8), route.prefill("a", suffix, start_pos=8)
        assert got.logits.tobytes() == owner.logits.tobytes()
        fresh = route.prefill("fresh", PROMPT[:8] + suffix, start_pos=0)
        assert got.token_id == fresh.token_id
        np.testing.assert_allclose(got.logits, fresh.logits, rtol=1e-4, atol=fresh_atol(spec, 1e-5))
    finally:
        route.close()


def test_a_session_back_from_the_warm_tier_continues_exactly(family):
    name, path, spec = family
    config = HotKvStateConfig(max_sessions=1, context_tokens=128, budget_tokens=128, ttl_seconds=0, warm_bytes=64 << 20)
    r, ref = Route(path, halves(spec), config), Route(path, halves(spec))
    try:
        tokens, _ = r.greedy("a", PROMPT, 6)
        r.greedy("b", [7, 7, 7], 2)  # one hot slot: "a" goes warm
        assert all(m.resolve("a", 0).tier == Tier.WARM for m in r.managers)
        out = r.decode("a", tokens[-1])
        ref_tokens, _ = ref.greedy("a", PROMPT, 6)
        assert ref_tokens == tokens
        assert out.logits.tobytes() == ref.decode("a", tokens[-1]).logits.tobytes()
    finally:
        r.close()
        ref.close()


def test_a_handed_over_session_continues_exactly(family):
    name, path, spec = family
    a, b = Route(path, halves(spec)), Route(path, halves(spec))
    try:
        tokens, _ = a.greedy("s", PROMPT, 6)
        for src, dst in zip(a.managers, b.managers):
            info, state = src.export_session("s", 0)
            dst.import_session("s", 0, info.seq_len, state)
        got = b.decode("s", tokens[-1])
        assert got.logits.tobytes() == a.decode("s", tokens[-1]).logits.tobytes()
    finally:
        a.close()
        b.close()


def test_inspect_reads_the_family_and_its_expert_bytes(family):
    from llama_shard.engine.models import gguf_shape

    name, path, spec = family
    shape = gguf_shape(path)
    assert shape.n_layer == spec.n_layer and shape.n_nextn == spec.n_nextn
    assert shape.n_expert == spec.n_expert and shape.n_expert_used == spec.n_expert_used
    recurrent = recurrent_layers(spec)
    kind = ([f"hybrid, {len(recurrent)} of {spec.n_layer} layers recurrent"] if recurrent else []) + (
        [f"MoE, {spec.n_expert} experts, {spec.n_expert_used} active"] if spec.n_expert else []
    )
    assert shape.kind == ("; ".join(kind) or "dense")
    if recurrent:
        assert list(shape.recurrent_layers) == recurrent
        if spec.family in ("nemotron_h", "nemotron_h_moe", "granitehybrid"):
            assert [b > 0 for b in shape.kv_layer_bytes] == [kind == "A" for kind in spec.layer_kinds]
        else:
            assert [b > 0 for b in shape.kv_layer_bytes] == [il not in recurrent for il in range(spec.n_layer)]
    moe = moe_layers(spec)
    assert [shape.expert_bytes[il] > 0 for il in range(spec.n_layer)] == [il in moe for il in range(spec.n_layer)]
    # the memory plan counts what llama.cpp allocated, within 10%
    for first, last in halves(spec):
        model = ShardModel(str(path), (first, last), 1)
        planned = shape.range_info(first, last)
        assert abs(planned.weight_bytes - model.info.weight_bytes) <= 0.1 * model.info.weight_bytes, (
            first,
            last,
            planned,
        )
        # KV and recurrent state per token and per session as llama.cpp allocates them
        assert planned.kv_bytes_per_token == model.info.kv_bytes_per_token
        assert planned.recurrent_bytes == model.info.recurrent_bytes


def test_a_cut_inside_the_mtp_block_is_refused(family_models):
    spec = CERTIFICATION_SPECS["glm4moe"]
    with pytest.raises(Exception, match="MTP"):
        ShardModel(str(family_models["glm4moe"]), (spec.n_layer // 2, spec.n_layer), 1)


def test_an_expert_count_that_disagrees_with_the_tensors_is_refused_at_load(tmp_path):
    """The header says 16 experts, the tensors hold 8: llama.cpp's loader refuses the shapes before
    any allocation."""
    path = write_moe_gguf(tmp_path / "liar.gguf", MoeSpec(family="qwen3moe"))
    import gguf

    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(str(path))
    field = reader.get_field("qwen3moe.expert_count")
    offset = int(field.parts[field.data[0]].__array_interface__["data"][0] - reader.data.__array_interface__["data"][0])
    data[offset : offset + 4] = (16).to_bytes(4, "little")
    bad = tmp_path / "liar16.gguf"
    bad.write_bytes(bytes(data))
    del reader
    with pytest.raises(ModelLoadError, match="ffn_gate_inp.weight' has wrong shape"):
        ShardModel(str(bad), (0, 2), 1)


@pytest.mark.parametrize(
    "arch, why",
    [
        ("deepseek4", "hyper-connection residual streams"),
        ("glm5-next", "4 mHC residual streams"),
        ("kimi-k3", "cross-layer residual attention"),
    ],
)
def test_a_family_that_cannot_be_split_exactly_is_refused_naming_why(tmp_path, arch, why):
    """Families whose layers pass more than one residual row on: a range is refused from the header,
    before llama.cpp reads anything, with the reason."""
    import gguf

    from llama_shard import UncertifiedArchitectureError

    w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UncertifiedArchitectureError, match=f"'{arch}' cannot be split exactly: .*{why}"):
        ShardModel(str(tmp_path / f"{arch}.gguf"), (0, 1), 1)


@pytest.mark.parametrize(
    "variant, why",
    [({"n_embd_per_layer": 16}, "per-layer input"), ({"n_kv_shared": 3}, "reuse earlier layers' KV cache")],
)
def test_a_gemma4_file_with_per_layer_inputs_or_shared_kv_is_refused_a_range(tmp_path, variant, why):
    """gemma4 is certified for files like 26B-A4B's; E2B/E4B-style files (per-layer inputs computed
    from the token ids before the loop, KV shared between layers) are refused from the header with
    the reason, and load whole."""
    import dataclasses

    from llama_shard import UncertifiedArchitectureError

    path = write_moe_gguf(tmp_path / "gemma4-e.gguf", dataclasses.replace(CERTIFICATION_SPECS["gemma4"], **variant))
    with pytest.raises(UncertifiedArchitectureError, match=f"'gemma4' cannot be split exactly: .*{why}"):
        ShardModel(str(path), (0, 2), 1)
    assert ShardModel(str(path), None, 1).info.n_layer == CERTIFICATION_SPECS["gemma4"].n_layer


REPEAT = PROMPT * 2  # its end is an n-gram seen before: the worker's prompt-lookup drafts from the first step


@pytest.mark.grpc
@pytest.mark.slow
def test_a_served_route_generates_the_whole_models_tokens_greedy_seeded_and_with_drafts(family):
    """Two workers, the tail sampling with llama.cpp's chain: greedy without drafts, with the
    worker's drafts, and seeded sampling each give the whole model's tokens."""
    from llama_shard._native import SamplingParams
    from llama_shard.proto.requests import sampling_to_wire

    from support.served_route import Route as ServedRoute
    from support.served_route import whole_model_tokens

    name, path, spec = family
    route = ServedRoute(path, halves(spec))
    try:
        # the third prompt repeats PROMPT and what the model says after it: once the route says the
        # same again, the worker's prompt lookup drafts the rest
        echo = PROMPT + whole_model_tokens(path, PROMPT, None) + PROMPT
        drafts_sent = 0
        for i, prompt in enumerate((PROMPT, REPEAT, echo)):
            expected = whole_model_tokens(path, prompt, None)
            plain, _ = route.generate(f"plain-{i}", prompt, max_drafts=0)
            drafted, final = route.generate(f"drafts-{i}", prompt)
            assert plain == expected, (name, i)
            assert drafted == expected, (name, i, final.accepted_tokens)
            drafts_sent += final.drafted_tokens
        assert drafts_sent > 0, name  # verification rows were computed (and cut back where rejected)
        params = SamplingParams(seed=42, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
        sampled, _ = route.generate("seeded", PROMPT, sampling=sampling_to_wire(params))
        assert sampled == whole_model_tokens(path, PROMPT, params)
    finally:
        route.stop()


def test_a_hybrid_whose_conv_kernel_is_not_f32_is_refused_at_load(tmp_path):
    """llama.cpp's conv kernel asserts an f32 weight at the first decode (an abort): the file is
    refused when it loads, whole or split, in a child process that must not die."""
    import dataclasses
    import subprocess
    import sys

    path = write_moe_gguf(
        tmp_path / "f16-conv.gguf", dataclasses.replace(CERTIFICATION_SPECS["nemotron_h"], ssm_conv_f16=True)
    )
    code = (
        "import sys\nfrom llama_shard import ShardModel, ModelLoadError\n"
        "for layers in (None, (0, 3)):\n"
        "    try:\n        ShardModel(sys.argv[1], layers, 1)\n    except ModelLoadError as e:\n        print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("conv kernel must be f32") == 2, res.stdout


def test_the_memory_plan_of_a_hybrid_shard_counts_its_state_not_every_layers_kv(family_models):
    """A range of recurrent layers caches no KV: its slot is the recurrent state; a range of FFN
    layers only holds nothing per session. Both are planned as llama.cpp allocates them."""
    from llama_shard._native import MAX_SESSIONS
    from llama_shard.engine.memory import memory_plan
    from llama_shard.engine.models import gguf_shape

    shape = gguf_shape(family_models["nemotron_h"])  # layers MMAFMMAF
    recurrent = memory_plan(shape.range_info(0, 1), 64 << 20, 128)
    model = ShardModel(str(family_models["nemotron_h"]), (0, 1), 1)
    assert recurrent.kv_bytes_per_token == 0 == model.info.kv_bytes_per_token
    assert recurrent.slot_bytes == model.info.recurrent_bytes > 0
    assert recurrent.checkpoint_bytes > 0 and "recurrent:" in recurrent.describe()
    ffn_only = memory_plan(shape.range_info(7, 7), 64 << 20, 128)
    assert ffn_only.slot_bytes == 0 and ffn_only.hot_slots == MAX_SESSIONS
