"""A TCP proxy between the workers and the engine that drops every connection and delays traffic, each
for less than a lease, again and again while Alice's instances run.

The workers' calls fail (UNAVAILABLE) or stall; they try again, keep their leases and journal what
they have: every instance finishes with one ticket, no model turn is paid twice.
"""

from __future__ import annotations

import asyncio
import contextlib

from fault_stack import INSTANCES, WORKERS, judge, running_stack, start_instances, wait_until_finished

DRILL = "flaky-network"
CUT_SECONDS = 1.0  # connections refused and cut for this long: well under the 6 s lease
DELAY_SECONDS = 0.3  # added to every chunk forwarded, for DELAYED_FOR seconds
DELAYED_FOR = 2.0
CALM_SECONDS = 1.5


class FlakyProxy:
    """Forwards 127.0.0.1:<port> to the engine; `cut()` drops every connection and refuses new ones
    until `restore()`; `delay` holds back every chunk forwarded either way."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.cutting = False
        self.delay = 0.0
        self.cuts = 0
        self.connections = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        self.cutting = True
        self.cuts += 1
        for downstream, upstream in list(self._pairs):
            downstream.transport.abort()
            upstream.transport.abort()
        self._pairs.clear()

    def restore(self) -> None:
        self.cutting = False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cutting:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        pair = (writer, up_writer)
        self._pairs.add(pair)
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            self._pairs.discard(pair)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                if self.delay:
                    await asyncio.sleep(self.delay)
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                sink.close()


async def _chaos(proxy: FlakyProxy, stop: asyncio.Event) -> None:
    """Cut, calm, delay, calm, ... until `stop` (the instances finished, or the test gave up)."""
    while not stop.is_set():
        for step in ("calm", "cut", "calm", "delay"):
            if stop.is_set():
                break
            if step == "cut":
                proxy.cut()
                await asyncio.sleep(CUT_SECONDS)
                proxy.restore()
            elif step == "delay":
                proxy.delay = DELAY_SECONDS
                await asyncio.sleep(DELAYED_FOR)
                proxy.delay = 0.0
            else:
                await asyncio.sleep(CALM_SECONDS)


async def test_connections_dropped_and_delayed_under_a_lease_lose_no_model_turn(
    tmp_path, shared_database, crm, gemini_url
):
    async with running_stack(tmp_path, shared_database, crm, gemini_url) as stack:
        proxy = FlakyProxy(stack.engine.address)
        proxied = await proxy.start()
        stop = asyncio.Event()
        chaos = asyncio.create_task(_chaos(proxy, stop))
        try:
            async with stack.engine.channel() as channel:
                ids = await start_instances(channel, DRILL, INSTANCES)
            for index in range(WORKERS):
                stack.add_worker(f"w{index}", engine_address=proxied)
            channel = stack.engine.channel()  # the test itself talks to the engine directly
            try:
                stuck = await wait_until_finished(lambda: channel, ids, timeout=180)
            finally:
                await channel.close()
        finally:
            stop.set()
            await chaos
            await proxy.stop()
        outcome = judge(crm, gemini_url, DRILL, ids, stuck)
        print(f"\nfault {DRILL}: {outcome.summary()} cuts={proxy.cuts} connections={proxy.connections}")
        assert proxy.cuts >= 1
        assert not stuck, stack.logs()
        outcome.assert_clean()
