"""GPU nodes: the owned layers and their KV on a device (ggml's Vulkan backend), tested on every
machine through Debian's lavapipe, a Vulkan driver that runs on the CPU (mesa-vulkan-drivers).

On the device: split = whole bit for bit (SmolLM2 and Gemma 3, 2 and 3 shards, equal threads), the
seed's session scenario with the CPU's outcomes, a warm-tier spill and restore equal to a session
never spilled, a shared prefix equal to a fresh prefill, a partial offload (the first N owned layers).
Everywhere (no device needed): a bad device name or --gpu-layers is exit 2 before anything loads.

lavapipe is a CPU-type device, which ggml lists only when GGML_VK_VISIBLE_DEVICES names it: this
module sets it (to 0, unless it is set) before the first GPU module loads in this process. The
tests skip, naming why, where no Vulkan driver or no Vulkan backend is there; with
LLAMA_SHARD_REQUIRE_VULKAN=1 (.ci/run installs lavapipe) that is a failure instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from llama_shard import (
    CacheMiss,
    CacheMissReason,
    HotKvStateConfig,
    HotKvStateManager,
    KvBoundaryAdapter,
    ManualClock,
    ShardModel,
    StaleRouteEpochError,
    TailOutput,
)
from llama_shard.engine.pipeline import LocalPipeline
from llama_shard.errors import InvalidInputError

VISIBLE = "GGML_VK_VISIBLE_DEVICES"


@pytest.fixture(scope="module")
def device():
    """The name of the first GPU device ggml lists (lavapipe's 'Vulkan0' on a machine without a GPU)."""
    from llama_shard._native import devices, gpu_backends

    before = os.environ.get(VISIBLE)
    os.environ[VISIBLE] = before or "0"  # before the Vulkan module initialises here: it reads it once
    try:
        found = devices()
    finally:  # the workers later tests start keep their own environment
        if before is None:
            del os.environ[VISIBLE]
    if found:
        yield found[0]["name"]
        return
    modules = gpu_backends()
    why = (
        "; ".join(modules)
        if modules
        else "this build ships no GPU backend (build it where libvulkan-dev, glslc and spirv-headers are installed)"
    ) + "; no Vulkan device (install mesa-vulkan-drivers: lavapipe)"
    if os.environ.get("LLAMA_SHARD_REQUIRE_VULKAN") == "1":
        pytest.fail(f"a Vulkan device is required (LLAMA_SHARD_REQUIRE_VULKAN=1): {why}")
    pytest.skip(why)


def device_env() -> dict:
    return dict(os.environ, **{VISIBLE: os.environ.get(VISIBLE, "0")})


def _generate(pipe: LocalPipeline, prompt: list[int], n: int) -> list[tuple[int, bytes]]:
    return [(tok, logits.tobytes()) for tok, logits in pipe.generate(prompt, n)]


# --- split = whole on the device --------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("model_fixture", ["embedded_model", "gemma3_model"])
@pytest.mark.slow
def test_split_matches_whole_bit_for_bit_on_the_device(request, model_fixture, device):
    path = request.getfixturevalue(model_fixture)
    kw = dict(n_ctx=64, n_seq_max=1, n_batch=16, n_threads=2, device=device)
    whole = LocalPipeline(path, None, **kw)
    n_layer = whole.head.info.n_layer
    assert whole.head.info.device == device and whole.head.info.gpu_layers == n_layer
    prompt = whole.head.tokenize("The capital of France is")
    expected = _generate(whole, prompt, 3)
    del whole
    third = n_layer // 3
    for split in (
        [(0, n_layer // 2 - 1), (n_layer // 2, n_layer - 1)],
        [(0, third - 1), (third, 2 * third - 1), (2 * third, n_layer - 1)],
    ):
        pipe = LocalPipeline(path, split, **kw)
        assert [m.info.device for m in pipe.models] == [device] * len(split)
        assert pipe.models[-1].info.output_on_device
        got = _generate(pipe, prompt, 3)
        assert got == expected, f"{split}: tokens {[t for t, _ in got]} vs {[t for t, _ in expected]}"


@pytest.mark.model
def test_generate_verifies_a_split_on_the_device_against_the_whole_model(embedded_model, device):
    res = _cli(
        "generate",
        "--model",
        str(embedded_model),
        "--split",
        "0-9,10-29",
        "--device",
        device,
        "--max-tokens",
        "4",
        "--threads",
        "2",
        "--context-tokens",
        "64",
        "--batch",
        "16",
        "--compare-whole",
        env=device_env(),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "tokens identical: True; logits bit-identical: True" in res.stderr, res.stderr[-2000:]


@pytest.mark.model
def test_the_device_agrees_with_the_cpu_within_rounding(embedded_model, device):
    """Other kernels round differently: the device's logits are close to the CPU's, not equal."""
    kw = dict(n_ctx=64, n_seq_max=1, n_batch=16, n_threads=2)
    cpu = LocalPipeline(embedded_model, None, **kw)
    gpu = LocalPipeline(embedded_model, None, device=device, **kw)
    prompt = cpu.head.tokenize("The capital of France is")
    a, b = cpu.step(0, 0, prompt), gpu.step(0, 0, prompt)
    assert int(np.argmax(a)) == int(np.argmax(b))
    rel = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    # different kernels (never the CPU's by accident), the same answer. The CPU's Q4_1 kernels round
    # the activations to 8 bits and the device's do not: on lavapipe this prompt's logits were 0.036
    # to 0.066 apart (relative) for every pair of CPU and device, flash attention on and off, with
    # either CPU attention kernel (patch 0010's or upstream's)
    assert 0 < rel < 0.1, rel


def test_a_partial_offload_puts_the_first_owned_layers_on_the_device(synthetic_model, device):
    """--gpu-layers N: the first N layers of the owned range (patch 0008), the output layer only
    with all of them; the layers left on the CPU compute the same step."""
    full = ShardModel(str(synthetic_model), (2, 5), 2, device)
    part = ShardModel(str(synthetic_model), (2, 5), 2, device, 2)
    cpu = ShardModel(str(synthetic_model), (2, 5), 2, "cpu")
    assert (full.info.gpu_layers, full.info.output_on_device) == (4, True)
    assert (part.info.gpu_layers, part.info.output_on_device) == (2, False)
    assert (cpu.info.device, cpu.info.gpu_layers) == ("cpu", 0)
    assert ShardModel(str(synthetic_model), (2, 5), 2, device, 0).info.device == "cpu"
    from llama_shard import ShardContext

    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((4, full.info.n_embd)).astype(np.float32)
    outs = []
    for m in (full, part, cpu):
        ctx = ShardContext(m, n_ctx=32, n_seq_max=1, n_batch=8, n_threads=2)
        outs.append(ctx.forward(0, 0, None, hidden))
    assert np.allclose(outs[0], outs[2], rtol=1e-2, atol=1e-3) and np.allclose(outs[1], outs[2], rtol=1e-2, atol=1e-3)


# --- the session store with its state on the device -------------------------------------------


def _scenario(model: ShardModel) -> list:
    """The seed's scenario: four sessions, truncate, release, TTL and LRU eviction, a stale epoch and
    a miss; what each step returned, with its logits."""
    clock = ManualClock()
    manager = HotKvStateManager(
        model, HotKvStateConfig(max_sessions=3, context_tokens=32, ttl_seconds=10.0), clock, n_batch=8
    )
    ad = KvBoundaryAdapter(model, manager)
    log = []

    def record(what, out):
        if isinstance(out, TailOutput):
            log.append((what, "ok", out.seq_len, out.token_id, out.logits))
        elif isinstance(out, CacheMiss):
            log.append((what, "miss", out.reason.name))
        else:
            log.append((what, out))

    for i, sid in enumerate(["a", "b", "c"]):
        record(f"prefill {sid}", ad.prefill(sid, 0, token_ids=[5 + i, 12, 3, 41]))
        clock.advance(1)
    record("decode a", ad.decode("a", 0, token_ids=[7]))
    record("truncate b", manager.truncate("b", 0, 2).seq_len)
    record("decode b after truncate", ad.decode("b", 0, token_ids=[9], expected_seq_len=2))
    clock.advance(1)
    record("prefill d (evicts the LRU c)", ad.prefill("d", 0, token_ids=[200, 7, 7, 19]))
    record("decode c", ad.decode("c", 0, token_ids=[1]))
    record("release a", manager.release("a", 0))
    record("release a again", manager.release("a", 0))
    record("new epoch of b", ad.prefill("b", 1, token_ids=[1, 2, 3]))
    try:
        ad.decode("b", 0, token_ids=[4])
        record("stale epoch", "accepted")
    except StaleRouteEpochError:
        record("stale epoch", "refused")
    clock.advance(11)
    record("decode d after its TTL", ad.decode("d", 0, token_ids=[4]))
    record("unknown session", ad.decode("never", 0, token_ids=[4]))
    record("sessions left", sorted(manager.session_keys()))
    manager.check_invariants()
    return log


def test_the_seed_scenario_has_the_cpus_outcomes_on_the_device(synthetic_model, device):
    cpu = _scenario(ShardModel(str(synthetic_model), None, 2, "cpu"))
    gpu = _scenario(ShardModel(str(synthetic_model), None, 2, device))
    assert [e[:4] if e[1] == "ok" else e for e in cpu] == [e[:4] if e[1] == "ok" else e for e in gpu]
    for c, g in zip(cpu, gpu):
        if c[1] == "ok":
            # other kernels (the device computes products in f16): close, not equal
            assert np.max(np.abs(c[4] - g[4])) <= 1e-2 * np.max(np.abs(c[4])), c[0]
    assert ("decode c", "miss", CacheMissReason.EVICTED_LRU.name) in gpu
    assert ("decode d after its TTL", "miss", CacheMissReason.EVICTED_TTL.name) in gpu


def _route_steps(model: ShardModel, config: HotKvStateConfig, prompts: list[list[int]], rounds: int) -> dict:
    """Round-robin greedy decoding of several sessions on one whole-model manager."""
    manager = HotKvStateManager(model, config, ManualClock(), n_batch=8)
    ad = KvBoundaryAdapter(model, manager)
    outs = {str(i): ad.prefill(str(i), 0, token_ids=p) for i, p in enumerate(prompts)}
    history = {sid: [(o.token_id, o.logits.tobytes())] for sid, o in outs.items()}
    for _ in range(rounds):
        for sid, out in list(outs.items()):
            nxt = ad.decode(sid, 0, token_ids=[out.token_id])
            assert isinstance(nxt, TailOutput), nxt
            outs[sid] = nxt
            history[sid].append((nxt.token_id, nxt.logits.tobytes()))
    manager.check_invariants()
    return history, manager.stats()


def test_a_device_session_spilled_to_the_warm_tier_resumes_bit_exact(synthetic_model, device):
    model = ShardModel(str(synthetic_model), None, 2, device)
    prompts = [[5, 12, 3, 41], [200, 7, 7, 19, 88], [1, 2, 3], [310, 45, 99, 150]]
    roomy, _ = _route_steps(model, HotKvStateConfig(max_sessions=4, context_tokens=32), prompts, 3)
    tight, st = _route_steps(model, HotKvStateConfig(max_sessions=1, context_tokens=32, warm_bytes=8 << 20), prompts, 3)
    assert tight == roomy  # state copied off the device to host memory and back: the same logits, byte for byte
    assert st["restores"] >= 4 * 3 - 1 and sum(st["misses"].values()) == 0, st


def test_a_shared_prefix_opened_on_the_device_equals_a_fresh_prefill(synthetic_model, device):
    model = ShardModel(str(synthetic_model), None, 2, device)
    manager = HotKvStateManager(
        model, HotKvStateConfig(max_sessions=4, context_tokens=32, prefix_bytes=8 << 20), ManualClock(), n_batch=8
    )
    ad = KvBoundaryAdapter(model, manager)
    prefix, rest = [5, 12, 3, 41, 7, 9], [22, 23]
    ad.prefill("fresh", 0, token_ids=prefix)
    fresh = ad.prefill("fresh", 0, token_ids=rest)  # the same chunks as the reader computes
    ad.prefill("donor", 0, token_ids=prefix)
    assert manager.store_prefix("donor", 0, key=1234, length=len(prefix))
    opened = manager.open_prefix("reader", 0, key=1234, length=len(prefix))
    assert not isinstance(opened, CacheMiss) and opened.seq_len == len(prefix)
    out = ad.prefill("reader", 0, token_ids=rest)
    assert out.token_id == fresh.token_id and out.logits.tobytes() == fresh.logits.tobytes()
    manager.check_invariants()


def test_speculations_row_steps_on_the_device_are_one_token_steps(synthetic_model, device):
    """A verification step (several logit rows, row by row: serve --verify exact) gives each row the
    logits a one-token step gives, to the byte, and a rejected draft's cells are cut, on the device."""
    model = ShardModel(str(synthetic_model), None, 2, device)
    manager = HotKvStateManager(model, HotKvStateConfig(max_sessions=2, context_tokens=32), ManualClock(), n_batch=8)
    ad = KvBoundaryAdapter(model, manager)
    prompt, more = [5, 12, 3, 41, 7, 9], [22, 23, 24, 25]
    ad.prefill("one", 0, prompt)
    ad.prefill("rows", 0, prompt)
    singles = [ad.decode("one", 0, [t]).logits.copy() for t in more]
    exact = ad.prefill("rows", 0, more, start_pos=len(prompt), logit_rows=4, row_by_row=True)
    assert exact.seq_len == len(prompt) + 4
    for i in range(4):
        assert exact.rows[i].tobytes() == singles[i].tobytes(), i
    again = ad.prefill("rows", 0, more[1:3], start_pos=len(prompt) + 1, logit_rows=2, row_by_row=True)
    assert again.seq_len == len(prompt) + 3 and again.rows[1].tobytes() == singles[2].tobytes()
    manager.check_invariants()


def test_a_device_that_fails_its_self_check_is_not_used(synthetic_model, device):
    """auto falls back to the CPU naming the device and the failure; a named device is refused."""
    from llama_shard._native import devices

    env = dict(device_env(), LLAMA_SHARD_DEVICE_PROBE_FAIL=",".join(d["name"] for d in devices()))  # every one
    code = (
        "from llama_shard import ShardModel; m = ShardModel(%r, (0, 2), 1, 'auto'); "
        "print(m.info.device, '|', m.info.device_note)" % str(synthetic_model)
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"cpu | {device} self-check failed"), res.stdout
    assert f"device self-check: {device} failed" in res.stderr
    res = _cli("serve", "--model", str(synthetic_model), "--layers", "0-2", "--device", device, "--port", "0", env=env)
    assert res.returncode == 2 and f"device {device} (" in res.stderr and "failed its self-check" in res.stderr, (
        res.stderr[-2000:]
    )


# --- listing and bad input (every machine) ------------------------------------------------------


def _cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llama_shard.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_serve_refuses_a_device_that_does_not_exist_before_loading(synthetic_model):
    res = _cli("serve", "--model", str(synthetic_model), "--layers", "0-2", "--device", "Vulkan7", "--port", "0")
    assert res.returncode == 2, res.stderr
    assert "no device named 'Vulkan7' (devices: cpu, auto" in res.stderr
    assert "listening" not in res.stderr + res.stdout


def test_gpu_layers_outside_the_owned_range_is_refused(synthetic_model):
    res = _cli("serve", "--model", str(synthetic_model), "--layers", "0-2", "--gpu-layers", "4", "--port", "0")
    assert res.returncode == 2 and "gpu_layers 4 is outside [0, 3]" in res.stderr, res.stderr
    res = _cli("serve", "--model", str(synthetic_model), "--gpu-layers", "-1", "--port", "0")
    assert res.returncode == 2 and "--gpu-layers" in res.stderr, res.stderr
    with pytest.raises(InvalidInputError, match="outside"):
        ShardModel(str(synthetic_model), (0, 2), 1, "cpu", 9)
    # accepted and ignored would mislead: layers for a device, with the CPU named
    res = _cli(
        "serve",
        "--model",
        str(synthetic_model),
        "--layers",
        "0-2",
        "--device",
        "cpu",
        "--gpu-layers",
        "2",
        "--port",
        "0",
    )
    assert res.returncode == 2 and "the device is the CPU" in res.stderr, res.stderr
    res = _cli("inspect", str(synthetic_model), "--device", "auto")
    assert res.returncode == 2 and "give --kv-memory too" in res.stderr, res.stderr
    res = _cli("generate", "--route", "0-5@127.0.0.1:1", "--device", "auto")
    assert res.returncode == 2 and "a route's devices are its workers'" in res.stderr, res.stderr


def test_serve_device_list_names_the_device(device):
    res = _cli("serve", "--device", "list", env=device_env())
    assert res.returncode == 0, res.stderr
    assert f"{device}:" in res.stdout and ": loaded, " in res.stdout, res.stdout


def test_a_node_whose_gpu_modules_may_not_load_runs_on_the_cpu(synthetic_model):
    """As on a machine without a Vulkan loader: nothing is loaded, `auto` is the CPU and says why."""
    env = dict(os.environ, LLAMA_SHARD_GPU_BACKENDS="none")
    res = _cli("serve", "--device", "list", env=env)
    assert res.returncode == 0, res.stderr
    assert "not loaded: LLAMA_SHARD_GPU_BACKENDS=none" in res.stdout or "none in this build" in res.stdout, res.stdout
    code = (
        "from llama_shard import ShardModel; m = ShardModel(%r, (0, 2), 1, 'auto'); "
        "print(m.info.device, '|', m.info.device_note)" % str(synthetic_model)
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("cpu | no GPU device listed"), res.stdout


def test_a_route_is_one_backend_only_where_its_workers_facts_say_so():
    """route_backends reads InfoReply's device facts, not the backend's text: one device kind and
    kernels on every stage is one backend; a stage with some layers on the CPU, another CPU
    variant, or a worker that reports no facts (an older one) makes the route mixed."""
    from types import SimpleNamespace

    from llama_shard.route.stages import StageInfo, route_backends

    def stage(first, last, device, layers, kernels, backend="x"):
        return SimpleNamespace(
            info=StageInfo(first, last, 30, 576, "llama", f"s{first}", "", backend, device, layers, kernels)
        )

    cpu = [stage(0, 14, "cpu", 15, "zen4"), stage(15, 29, "cpu", 15, "zen4")]
    assert "one backend" in route_backends(cpu)
    gpu = [stage(0, 14, "Vulkan0", 15, "llvmpipe"), stage(15, 29, "Vulkan0", 15, "llvmpipe")]
    assert "one backend" in route_backends(gpu)
    for other in (
        stage(15, 29, "Vulkan0", 10, "llvmpipe"),
        stage(15, 29, "cpu", 15, "haswell"),
        stage(15, 29, "", 0, "", backend="cpu (zen4)"),
    ):
        assert "mixed backends" in route_backends([cpu[0], other]), other.info


# --- a route that mixes devices ----------------------------------------------------------------

MIXED_PROMPTS = ["The capital of France is", "Once upon a time,", "def add(a, b):", "Water boils at"]


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
def test_a_cpu_head_and_a_device_tail_serve_the_openai_endpoint(embedded_model, device, capsys):
    """A CPU stage and a device stage chain as two CPU stages do; the route's greedy completions are
    compared with the whole model's on the CPU, and the agreement printed (other kernels: close, not
    equal, is the promise; docs/devices.md)."""
    openai = pytest.importorskip("openai")
    from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_serving

    before = os.environ.get(VISIBLE)
    os.environ[VISIBLE] = before or "0"
    try:
        tail, tail_addr = start_worker(embedded_model, 15, 29, 1, extra=("--device", device, "--context-tokens", "256"))
    finally:
        if before is None:
            del os.environ[VISIBLE]
    port, client = free_port(), None
    head, head_addr = start_worker(
        embedded_model,
        0,
        14,
        1,
        extra=(
            "--device",
            "cpu",
            "--context-tokens",
            "256",
            "--peer",
            tail_addr,
            "--http-port",
            str(port),
            "--draft",
            "off",
        ),
    )
    try:
        wait_serving(tail, tail_addr, timeout_s=300)
        wait_serving(head, head_addr)
        from llama_shard.route import RemoteStage
        from llama_shard.route.stages import route_backends

        stages = [RemoteStage(head_addr), RemoteStage(tail_addr)]
        assert stages[0].info.backend.startswith("cpu (") and stages[1].info.backend.startswith(f"{device} (")
        described = route_backends(stages)
        assert "mixed backends" in described
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        whole = LocalPipeline(embedded_model, None, n_ctx=64, n_seq_max=1, n_batch=16, n_threads=1)
        same, agreed, lines = 0, 0, []
        for prompt in MIXED_PROMPTS:
            r = client.completions.create(
                model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=8, temperature=0, logprobs=1
            )
            got = r.choices[0].logprobs.tokens
            ids = [t for t, _ in whole.generate(whole.head.tokenize(prompt), 8)]
            expected = [whole.head.detokenize([t]) for t in ids]
            assert got and r.usage.completion_tokens == len(got)
            lead = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            same += got == expected
            agreed += lead
            lines.append(
                f"  {prompt!r}: {lead} of 8 tokens before the first difference: route {''.join(got)!r}, "
                f"whole CPU model {''.join(expected)!r}"
            )
        with capsys.disabled():
            print(
                f"\nmixed route ({described}):\n  greedy completions (8 tokens) equal to the whole CPU model's: "
                f"{same} of {len(MIXED_PROMPTS)}; tokens equal before the first difference: {agreed} of "
                f"{8 * len(MIXED_PROMPTS)}\n" + "\n".join(lines)
            )
    finally:
        if client is not None:  # (an open connection left to the collector fails a later test)
            client.close()
        exited = tail.poll()  # a tail that exited by itself says why (once seen in a slow lane, not alone)
        stop_worker(head)
        rc, said = stop_worker(tail)
        if exited is not None:
            print(f"the device tail exited by itself ({rc}); its stderr ends:\n{said[-3000:]}")


# --- the memory plan in device bytes ------------------------------------------------------------


@pytest.mark.model
def test_the_memory_plan_is_what_llama_cpp_allocates_on_the_device(embedded_model, device):
    from llama_shard._native import plan_memory

    config = HotKvStateConfig(max_sessions=4, context_tokens=256)
    plan = plan_memory(str(embedded_model), (0, 14), device, -1, config.engine_config(n_batch=64))
    model = ShardModel(str(embedded_model), (0, 14), 1, device)
    manager = HotKvStateManager(model, config, n_batch=64)
    real = manager.engine.memory()
    assert plan["device"] == real["device"] == device
    for part in ("device_model", "device_context", "device_compute"):
        assert real[part] > 0 and abs(plan[part] - real[part]) <= 0.10 * real[part], (part, plan[part], real[part])
    assert real["device_model"] >= 0.9 * model.info.weight_bytes - real["host_model"]
    manager.close()


def test_a_plan_larger_than_the_device_is_refused_before_loading(embedded_model, device):
    """Exit 2 with the reason, never an abort: KV in all over the device's free memory (the dry run's
    plan), and one layer's cache larger than the device takes in one tensor (Vulkan's buffer range;
    llama.cpp would abort placing it)."""
    from llama_shard._native import MAX_CONTEXT_TOKENS, devices, kv_bytes_per_token

    dev = next(d for d in devices() if d["name"] == device)
    info = ShardModel(str(embedded_model), (0, 0), 1).info
    per_token = kv_bytes_per_token(info.n_head_kv, info.head_dim, 15)  # layers 0-14
    too_much = min(MAX_CONTEXT_TOKENS, int(1.3 * dev["memory_free"]) // (64 * per_token) + 256)  # KV: 1.3x free
    one_tensor_too_large = MAX_CONTEXT_TOKENS  # one session of 1 Mi cells: 384 MiB per layer's K
    lavapipe = dev["description"].startswith("llvmpipe")
    for sessions, context, expected in (
        (64, too_much, f"the plan does not fit {device}: it needs"),
        (1, one_tensor_too_large, f"is larger than {device} takes in one tensor"),
    ):
        res = _cli(
            "serve",
            "--model",
            str(embedded_model),
            "--layers",
            "0-14",
            "--device",
            device,
            "--max-sessions",
            str(sessions),
            "--context-tokens",
            str(context),
            "--budget-tokens",
            "65536",
            "--port",
            "0",
            env=device_env(),
        )
        assert res.returncode == 2, res.stderr[-2000:]  # not a signal
        refused = "the plan does not fit" in res.stderr or "takes in one tensor" in res.stderr
        assert refused and (expected in res.stderr or not lavapipe), res.stderr[-2000:]
        assert "loading" not in res.stderr


# --- a mixture of experts on one GPU: its experts in host memory (--cpu-moe) ----------------------


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from llama_shard.testing.synthetic_families import CERTIFICATION_SPECS, write_moe_gguf

    return write_moe_gguf(tmp_path_factory.mktemp("moe") / "qwen3moe.gguf", CERTIFICATION_SPECS["qwen3moe"])


def test_cpu_moe_keeps_the_owned_experts_in_host_memory(moe_model, device):
    """--cpu-moe / --n-cpu-moe N: the owned layers' expert tensors (the first N layers') move from the
    device's weights to the host's, by their bytes, in the dry run and in what llama.cpp allocates."""
    from llama_shard._native import plan_memory
    from llama_shard.engine.models import gguf_shape

    experts = gguf_shape(moe_model).expert_bytes
    routers = [t.n_bytes for t in __import__("gguf").GGUFReader(str(moe_model)).tensors if "ffn_gate_inp" in t.name]
    config = HotKvStateConfig(max_sessions=2, context_tokens=64).engine_config(n_batch=16)
    plans = {n: plan_memory(str(moe_model), (2, 5), device, -1, config, n) for n in (0, 2, -1)}
    moved = {n: plans[0]["device_model"] - plans[n]["device_model"] for n in (2, -1)}
    # the routed experts only: the router (ffn_gate_inp, counted with them) stays on the device
    for n, layers in ((2, (2, 3)), (-1, (2, 3, 4, 5))):
        want = sum(experts[il] - routers[il] for il in layers)
        assert abs(moved[n] - want) <= 4096 * 3 * len(layers), (n, moved[n], want)
        assert plans[n]["host_model"] - plans[0]["host_model"] == moved[n]
    model = ShardModel(str(moe_model), (2, 5), 2, device, -1, -1)
    assert model.info.cpu_moe_layers == 4 and model.info.gpu_layers == 4
    manager = HotKvStateManager(model, HotKvStateConfig(max_sessions=2, context_tokens=64), n_batch=16)
    try:
        real = manager.engine.memory()
        assert abs(real["device_model"] - plans[-1]["device_model"]) <= 0.10 * plans[-1]["device_model"]
    finally:
        manager.close()
    # nothing changes on the CPU, and a count outside the owned layers is refused before loading
    assert ShardModel(str(moe_model), (2, 5), 2, "cpu", 0, -1).info.cpu_moe_layers == 0
    with pytest.raises(InvalidInputError, match="cpu_moe_layers 5 is outside"):
        ShardModel(str(moe_model), (2, 5), 2, device, -1, 5)


def test_a_split_with_its_experts_in_host_memory_equals_the_whole_model_so_placed(moe_model, device):
    """Experts on the host, the rest on the device: a 2-shard split gives the whole model's logits to
    the bit when both are placed alike, and the CPU's greedy tokens."""
    kw = dict(n_ctx=64, n_seq_max=1, n_batch=16, n_threads=2, device=device, cpu_moe_layers=-1)
    prompt = [1, 17, 42, 99, 5, 250, 3, 8]
    whole = _generate(LocalPipeline(moe_model, None, **kw), prompt, 8)
    split = _generate(LocalPipeline(moe_model, [(0, 2), (3, 5)], **kw), prompt, 8)
    assert split == whole
    cpu = _generate(
        LocalPipeline(moe_model, [(0, 2), (3, 5)], n_ctx=64, n_seq_max=1, n_batch=16, n_threads=2), prompt, 8
    )
    assert [t for t, _ in cpu] == [t for t, _ in whole]


def test_serve_refuses_n_cpu_moe_outside_the_owned_layers_before_loading(moe_model):
    res = _cli(
        "serve", "--model", str(moe_model), "--layers", "2-5", "--device", "cpu", "--n-cpu-moe", "9", "--port", "0"
    )
    assert res.returncode == 2, res.stderr
    assert "cpu_moe_layers 9 is outside [0, 4]" in res.stderr
    assert "listening" not in res.stderr + res.stdout
