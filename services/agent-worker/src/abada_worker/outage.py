"""Riding out an engine outage without giving up what the attempt already has.

A model turn or a tool call that came back while the engine (or its database) is unreachable has
been paid for: its journal entry is retried, with backoff, until the engine takes it or says the
lease is gone, and nothing new starts meanwhile (the caller awaits it). The lease keeper goes on
renewing in the same way; when it gives up, the task's interruption ends the wait here.

An append refused LEASE_EXPIRED means the lease ran out during the outage: the engine re-grants it
to its holder if nobody took the task over (`ExtendLease`), and the append is sent again once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from abada.engine.v1.error_reason_pb2 import ErrorReason

from .errors import EngineUnavailable, LeaseLost
from .interruption import TaskInterruption

log = logging.getLogger(__name__)

Reply = TypeVar("Reply")
FIRST_PAUSE_SECONDS = 0.1
MAX_PAUSE_SECONDS = 1.0


async def until_the_engine_takes_it(
    send: Callable[[], Awaitable[Reply]],
    interruption: TaskInterruption,
    *,
    renew: Callable[[], Awaitable[None]] | None = None,
    what: str = "journal entry",
) -> Reply:
    """`send()` again after every EngineUnavailable until it is answered or the task is interrupted."""
    pause = FIRST_PAUSE_SECONDS
    renewed = False
    must_renew = False
    failures = 0
    while True:
        try:
            if must_renew and renew is not None:
                await renew()
                must_renew = False
            reply = await send()
        except EngineUnavailable as error:
            failures += 1
            log.log(
                logging.WARNING if failures == 1 else logging.DEBUG,
                "the engine is unreachable; keeping the %s and trying again",
                what,
                extra={"error": str(error), "failures": failures},
            )
            await interruption.pause(pause)
            pause = min(pause * 2, MAX_PAUSE_SECONDS)
            continue
        except LeaseLost as lost:
            if lost.reason != ErrorReason.Name(ErrorReason.LEASE_EXPIRED) or renew is None or renewed:
                raise
            renewed = must_renew = True
            continue
        if failures:
            log.info("the engine took the %s after %d failed tries", what, failures)
        return reply
