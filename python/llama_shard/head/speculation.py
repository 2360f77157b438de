"""Speculative decoding on the route: the head drafts, one route step verifies, the tail accepts.

- Drafts (the head): prompt lookup. The longest n-gram (NGRAM_MAX down to NGRAM_MIN tokens) that
  ends the session's tokens and occurred before names the tokens that followed it then; those are
  the drafts. Matches of one token are right less often: they keep an acceptance rate of their own.
  No model is needed, and on text that repeats itself (a rewrite, a quote, code) they are often
  right.
- How many (the head, per stream): `DraftControl` picks k in 0..max_drafts maximising expected
  tokens per step over the step's cost, E(k) / c(k), with E(k) = 1 + a1 (1 + an + ... + an^(k-1))
  for the stream's acceptance rates (a1 of a step's first draft, an of a draft after an accepted
  one: acceptance comes in runs) and c(k) the route's measured time of a step of k + 1 tokens
  relative to a step of 1 (`StepCost`: the loop's own steps, timed by size; llama.cpp's cost is
  not linear in the rows). Where drafting does not pay, k is 0; the first draft it would have sent
  is still compared with the token the step gives (`unsent`), so the rates follow the text for free
  (a draft model, whose drafts cost a step of their own, drafts one token every PROBE_EVERY steps
  instead).
- Verification (the tail, `worker/sampling.py: verify`): row i of the step's logits is the distribution the tail would
  have sampled from had the step ended at its i-th token; it samples row by row with the session's
  sampler state exactly as one token per step would (greedy: the first largest logit), and stops at
  the first token that is not the next draft. Drafts are deterministic (q puts all its mass on the
  draft d), so the standard speculative-sampling rule (accept d with probability min(1, p(d)/q(d))
  = p(d), otherwise sample from max(0, p - q) renormalised = p without d) is exactly this: draw
  y ~ p, accept when y == d, else answer y. The tokens are the ones non-speculative generation
  draws with the same seed from the same logits.
"""

from __future__ import annotations

from .._native import MAX_LOGIT_ROWS

NGRAM_MAX = 4
NGRAM_MIN = 1
#: matches this long or longer share one acceptance rate; shorter ones (a lone token) have their own
NGRAM_LONG = 2
#: a stream whose drafting does not pay drafts one token every this many steps (to follow the text)
PROBE_EVERY = 8
#: a step size not timed yet: one more token costs this fraction of a one-token step (a guess on the
#: low side, so that a size is tried; llama.cpp measured 0.2-0.5 per shard: docs/benchmarks.md)
PRIOR_BETA = 0.15
#: a new stream starts from the rates its route's last stream ended with (generation/loops.py,
#: RouteMeasures), weighing this many observations per rate (DraftControl.learn_rates_from)
CARRIED_WEIGHT = 4.0
DRAFT_SOURCES = ("ngram", "off")
#: how a route computes a verification step: "exact", every row the bytes of a one-token step's on
#: every shard (the tokens of generation without drafts: one computation where a shard has shown it
#: gives those bytes, shard_context's whole_rows_verdicts, each row alone otherwise), or "batched",
#: all in one computation unchecked (llama.cpp may round by a computation's shape: a near-tie may flip)
VERIFY_MODES = ("exact", "batched")


