"""Spot checks across kernels (head/row_checks.py, receipts/tolerance.py): a stage whose only other
replica runs other CPU kernels (LLAMA_SHARD_CPU_VARIANT, so any machine has one) is replayed stage
by stage, its worker held to its own commitment and its partner to the tolerance.

- The tolerance's measure: a row's relative error, logits centred first; shapes that differ or
  values that are not finite never pass.
- On live workers over loopback (SmolLM2, a head and two tail replicas of other kernels, one thread
  each): every request of an honest route is "close", within the tolerance and above 0 (the kernels
  do round differently), and no replica is taken out.
- Each cheat of tests/support/cheats.py served as the tail, with two honest replicas of other
  kernels beside it, is caught by the first request's spot check, and only the cheat is out; fresh
  noise (its replays never repeat what it committed), and a worker that refuses every replay, by
  its third check (head/strikes.py).
- Strikes, without workers: off the CPU a miss only counts; a refusal by a worker that still answers
  Info is struck, one that does not answer or drains is not.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from llama_shard import ShardModel, cpu_backend
from llama_shard.head.row_checks import ReplyProblem, _answer
from llama_shard.head.strikes import STRIKES_OUT, Strikes
from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.proto.wire import encode_tensor
from llama_shard.receipts.tolerance import HIDDEN_TOLERANCE, LOGITS_TOLERANCE, Closeness, row_errors

from support.cheats import CHEATS, OTHER_TOKENS, REFUSE_REPLAYS, cheating_worker
from support.prompts import REPEAT

PROMPT = [1, 504, 3458, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
TAIL = (15, 29)


def test_a_worker_is_out_at_its_third_miss_among_its_last_checks_and_old_misses_slide_out():
    strikes = Strikes(window=5, limit=3, max_workers=2)
    assert [strikes.record("a", m) for m in (True, False, True)] == [1, 1, 2]
    assert not strikes.out(2) and strikes.out(3)
    assert [strikes.record("a", False) for _ in range(3)] == [2, 2, 1]  # the first miss slid out
    assert strikes.record("a", True) == 2
    strikes.record("b", True), strikes.record("c", True)  # "a", checked least recently, is forgotten
    assert strikes.record("a", True) == 1
    assert (STRIKES_OUT, Strikes().window) == (3, 20)


def test_a_row_error_is_relative_centred_for_logits_and_never_passes_what_it_cannot_compare():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 64)).astype(np.float32)
    assert row_errors(a, a).tolist() == [0.0, 0.0, 0.0]
    b = a * 1.01
    assert np.allclose(row_errors(a, b), 0.01, rtol=1e-3)
    shifted = a + 5.0  # the same distribution: a logit row is defined up to a constant
    assert row_errors(a, shifted, centered=True).max() < 1e-6 < row_errors(a, shifted).min()
    assert np.isinf(row_errors(a, a[:2])).all()
    nan = a.copy()
    nan[1, 3] = np.nan
    assert np.isinf(row_errors(a, nan)[1])
    c = Closeness()
    c.add(a, b)
    c.add(a, nan)
    assert c.rows == 6 and not c.within(max(HIDDEN_TOLERANCE, LOGITS_TOLERANCE))


def test_a_replayed_answer_that_contradicts_its_step_is_the_answerers_fault():
    """The position is the route's, never the worker's: a length that does not fit, rows of another
    count or rows that do not decode are its own answer's problem (ReplyProblem), not an unchecked
    replay."""
    rows = np.ones((2, 8), dtype=np.float32)
    req = pb.StepRequest(position=5, hidden=encode_tensor(rows))
    good = pb.StepReply(outcome=pb.OUTCOME_OK, seq_len=7, hidden=encode_tensor(rows))
    assert _answer(good, req, tail=False)[0].tolist() == rows.tolist()
    for bad in (
        pb.StepReply(outcome=pb.OUTCOME_OK, seq_len=8, hidden=encode_tensor(rows)),  # its own position
        pb.StepReply(outcome=pb.OUTCOME_OK, seq_len=7, hidden=encode_tensor(rows[:1])),
        pb.StepReply(outcome=pb.OUTCOME_OK, seq_len=7, hidden=pb.Tensor(shape=[2, 8], data=b"\0" * 5)),
        pb.StepReply(outcome=pb.OUTCOME_OK, seq_len=7, hidden=encode_tensor(rows * np.nan)),
        pb.StepReply(outcome=pb.OUTCOME_OK, seq_len=7, hidden=encode_tensor(rows[:, :4])),  # another width
        pb.StepReply(outcome=pb.OUTCOME_OK, seq_len=7, hidden=encode_tensor(rows, pb.DTYPE_FLOAT16)),
        pb.StepReply(outcome=pb.OUTCOME_OK, seq_len=7),  # a tail without its logit rows
    ):
        with pytest.raises(ReplyProblem):
            _answer(bad, req, tail=not bad.HasField("hidden"))


def _other_variant() -> str:
    """CPU kernels other than the ones this machine picks, that it can run (a lower variant: the
    picked one's features include what it needs), or a skip."""
    c = cpu_backend()
    shipped, features = set(c.get("available") or ()), set(c["features"])
    for variant, needs in (("haswell", {"AVX2", "FMA", "F16C"}), ("sandybridge", {"AVX"}), ("x64", set())):
        if variant in shipped and variant != c["variant"] and needs <= features:
            return variant
    pytest.skip("one CPU variant in this build (a source build): no other kernels to compare with")


class _Route:
    """A head (layers 0..first-1) at spot-check rate 1 and its later stages' workers, over loopback,
    one thread each."""

    def __init__(self, model, first: int, peers: list[str]):
        flags = sum((["--peer", a] for a in peers), [])
        self.proc, self.address = start_worker(
            model, 0, first - 1, port=free_port(), extra=(*flags, "--spot-check-rate", "1")
        )
        wait_serving(self.proc, self.address)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.ShardServiceStub(self.channel)
        deadline = time.monotonic() + 30
        while sorted(r.state for r in self.info().replicas) != ["up"] * len(peers):
            assert time.monotonic() < deadline, self.info().replicas
            time.sleep(0.1)

    def generate(self, sid: str, n: int = 16, prompt=PROMPT, **kw) -> tuple[pb.GenerateFinal, pb.RouteReceipt]:
        req = pb.GenerateRequest(session_id=sid, prompt=prompt, max_tokens=n, receipt=True, **kw)
        final = list(self.stub.Generate(req))[-1].final
        assert final.finish_reason == "length" and final.receipt_verdict == "verified", final
        r = pb.RouteReceipt()
        r.ParseFromString(final.receipt)
        return final, r

    def info(self) -> pb.InfoReply:
        return self.stub.Info(pb.InfoRequest(), timeout=10)

    def stop(self) -> None:
        self.channel.close()
        stop_worker(self.proc)


@pytest.mark.model
@pytest.mark.grpc
def test_an_honest_route_across_kernels_is_close_and_no_replica_is_out(embedded_model):
    """Three stages: the head (0-9), then 10-19 and 20-29, each held by this machine's kernels and
    another variant's: each stage is judged on its own inputs, hidden rows and logit rows alike."""
    env = {"LLAMA_SHARD_CPU_VARIANT": _other_variant()}
    tails = [start_worker(embedded_model, 20, 29), start_worker(embedded_model, 20, 29, env=env)]
    to_tails = sum((["--peer", a] for _, a in tails), [])
    mids = [
        start_worker(embedded_model, 10, 19, extra=tuple(to_tails)),
        start_worker(embedded_model, 10, 19, extra=tuple(to_tails), env=env),
    ]
    workers = tails + mids
    route = None
    try:
        for proc, address in workers:
            wait_serving(proc, address)
        route = _Route(embedded_model, 10, [a for _, a in workers])
        seeded = pb.Sampling(temperature=0.8, top_k=40, seed=5)
        # a rewrite, so that drafts are made and pay on any machine (whether they pay is timed: a
        # short open answer drafted none on a Sapphire Rapids)
        rewrite = {"max_drafts": 4, "prompt": ShardModel(str(embedded_model), (0, 0), 1).tokenize(REPEAT)}
        errors = []
        for sid, n, kw in (("greedy", 16, {}), ("seeded", 16, {"sampling": seeded}), ("drafts", 32, rewrite)):
            final, r = route.generate(sid, n, **kw)
            if sid == "drafts":  # verifications ran: their logit rows were compared too
                assert final.drafted_tokens > 0, final
            assert [c.stage for c in r.spot_checks] == [1, 2], r.spot_checks
            for c, tolerance in zip(r.spot_checks, (HIDDEN_TOLERANCE, LOGITS_TOLERANCE)):
                assert c.outcome.startswith("close"), c
                assert c.replica != c.worker and c.tolerance == pytest.approx(tolerance)
                assert c.max_error <= c.tolerance, c
                errors.append(c.max_error)
        # other kernels: close, not equal (hidden rows may be, over a short session: the kernels that
        # differ here are attention's, which differ with its length, and the logits' matrix product)
        assert max(errors) > 0, errors
        info = route.info()
        assert (info.spot_checks, info.spot_check_failures) == (3, 0)
        assert all(r.state == "up" for r in info.replicas)
    finally:
        if route is not None:
            route.stop()
        for proc, _ in workers:
            stop_worker(proc)


@pytest.fixture(scope="module")
def other_tails(embedded_model):
    """Two honest tails (15-29) on other kernels than this machine's, shared by the slow tests."""
    env = {"LLAMA_SHARD_CPU_VARIANT": _other_variant()}
    procs = [start_worker(embedded_model, *TAIL, env=env) for _ in range(2)]
    try:
        for proc, address in procs:
            wait_serving(proc, address)
        yield [address for _, address in procs]
    finally:
        for proc, _ in procs:
            stop_worker(proc)


def _honest_info(model) -> pb.InfoReply:
    """An honest tail's Info on this machine's kernels (what a cheat claims to be)."""
    proc, address = start_worker(model, *TAIL)
    try:
        wait_serving(proc, address)
        with grpc.insecure_channel(address) as ch:
            return pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10)
    finally:
        stop_worker(proc)


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
@pytest.mark.parametrize("cheat", (*CHEATS, OTHER_TOKENS, REFUSE_REPLAYS))
def test_a_cheating_tail_is_caught_against_replicas_of_other_kernels(embedded_model, other_tails, tmp_path, cheat):
    worker = cheating_worker(embedded_model, *TAIL, cheat, _honest_info(embedded_model), tmp_path)
    route = _Route(embedded_model, TAIL[0], [worker.address, *other_tails])
    try:
        [check] = route.generate(f"{cheat}-1")[1].spot_checks
        assert check.worker == worker.address, check  # the first route takes the first peer
        if cheat in ("noise", REFUSE_REPLAYS):  # fresh noise each time: it cannot repeat what it
            # committed; or no answer to its replays, twice each: a strike, out at the third (honest
            # workers were seen to miss, 3 times in two runs)
            checks = [check]
            for k in range(2, 12):
                if len(checks) == STRIKES_OUT:
                    break
                assert all(r.state == "up" for r in route.info().replicas)
                checks += [
                    c for c in route.generate(f"{cheat}-strike-{k}")[1].spot_checks if c.worker == worker.address
                ]
            said, did = (
                ("unchecked: its worker did not repeat the rows it committed", "did not repeat the rows it committed")
                if cheat == "noise"
                else ("unchecked: stage 1's worker answered its replay OUTCOME_BUDGET_EXCEEDED", "refused its replay")
            )
            assert [c.outcome for c in checks[:-1]] == [
                f"{said}{': the KV budget is full' if cheat == REFUSE_REPLAYS else ''} "
                f"(strike {k} of {STRIKES_OUT} in its last 20 checks)"
                for k in (1, 2)
            ], checks
            assert checks[-1].outcome == f"mismatch: its worker {did} (3 times)"
        elif cheat == OTHER_TOKENS:  # its tokens are not its logits'
            assert check.outcome.startswith("mismatch: its worker's answer contradicted itself"), check
        else:  # a third replica of other kernels says which of the two is wrong
            assert check.outcome.startswith("mismatch") and "(arbitrated by" in check.outcome, check
            assert check.max_error > check.tolerance, check
        states = {r.address: r.state for r in route.info().replicas}
        assert states == {worker.address: "failed-check", other_tails[0]: "up", other_tails[1]: "up"}, states
        [again] = route.generate(f"{cheat}-2")[1].spot_checks
        assert again.worker != worker.address and again.outcome.startswith("equal"), again
    finally:
        route.stop()
        worker.stop()


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
def test_a_dishonest_partner_cannot_frame_an_honest_worker(embedded_model, tmp_path):
    """The route's worker (other kernels) is honest, its only partner of other kernels than its own
    cheats (a layer skipped); the third replica, of the cheat's kernels but honest, says which."""
    info = _honest_info(embedded_model)
    cheat = cheating_worker(embedded_model, *TAIL, "skip_layer", info, tmp_path)
    # fresh workers, none holding a session: the first route takes the first peer
    mine = start_worker(embedded_model, *TAIL, env={"LLAMA_SHARD_CPU_VARIANT": _other_variant()})
    honest = start_worker(embedded_model, *TAIL)
    for proc, address in (mine, honest):
        wait_serving(proc, address)
    route = _Route(embedded_model, TAIL[0], [mine[1], cheat.address, honest[1]])
    try:
        [check] = route.generate("framed")[1].spot_checks
        assert (check.worker, check.replica) == (mine[1], cheat.address), check
        assert check.outcome.startswith("mismatch"), check
        assert f"arbitrated by {honest[1]}: {cheat.address} out" in check.outcome, check
        states = {r.address: r.state for r in route.info().replicas}
        assert states == {mine[1]: "up", cheat.address: "failed-check", honest[1]: "up"}, states
    finally:
        route.stop()
        cheat.stop()
        for proc, _ in (mine, honest):
            stop_worker(proc)


