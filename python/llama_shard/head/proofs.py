"""A head's proofs of its route's work, per Generate request (docs/security.md, "Receipts and spot
checks"):

- every request carries a fresh nonce (`RequestProof`); every worker commits to the bytes its steps
  took in and sent out under it (receipts/chain.py). When the request ends, the head collects the
  route's signed receipts (one chained call), checks them against each other and against the keys
  its workers showed it (receipts/verify.py), and answers with its verdict (and the receipt when
  asked) in the final event;
- at `spot_check_rate`, it also keeps the steps it sent to its first later stage and replays them,
  as they were, on a route of other replicas of the same layers, numerics and backend, then demands
  that each replica's commitments equal the route's: equal bytes, not a tolerance. A worker whose
  bytes differ is out of routes (Replicas.fail_check) and counted. Where a stage's only other
  replica runs other kernels, the replay goes stage by stage instead (head/row_checks.py) and that
  stage is held to a tolerance.

The work runs on a small pool of its own, after the stream's last token: a stream's scheduler never
waits for a receipt, and a reader gets its final event once its receipt is checked."""

from __future__ import annotations

import random
import secrets
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import Counter

from ..proto import shard_pb2 as pb
from ..receipts.chain import NONCE_BYTES, ReceiptChains
from ..receipts.verify import check_route, stage_bodies
from ..worker import DEFAULT_MAX_HOP_S
from .row_checks import RowReplay, StageRows
from .strikes import Strikes

#: how long collecting a route's receipts, or one replayed step, may take
RECEIPT_TIMEOUT_S = 10.0
#: requests whose receipts are checked at once (the rest wait their turn in the pool's queue)
PROOF_THREADS = 2
#: spot checks replayed at once, and waiting: past it a request chosen for one is not checked
#: ("unchecked: the head's spot checks are behind"), so replays never hold other requests' verdicts
CHECK_THREADS, MAX_PENDING_CHECKS = 1, 4
#: a request's last pipelined windows may still be on their way back when it ends: each stage
#: commits a step once the route behind it answered, so a receipt read too early can see a step at
#: the tail that the head has not committed yet. Read again after these pauses before saying no.
RECOLLECT_S = (0.05, 0.1, 0.2, 0.4)
#: a route's worker that refused its row replay is asked once more after this pause (a step of its
#: replay may meet a full queue, or its session an eviction, on a loaded worker)
REFUSED_PAUSE_S = 1.0
#: a row replay's step may take as long as a live chained step may hold a worker (a long prefill on
#: a slow worker must not time out into a refusal)
REPLAY_STEP_S = DEFAULT_MAX_HOP_S
#: refusals a stage's input can cause (rows from the replay of the stage before, not yet checked)
INPUT_REFUSALS = ("OUTCOME_INVALID_ARGUMENT", "OUTCOME_INTERNAL")
VERIFIED = "verified"


class RequestProof:
    """A stream's part: its request's nonce, whether its caller wants the receipt, whether its
    steps are kept for a spot check."""

    __slots__ = ("nonce", "wanted", "spot_check")

    def __init__(self, nonce: bytes, wanted: bool, spot_check: bool):
        self.nonce, self.wanted, self.spot_check = nonce, wanted, spot_check


NO_PROOF = RequestProof(b"", False, False)  # a head without receipts (serve --no-receipts)


def _same_output(a: pb.ReceiptBody, b: pb.ReceiptBody, tail: bool) -> bool:
    """Whether two commitments of a stage to the same input agree: the rows it sent on, and at the
    tail the tokens it answered (every stage sees the tail's answer pass: only the tail is judged
    by it)."""
    return a.out_chain == b.out_chain and (not tail or a.answer_chain == b.answer_chain)


def _log(message: str) -> None:
    print(f"llama-shard head: {message}", file=sys.stderr, flush=True)


