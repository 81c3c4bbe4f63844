"""`abada-engine reseal`: every sealed value at rest moved under the primary journal key and the
current associated data, so a retired key can leave the ring.

It runs beside live engines. It reads a batch without locks, seals again in memory, and writes each
row back in one short transaction per batch, only if the row still holds what was read: a step an
engine finished meanwhile is left for the next pass (the engine's own writes check the row's key and
version in turn, so neither can put a payload under the wrong ones). It changes nothing a reader sees,
so it can stop anywhere and run again; a second run finds nothing to do.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.errors import EngineError
from abada_engine.runtime.approvals import approved_arguments, approved_call
from abada_engine.runtime.crypto.keys import KeyRing
from abada_engine.runtime.crypto.sealing import AAD_VERSION, StepSealer
from abada_engine.store import resealing as store
from abada_engine.store.journal_steps import StepRow

# Passes over the table at most: a pass leaves only rows an engine changed while it ran.
MAX_PASSES = 3
# Steps it could not open, named in the report (all are counted).
NAMED_AT_MOST = 10


@dataclass
class ResealReport:
    primary: str
    dry_run: bool
    steps_before: dict[tuple[str, int], int] = field(default_factory=dict)
    approvals_before: dict[str, int] = field(default_factory=dict)
    steps_after: dict[tuple[str, int], int] = field(default_factory=dict)
    approvals_after: dict[str, int] = field(default_factory=dict)
    # By the key id (and, for steps, associated data version) they were under.
    steps_resealed: Counter[tuple[str, int]] = field(default_factory=Counter)
    approvals_rekeyed: Counter[str] = field(default_factory=Counter)
    changed_meanwhile: int = 0
    unreadable: list[str] = field(default_factory=list)
    newest_step_key: str | None = None
    # Nothing was done: the ring looks misordered and the run was not forced.
    refused: bool = False

    @property
    def misordered(self) -> bool:
        """The engines seal under another key than this ring's primary: a replica still runs the old
        ring, or this ring is not theirs. Re-sealing now would seal under a key some engine lacks."""
        return self.newest_step_key is not None and self.newest_step_key != self.primary

    @property
    def done(self) -> bool:
        """Every sealed value is under the primary key and the current associated data."""
        return set(self.steps_after) <= {(self.primary, AAD_VERSION)} and set(self.approvals_after) <= {
            self.primary
        }

    def removable(self, ring: KeyRing) -> list[str]:
        """Keys of the ring no sealed value needs any more."""
        used = {key for key, _ in self.steps_after} | set(self.approvals_after)
        return [key for key in ring.keys if key != self.primary and key not in used]

    def lines(self, ring: KeyRing) -> list[str]:
        verb = "would re-seal" if self.dry_run else "re-sealed"
        out = [
            f"primary key: {self.primary}; associated data version: {AAD_VERSION}",
            f"before: journal steps {_by_key(self.steps_before)}; approved calls {_by_key(self.approvals_before)}",
            f"{verb} under {self.primary}: {sum(self.steps_resealed.values())} journal steps "
            f"({_by_key(self.steps_resealed)}), {sum(self.approvals_rekeyed.values())} approved-call digests "
            f"({_by_key(self.approvals_rekeyed)})",
        ]
        if self.misordered:
            what = "refused" if self.refused else "warning"
            out.append(
                f"{what}: the newest journal step is sealed under {self.newest_step_key}, not {self.primary}: "
                f"every engine replica must have {self.primary} first in ABADA_JOURNAL_KEYS before re-sealing"
            )
            if self.refused:
                out.append(
                    "nothing was re-sealed. If every replica has the new ring and none has journaled a step "
                    "since, run again with --force"
                )
                return out
        if self.changed_meanwhile:
            out.append(
                f"changed by a running engine while read, left as they are: {self.changed_meanwhile} (run again)"
            )
        if self.unreadable:
            shown = ", ".join(self.unreadable[:NAMED_AT_MOST])
            more = (
                f" and {len(self.unreadable) - NAMED_AT_MOST} more"
                if len(self.unreadable) > NAMED_AT_MOST
                else ""
            )
            out.append(f"could not be opened, left as they are: {len(self.unreadable)} ({shown}{more})")
        if not self.dry_run:
            out.append(
                f"after: journal steps {_by_key(self.steps_after)}; approved calls {_by_key(self.approvals_after)}"
            )
            removable = self.removable(ring)
            out.append(
                f"keys nothing is sealed under any more (may leave ABADA_JOURNAL_KEYS): {', '.join(removable) or 'none'}"
            )
        return out


def _by_key(counts: dict[tuple[str, int], int] | dict[str, int]) -> str:
    if not counts:
        return "none"
    parts = []
    for key, n in sorted(counts.items()):
        parts.append(f"{key[0]} (v{key[1]}): {n}" if isinstance(key, tuple) else f"{key}: {n}")
    return ", ".join(parts)


class Resealer:
    def __init__(self, engine: AsyncEngine, sealer: StepSealer, batch_size: int = 200) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._sealer = sealer
        self._batch = batch_size

    async def run(self, dry_run: bool = False, force: bool = False) -> ResealReport:
        """Re-seal (or count, with `dry_run`); a ring that looks misordered is refused unless `force`."""
        primary = self._sealer.primary_key_id
        report = ResealReport(primary, dry_run)
        async with self._reads.connect() as conn:
            report.steps_before = await store.steps_by_key(conn)
            report.approvals_before = await store.approvals_by_key(conn)
            report.newest_step_key = await store.newest_step_key(conn)
        if report.misordered and not dry_run and not force:
            report.refused = True
            report.steps_after, report.approvals_after = report.steps_before, report.approvals_before
            return report
        for _ in range(MAX_PASSES):
            # Each pass counts afresh what it left: rows changed meanwhile are tried again.
            report.changed_meanwhile = 0
            report.unreadable.clear()
            await self._steps(report, dry_run)
            await self._approvals(report, dry_run)
            if dry_run or report.changed_meanwhile == 0:
                break
        async with self._reads.connect() as conn:
            report.steps_after = await store.steps_by_key(conn)
            report.approvals_after = await store.approvals_by_key(conn)
        return report

    async def _steps(self, report: ResealReport, dry_run: bool) -> None:
        after: tuple[uuid.UUID, int] | None = None
        while True:
            async with self._reads.connect() as conn:
                rows = await store.stale_steps(conn, report.primary, AAD_VERSION, after, self._batch)
            if not rows:
                return
            after = (rows[-1].task_id, rows[-1].sequence)
            batch = []
            for row in rows:
                try:
                    batch.append(self._resealed(row))
                except EngineError:
                    report.unreadable.append(f"step {row.task_id}/{row.sequence} under {row.key_id}")
            if dry_run:
                report.steps_resealed.update((r.row.key_id, r.row.aad_version) for r in batch)
                continue
            async with self._engine.begin() as conn:
                for resealed in batch:
                    if await store.replace_step_seal(conn, resealed):
                        report.steps_resealed[(resealed.row.key_id, resealed.row.aad_version)] += 1
                    else:
                        report.changed_meanwhile += 1

    def _resealed(self, row: StepRow) -> store.Resealed:
        request, request_digest = self._sealer.reseal(row, "request")
        response, response_digest = self._sealer.reseal(row, "response")
        return store.Resealed(
            row, self._sealer.primary_key_id, AAD_VERSION, request, response, request_digest, response_digest
        )

    async def _approvals(self, report: ResealReport, dry_run: bool) -> None:
        after: uuid.UUID | None = None
        while True:
            async with self._reads.connect() as conn:
                found = await store.stale_approvals(conn, report.primary, after, self._batch)
            if not found:
                return
            after = found[-1].approval_id
            rekeyed = []
            for approval in found:
                try:
                    call = approved_call(
                        self._sealer.open(approval.step, "request") or {},
                        approved_arguments(self._sealer.open(approval.step, "response")) or {},
                    )
                except (EngineError, json.JSONDecodeError):
                    report.unreadable.append(
                        f"approval {approval.approval_id} (its step could not be opened)"
                    )
                    continue
                if self._sealer.knows(approval.approval_key_id) and (
                    self._sealer.digest(approval.approval_key_id, call) != approval.approved_request_digest
                ):
                    # The call rebuilt from the step is not the one approved: never re-key a guess.
                    report.unreadable.append(
                        f"approval {approval.approval_id} (its digest does not match its step)"
                    )
                    continue
                rekeyed.append((approval, self._sealer.digest(report.primary, call)))
            if dry_run:
                report.approvals_rekeyed.update(a.approval_key_id for a, _ in rekeyed)
                continue
            async with self._engine.begin() as conn:
                for approval, digest in rekeyed:
                    if await store.replace_approval_digest(conn, approval, report.primary, digest):
                        report.approvals_rekeyed[approval.approval_key_id] += 1
                    else:
                        report.changed_meanwhile += 1
