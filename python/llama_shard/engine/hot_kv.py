"""The Hot KV State contract: keys, configuration, recipes, misses and the values a step returns.

A shard keeps KV state for many route sessions, each keyed by `(route_session_id, route_epoch)`.
Expected outcomes are values: a step that cannot be served from cache returns a `CacheMiss` with
a reason, and the head re-prefills from token zero. A stale epoch, an incompatible KV recipe and a
step that cannot fit even alone raise (the seed contract's exceptions); caller mistakes raise
`InvalidInputError`. Both the native engine and the numpy reference engine satisfy this contract.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from .._native import MAX_EPOCH, MAX_LOGIT_ROWS, MAX_SESSION_ID_BYTES, HotKvConfig, StepKind, Tier, cpu_backend
from ..errors import InvalidInputError
from .recipe import KV_TYPES

# ---------------------------------------------------------------------------------------------
# misses
# ---------------------------------------------------------------------------------------------


class CacheMissReason(str, enum.Enum):
    """Why a request could not be served from cache."""

    UNKNOWN_SESSION = "unknown-session"
    EVICTED_TTL = "evicted-ttl"
    EVICTED_LRU = "evicted-lru"
    RELEASED = "released"
    SUPERSEDED_EPOCH = "superseded-epoch"
    SEQ_LEN_MISMATCH = "seq-len-mismatch"
    PREFIX_EVICTED = "prefix-evicted"  # a step opening from a shared prefix this shard no longer holds


@dataclasses.dataclass(frozen=True)
class CacheMiss:
    """An explicit, serializable cache miss: the head must re-prefill the route from token zero."""

    session_id: str
    route_epoch: int
    reason: CacheMissReason
    detail: str = ""

    def to_dict(self) -> dict:
        return {
            "session_id": self.session_id,
            "route_epoch": self.route_epoch,
            "reason": self.reason.value,
            "detail": self.detail,
        }


# ---------------------------------------------------------------------------------------------
# the step: one request type from the adapter through the engines to the wire
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """One session's step: append a prompt chunk (`StepKind.PREFILL`) or decode token(s)
    (`StepKind.DECODE`). The head sends `token_ids`, other shards `hidden` (float32
    (n_tokens, n_embd)). `start_pos` (prefill only): where the chunk goes, None for the cached
    length, 0 to re-prefill from scratch. `expected_seq_len` (decode only): the cached length the
    step must find, None for unchecked. `logit_rows`: the tail returns the logits of the step's last
    logit_rows tokens (a speculative verification; 1..min(n_tokens, MAX_LOGIT_ROWS)); a step asking
    for more than one is computed whole, never cut into chunks. `row_by_row`: every row is, to the
    bit, what a one-token step gives (llama.cpp may round by a computation's shape: the rows are
    one computation where the engine has shown it gives those bytes, each alone otherwise;
    `HotKvEngine.whole_rows_verdicts`). Constructing one validates it (InvalidInputError)."""

    kind: StepKind
    session_id: str
    route_epoch: int
    token_ids: Sequence[int] | np.ndarray | None = None
    hidden: np.ndarray | None = None
    start_pos: int | None = None
    expected_seq_len: int | None = None
    logit_rows: int = 1
    row_by_row: bool = False

    def __post_init__(self):
        if not isinstance(self.kind, StepKind):
            raise InvalidInputError(f"a step's kind is StepKind.PREFILL or StepKind.DECODE, not {self.kind!r}")
        check_key(self.session_id, self.route_epoch)
        if (self.token_ids is None) == (self.hidden is None):
            raise InvalidInputError("a step needs token_ids (head) or hidden (other shards), not both")
        if self.kind == StepKind.PREFILL:
            if self.expected_seq_len is not None:
                raise InvalidInputError("expected_seq_len belongs to a decode; a prefill takes start_pos")
            if self.start_pos is not None:
                check_count("start_pos", self.start_pos)
        else:
            if self.start_pos is not None:
                raise InvalidInputError("start_pos belongs to a prefill; a decode takes expected_seq_len")
            if self.expected_seq_len is not None:
                check_count("expected_seq_len", self.expected_seq_len)
        rows = self.logit_rows
        if type(rows) is not int or not 1 <= rows <= min(self.n_tokens, MAX_LOGIT_ROWS):
            raise InvalidInputError(
                f"logit_rows is {rows!r}; a step returns logits of 1 to min(n_tokens, {MAX_LOGIT_ROWS}) tokens"
            )
        if type(self.row_by_row) is not bool:
            raise InvalidInputError(f"row_by_row is True or False, not {self.row_by_row!r}")

    @classmethod
    def prefill(
        cls,
        session_id: str,
        route_epoch: int,
        token_ids=None,
        hidden=None,
        start_pos: int | None = None,
        logit_rows: int = 1,
        row_by_row: bool = False,
    ) -> "Step":
        return cls(
            StepKind.PREFILL,
            session_id,
            route_epoch,
            token_ids,
            hidden,
            start_pos=start_pos,
            logit_rows=logit_rows,
            row_by_row=row_by_row,
        )

    @classmethod
    def decode(
        cls,
        session_id: str,
        route_epoch: int,
        token_ids=None,
        hidden=None,
        expected_seq_len: int | None = None,
        logit_rows: int = 1,
    ) -> "Step":
        return cls(
            StepKind.DECODE,
            session_id,
            route_epoch,
            token_ids,
            hidden,
            expected_seq_len=expected_seq_len,
            logit_rows=logit_rows,
        )

    @property
    def position(self) -> int:
        """The engine's one integer: start_pos (prefill) or expected_seq_len (decode), -1 for None."""
        value = self.start_pos if self.kind == StepKind.PREFILL else self.expected_seq_len
        return -1 if value is None else int(value)

    @property
    def n_tokens(self) -> int:
        data = self.token_ids if self.token_ids is not None else self.hidden
        return len(data) if hasattr(data, "__len__") else 0


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """A live session: its key, cached length and the llama_seq_id (or reference slot) serving it."""

    session_id: str
    route_epoch: int
    seq_len: int
    seq_id: int
    owned_layers: tuple[int, ...]
    bytes_per_token: int
    tier: Tier = Tier.HOT  # HOT: in the shard's context; WARM/DISK: spilled (resolve does not move it)

    @property
    def nbytes(self) -> int:
        return self.seq_len * self.bytes_per_token