class _Unreachable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class _Peers:
    """What a head's proofs ask a worker after it refused a replay: its Info (None: no answer)."""

    def __init__(self):
        self.answer: pb.InfoReply | None = None

    def info(self, address: str, timeout: float) -> pb.InfoReply:
        if self.answer is None:
            raise _Unreachable()
        return self.answer


class _Replicas:
    def __init__(self):
        self.cpu, self.taken_out = True, []

    def on_cpu(self, address: str) -> bool:
        return self.cpu

    def fail_check(self, address: str, why: str) -> None:
        self.taken_out.append(address)


def test_a_refusal_is_struck_unless_its_worker_restarted_or_its_input_came_from_a_replay():
    """After its second refusal: a worker whose Info answers, or does not, is struck (a cheat could
    fail its Info after each refusal); one that restarted since the request, or whose refusal its
    replayed input can cause, is not. Off the CPU, rows that differ from its commitment only count."""
    from llama_shard.head.proofs import RouteProofs
    from llama_shard.head.row_checks import StageRows

    peers, replicas = _Peers(), _Replicas()
    proofs = RouteProofs(None, None, b"", replicas, peers)
    hop = pb.Hop(address="w:1", recipe_fingerprint="r1")
    said = "unchecked: stage 2's worker answered its replay OUTCOME_INTERNAL"
    try:

        def refused(fed_by_replay: bool = False) -> str:
            c = pb.SpotCheck(stage=2, worker=hop.address)
            stage = StageRows(hop, None, False, True, refused=said[len("unchecked: ") :], refusal="OUTCOME_INTERNAL")
            proofs._refused(c, stage, fed_by_replay, "instance-1")
            return c.outcome

        assert refused(fed_by_replay=True) == f"{said} (its input came from the replay of the stage before; not blamed)"
        peers.answer = pb.InfoReply(instance_id="instance-2")
        assert refused() == f"{said} (it restarted since the request; not blamed)"
        assert replicas.taken_out == []
        peers.answer = None  # no answer excuses nothing
        assert (
            refused()
            == f"{said} (its Info does not answer either: UNAVAILABLE) (strike 1 of {STRIKES_OUT} in its last 20 checks)"
        )
        replicas.cpu = False  # off the CPU, rows that differ from its commitment only count...
        c = pb.SpotCheck(stage=1, worker=hop.address)
        proofs._not_repeated(c, "rows")
        assert c.outcome == "unchecked: its worker did not repeat the rows it committed (off the CPU: not known to)"
        peers.answer = pb.InfoReply(instance_id="instance-1", draining=True)  # ...refusals do not
        assert refused() == f"{said} (strike 2 of {STRIKES_OUT} in its last 20 checks)"
        assert replicas.taken_out == []
        assert refused() == "mismatch: its worker refused its replay (3 times)"
        assert replicas.taken_out == [hop.address]
    finally:
        proofs.close()


