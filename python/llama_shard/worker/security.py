"""Transport security and authentication for workers and their clients.

Three set-ups (docs in the README):

- **loopback** (the default): plaintext, no authentication, every caller is the same anonymous
  principal; a worker refuses to bind another address this way unless told `--insecure`.
- **token over TLS**: the worker presents a certificate (`--tls-cert/--tls-key`); a client sends
  `authorization: Bearer <token>`; the worker's `--auth-token-file` names the principal of each
  token (`principal:token` per line).
- **mutual TLS**: the worker also requires a client certificate signed by `--tls-client-ca`; the
  principal is the certificate's subject common name (or the token's, when a token file is set
  too: then a caller needs both).

The worker re-reads its certificate files when they change (gRPC asks at each new handshake;
open connections keep theirs) and its token file on SIGHUP or when it changes. Sessions belong to
the principal that opened them: the worker keys them by principal (`ServerSecurity.engine_key`), so
another principal's request for the same id finds nothing, exactly as for an absent session.

Invariants: on a worker with authentication no caller is ANONYMOUS (a blank certificate name or
on-behalf-of name is no credential), and every engine key is `<tag>/<id>` with the caller's own tag,
keyed by a secret of this worker's, so no id a client sends is another principal's key. A forwarder
(`--forwarder`) acts for the principal it names only with the head's signature under the route key
(`--route-key-file`, the same file on every worker of the route), issued within ASSERTION_MAX_AGE_S.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import grpc

from .._native import MAX_SESSION_ID_BYTES
from ..errors import InvalidInputError
from ..proto.credentials import read_bytes

#: the principal of every caller of a worker without authentication
ANONYMOUS = ""
#: call metadata a forwarding worker sends: the principal its caller authenticated as (UTF-8 in a
#: binary value: a principal may be any text, a client certificate's CN, and text metadata is ASCII)
ON_BEHALF_OF = "llama-shard-on-behalf-of-bin"
#: beside ON_BEHALF_OF: the head's assertion of it, ASSERTION_VERSION || issued-at (8 bytes, big-endian
#: Unix seconds) || HMAC-SHA256(route key, those 9 bytes || the principal's UTF-8); a middle worker
#: passes the one it received on unchanged
ON_BEHALF_OF_SIG = "llama-shard-on-behalf-of-sig-bin"
ASSERTION_VERSION = 1
#: how old an assertion may be when it arrives, and how far ahead of this worker's clock (skew)
ASSERTION_MAX_AGE_S = 300
ASSERTION_MAX_AHEAD_S = 60
#: how long a head reuses its assertion for a principal (well inside ASSERTION_MAX_AGE_S)
ASSERTION_REUSE_S = 60
#: a route key file's size bounds: 32 bytes of entropy at least (`head -c 32 /dev/urandom`)
ROUTE_KEY_MIN_BYTES, ROUTE_KEY_MAX_BYTES = 32, 4096
#: the warm directory's MAC key (kv_file_store.cpp), from which owner tags are keyed
WARM_KEY_NAME, WARM_KEY_BYTES = "llama-shard.key", 32


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def file_mtimes(paths) -> tuple:
    out = []
    for p in paths:
        try:
            out.append(os.stat(p).st_mtime_ns if p else None)
        except OSError:
            out.append(None)
    return tuple(out)


class TokenTable:
    """`principal:token` lines (blank lines and `#` comments ignored), re-read when the file
    changes or on reload(). Tokens are kept as SHA-256 digests and compared in constant time.

    A reload reads the file between two stats and retries if it changed in between, so a rewrite
    during the read is never half-seen and never missed. A file that is empty, malformed or lists a
    token twice is refused with a log line and the last good table stays; a deleted file means no
    tokens (every caller is refused until it is back). At start-up a bad file is an error."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple | None = None  # the file's identity when the table (or a refusal) was taken
        self._entries: list[tuple[bytes, str]] = []
        self.reload(strict=True)

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _parse(self, text: str) -> list[tuple[bytes, str]]:
        entries, seen = [], set()
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            principal, sep, token = line.partition(":")
            if not sep or not principal.strip() or len(token.strip()) < 16:
                raise ValueError(f"{self.path}:{n}: expected 'principal:token' with a token of 16 or more characters")
            digest = hashlib.sha256(token.strip().encode()).digest()
            if digest in seen:
                raise ValueError(f"{self.path}:{n}: a token listed twice (each token names one principal)")
            seen.add(digest)
            entries.append((digest, principal.strip()))
        if not entries:
            raise ValueError(f"{self.path}: no 'principal:token' line (an empty table would refuse everyone)")
        return entries

    def reload(self, strict: bool = False) -> None:
        """Re-reads the file; `strict` (start-up): a bad or missing file raises (OSError, ValueError)."""
        for _ in range(5):
            before = self._stat()
            if before is None:
                if strict:
                    raise OSError(f"cannot read the token file {self.path}")
                with self._lock:
                    self._entries, self._stamp = [], None
                _log(f"token file {self.path} is gone: no tokens are valid until it is back")
                return
            try:
                text = Path(self.path).read_text(encoding="utf-8")  # principals may be any text
            except OSError:
                continue
            stamp = self._stat()
            if stamp != before:
                continue  # rewritten while it was read: read it again
            try:
                entries = self._parse(text)
            except ValueError as e:
                if strict:
                    raise
                with self._lock:
                    self._stamp = stamp  # refused once per version of the file; the last good table stays
                _log(f"{e}; keeping the last good token table")
                return
            with self._lock:
                self._entries, self._stamp = entries, stamp
            return
        _log(f"token file {self.path} kept changing while it was read; keeping the last good table")

    def principal(self, token: str) -> str | None:
        if self._stat() != self._stamp:
            self.reload()
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        with self._lock:
            for known, principal in self._entries:  # every entry compared: the time says nothing
                if hmac.compare_digest(known, digest):
                    found = principal
        return found


