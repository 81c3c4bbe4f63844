"""Keeps a lease alive while its task works: ExtendLease about every third of the lease.

While the engine cannot be reached the keeper tries again every few hundred milliseconds, past the
lease's own expiry too: a lease that ran out with nobody taking the task over is re-granted to its
holder (the engine's `leases` module says why), so only the engine can say the lease is truly lost
(NOT_LEASE_HOLDER, TASK_NOT_LEASED). `outage_patience_seconds` past the expiry bounds the wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .engine_client import EngineClient, LeaseRef
from .errors import AttemptFailed, EngineUnavailable, LeaseLost
from .metrics import LEASE_RENEWALS

log = logging.getLogger(__name__)

DEFAULT_OUTAGE_PATIENCE_SECONDS = 300.0


async def keep_lease_alive(
    engine: EngineClient,
    lease: LeaseRef,
    lease_ms: int,
    on_lost: Callable[[str], None],
    *,
    outage_patience_seconds: float = DEFAULT_OUTAGE_PATIENCE_SECONDS,
) -> None:
    """Runs until cancelled; calls `on_lost` once if the lease is gone or cannot be renewed in time."""
    interval = lease_ms / 3000
    retry_in = min(max(interval / 8, 0.05), 0.5)
    expires_at = time.monotonic() + lease_ms / 1000
    next_renewal = interval
    failures = 0
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
        except EngineUnavailable as error:
            LEASE_RENEWALS.labels("failed").inc()
            if time.monotonic() >= expires_at + outage_patience_seconds:
                on_lost("ENGINE_UNREACHABLE")
                return
            failures += 1
            next_renewal = retry_in
            log.log(
                logging.WARNING if failures == 1 else logging.DEBUG,
                "could not extend the lease, retrying",
                extra={"task_id": lease.task_id, "error": str(error), "failures": failures},
            )
            continue
        except AttemptFailed as refused:
            LEASE_RENEWALS.labels("failed").inc()
            # Refused for a reason other than the lease: try again until the lease runs out.
            if time.monotonic() >= expires_at:
                on_lost("LEASE_EXPIRED")
                return
            next_renewal = retry_in
            log.warning(
                "the engine refused to extend the lease, retrying",
                extra={"task_id": lease.task_id, "error": str(refused)},
            )
            continue
        if failures:
            log.info("lease renewed after an outage", extra={"task_id": lease.task_id, "failures": failures})
            failures = 0
        expires_at = started + lease_ms / 1000
        next_renewal = interval
