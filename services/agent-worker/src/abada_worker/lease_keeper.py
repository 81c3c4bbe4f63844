"""Keeps a lease alive while its task works: ExtendLease about every third of the lease."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .engine_client import EngineClient, LeaseRef
from .errors import AttemptFailed, EngineUnavailable, LeaseLost
from .metrics import LEASE_RENEWALS

log = logging.getLogger(__name__)


async def keep_lease_alive(
    engine: EngineClient, lease: LeaseRef, lease_ms: int, on_lost: Callable[[str], None]
) -> None:
    """Runs until cancelled; calls `on_lost` once if the lease is gone or cannot be renewed in time."""
    interval = lease_ms / 3000
    expires_at = time.monotonic() + lease_ms / 1000
    next_renewal = interval
    while True:
        await asyncio.sleep(next_renewal)
        started = time.monotonic()
        try:
            await engine.extend_lease(lease, lease_ms)
            LEASE_RENEWALS.labels("ok").inc()
        except LeaseLost as lost:
            LEASE_RENEWALS.labels("lost").inc()
            log.warning("lease lost", extra={"task_id": lease.task_id, "reason": lost.reason})
            on_lost(lost.reason)
            return
        except (EngineUnavailable, AttemptFailed) as error:
            LEASE_RENEWALS.labels("failed").inc()
            if time.monotonic() >= expires_at:
                on_lost("LEASE_EXPIRED")
                return
            # Try again soon, well before the lease runs out.
            next_renewal = max(0.05, min(interval / 4, expires_at - time.monotonic()) / 2)
            log.warning(
                "could not extend the lease, retrying", extra={"task_id": lease.task_id, "error": str(error)}
            )
            continue
        expires_at = started + lease_ms / 1000
        next_renewal = interval