class SessionRecord(NamedTuple):
    """A cached session as an engine lists it (`sessions()`): hot ones least recently used first,
    then warm and disk ones (seq_id -1)."""

    session_id: str
    route_epoch: int
    seq_id: int
    seq_len: int
    last_used: float
    tier: Tier


@dataclasses.dataclass(frozen=True)
class BoundaryBundle:
    """What a non-tail shard hands to the next: the unnormalized residual of every input token."""

    session_id: str
    route_epoch: int
    start_pos: int
    hidden: np.ndarray  # float32 (n_tokens, n_embd)

    def __post_init__(self):
        h = self.hidden
        if not isinstance(h, np.ndarray) or h.dtype != np.float32 or h.ndim != 2:
            raise InvalidInputError("a boundary bundle carries a float32 (n_tokens, n_embd) array")


@dataclasses.dataclass(frozen=True)
class TailOutput:
    """What the tail returns for a step: the last token's logits and the greedy next token; for a
    step with logit_rows > 1, `rows` holds the last logit_rows tokens' logits (the last is `logits`)."""

    session_id: str
    route_epoch: int
    seq_len: int
    logits: np.ndarray  # float32 (n_vocab,)
    token_id: int
    rows: np.ndarray | None = None  # float32 (logit_rows, n_vocab), when the step asked for more than one


# ---------------------------------------------------------------------------------------------
# configuration and clock
# ---------------------------------------------------------------------------------------------

#: the environment's names of the configuration's fields: LLAMA_SHARD_<FIELD>
ENV_PREFIX = "LLAMA_SHARD_"
#: the names before (read where the new one is unset, with a warning naming the new one; to be dropped)
LEGACY_ENV_PREFIX = "MESHNET_HOT_KV_"
_ENGINE_DEFAULTS = HotKvConfig()


def route_numerics(kv_type: str, flash_attn: bool) -> str:
    """What every worker of a route must share for the route's logits to be the whole model's under
    one setting: the K/V element type and the attention kernel (each rounds differently). With
    flash attention on an f16 or f32 cache, also which CPU kernel computes it (patch 0010's,
    batch-invariant, for steps of at least `cpu_backend()["flash_attn_tiled_rows"]` rows). Compared as a
    string (StepRequest.numerics, InfoReply.numerics, check_route)."""
    if not flash_attn:
        return f"K/V {kv_type}, flash attention off"
    if kv_type not in ("f16", "f32"):  # ggml tiles only a float cache
        return f"K/V {kv_type}, flash attention on"
    rows = cpu_backend()["flash_attn_tiled_rows"]
    kernel = "upstream's kernels" if rows == 0 else "llama-shard's kernel" + (f" from {rows} rows" if rows > 1 else "")
    return f"K/V {kv_type}, flash attention on ({kernel})"


#: the end of every refusal of a route whose workers' numerics differ
MIXED_NUMERICS = (
    "every worker of a route needs the same --kv-type and --flash-attn (a mixed route's logits are neither setting's)"
)