def test_a_row_replay_refused_is_asked_again_and_only_a_stage_refused_both_times_can_be_blamed(monkeypatch):
    """The replay runs once more after a refusal; a stage is blamed only when its worker refused both
    times (the first replay may have stopped before a later stage was ever asked)."""
    from llama_shard.head import proofs as proofs_module
    from llama_shard.head.row_checks import RowReplay

    attempts: list[set[int]] = []  # which stages refuse, attempt by attempt

    def run(self, stages, steps, numerics):
        mine = attempts.pop(0)
        for i in sorted(mine)[:1]:  # a replay stops at its first refusal
            stages[i].refused, stages[i].refusal = f"stage {i + 1} refused", "OUTCOME_BUDGET_EXCEEDED"
            return stages[i].refused
        return None

    monkeypatch.setattr(RowReplay, "run", run)
    monkeypatch.setattr(proofs_module, "REFUSED_PAUSE_S", 0.0)
    proofs = proofs_module.RouteProofs(None, None, b"", _Replicas(), _Peers())
    route = [pb.Hop(address=f"w:{i}") for i in (1, 2)]
    try:
        for plan, blamed in (
            ([set(), {0}], set()),  # answered the first time: never asked again
            ([{0}, set()], set()),  # refused once, then answered
            ([{0}, {1}], set()),  # stage 2 was never asked the first time
            ([{1}, {1}], {1}),
        ):
            attempts[:] = plan
            _, stages, why, refused = proofs._replay_rows(route, [], [None, None], route[::-1], "n")
            assert refused == blamed and (why is None) == (not any(s.refused for s in stages)), plan
            assert len(attempts) == (1 if plan[0] == set() else 0), plan
    finally:
        proofs.close()
