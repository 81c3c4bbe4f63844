"""The due-time process: fires timers, receive timeouts and deadlines, and matches buffered messages,
beside the process that serves the API and below it in CPU priority.

Firing is background work that comes in bursts (a hundred thousand timers due within a minute are
1,667 token moves a second); in the serving process it would share the event loop and the CPU with
every FetchAndLock and Complete, and their tail latency would pay for it. So `abada-engine serve`
runs it in a child of its own, niced (`ABADA_DUE_TIME_PROCESS_NICENESS`), and restarts it a second
after it dies; the child leaves when its parent does. Firing stays exact whatever runs it: each due
time is claimed with SKIP LOCKED in the transaction that moves its token (`runtime/waits.py`), so a
child killed mid-round rolls its claim back and the next one, or another replica's, fires it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping

from .db.database import create_engine, plain_url
from .definitions.catalog import DefinitionCatalog
from .runtime.background.timer_clock import waiting_on_the_world
from .runtime.background.wakeups import TaskWakeups
from .runtime.waits import Waits

log = logging.getLogger(__name__)

DUE_TIME_PROCESS = "fire-due-times"
# Connections the child holds: one firing round at a time, and the message matcher's.
_POOL_SIZE = 2
_RESTART_SECONDS = 1.0
_PARENT_CHECK_SECONDS = 1.0


async def fire_due_times(database_url: str, parent: int, niceness: int, idle_seconds: float = 5.0) -> None:
    """The child's life: fire and match until SIGTERM, or until the serving process `parent` is gone
    (named by the parent itself: one that died while this child was starting is not its parent now)."""
    if os.getppid() != parent:
        return
    os.nice(niceness)
    db = create_engine(database_url, _POOL_SIZE)
    wakeups = TaskWakeups(plain_url(database_url))
    clock, matcher = waiting_on_the_world(Waits(db, DefinitionCatalog(db)), wakeups, idle_seconds)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await wakeups.start()
    clock.start()
    matcher.start()
    log.info("due-time process ready", extra={"niceness": niceness})
    try:
        # A serving process killed outright cannot stop its child: the child sees itself adopted.
        while os.getppid() == parent and not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=_PARENT_CHECK_SECONDS)
    finally:
        await matcher.stop()
        await clock.stop()
        await wakeups.stop()
        await db.dispose()


class DueTimeProcess:
    """The serving process's end: keeps one child running until `stop`."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        self._child: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._keeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._keeper = asyncio.create_task(self._keep_running(), name="due-time process keeper")

    async def _keep_running(self) -> None:
        while not self._stopping:
            self._child = self._spawn()
            code = await asyncio.to_thread(self._child.wait)
            if self._stopping:
                return
            log.warning("the due-time process ended; starting another", extra={"exit_code": code})
            await asyncio.sleep(_RESTART_SECONDS)

    def _spawn(self) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "abada_engine.main", DUE_TIME_PROCESS, "--parent", str(os.getpid())]
        return subprocess.Popen(command, env=self._env)

    async def stop(self) -> None:
        self._stopping = True
        child = self._child
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(child.wait), timeout=10)
            except TimeoutError:
                child.kill()
        if self._keeper is not None:
            await self._keeper
