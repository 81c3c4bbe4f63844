"""What this replica remembers about the tasks it handed out, so the hot path can skip a read.

Nothing remembered is trusted: each statement that relies on it re-checks what matters inside
the statement (the live lease, the sequence, the limits, the instance row's version), and when
the memory turned out stale the caller takes the careful path (read, then write). A replica that
remembers nothing (another replica handed the task out, or it restarted) is merely slower.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
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

    def take_lease(self, task_id: uuid.UUID) -> LeaseHeld | None:
        """The lease as granted, forgotten at once: a task is completed at most once per grant."""
        return self._leases.pop(task_id, None)

    def place(self, task_id: uuid.UUID, definition_id: uuid.UUID, node_id: str) -> None:
        self._placements[task_id] = (definition_id, node_id)
        self._placements.move_to_end(task_id)
        if len(self._placements) > self._placements_kept:
            self._placements.popitem(last=False)

    def placement(self, task_id: uuid.UUID) -> tuple[uuid.UUID, str] | None:
        return self._placements.get(task_id)
