"""The step loop's figures: does libgomp's spin after each step slow a worker serving 8 gRPC
clients, and what does a decode through the adapter and the step loop cost beyond the engine step.

    python benchmarks/hot_path_study.py [ROUNDS] [--threads 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import model_and_vocab, user_manager
from routes import ours_worker_clients

from llama_shard import KvBoundaryAdapter, ShardModel
from llama_shard.engine.models import require_embedded_model


def hot_path_study(path: Path, threads: int, rounds: int, quick: bool = False) -> str:
    """Two questions about the step loop: does libgomp's spin after each step (its workers spin
    before they sleep) slow a worker serving 8 gRPC clients (the default spin count against
    30,000), and what does a decode through the adapter and the step loop cost beyond the engine
    step itself (a synthetic model, so that the compute is small)."""
    import tempfile

    from llama_shard.testing.synthetic import SyntheticSpec, write_synthetic_gguf

    _, vocab = model_and_vocab(path)
    npp, ntg, n_clients = (16, 8, 4) if quick else (128, 64, 8)
    lines = [f"{path.name}: one worker ({threads} threads), {n_clients} gRPC clients, {rounds} alternating rounds"]
    spins = {"300000 (libgomp's default)": "300000", "30000": "30000"}
    got: dict[str, list[float]] = {name: [] for name in spins}
    for _ in range(rounds):
        for name, value in spins.items():
            got[name].append(ours_worker_clients(path, threads, npp, ntg, n_clients, vocab, {"GOMP_SPINCOUNT": value}))
    for name, rates in got.items():
        lines.append(f"GOMP_SPINCOUNT={name}: " + ", ".join(f"{r:.1f}" for r in rates) + " tok/s")
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = Path(tmp) / "synthetic.gguf"
        write_synthetic_gguf(str(synthetic), SyntheticSpec())
        model = ShardModel(str(synthetic), None, threads)
        manager = user_manager(model, 1, 4096)
        adapter = KvBoundaryAdapter(model, manager)
        n = 200 if quick else 2000
        token = adapter.prefill("o", 0, token_ids=[1, 2, 3]).token_id
        before = manager.loop_stats()
        t0 = time.perf_counter()
        for _ in range(n):
            token = adapter.decode("o", 0, token_ids=[token]).token_id
        per_step = (time.perf_counter() - t0) / n
        after = manager.loop_stats()
        busy = (after["busy_seconds"] - before["busy_seconds"]) / (after["steps"] - before["steps"])
        manager.close()
    lines.append(
        f"a lone session on a synthetic model, {n} decodes through KvBoundaryAdapter: {per_step * 1e6:.0f} us "
        f"per decode, of which the engine step {busy * 1e6:.0f} us: {(per_step - busy) * 1e6:.0f} us for the "
        "adapter, the step loop and the thread hand-offs"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/hot_path_study.py", description=__doc__.splitlines()[0])
    ap.add_argument("rounds", type=int, nargs="?", default=3)
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small shapes (for tests)")
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else require_embedded_model()
    print(hot_path_study(path, args.threads, args.rounds, args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
