"""Workers for external tasks.

`Worker` serves topics with plain Python handlers. It is put together from parts that the agent
worker (abada-worker) is built on as well, so both fetch, run, keep leases and drain the same way:
`Poller` (fetch while there is room, back off while the engine is away, hand back a late poll's
tasks), `Executor` (slots, hand-over, the drain deadline), `keep_lease_alive` and `Backoff`.
"""

from .executor import DRAIN_DEADLINE, Executor, TaskRun
from .lease_keeper import Renewal, keep_lease_alive
from .poller import Poller
from .waiting import Backoff, first_of, sleep_unless
from .worker import DEFAULT_LEASE_MS, Handler, Worker

__all__ = [
    "DEFAULT_LEASE_MS",
    "DRAIN_DEADLINE",
    "Backoff",
    "Executor",
    "Handler",
    "Poller",
    "Renewal",
    "TaskRun",
    "Worker",
    "first_of",
    "keep_lease_alive",
    "sleep_unless",
]
