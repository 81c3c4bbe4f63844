"""What this replica remembers about the tasks it handed out, so the hot path can skip a read.

Nothing remembered is trusted: each statement that relies on it re-checks what matters inside
the statement (the live lease, the sequence, the limits, the instance row's version), and when
the memory turned out stale the caller takes the careful path (read, then write). A replica that
remembers nothing (another replica handed the task out, or it restarted) is merely slower.
"""

from __future__ import annotations

import hmac
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

LEASES_KEPT = 50_000
PLACEMENTS_KEPT = 100_000


@dataclass(frozen=True)
class LeaseHeld:
    """A task row as seen by someone who proved they hold its live lease (or who just granted it)."""

    task_id: uuid.UUID
    instance_id: uuid.UUID
    definition_id: uuid.UUID
    node_id: str
    attempt: int
    retries_left: int
    lease_expires_at: datetime
    variables: dict[str, Any]
    instance_state: str
    # The instance row's version (PostgreSQL xmin): a write guarded by it fails if anything changed it.
    instance_xmin: str | None = None
    # Whom the lease was granted to, when this replica granted it: a remembered lease serves only them.
    lease_owner: str = ""
    lease_token_hash: bytes = b""
    # The instance was started by a call activity: its end moves its parent (runtime/calls.py).
    called: bool = False


class HandedOut:
    """Two bounded memories, both filled when this replica leases or journals a task.

    - the lease and the instance as they were when the task was locked: `Complete` decides on them
      and writes in one statement guarded by the lease and the instance's xmin;
    - where the task stands (definition, node): `AppendStep` knows the node's bindings and limits.
    """

    def __init__(self, leases_kept: int = LEASES_KEPT, placements_kept: int = PLACEMENTS_KEPT) -> None:
        self._leases: OrderedDict[uuid.UUID, LeaseHeld] = OrderedDict()
        self._placements: OrderedDict[uuid.UUID, tuple[uuid.UUID, str]] = OrderedDict()
        self._leases_kept = leases_kept
        self._placements_kept = placements_kept

    def leased(self, held: LeaseHeld) -> None:
        self._leases[held.task_id] = held
        if len(self._leases) > self._leases_kept:
            self._leases.popitem(last=False)

    def take_lease(self, task_id: uuid.UUID, worker_id: str, token_hash: bytes) -> LeaseHeld | None:
        """The lease as granted to `worker_id` with this token and not yet expired, forgotten at once (a
        task is completed at most once per grant); None for anyone else, whose call leaves it in place."""
        held = self._leases.get(task_id)
        if held is None:
            return None
        if not (
            held.lease_owner == worker_id
            and held.lease_token_hash
            and hmac.compare_digest(held.lease_token_hash, token_hash)
            and held.lease_expires_at > datetime.now(UTC)
        ):
            return None
        del self._leases[task_id]
        return held

    def place(self, task_id: uuid.UUID, definition_id: uuid.UUID, node_id: str) -> None:
        self._placements[task_id] = (definition_id, node_id)
        self._placements.move_to_end(task_id)
        if len(self._placements) > self._placements_kept:
            self._placements.popitem(last=False)

    def placement(self, task_id: uuid.UUID) -> tuple[uuid.UUID, str] | None:
        return self._placements.get(task_id)
