"""Finding a mesh's head on the local network by mDNS (zeroconf), where the user asks for it: a head
started with `--mesh-announce` announces `_llama-shard._tcp.local.` (its address, port and model
digest), and `serve --join auto` browses for one. Across the internet addresses stay explicit.

An announcement says where to connect, nothing more: the member still authenticates as a peer and
the head admits it or not, so a forged announcement gets a member nothing it could not get by
dialling that address itself (with TLS it also needs the head's certificate to verify).
"""

from __future__ import annotations

import socket
import threading
import time

#: the service type of a mesh's head
SERVICE = "_llama-shard._tcp.local."
#: how long `--join auto` looks for a head
DISCOVER_S = 10.0


def _interfaces(host: str):
    from zeroconf import InterfaceChoice

    from ..worker.security import is_loopback

    return ["127.0.0.1"] if is_loopback(host) else InterfaceChoice.All


class Announcement:
    """A head's mDNS record, from `announce` until `close`."""

    def __init__(self, host: str, port: int, model_digest: str):
        from zeroconf import IPVersion, ServiceInfo, Zeroconf

        address = "127.0.0.1" if host in ("localhost", "127.0.0.1") else host
        if address in ("0.0.0.0", "::", ""):
            address = socket.gethostbyname(socket.gethostname())
        self.zeroconf = Zeroconf(interfaces=_interfaces(host), ip_version=IPVersion.V4Only)
        name = f"llama-shard-{model_digest.split('-')[-1][:12]}-{port}.{SERVICE}"
        self.info = ServiceInfo(
            SERVICE,
            name,
            addresses=[socket.inet_aton(address)],
            port=port,
            properties={"model_digest": model_digest},
        )
        self.zeroconf.register_service(self.info)

    def close(self) -> None:
        self.zeroconf.unregister_service(self.info)
        self.zeroconf.close()


def discover(model_digest: str = "", timeout_s: float = DISCOVER_S) -> str | None:
    """The first head announced on this network (of `model_digest`, when one is given), as
    host:port; None when none answered within `timeout_s`."""
    from zeroconf import IPVersion, ServiceBrowser, Zeroconf

    found: list[str] = []
    done = threading.Event()

    class Listener:
        def add_service(self, zc, kind, name):
            info = zc.get_service_info(kind, name, timeout=2000)
            if info is None or not info.parsed_addresses():
                return
            digest = (info.properties or {}).get(b"model_digest", b"").decode("utf-8", "replace")
            if model_digest and digest != model_digest:
                return
            found.append(f"{info.parsed_addresses()[0]}:{info.port}")
            done.set()

        def update_service(self, zc, kind, name):
            self.add_service(zc, kind, name)

        def remove_service(self, zc, kind, name):
            pass

    zeroconf = Zeroconf(ip_version=IPVersion.V4Only)
    try:
        ServiceBrowser(zeroconf, SERVICE, Listener())
        deadline = time.monotonic() + timeout_s
        while not done.is_set() and time.monotonic() < deadline:
            done.wait(0.1)
    finally:
        zeroconf.close()
    return found[0] if found else None
