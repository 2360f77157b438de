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
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import os
import sys
import threading
from pathlib import Path

import grpc

from .._native import MAX_SESSION_ID_BYTES
from ..errors import InvalidInputError

#: the principal of every caller of a worker without authentication
ANONYMOUS = ""
#: call metadata a forwarding worker sends: the principal its caller authenticated as (UTF-8 in a
#: binary value: a principal may be any text, a client certificate's CN, and text metadata is ASCII)
ON_BEHALF_OF = "llama-shard-on-behalf-of-bin"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


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

    def __post_init__(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidInputError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidInputError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.token_file and not self.tls_cert:
            raise InvalidInputError("--auth-token-file needs TLS (--tls-cert and --tls-key): a bearer token "
                                    "must not cross the network in clear")
        try:
            self.tokens = TokenTable(self.token_file) if self.token_file else None
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"--auth-token-file: {e}") from None
        for path in (self.tls_cert, self.tls_key, self.tls_client_ca):
            if path is not None:
                _read(path)  # fails now, with the path, rather than at the first handshake

    @property
    def authenticated(self) -> bool:
        return self.tokens is not None or bool(self.tls_client_ca)

    def check_exposure(self, host: str) -> None:
        """A worker on a non-loopback address needs TLS and authentication, or --insecure."""
        if not is_loopback(host) and not (self.tls_cert and self.authenticated) and not self.insecure:
            raise InvalidInputError(
                f"refusing to serve on {host} without TLS and authentication: give --tls-cert and --tls-key "
                "with --auth-token-file or --tls-client-ca (mutual TLS), or --insecure to serve in clear anyway")

    def check_metrics_exposure(self, host: str) -> None:
        """The metrics endpoint is plaintext HTTP without authentication: loopback, unless --insecure."""
        if not is_loopback(host) and not self.insecure:
            raise InvalidInputError(
                f"refusing to serve metrics on {host}: the endpoint is plaintext and unauthenticated; keep the "
                "default (--metrics-host 127.0.0.1, scraped through a local agent) or give --insecure")

    # --- the port ---------------------------------------------------------------------------

    def _certificate_configuration(self):
        return grpc.ssl_server_certificate_configuration([(_read(self.tls_key), _read(self.tls_cert))],
                                                         root_certificates=_read(self.tls_client_ca))

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

        return grpc.dynamic_ssl_server_credentials(self._certificate_configuration(), fetch,
                                                   require_client_authentication=bool(self.tls_client_ca))

    def reload(self) -> None:
        """SIGHUP: re-read the token file (certificates are re-read on change by themselves)."""
        if self.tokens is not None:
            self.tokens.reload()

    # --- each call --------------------------------------------------------------------------

    def principal(self, context: grpc.ServicerContext, step: bool = False) -> str | None:
        """The principal a call acts for; None when it presents no valid credentials. On a step RPC
        (`step`: Prefill, Decode, StepBatch), a forwarder (a worker this one trusts, `--forwarder`)
        acts for the principal it names in ON_BEHALF_OF, so that a session keeps its owner along a
        chained route; never for an admin, and on no other call (Info, Release, Truncate, Resolve
        are the forwarder's own): a leaked peer token steps sessions, it does not list or drop them."""
        if not self.authenticated:
            return ANONYMOUS
        metadata = dict(context.invocation_metadata())
        caller = self._caller(context, metadata)
        named = metadata.get(ON_BEHALF_OF)
        if step and caller is not None and caller in self.forwarders and isinstance(named, bytes) and named:
            try:
                principal = named.decode("utf-8")
            except UnicodeDecodeError:
                return None
            return None if principal in self.admins else principal
        return caller

    def forwarded(self, context: grpc.ServicerContext) -> bool:
        """Whether a step RPC comes from a forwarder (`--forwarder`) acting for a principal it names."""
        if not self.authenticated or not self.forwarders:
            return False
        metadata = dict(context.invocation_metadata())
        if not metadata.get(ON_BEHALF_OF):
            return False
        caller = self._caller(context, metadata)
        return caller is not None and caller in self.forwarders

    def _caller(self, context: grpc.ServicerContext, metadata: dict) -> str | None:
        """Who presents the call's credentials: its bearer token's principal, else its client
        certificate's common name; None for neither."""
        if self.tokens is not None:
            value = metadata.get("authorization", "")
            return self.tokens.principal(value[len("Bearer "):]) if value.startswith("Bearer ") else None
        names = context.auth_context().get("x509_common_name") or []
        return names[0].decode("utf-8", "replace") if names else None

    @staticmethod
    def tag(principal: str) -> str | None:
        """16 hex digits naming a principal inside engine keys (None: the anonymous caller)."""
        return None if principal == ANONYMOUS else hashlib.blake2b(principal.encode(), digest_size=8).hexdigest()

    def engine_key(self, principal: str, session_id: str) -> str:
        """The engine's key for a principal's session: the id itself without authentication, else
        the principal's tag before it, so that principals never share a session."""
        tag = self.tag(principal)
        if tag is None or not session_id:
            return session_id
        if len(session_id.encode("utf-8", "surrogatepass")) > MAX_SESSION_ID_BYTES - len(tag) - 1:
            raise InvalidInputError(f"route_session_id must be 1 to {MAX_SESSION_ID_BYTES - len(tag) - 1} bytes "
                                    "on a worker with authentication")
        return f"{tag}/{session_id}"

    @staticmethod
    def split_key(key: str) -> tuple[str | None, str]:
        """(principal tag or None, session id) of an engine key."""
        tag, sep, sid = key.partition("/")
        if sep and len(tag) == 16 and all(c in "0123456789abcdef" for c in tag):
            return tag, sid
        return None, key


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """How a client (RemoteStage, `llama-shard generate`, a worker forwarding to its peer) reaches
    a worker: plaintext when nothing is set, else TLS trusting `tls_ca` (the system's roots when
    None), with a client certificate for mutual TLS and/or a bearer token."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None

    @property
    def secure(self) -> bool:
        return any((self.tls_ca, self.tls_cert, self.token_file))

    def token(self) -> str | None:
        if self.token_file is None:
            return None
        lines = [ln.strip() for ln in Path(self.token_file).read_text().splitlines() if ln.strip()]
        if len(lines) != 1:
            raise InvalidInputError(f"{self.token_file} must hold one line: the token")
        return lines[0]

    def channel(self, address: str, options: list) -> grpc.Channel:
        if not self.secure:
            return grpc.insecure_channel(address, options=options)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidInputError("--tls-cert and --tls-key go together")
        creds = grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca), private_key=_read(self.tls_key),
                                             certificate_chain=_read(self.tls_cert))
        token = self.token()
        if token is not None:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        return grpc.secure_channel(address, creds, options=options)
