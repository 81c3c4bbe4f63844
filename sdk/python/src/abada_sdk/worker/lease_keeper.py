"""Keeps a lease alive while its task works: ExtendLease about every third of the lease.

While the engine cannot be reached the keeper tries again every few hundred milliseconds, past the
lease's own expiry too: a lease that ran out with nobody taking the task over is re-granted to its
holder, so only the engine can say the lease is truly lost (NOT_LEASE_HOLDER, TASK_NOT_LEASED).
`outage_patience_seconds` past the expiry bounds that wait. A refusal for another reason is tried
again until the lease runs out.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("abada_sdk.worker")

DEFAULT_OUTAGE_PATIENCE_SECONDS = 300.0


class Renewal(enum.Enum):
    """How one ExtendLease ended."""

    RENEWED = "ok"
    LOST = "lost"  # somebody else holds the task now, or nobody: stop working on it
    UNREACHABLE = "unreachable"  # no answer from the engine: keep trying, past the expiry too
    REFUSED = "refused"  # the engine answered no for another reason: keep trying until the lease ends


# A failed extension's verdict, and for LOST the engine's reason.
Classify = Callable[[Exception], tuple[Renewal, str]]


async def keep_lease_alive(
    extend: Callable[[], Awaitable[object]],
    lease_ms: int,
    on_lost: Callable[[str], None],
    *,
    classify: Classify,
    task_id: str,
    outage_patience_seconds: float = DEFAULT_OUTAGE_PATIENCE_SECONDS,
    on_renewal: Callable[[Renewal], None] | None = None,
) -> None:
    """Runs until cancelled; calls `on_lost` once if the lease is gone or cannot be renewed in time."""
    interval = lease_ms / 3000
    retry_in = min(max(interval / 8, 0.05), 0.5)
    expires_at = time.monotonic() + lease_ms / 1000
    next_renewal = interval
    failures = 0

    def counted(outcome: Renewal) -> None:
        if on_renewal is not None:
            on_renewal(outcome)

    while True:
        await asyncio.sleep(next_renewal)
        started = time.monotonic()
        try:
            await extend()
        except Exception as error:
            outcome, reason = classify(error)
            counted(outcome)
            if outcome is Renewal.LOST:
                log.warning("lease lost: %s", reason, extra={"task_id": task_id, "reason": reason})
                on_lost(reason)
                return
            patience = outage_patience_seconds if outcome is Renewal.UNREACHABLE else 0.0
            if time.monotonic() >= expires_at + patience:
                on_lost("ENGINE_UNREACHABLE" if outcome is Renewal.UNREACHABLE else "LEASE_EXPIRED")
                return
            failures += 1
            next_renewal = retry_in
            log.log(
                logging.WARNING if failures == 1 else logging.DEBUG,
                "could not extend the lease, retrying: %s",
                error,
                extra={"task_id": task_id, "error": str(error), "failures": failures},
            )
            continue
        counted(Renewal.RENEWED)
        if failures:
            log.info("lease renewed after an outage", extra={"task_id": task_id, "failures": failures})
            failures = 0
        expires_at = started + lease_ms / 1000
        next_renewal = interval