def _log(message: str) -> None:
    print(f"llama-shard: {message}", file=sys.stderr, flush=True)


def read_private_file(path: str, what: str, min_bytes: int, max_bytes: int) -> bytes:
    """A secret's bytes: a regular file (checked on the open descriptor, so the file checked is the
    file read; a FIFO does not block), this user's, no access for group or others, min..max bytes;
    else InvalidInputError naming `what` and the reason."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidInputError(f"{what} {path}: cannot open it: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInputError(f"{what} {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise InvalidInputError(f"{what} {path} belongs to another user (uid {st.st_uid}); it must be this user's")
        if st.st_mode & 0o077:
            raise InvalidInputError(
                f"{what} {path} is open to group or others (mode {st.st_mode & 0o7777:04o}); chmod 600 it"
            )
        if not min_bytes <= st.st_size <= max_bytes:
            raise InvalidInputError(
                f"{what} {path} holds {st.st_size} bytes; it must hold {min_bytes} to {max_bytes} "
                f"(e.g. head -c {min_bytes} /dev/urandom > FILE)"
            )
        data = b""
        while len(data) < st.st_size:
            chunk = os.read(fd, st.st_size - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) != st.st_size:
        raise InvalidInputError(f"{what} {path} changed while it was read")
    return data


class Caller(NamedTuple):
    """Whom a call acts for: `principal` (None: refused, `why` says why), and on a step a forwarder
    sent for someone else, the verified `assertion` it carried (passed on unchanged to a next hop)."""

    principal: str | None
    assertion: bytes | None = None
    why: str = ""


_NO_CREDENTIALS = (
    "valid credentials are required (a bearer token or a client certificate this worker trusts, with a common name)"
)
_BAD_ASSERTION = (
    "a forwarder's on-behalf-of name needs the head's signature under this worker's route key, "
    f"issued within {ASSERTION_MAX_AGE_S} s (serve --route-key-file, the same file on every worker "
    "of the route), for a name that is not blank and not an admin's"
)


@dataclasses.dataclass
class ServerSecurity:
    """What `serve` was told about TLS, authentication and ownership."""

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    token_file: str | None = None
    admins: tuple[str, ...] = ()
    insecure: bool = False
    forwarders: tuple[str, ...] = ()  # principals (workers) trusted to say whom a forwarded step is for
    route_key_file: str | None = None  # the route's shared secret: signs and checks on-behalf-of names

    def __post_init__(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidInputError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidInputError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.token_file and not self.tls_cert:
            raise InvalidInputError(
                "--auth-token-file needs TLS (--tls-cert and --tls-key): a bearer token "
                "must not cross the network in clear"
            )
        try:
            self.tokens = TokenTable(self.token_file) if self.token_file else None
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"--auth-token-file: {e}") from None
        for path in (self.tls_cert, self.tls_key, self.tls_client_ca):
            if path is not None:
                read_bytes(path)  # fails now, with the path, rather than at the first handshake
        if self.forwarders and not self.route_key_file:
            # an unsigned on-behalf-of name would let a leaked peer token step anyone's sessions
            raise InvalidInputError(
                "--forwarder needs --route-key-file: a forwarder acts for a principal only "
                "with the head's signature under the route's key (the same private file, "
                f"{ROUTE_KEY_MIN_BYTES} bytes or more, on every worker of the route)"
            )
        self._route_key = (
            read_private_file(self.route_key_file, "--route-key-file", ROUTE_KEY_MIN_BYTES, ROUTE_KEY_MAX_BYTES)
            if self.route_key_file
            else None
        )
        self._assertions: dict[str, tuple[int, bytes]] = {}  # principal -> (issued at, this head's assertion)
        self._assertions_lock = threading.Lock()
        # owner tags: keyed per process until key_owner_tags() ties them to a warm directory's key
        self._tag_key = secrets.token_bytes(32)
        self._tag_key_from: str | None = None

    @property
    def authenticated(self) -> bool:
        return self.tokens is not None or bool(self.tls_client_ca)

    def check_exposure(self, host: str) -> None:
        """A worker on a non-loopback address needs TLS and authentication, or --insecure."""
        if not is_loopback(host) and not (self.tls_cert and self.authenticated) and not self.insecure:
            raise InvalidInputError(
                f"refusing to serve on {host} without TLS and authentication: give --tls-cert and --tls-key "
                "with --auth-token-file or --tls-client-ca (mutual TLS), or --insecure to serve in clear anyway"
            )

    def check_metrics_exposure(self, host: str) -> None:
        """The metrics endpoint is plaintext HTTP without authentication: loopback, unless --insecure."""
        if not is_loopback(host) and not self.insecure:
            raise InvalidInputError(
                f"refusing to serve metrics on {host}: the endpoint is plaintext and unauthenticated; keep the "
                "default (--metrics-host 127.0.0.1, scraped through a local agent) or give --insecure"
            )

    # --- the port ---------------------------------------------------------------------------

    def _certificate_configuration(self):
        return grpc.ssl_server_certificate_configuration(
            [(read_bytes(self.tls_key), read_bytes(self.tls_cert))], root_certificates=read_bytes(self.tls_client_ca)
        )

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None for a plaintext port; else TLS whose certificates are re-read when their files change."""
        if not self.tls_cert:
            return None
        files = (self.tls_cert, self.tls_key, self.tls_client_ca)
        state = {"mtimes": file_mtimes(files)}

        def fetch():  # called by gRPC before each new handshake: None keeps the current configuration
            now = file_mtimes(files)
            if now == state["mtimes"]:
                return None
            try:
                config = self._certificate_configuration()
            except (OSError, ValueError):
                return None  # a half-written file: keep serving the last good certificate
            state["mtimes"] = now
            return config

        return grpc.dynamic_ssl_server_credentials(
            self._certificate_configuration(), fetch, require_client_authentication=bool(self.tls_client_ca)
        )

    def reload(self) -> None:
        """SIGHUP: re-read the token file (certificates are re-read on change by themselves)."""
        if self.tokens is not None:
            self.tokens.reload()

    # --- each call --------------------------------------------------------------------------

    def principal(self, context: grpc.ServicerContext, step: bool = False) -> str | None:
        """The principal a call acts for; None when it presents no valid credentials (`caller`)."""
        return self.caller(context, step).principal

    def caller(self, context: grpc.ServicerContext, step: bool = False) -> Caller:
        """Whom a call acts for. On a step RPC (`step`: Prefill, Decode, StepBatch) from a forwarder
        (a worker this one trusts, `--forwarder`) that names a principal in ON_BEHALF_OF, that
        principal, so that a session keeps its owner along a chained route, but only with a valid
        assertion (ON_BEHALF_OF_SIG: the head's, under the route key, fresh, for that very name),
        never for an admin or a blank name, and never the forwarder itself instead: any of those
        refuses the call. On every other call (Info, Release, Truncate, Resolve) and from anyone
        else, ON_BEHALF_OF is ignored: a leaked peer token cannot list or drop anyone's sessions,
        and without the route key it steps none but its own. Never ANONYMOUS with authentication."""
        if not self.authenticated:
            return Caller(ANONYMOUS)
        metadata = dict(context.invocation_metadata())
        caller = self._caller(context, metadata)
        if caller is None:
            return Caller(None, why=_NO_CREDENTIALS)
        if not (step and caller in self.forwarders and (ON_BEHALF_OF in metadata or ON_BEHALF_OF_SIG in metadata)):
            return Caller(caller)  # (a forwarder's step that names no one is its own)
        named, assertion = metadata.get(ON_BEHALF_OF), metadata.get(ON_BEHALF_OF_SIG)
        try:
            principal = named.decode("utf-8") if isinstance(named, bytes) else None
        except UnicodeDecodeError:
            principal = None
        if (
            principal is None
            or not principal.strip()
            or principal in self.admins
            or not isinstance(assertion, bytes)
            or not self._assertion_valid(principal, assertion)
        ):
            return Caller(None, why=_BAD_ASSERTION)
        return Caller(principal, assertion)

    def _caller(self, context: grpc.ServicerContext, metadata: dict) -> str | None:
        """Who presents the call's credentials: its bearer token's principal, else its client
        certificate's common name; None for neither, and for an empty or blank common name (a
        certificate without one is no name: it must never be ANONYMOUS's)."""
        if self.tokens is not None:
            value = metadata.get("authorization", "")
            return self.tokens.principal(value[len("Bearer ") :]) if value.startswith("Bearer ") else None
        names = context.auth_context().get("x509_common_name") or []
        name = names[0].decode("utf-8", "replace") if names else ""
        return name if name.strip() else None

    # --- on-behalf-of assertions -------------------------------------------------------------

    def _assertion_mac(self, issued_at: int, principal: str) -> bytes:
        head = bytes([ASSERTION_VERSION]) + issued_at.to_bytes(8, "big")
        return head + hmac.digest(self._route_key, head + principal.encode("utf-8", "surrogatepass"), "sha256")

    def assertion(self, principal: str) -> bytes | None:
        """This worker's ON_BEHALF_OF_SIG for a principal it authenticated itself (it is the head of
        the step), reused for ASSERTION_REUSE_S; None without a route key (a next hop that lists this
        worker as a forwarder then refuses the step)."""
        if self._route_key is None or principal == ANONYMOUS:
            return None
        now = int(time.time())
        with self._assertions_lock:
            cached = self._assertions.get(principal)
            if cached is not None and 0 <= now - cached[0] < ASSERTION_REUSE_S:
                return cached[1]
            if len(self._assertions) >= 4096:  # principals are few; a table never grows without bound
                self._assertions.clear()
            value = self._assertion_mac(now, principal)
            self._assertions[principal] = (now, value)
            return value

    def assertion_valid(self, principal: str, value: bytes) -> bool:
        """Whether a forwarder's `value` asserts exactly `principal` under this worker's route key (a
        step's ON_BEHALF_OF_SIG; a hand-over's owner_assertion)."""
        return isinstance(value, bytes) and self._assertion_valid(principal, value)

    def _assertion_valid(self, principal: str, value: bytes) -> bool:
        """Whether `value` is an assertion for exactly `principal` under this worker's route key,
        issued no more than ASSERTION_MAX_AGE_S ago nor ASSERTION_MAX_AHEAD_S ahead of this clock."""
        if self._route_key is None or len(value) != 9 + 32 or value[0] != ASSERTION_VERSION:
            return False
        issued_at = int.from_bytes(value[1:9], "big")
        now = time.time()
        if not now - ASSERTION_MAX_AGE_S <= issued_at <= now + ASSERTION_MAX_AHEAD_S:
            return False
        return hmac.compare_digest(self._assertion_mac(issued_at, principal), value)

    # --- engine keys -----------------------------------------------------------------------------

    def key_owner_tags(self, warm_dir: str) -> None:
        """Keys owner tags by the warm directory's MAC key (which the engine has made or checked by
        now), so that sessions a restarted worker resumes from there keep their owners: the tag key is
        HMAC-SHA256(that key, "llama-shard owner tag v1"). One warm directory per ServerSecurity."""
        path = os.path.join(warm_dir, WARM_KEY_NAME)
        key = hmac.digest(
            read_private_file(path, "the warm tier's key", WARM_KEY_BYTES, WARM_KEY_BYTES),
            b"llama-shard owner tag v1",
            "sha256",
        )
        if self._tag_key_from is not None and not hmac.compare_digest(key, self._tag_key):
            raise InvalidInputError(
                f"these security settings already key owner tags by {self._tag_key_from}; "
                f"give the worker on {warm_dir} settings of its own"
            )
        self._tag_key, self._tag_key_from = key, path

    def tag(self, principal: str) -> str | None:
        """16 hex digits naming a principal inside engine keys: HMAC-SHA256 under this worker's tag
        key (per process, or from its warm directory), so nobody can compute another principal's
        key. None on a worker without authentication, where everyone is ANONYMOUS and ids are keys."""
        if not self.authenticated:
            return None
        return hmac.digest(self._tag_key, principal.encode("utf-8", "surrogatepass"), "sha256").hex()[:16]

    def engine_key(self, principal: str, session_id: str) -> str:
        """The engine's key for a principal's session: the id itself without authentication, else
        the principal's tag before it, so that principals never share a session (and no id is ever
        used raw: a client's id cannot be another principal's key)."""
        tag = self.tag(principal)
        if tag is None or not session_id:
            return session_id
        if not principal.strip():  # caller() never lets one through: a bug must not share a key space
            raise InvalidInputError("a session needs an authenticated principal")
        if len(session_id.encode("utf-8", "surrogatepass")) > MAX_SESSION_ID_BYTES - len(tag) - 1:
            raise InvalidInputError(
                f"route_session_id must be 1 to {MAX_SESSION_ID_BYTES - len(tag) - 1} bytes "
                "on a worker with authentication"
            )
        return f"{tag}/{session_id}"

    def owner_of_key(self, key: str) -> tuple[str | None, str]:
        """(the owner's tag, the caller's session id) of an engine key; (None, key) on a worker
        without authentication (every key is the anonymous principal's own id)."""
        return self.split_key(key) if self.authenticated else (None, key)

    @staticmethod
    def split_key(key: str) -> tuple[str | None, str]:
        """(principal tag or None, session id) of an engine key."""
        tag, sep, sid = key.partition("/")
        if sep and len(tag) == 16 and all(c in "0123456789abcdef" for c in tag):
            return tag, sid
        return None, key
