"""A TCP proxy on loopback that delays every byte by D ms in each direction, and optionally limits
each direction's bandwidth: a link of a real network, without kernel features (tc/netem) or
privileges. For the benchmarks only.

    with DelayProxy("127.0.0.1:5002", delay_s=0.005, bits_per_s=100e6) as proxy:
        proxy.address   # "127.0.0.1:PORT": connect here instead of to the upstream

Each direction keeps its order and is one link: a chunk read at t starts crossing it when the chunks
before it have crossed (or at t), takes len * 8 / bits_per_s to cross (0 without a limit), and is
written delay later. The proxy runs an asyncio loop in its own thread."""

from __future__ import annotations

import asyncio
import threading
import time


class DelayProxy:
    def __init__(self, upstream: str, delay_s: float, bits_per_s: float | None = None):
        self.upstream_host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.delay_s = delay_s
        self.seconds_per_byte = 8.0 / bits_per_s if bits_per_s else 0.0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)
        self.address = ""

    def __enter__(self) -> "DelayProxy":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self.loop.run_forever()
        # closed: the listening socket, the connections' transports (a turn of the loop lets the
        # cancelled handlers' closes finish) and the loop itself, so nothing is left to the collector
        server.close()
        try:  # (3.12+: it waits for the connections too, which the cancelled handlers close)
            self.loop.run_until_complete(asyncio.wait_for(server.wait_closed(), 1))
        except asyncio.TimeoutError:
            pass
        self.loop.run_until_complete(asyncio.sleep(0.05))
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)
        except asyncio.CancelledError:  # the proxy is closing: end quietly (asyncio logs a cancelled handler)
            writer.close()
            up_writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        task = asyncio.ensure_future(deliver())
        link_free = 0.0  # when the link has carried every chunk read so far
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                link_free = max(time.monotonic(), link_free) + len(data) * self.seconds_per_byte
                queue.put_nowait((link_free + self.delay_s, data))
        finally:
            queue.put_nowait((0.0, None))
            await task