class NgramDrafter:
    """Prompt lookup over one session's tokens, indexed as they grow (O(1) per token)."""

    def __init__(self):
        self._index: dict[tuple, int] = {}  # n-gram -> the position after its latest earlier occurrence
        self._indexed = 0  # n-grams ending before this index are in _index

    def propose(self, tokens: list[int], k: int, index: bool = True) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram ending the
        tokens, and that n-gram's length (0: none occurred before). `index=False`: the tokens go on
        past the session's (drafts assumed accepted): look them up without indexing them, so the
        index only ever holds the session's own tokens (its positions are read in `tokens`, which
        begin with those)."""
        n_tok = len(tokens)
        # index every n-gram that has a continuation (ends before the last token)
        for end in range(self._indexed, n_tok - 1) if index else ():
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end + 1 >= n:
                    self._index[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        if index:
            self._indexed = max(self._indexed, n_tok - 1)
        if k <= 0:
            return [], 0
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if n_tok < n:
                continue
            at = self._index.get(tuple(tokens[n_tok - n :]))
            if at is not None:
                return tokens[at : at + k], n
        return [], 0

    def reset(self) -> None:
        """The tokens were replaced (a new prompt): index them again."""
        self._index.clear()
        self._indexed = 0


class StepCost:
    """The route's step time by the tokens each stream's step carried (1 .. MAX_LOGIT_ROWS), each an
    exponential average of the loop's recent steps. A size not timed yet is priced from the largest
    smaller one timed, at PRIOR_BETA of a one-token step per extra token, or at the cost per extra
    token of the largest size timed twice where that is less (optimistic: a size is timed once
    tried, and dropped again where it does not pay; over a +50 ms link PRIOR_BETA alone priced a
    token at 17 ms where it costs about 1 ms, and the stream kept to the sizes it had timed). The
    first step of a size may carry the workers' one-time comparison of its rows (a verification
    computed both ways: shard_context's whole_rows_verdicts), so a size timed once is priced at most
    at that estimate, and its second time replaces its first."""

    DECAY = 0.8

    def __init__(self):
        self._t = [0.0] * (MAX_LOGIT_ROWS + 1)  # index: tokens per stream's step
        self._n = [0] * (MAX_LOGIT_ROWS + 1)  # steps of that size timed

    def observe(self, tokens_per_stream: int, seconds: float) -> None:
        n = min(max(tokens_per_stream, 1), MAX_LOGIT_ROWS)
        old = self._t[n]
        self._t[n] = seconds if self._n[n] < 2 else self.DECAY * old + (1 - self.DECAY) * seconds
        self._n[n] += 1

    def seconds(self, tokens_per_stream: int) -> float | None:
        """The measured time of a step of that many tokens; None until it was timed twice (a size's
        first step may carry the workers' one-time comparison of its rows)."""
        n = min(max(tokens_per_stream, 1), MAX_LOGIT_ROWS)
        return self._t[n] if self._n[n] >= 2 else None

    def relative(self) -> list[float]:
        """Cost of a step of n tokens relative to one of 1 token, for n = 1 .. MAX_LOGIT_ROWS (index n - 1)."""
        base = self._t[1]
        if base <= 0:
            return [1 + PRIOR_BETA * (n - 1) for n in range(1, MAX_LOGIT_ROWS + 1)]
        # per extra token: PRIOR_BETA of a one-token step, or less where the largest size timed twice
        # cost less a token (over a slow link most of a step is the link, not its tokens)
        per_token = PRIOR_BETA * base
        for n in range(MAX_LOGIT_ROWS, 1, -1):
            if self._n[n] >= 2:
                per_token = min(per_token, max(self._t[n] - base, 0.0) / (n - 1))
                break
        out, last_n, last = [], 1, base
        for n in range(1, MAX_LOGIT_ROWS + 1):
            estimate = last + per_token * (n - last_n)
            timed = self._t[n]  # 0.0: not timed
            if n == 1 or self._n[n] >= 2 or (timed and timed <= estimate):
                last_n, last = n, timed
                out.append(last / base)
            else:
                out.append(estimate / base)  # not timed, or once and above the estimate
        return out


class AheadTiming:
    """What a verification window sent ahead (while the step before it is still in flight) gains
    when it is kept and costs when it is dropped, as measured on the route (exponential averages,
    in seconds; generation/loops.py's `_pipeline` observes them):

    - `gain`: a kept window's reply came this much sooner than had it been sent once the reply
      before it was back (its size's step time alone, StepCost, less the time between the replies);
    - `slowdown`: a step with a window sent behind it took this much longer than alone (the
      workers compute both at once, on cores they share with the head);
    - `drop_per_row`: a dropped window held up the stream's next step this much per token it
      carried (its replies waited for before the next step may go).

    Before the route has measured one, the model pipelining started with: a kept window saves a
    one-token step, a dropped one costs its rows at the step cost of a second token, and nothing is
    slowed. That holds over a slow link, where most of a step is the link. On loopback (2 cores,
    two 1-thread workers) a kept window saved 1-4 ms of a 7 ms step, a step with one behind it
    took up to 3.7 ms longer, and a dropped window held the next step up to 4.8 ms: there a window
    ahead pays only when nearly sure to be kept. Sent at the priors' odds, in a measuring build that
    sent no drafts inside a step, 43 windows (13 kept) made the open prompts 0.81-0.90x of no drafts
    (docs/benchmarks.md)."""

    DECAY = 0.8

    def __init__(self):
        self._gain = self._slowdown = self._drop_per_row = None

    @classmethod
    def _average(cls, old: float | None, new: float) -> float:
        return new if old is None else cls.DECAY * old + (1 - cls.DECAY) * new

    def kept(self, alone_s: float, between_replies_s: float) -> None:
        self._gain = self._average(self._gain, alone_s - between_replies_s)

    def slowed(self, alone_s: float, took_s: float) -> None:
        self._slowdown = self._average(self._slowdown, took_s - alone_s)

    def dropped(self, rows: int, waited_s: float) -> None:
        if rows > 0:
            self._drop_per_row = self._average(self._drop_per_row, waited_s / rows)

    def worth(self, chance: float, rows: int, step_s: float, row_s: float) -> bool:
        """Whether a window of `rows` tokens, kept with probability `chance`, is worth sending ahead
        on a route whose one-token step takes `step_s` and whose second token costs `row_s` (the
        priors, where nothing was measured yet): chance * gain >= (1 - chance) * rows * drop + slowdown."""
        gain = step_s if self._gain is None else self._gain
        drop = row_s if self._drop_per_row is None else self._drop_per_row
        slowdown = 0.0 if self._slowdown is None else self._slowdown
        return chance * gain >= (1.0 - chance) * rows * drop + slowdown


class DraftControl:
    """One stream's number of drafts per step (see the module's docstring) and its counters.

    Acceptance comes in runs: where the text copies, a draft after an accepted one is accepted more
    often than a step's first draft. So two rates are kept, each per match kind: `rate` for a step's
    first draft, `run_rate` for a draft after an accepted one. A step of k drafts then yields
    E(k) = 1 + a1 (1 + an + ... + an^(k-1)) tokens on average, and all k are accepted with
    probability a1 an^(k-1) (a window sent ahead is kept only then). With one rate for both, the
    rewrites of the speculation benchmark drafted too little: 1.88x against 1.94x at +10 ms, replayed
    on their greedy tokens at the route's measured step costs (benchmarks/draft_control_study.py,
    docs/benchmarks.md)."""

    DECAY = 0.9

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        # [accepted, rejected] by match kind. A step's first draft: prior a = 0.25, worth a draft only
        # where one costs little (a slow link), so open text on a fast route does not pay for the rate
        # to fall (on loopback the prior a = 0.5 made requests 6% slower than no drafting;
        # docs/benchmarks.md). A draft after an accepted one: prior 0.5.
        self._first = {True: [1.0, 3.0], False: [1.0, 3.0]}
        self._run = {True: [1.0, 1.0], False: [1.0, 1.0]}
        self._idle = 0
        self._unsent_right = False  # the last step's draft, not sent, was right (a run unsent)
        self.observed = 0  # outcomes learned (sent or unsent drafts): a stream that saw none teaches nothing
        self.drafted = 0
        self.accepted = 0

    def learn_rates_from(self, other: "DraftControl", weight: float | None = None) -> None:
        """Takes another's acceptance rates: its decayed counts, scaled down to `weight` observations
        per rate where they weigh more (None: as they are). A route loop keeps the rates its last
        stream ended with and each new stream starts from them, weighing CARRIED_WEIGHT: one
        request meets few matches of each kind, and from the priors alone it drafted too little
        where the text copies; light, so that a request whose text does not repeat (after one
        that did) stops drafting after a few misses. Replayed (benchmarks/draft_control_study.py,
        15 drafts at most): the rewrites at +10 ms 2.20x against 2.14x from the priors; open
        questions right after them on loopback 0.99x (live, the rates carried whole: 0.89-0.93x)."""

        def scaled(counts: list[float]) -> list[float]:
            total = sum(counts)
            return [c * weight / total for c in counts] if weight is not None and total > weight else list(counts)

        self._first = {kind: scaled(counts) for kind, counts in other._first.items()}
        self._run = {kind: scaled(counts) for kind, counts in other._run.items()}

    def rate(self, long: bool = True) -> float:
        """The acceptance rate of a step's first draft from matches of NGRAM_LONG tokens or more (or
        of shorter ones)."""
        acc, rej = self._first[long]
        return acc / (acc + rej)

    def run_rate(self, long: bool = True) -> float:
        """The acceptance rate of a draft that follows an accepted one."""
        acc, rej = self._run[long]
        return acc / (acc + rej)

    def all_accepted(self, n: int, long: bool = True) -> float:
        """The chance that n drafts in a row, the first a step's first, are all accepted."""
        return self.rate(long) * self.run_rate(long) ** (n - 1) if n > 0 else 1.0

    def k(self, cost: list[float], long: bool = True, probe: bool = True) -> int:
        """The drafts for the next step, given the route's relative step cost by size
        (StepCost.relative) and the kind of match they come from. `probe`: where drafting does not pay,
        draft one token every PROBE_EVERY steps to follow the text (not needed where each unsent
        draft is compared for free: `unsent`)."""
        if self.max_drafts <= 0:
            return 0
        a1, an = min(self.rate(long), 0.999), min(self.run_rate(long), 0.999)
        best_k, best, e, ai = 0, 1.0, 1.0, a1
        for k in range(1, self.max_drafts + 1):
            e += ai  # ai: the chance that the k-th draft is accepted (and every one before it)
            ai *= an
            value = e / cost[k]
            if value > best:
                best_k, best = k, value
        if best_k == 0 and probe:
            self._idle += 1
            if self._idle >= PROBE_EVERY:
                self._idle = 0
                return 1
        else:
            self._idle = 0
        return best_k

    def update(self, drafted: int, accepted: int, long: bool = True, in_run: bool = False) -> None:
        """A verification's outcome: `accepted` of `drafted` drafts, the first rejected one after.
        `in_run`: the first of them followed accepted drafts (the guess of a window sent ahead)."""
        if drafted <= 0:
            return
        self._unsent_right = False
        self.drafted += drafted
        self.accepted += accepted
        self._learn(drafted, accepted, long, in_run)

    def unsent(self, right: bool, long: bool = True) -> None:
        """A draft that was not sent (k was 0) turned out right or wrong: the rate learns it for free,
        so a stream whose text starts repeating itself drafts again without waiting for a probe. It
        was a step's first draft; after a right one it also continued a run (both would have been
        drafts of one step), which the run rate learns."""
        self._learn(1, int(right), long, False)
        if self._unsent_right:
            self._learn(1, int(right), long, True)
        self._unsent_right = right

    def no_candidate(self) -> None:
        """The drafter had nothing for a step: a run of unsent right drafts ends."""
        self._unsent_right = False

    def _learn(self, drafted: int, accepted: int, long: bool, in_run: bool) -> None:
        self.observed += 1
        d = self.DECAY
        first, run = self._first[long], self._run[long]
        rejected = 1 if accepted < drafted else 0
        if not in_run:  # the first draft judged alone; the ones after it (up to the rejected one) in a run
            first[0] = d * first[0] + (1 if accepted else 0)
            first[1] = d * first[1] + (0 if accepted else 1)
            run_acc, run_rej = max(accepted - 1, 0), rejected if accepted else 0
        else:
            run_acc, run_rej = accepted, rejected
        if run_acc or run_rej:
            run[0] = d * run[0] + run_acc
            run[1] = d * run[1] + run_rej