@dataclasses.dataclass(frozen=True)
class HotKvStateConfig:
    """Bounds of the Hot KV state of one shard.

    max_sessions: hot sessions at most (each holds one llama_seq_id and a KV stream of
    context_tokens cells, allocated up front: max_sessions x context_tokens x KV bytes per token is
    the hot tier's memory; `memory_plan` derives max_sessions from a size in bytes);
    context_tokens: tokens one session may hold; budget_tokens: a cap on the tokens all hot
    sessions hold together (None: max_sessions x context_tokens, i.e. no cap beyond the slots);
    ttl_seconds: idle time before a hot session is evicted (0 disables TTL).
    warm_bytes: host memory for the KV of sessions evicted from the hot set (0: no warm tier; then
    an evicted session is a cache miss); warm_ttl_seconds: idle time before a warm session is
    dropped (0 disables); kv_type: the K/V element type, f16, q8_0 or q4_0 (part of the recipe:
    the shards of a route must agree); flash_attn: llama.cpp's flash attention (its CPU default);
    off stores V transposed (part of the recipe) and needs f16; the logits round differently.
    warm_dir, warm_disk_bytes: the disk tier (native engine only): sessions that fall out of the
    host tier go to files in warm_dir, at most warm_disk_bytes of them, and a worker restarted on
    the same directory, model, range and recipe resumes them. One worker per directory.
    prefix_bytes: host memory for shared prefixes (the KV of a system prompt many sessions begin
    with: new sessions open from a copy instead of computing it); 0: no prefix store.
    """

    max_sessions: int = _ENGINE_DEFAULTS.max_sessions
    context_tokens: int = _ENGINE_DEFAULTS.context_tokens
    budget_tokens: int | None = None
    ttl_seconds: float = _ENGINE_DEFAULTS.ttl_seconds
    warm_bytes: int = _ENGINE_DEFAULTS.warm_bytes
    warm_ttl_seconds: float = _ENGINE_DEFAULTS.warm_ttl_seconds
    kv_type: str = _ENGINE_DEFAULTS.kv_type
    flash_attn: bool = _ENGINE_DEFAULTS.flash_attn
    warm_dir: str | None = None
    warm_disk_bytes: int = _ENGINE_DEFAULTS.warm_disk_bytes
    prefix_bytes: int = _ENGINE_DEFAULTS.prefix_bytes

    def __post_init__(self):
        # types here (the native struct would raise TypeError); bounds once, in hot_kv_check_config
        for name in (
            "max_sessions",
            "context_tokens",
            "budget_tokens",
            "warm_bytes",
            "warm_disk_bytes",
            "prefix_bytes",
        ):
            v = getattr(self, name)
            if not (v is None and name == "budget_tokens") and (isinstance(v, bool) or not isinstance(v, int)):
                raise InvalidInputError(f"{name} must be an integer, got {v!r}")
        for name in ("ttl_seconds", "warm_ttl_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidInputError(f"{name} must be a number of seconds, got {v!r}")
        if not isinstance(self.kv_type, str):
            raise InvalidInputError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {self.kv_type!r}")
        if not isinstance(self.flash_attn, bool):
            raise InvalidInputError(f"flash_attn must be true or false, got {self.flash_attn!r}")
        if self.warm_dir is not None and (not isinstance(self.warm_dir, str) or not self.warm_dir):
            raise InvalidInputError(f"warm_dir must be a directory path, got {self.warm_dir!r}")
        if self.budget_tokens is None:  # no cap beyond the slots
            object.__setattr__(self, "budget_tokens", max(self.max_sessions, 0) * max(self.context_tokens, 0))
        self.engine_config().check()

    @property
    def numerics(self) -> str:
        return route_numerics(self.kv_type, self.flash_attn)

    def engine_config(
        self,
        *,
        n_batch: int = _ENGINE_DEFAULTS.n_batch,
        n_threads: int | None = None,
        recent_capacity: int = _ENGINE_DEFAULTS.recent_capacity,
        recipe_fingerprint: str = "",
    ) -> "HotKvConfig":
        """The engine's configuration (the one type both engines take), with the manager's step
        options; checked by the engine itself."""
        try:
            return HotKvConfig(
                max_sessions=self.max_sessions,
                context_tokens=self.context_tokens,
                budget_tokens=self.budget_tokens,
                ttl_seconds=float(self.ttl_seconds),
                n_batch=n_batch,
                n_threads=n_threads or 0,
                recent_capacity=recent_capacity,
                warm_bytes=self.warm_bytes,
                warm_ttl_seconds=float(self.warm_ttl_seconds),
                kv_type=self.kv_type,
                flash_attn=self.flash_attn,
                warm_dir=self.warm_dir or "",
                warm_disk_bytes=self.warm_disk_bytes,
                recipe_fingerprint=recipe_fingerprint,
                prefix_bytes=self.prefix_bytes,
            )
        except TypeError:  # an integer beyond its native field's width (int32 or int64)
            fields = {
                "max_sessions": (self.max_sessions, 31),
                "context_tokens": (self.context_tokens, 31),
                "budget_tokens": (self.budget_tokens, 63),
                "warm_bytes": (self.warm_bytes, 63),
                "warm_disk_bytes": (self.warm_disk_bytes, 63),
                "prefix_bytes": (self.prefix_bytes, 63),
                "n_batch": (n_batch, 31),
                "recent_capacity": (recent_capacity, 31),
            }
            for name, (value, bits) in fields.items():
                if isinstance(value, int) and not -(1 << bits) <= value < (1 << bits):
                    raise InvalidInputError(f"{name} is outside its bounds, got {value}") from None
            raise

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "HotKvStateConfig":
        """Reads LLAMA_SHARD_<FIELD> (or the deprecated MESHNET_HOT_KV_<FIELD>) for each field (MAX_SESSIONS, CONTEXT_TOKENS, BUDGET_TOKENS,
        TTL_SECONDS, WARM_BYTES, WARM_DISK_BYTES and PREFIX_BYTES (sizes: 512MiB, 2GiB or bytes), WARM_TTL_SECONDS,
        KV_TYPE, FLASH_ATTN (on/off), WARM_DIR); unset keeps the default."""
        return cls.from_env_values(cls.env_values(environ))

    @classmethod
    def from_env_values(cls, values: Mapping[str, object]) -> "HotKvStateConfig":
        """A configuration from env_values()' fields over the defaults, checked."""
        try:
            return cls(**values)  # type: ignore[arg-type]
        except InvalidInputError as e:
            raise InvalidInputError(f"bad {ENV_PREFIX}* configuration: {e}") from None

    @classmethod
    def env_values(cls, environ: Mapping[str, str] | None = None) -> dict[str, object]:
        """The fields LLAMA_SHARD_* set, parsed (not yet checked together: from_env does that);
        a field the environment leaves unset is absent. A field set only under its old name
        (MESHNET_HOT_KV_*) is read from there, with a warning on stderr naming the new one."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            key = ENV_PREFIX + field.name.upper()
            raw = env.get(key)
            legacy = LEGACY_ENV_PREFIX + field.name.upper()
            if raw is None and env.get(legacy) is not None:
                print(f"llama-shard: {legacy} is deprecated; set {key} instead", file=sys.stderr, flush=True)
                key, raw = legacy, env.get(legacy)
            if raw is None or raw.strip() == "":
                continue
            try:
                if field.name.endswith("_seconds"):
                    values[field.name] = float(raw)
                elif field.name == "kv_type":
                    values[field.name] = raw.strip().lower()
                elif field.name == "warm_dir":
                    values[field.name] = raw.strip()
                elif field.name == "flash_attn":
                    values[field.name] = parse_switch(raw)
                elif field.name in ("warm_bytes", "warm_disk_bytes", "prefix_bytes"):
                    values[field.name] = parse_size(raw)
                else:
                    values[field.name] = int(raw.strip(), 10)
            except ValueError:
                raise InvalidInputError(f"{key}={raw!r} is not a valid value for {field.name}") from None
        return values


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_switch(text: str) -> bool:
    """True from on/true/1/yes, False from off/false/0/no (any case); ValueError otherwise."""
    word = text.strip().lower()
    if word in ("on", "true", "1", "yes"):
        return True
    if word in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"expected on or off, got {text!r}")


def parse_size(text: str | int) -> int:
    """Bytes from '512MiB', '2GiB', '1.5G', '4096' (SI and binary units); ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError("a size is >= 0")
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class ManualClock:
    """A clock for tests: time moves only when advanced."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise InvalidInputError("a clock only moves forward")
        with self._lock:
            self._now += float(seconds)


def monotonic_clock() -> float:
    return time.monotonic()


def check_key(session_id, route_epoch) -> None:
    if not isinstance(session_id, str):
        raise InvalidInputError(f"route_session_id must be a str, got {type(session_id).__name__}")
    if not session_id or len(session_id.encode("utf-8", "surrogatepass")) > MAX_SESSION_ID_BYTES:
        raise InvalidInputError(f"route_session_id must be 1 to {MAX_SESSION_ID_BYTES} bytes")
    check_count("route_epoch", route_epoch, upper=MAX_EPOCH)


def check_count(name: str, value, upper: int = 2**31 - 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidInputError(f"{name} must be an integer, got {type(value).__name__}")
    if not 0 <= int(value) <= upper:
        raise InvalidInputError(f"{name} must be in [0, {upper}], got {value}")