class RouteProofs:
    """Collects, checks and spot-checks the receipts of a head's requests.

    `receipts(principal, request, deadline)`: the head's own stage's receipt, then its route's
    (ShardServicer.own_receipts); `recorder`: the head's StepRunner's ReceiptChains (the steps it
    sent on); `own_key`: the head's receipt key; `replicas`: the later stages (None: a head alone);
    `peers`: how the head reaches them."""

    def __init__(
        self,
        receipts: Callable[[str, pb.ReceiptRequest, float], pb.ReceiptReply],
        recorder: ReceiptChains,
        own_key: bytes,
        replicas,
        peers,
        spot_check_rate: float = 0.0,
        registry=None,
    ):
        self.receipts, self.recorder, self.own_key = receipts, recorder, own_key
        self.replicas, self.peers = replicas, peers
        self.spot_check_rate = spot_check_rate
        self._pool = ThreadPoolExecutor(PROOF_THREADS, thread_name_prefix="proofs")
        self._checks = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="spot-checks")
        self._pending_checks = 0
        self._lock = threading.Lock()
        self.spot_checks = self.spot_check_failures = self.receipt_failures = 0
        self.strikes = Strikes()  # workers that refused their row replays, or (a CPU's) did not repeat their rows
        self._outcomes = (
            Counter(
                "llama_shard_spot_checks",
                "Requests the head replayed on other replicas, by outcome (equal, close, mismatch, unchecked)",
                ["outcome"],
                registry=registry,
            )
            if registry is not None
            else None
        )
        self._receipts = (
            Counter(
                "llama_shard_receipts", "Route receipts the head checked, by verdict", ["verdict"], registry=registry
            )
            if registry is not None
            else None
        )

    def open(self, req: pb.GenerateRequest) -> RequestProof:
        nonce = secrets.token_bytes(NONCE_BYTES)
        spot = self.spot_check_rate > 0 and random.random() < self.spot_check_rate
        if spot:
            self.recorder.record(nonce)
        return RequestProof(nonce, req.receipt, spot)

    def settle(self, s, final: pb.GenerateFinal, put: Callable[[pb.GenerateFinal], None]) -> None:
        """Checks a finished stream's receipts (and spot-checks it when chosen) on the pool, then
        `put`s its final event with the verdict. Only a request that ended as asked (stop, length) on
        the route it started on has receipts to check."""
        proof = s.out.proof
        if final.finish_reason not in ("stop", "length"):
            self.recorder.recorded(proof.nonce)
            put(final)
            return
        if s.place.failovers or s.place.moves:
            self.recorder.recorded(proof.nonce)
            final.receipt_verdict = "not verified: the route changed during the request (a failover or a move)"
            put(final)
            return
        route = list(s.place.route)
        request = pb.ReceiptRequest(
            session_id=s.req.session_id, route_epoch=s.req.route_epoch, nonce=proof.nonce, forward=route
        )

        def answer(receipt: pb.RouteReceipt | None, verdict: str) -> None:
            final.receipt_verdict = verdict
            if proof.wanted and receipt is not None:
                final.receipt = receipt.SerializeToString(deterministic=True)
            put(final)

        def check(receipt: pb.RouteReceipt, verdict: str) -> None:
            try:
                receipt.spot_checks.extend(self._spot_check(route, receipt, proof.nonce))
            except Exception as e:  # noqa: BLE001 - the reader gets its final event whatever failed here
                receipt.spot_checks.append(pb.SpotCheck(outcome=f"unchecked: {type(e).__name__}: {e}"))
            finally:
                self.recorder.recorded(proof.nonce)
                with self._lock:
                    self._pending_checks -= 1
                answer(receipt, verdict)

        def work() -> None:
            receipt, verdict = None, "not verified"
            try:
                receipt, verdict = self._collect(s.principal, request, route)
                if proof.spot_check and verdict == VERIFIED:
                    with self._lock:
                        room = self._pending_checks < MAX_PENDING_CHECKS
                        self._pending_checks += room
                    if room:
                        self._checks.submit(check, receipt, verdict)
                        return
                    checks = [pb.SpotCheck(stage=i, worker=h.address) for i, h in enumerate(route, start=1)]
                    receipt.spot_checks.extend(self._counted(checks, "unchecked: the head's spot checks are behind"))
            except Exception as e:  # noqa: BLE001 - the reader gets its final event whatever failed here
                verdict = f"not verified: {type(e).__name__}: {e}"
            self.recorder.recorded(proof.nonce)
            answer(receipt, verdict)

        self._pool.submit(work)

    # --- receipts ------------------------------------------------------------------------------

    def _keys(self, route: list[pb.Hop]) -> list[bytes | None]:
        keys: list[bytes | None] = [self.own_key]
        for hop in route:
            keys.append(self.replicas.receipt_key(hop.address) if self.replicas is not None else None)
        return keys

    def _collect(self, principal: str, request: pb.ReceiptRequest, route) -> tuple[pb.RouteReceipt, str]:
        for pause in (*RECOLLECT_S, None):
            reply = self.receipts(principal, request, time.monotonic() + RECEIPT_TIMEOUT_S)
            receipt = pb.RouteReceipt(nonce=request.nonce, stages=reply.receipts)
            if reply.detail:
                verdict = f"not verified: stage {reply.stage} gave no receipt: {reply.detail}"
            else:
                problems = check_route(receipt, keys=self._keys(route), nonce=request.nonce)
                verdict = VERIFIED if not problems else "not verified: " + "; ".join(problems[:4])
            if verdict == VERIFIED or pause is None:
                break
            time.sleep(pause)  # (a step still on its way back: RECOLLECT_S)
        if verdict != VERIFIED:
            with self._lock:
                self.receipt_failures += 1
            _log(f"a route receipt did not verify (route {[h.address for h in route]}): {verdict}")
        if self._receipts is not None:
            self._receipts.labels("verified" if verdict == VERIFIED else "failed").inc()
        return receipt, verdict

    # --- spot checks ---------------------------------------------------------------------------

    def _spot_check(self, route: list[pb.Hop], receipt: pb.RouteReceipt, nonce: bytes) -> list[pb.SpotCheck]:
        steps = self.recorder.recorded(nonce)
        checks = [pb.SpotCheck(stage=i, worker=hop.address) for i, hop in enumerate(route, start=1)]
        why = self._unreplayable(route, steps)
        partners = [self.replicas.check_partner(hop.address) if self.replicas is not None else None for hop in route]
        others = [
            self.replicas.check_partner(hop.address, exact=False) if p is None and self.replicas is not None else None
            for hop, p in zip(route, partners)
        ]
        if why is None and not any(partners) and not any(others):
            why = "no other replica of its layers and numerics"
        if why is not None:
            return self._counted(checks, f"unchecked: {why}")
        if any(others):  # a stage held to a tolerance: replayed stage by stage (head/row_checks.py)
            return self._row_check(route, receipt, steps, partners, others, checks)
        check_route = [p or hop for p, hop in zip(partners, route)]
        for c, p in zip(checks, partners):
            c.replica = p.address if p is not None else ""
        replayed = self._replay(check_route, steps)
        if isinstance(replayed, str):
            return self._counted(checks, f"unchecked: {replayed}")
        bodies, _ = stage_bodies(receipt)
        mine, problems = stage_bodies(replayed)
        if problems or len(mine) != len(route):
            return self._counted(checks, "unchecked: the replicas' receipts do not verify")
        last = len(checks) - 1
        for i, (c, orig, again) in enumerate(zip(checks, bodies[1:], mine)):
            if again.in_chain != orig.in_chain:  # an earlier stage's rows differed: reported there
                c.outcome = "unchecked: its input differed in the replay"
            elif not _same_output(orig, again, i == last):
                c.outcome = "mismatch"
            elif partners[i] is None:
                c.outcome = "unchecked: replayed on the same worker (no other replica): it repeats itself"
            else:
                c.outcome = "equal"
        for i, c in enumerate(checks):
            if c.outcome == "mismatch":
                self._blame(c, bodies[i + 1], mine[i], check_route, i, steps)
        return self._counted(checks, None)

    def _blame(self, c: pb.SpotCheck, orig: pb.ReceiptBody, again: pb.ReceiptBody, route, i: int, steps) -> None:
        """Two workers of a stage gave other bytes for the same input: a third replica of equal
        bytes, where there is one, says which (the one it disagrees with is out of routes); without
        one, both are (each may be the one that lies). A worker that replayed on itself is out."""
        if not c.replica:
            blamed = [c.worker]
        else:
            third = self.replicas.check_partner(c.worker, avoid=(c.replica,))
            blamed = [c.worker, c.replica]
            if third is not None:
                replayed = self._replay([*route[:i], third, *route[i + 1 :]], steps)
                bodies = stage_bodies(replayed)[0] if not isinstance(replayed, str) else []
                if len(bodies) == len(route) and bodies[i].in_chain == orig.in_chain:
                    tail = i == len(route) - 1
                    if _same_output(bodies[i], orig, tail):
                        blamed = [c.replica]
                    elif _same_output(bodies[i], again, tail):
                        blamed = [c.worker]
                c.outcome = f"mismatch (arbitrated by {third.address}: {', '.join(blamed)} out of routes)"
        self._take_out(
            blamed,
            f"its bytes differed in a spot check of stage {c.stage} ({c.worker} against {c.replica or 'itself'})",
        )

    def _row_check(self, route, receipt, steps, partners, others, checks: list[pb.SpotCheck]) -> list[pb.SpotCheck]:
        """The spot check of a route where a stage's only other replica computes on other kernels."""
        bodies, problems = stage_bodies(receipt)
        if problems or len(bodies) != len(route) + 1:
            return self._counted(checks, "unchecked: the route's receipt does not verify")
        replay, stages, why, refused_before = self._replay_rows(route, steps, partners, others, bodies[0].numerics)
        for c, stage in zip(checks, stages):
            c.replica = stage.partner.address if stage.partner is not None else ""
        if why is not None:
            for i, (c, stage, orig) in enumerate(zip(checks, stages, bodies[1:])):
                if stage.worker_failed:  # its own answer contradicted itself: it alone is out
                    c.outcome = f"mismatch: its worker's answer contradicted itself: {stage.worker_failed}"
                    self._take_out([c.worker], f"its answer contradicted itself in a spot check of stage {c.stage}")
                elif stage.refused and i in refused_before:
                    self._refused(c, stage, i > 0, orig.instance_id)
                else:
                    c.outcome = f"unchecked: {why}"
            return self._counted(checks, None)
        for c, stage, orig in zip(checks, stages, bodies[1:]):
            again = pb.ReceiptBody()
            stage.commitment.fill(again)
            if again.in_chain != orig.in_chain:  # an earlier stage's rows differed: reported there
                c.outcome = "unchecked: its input differed in the replay"
                continue
            if not _same_output(orig, again, stage.tail):
                self._not_repeated(c, "rows" if again.out_chain != orig.out_chain else "tokens")
                continue
            self.strikes.record(c.worker, False)  # it answered and repeated: its window of checks slides on
            if stage.partner is None:
                c.outcome = "unchecked: no other replica of its layers and numerics"
            elif stage.partner_failed:
                c.outcome = f"mismatch: {stage.partner_failed}"
                self._take_out([c.replica], f"its answer contradicted itself in a spot check of stage {c.stage}")
            elif not stage.compared:
                c.outcome = f"unchecked: {stage.stopped}"
            else:
                self._compared(c, stage, replay)
        return self._counted(checks, None)

    def _replay_rows(self, route, steps, partners, others, numerics: str) -> tuple:
        """Replays the route's stages (RowReplay); where a worker refused, all of it once more after
        REFUSED_PAUSE_S. Returns the last replay and its stages, why it did not complete (None: it
        did) and the stages whose worker refused the first time as well (the only ones a refusal can
        blame)."""
        last, refused_before = len(route) - 1, set()
        for attempt in (1, 2):
            stages = [
                StageRows(hop, p or o, p is not None, i == last)
                for i, (hop, p, o) in enumerate(zip(route, partners, others))
            ]
            replay = RowReplay(self.peers, REPLAY_STEP_S)
            why = replay.run(stages, steps, numerics)
            refused = {i for i, stage in enumerate(stages) if stage.refused}
            if why is None or not refused or attempt == 2:
                return replay, stages, why, refused_before & refused
            refused_before = refused
            time.sleep(REFUSED_PAUSE_S)
        raise AssertionError("unreachable")

    def _repeats(self, worker: str) -> bool:
        """Whether `worker` is held to repeating its rows: a CPU's are the same bytes batched or alone."""
        return self.replicas is not None and self.replicas.on_cpu(worker)

    def _not_repeated(self, c: pb.SpotCheck, what: str) -> None:
        """A route's worker did not repeat what it committed to. Other tokens from the rows it
        committed are its own doing (a tail draws them from its rows and the step's sampler state
        alone): out. Other rows are a strike against a CPU worker (head/strikes.py: out at the
        third among its last checks); off the CPU rows are not known to repeat: counted."""
        if what == "rows":
            c.outcome = f"unchecked: its worker did not repeat the {what} it committed"
            if not self._repeats(c.worker):
                c.outcome += " (off the CPU: not known to)"
                self.strikes.record(c.worker, False)  # it answered: its window slides on
                return
            self._strike(c, f"did not repeat the {what} it committed")
            return
        c.outcome = f"mismatch: its worker did not repeat the {what} it committed"
        self._take_out([c.worker], f"it did not repeat its committed {what} in a spot check of stage {c.stage}")

    def _refused(self, c: pb.SpotCheck, stage: StageRows, fed_by_replay: bool, instance_id: str) -> None:
        """A route's worker refused its row replay twice (`stage.refused`: the last refusal). It is
        struck (head/strikes.py): a worker can tell a replay apart, and refusing them all would
        otherwise keep a cheat unchecked for free. Not blamed: a worker that restarted since it
        signed the request (its Info names another instance than `instance_id`), and one whose
        refusal its input can cause where that input is the replay of the stage before
        (`fed_by_replay`: rows not checked yet). A worker that drains, or whose Info does not answer,
        is struck too: a cheat could say as much after each refusal."""
        c.outcome = f"unchecked: {stage.refused}"
        if fed_by_replay and stage.refusal in INPUT_REFUSALS:
            c.outcome += " (its input came from the replay of the stage before; not blamed)"
            return
        try:
            info = self.peers.info(c.worker, RECEIPT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - no answer at all excuses nothing
            code = e.code().name if isinstance(e, grpc.RpcError) else type(e).__name__
            c.outcome += f" (its Info does not answer either: {code})"
        else:
            if instance_id and info.instance_id and info.instance_id != instance_id:
                c.outcome += " (it restarted since the request; not blamed)"
                return
        self._strike(c, "refused its replay")

    def _strike(self, c: pb.SpotCheck, what: str) -> None:
        """One strike against `c.worker` for `what` it did (head/strikes.py): `c.outcome` says
        which strike, or at the limit the mismatch that takes the worker out of routes."""
        misses = self.strikes.record(c.worker, True)
        _log(f"worker {c.worker} {what} in a spot check of stage {c.stage}")
        if not self.strikes.out(misses):
            c.outcome += f" (strike {misses} of {self.strikes.limit} in its last {self.strikes.window} checks)"
            return
        c.outcome = f"mismatch: its worker {what} ({misses} times)"
        self._take_out([c.worker], f"it {what} in {misses} spot checks")

    def _compared(self, c: pb.SpotCheck, stage: StageRows, replay: RowReplay) -> None:
        if not stage.exact:
            c.max_error, c.tolerance = stage.closeness.max_error, stage.tolerance
        agrees = stage.agrees()
        c.outcome = ("equal" if stage.exact else "close") if agrees else "mismatch"
        if stage.stopped:
            c.outcome += f" (compared until {stage.stopped})"
        elif stage.parted:  # sampled near a tie: its cells follow the route's rows all the same
            c.outcome += f" (its replica's tokens parted at {stage.parted} of {stage.compared} steps)"
        if agrees:
            return
        blamed, found = [c.worker, c.replica], "no third replica to arbitrate"
        third = self.replicas.check_partner(c.worker, avoid=(c.replica,)) or self.replicas.check_partner(
            c.worker, avoid=(c.replica,), exact=False
        )
        if third is not None:
            exact = tuple(self.replicas.same_kernels(third.address, a) for a in (c.worker, c.replica))
            repeats = tuple(self.replicas.on_cpu(a) for a in (c.worker, c.replica))
            blamed, found = replay.arbitrate(stage, third, exact, repeats)
        c.outcome += f" ({found}: {', '.join(blamed)} out of routes)"
        how = (
            "bytes differed"
            if stage.exact
            else f"rows differed past the tolerance ({c.max_error:.3g} > {c.tolerance:.3g})"
        )
        self._take_out(blamed, f"its {how} in a spot check of stage {c.stage} ({c.worker} against {c.replica})")

    def _take_out(self, addresses: list[str], detail: str) -> None:
        for address in addresses:
            _log(f"worker {address} failed a spot check: {detail}; out of routes")
            if self.replicas is not None:
                self.replicas.fail_check(address, detail)

    def _counted(self, checks: list[pb.SpotCheck], outcome: str | None) -> list[pb.SpotCheck]:
        for c in checks:
            if outcome is not None:
                c.outcome = outcome
        failed = any(c.outcome.startswith("mismatch") for c in checks)
        with self._lock:
            self.spot_checks += 1
            self.spot_check_failures += failed
        if self._outcomes is not None:
            passed = [c.outcome.split(" ")[0] for c in checks if c.outcome.startswith(("equal", "close"))]
            label = "mismatch" if failed else "close" if "close" in passed else "equal" if passed else "unchecked"
            self._outcomes.labels(label).inc()
        return checks

    @staticmethod
    def _unreplayable(route: list[pb.Hop], steps: list | None) -> str | None:
        """Why the kept steps cannot be replayed on another replica (None: they can)."""
        if not route:
            return "the head has no later stage"
        if not steps:
            return "its steps were not kept (pushed out by newer requests)"
        first = steps[0][1]
        if not first.HasField("position") or first.position != 0:
            return "the request continued its session (its first positions came from an earlier request)"
        if any(req.HasField("prefix") and req.prefix.open_tokens for _, req in steps):
            return "the request opened a shared prefix"
        if any(req.HasField("sampler") and len(req.sampler.generated_digest) for _, req in steps):
            return "the tail kept its grammar's state (a replica holds none)"
        return None

    def _replay(self, route: list[pb.Hop], steps: list) -> pb.RouteReceipt | str:
        """Sends the kept steps as they were down `route` as a new session of the head's own, then
        reads their receipts; the receipts, or why the replay did not complete. The session is
        released everywhere afterwards."""
        session_id = secrets.token_hex(12)  # a session like any other to the replicas
        nonce = secrets.token_bytes(NONCE_BYTES)
        first, rest = route[0], route[1:]
        try:
            for kind, sent in steps:
                req = pb.StepRequest()
                req.CopyFrom(sent)
                req.session_id, req.route_epoch, req.receipt_nonce = session_id, 1, nonce
                req.recipe_fingerprint = first.recipe_fingerprint
                req.ClearField("prefix")  # nothing is stored for a check
                del req.handed_from[:]
                req.follows = False  # sent one after another
                [reply] = self.peers.call(first.address, [(kind, req)], rest, RECEIPT_TIMEOUT_S, False)
                if reply.outcome != pb.OUTCOME_OK:
                    name = pb.Outcome.Name(reply.outcome)
                    return f"stage {reply.stage + 1} of the replay answered {name}: {reply.detail[:200]}"
            got = self.peers.receipt(
                first.address,
                pb.ReceiptRequest(session_id=session_id, route_epoch=1, nonce=nonce, forward=rest),
                RECEIPT_TIMEOUT_S,
            )
            if got.detail:
                return f"stage {got.stage + 1} of the replay gave no receipt: {got.detail}"
            return pb.RouteReceipt(nonce=nonce, stages=got.receipts)
        except grpc.RpcError as e:
            return f"the replay could not reach its route: {e.code().name}"
        finally:
            for hop in route:
                try:
                    self.peers.release(hop.address, session_id, 1, RECEIPT_TIMEOUT_S)
                except grpc.RpcError:
                    pass  # its TTL frees it

    def info_fields(self) -> dict:
        with self._lock:
            return {
                "spot_checks": self.spot_checks,
                "spot_check_failures": self.spot_check_failures,
                "receipt_failures": self.receipt_failures,
            }

    def close(self) -> None:
        self._checks.shutdown(wait=False, cancel_futures=False)
        self._pool.shutdown(wait=False, cancel_futures=False)
