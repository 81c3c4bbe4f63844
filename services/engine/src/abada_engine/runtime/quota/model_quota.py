"""Admitting model calls against their profile's quotas, and refusing calls a spend budget forbids.

The engine sees every model call before it happens (its STARTED step) and after (COMPLETED, with
tokens), so it is where a provider's quota and a spend budget hold for every worker at once:

- quotas: at STARTED the call is admitted against the profile's windows, shared by every replica
  through PostgreSQL (`store.model_quotas`), or refused with RESOURCE_EXHAUSTED,
  `MODEL_QUOTA_EXHAUSTED` and the wait in `google.rpc.RetryInfo`. Calls are admitted in order of
  arrival per model: a call that has waited goes before later ones. Its tokens are estimated from
  the request's size (sent by the worker with the STARTED step) and settled when COMPLETED (or
  FAILED) is journaled;
- budgets: a call whose STARTED would begin once the task has spent its node's `max_cost_usd`, or
  the instance its process's, is refused LIMIT_EXCEEDED naming the budget. Cost is the profile's
  prices times the journaled tokens. On a `for_each` node the node's budget is shared by all its
  items: the call that would pass it is refused, whichever item makes it. The fan-out's spend, its
  calls in flight and this call (each counted at the dearest call it has finished, or at this call's
  estimated input if dearer) are weighed under the fan-out's lock, in the transaction that journals
  the STARTED: items beginning calls at once cannot both pass.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada.engine.v1.incident_type_pb2 import IncidentType
from abada_common.group_commit import GroupCommit
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine import metrics
from abada_engine.db.database import autocommit
from abada_engine.definitions.model import ModelProfile, Price, Process
from abada_engine.errors import Category, EngineError
from abada_engine.runtime.flow.navigator import IncidentToRaise
from abada_engine.runtime.held import raise_recorded_incident
from abada_engine.runtime.incident_types import type_name
from abada_engine.runtime.quota.window import QUOTA_SPAN_SECONDS
from abada_engine.store import fan_out_budget as fan_out_budget_store
from abada_engine.store import history as history_store
from abada_engine.store import model_quotas as quota_store
from abada_engine.store.hand_written import HotPath
from abada_engine.store.history import HistoryRecord

log = logging.getLogger(__name__)

LIMIT_EXCEEDED = type_name(IncidentType.INCIDENT_TYPE_LIMIT_EXCEEDED)
# The refusal's `scope` when the budget is a fan-out's, shared by all its items.
SHARED_SCOPE = "fan_out"


def stops_a_fan_out(incident_type: str, details: dict[str, Any]) -> bool:
    """The incident a fan-out's spent budget raised (others of its items may be stopped beside it)."""
    inner = details.get("details")
    return incident_type == LIMIT_EXCEEDED and isinstance(inner, dict) and inner.get("scope") == SHARED_SCOPE


# What a call is taken to cost before it happens when the worker sent no estimate of its size.
DEFAULT_ESTIMATED_TOKENS = 1_000
# The most a STARTED's estimate counts for: more than any model's context window.
MAX_ESTIMATED_TOKENS = 2_000_000


def has_quota(profile: ModelProfile | None) -> bool:
    return profile is not None and any(
        limit is not None
        for limit in (profile.requests_per_minute, profile.tokens_per_minute, profile.max_concurrent_calls)
    )


class ModelQuotas:
    """Admission of one engine replica, a group commit (`group_commit`) per model.

    The STARTED admissions of a model that arrive while the replica's previous batch for that model is
    in the database are admitted together next, in order of arrival: one round trip and one
    acquisition of the model's lock for the batch. A call is settled (its real tokens replace the
    estimate, its concurrency slot is freed) by the database itself, in the transaction that journals
    its COMPLETED or FAILED step (migration 0004): no round trip of its own.
    """

    def __init__(self, engine: AsyncEngine, hot: HotPath | None = None) -> None:
        # Admission runs beside every model call's AppendStep: on the hot path's pool.
        self._db = hot if hot is not None else HotPath(engine)
        # One line per model and windows: two definition versions may give a model different limits.
        self._admissions: dict[
            quota_store.Quota, GroupCommit[quota_store.ModelCall, quota_store.Admission]
        ] = {}

    async def admit(
        self, profile: ModelProfile, task_id: uuid.UUID, sequence: int, attempt: int, estimated_tokens: int
    ) -> bool:
        """Admits the model call or raises MODEL_QUOTA_EXHAUSTED with the time to wait. True when this
        call was admitted now, False when it had been admitted already (a re-sent STARTED): only the
        former may be given back (`release`)."""
        quota = quota_store.Quota(
            model=profile.name,
            requests_per_minute=profile.requests_per_minute,
            tokens_per_minute=profile.tokens_per_minute,
            max_concurrent=profile.max_concurrent_calls,
            span_seconds=QUOTA_SPAN_SECONDS,
        )
        line = self._admissions.get(quota)
        if line is None:
            line = self._admissions[quota] = GroupCommit(functools.partial(self._admit_batch, quota))
        tokens = estimated_tokens if estimated_tokens > 0 else DEFAULT_ESTIMATED_TOKENS
        # The estimate is the worker's word: it may hold back a window, never fill it for ever.
        tokens = min(tokens, MAX_ESTIMATED_TOKENS)
        admission = await line.submit(quota_store.ModelCall(task_id, sequence, attempt, tokens))
        if admission.admitted:
            if admission.reason == quota_store.ALREADY_ADMITTED:
                return False
            metrics.MODEL_CALLS_ADMITTED.labels(profile.name).inc()
            return True
        metrics.MODEL_CALLS_REFUSED.labels(profile.name, admission.reason).inc()
        wait = admission.retry_after_ms / 1000
        ahead = f", {admission.waiting_ahead} call(s) waiting before it" if admission.waiting_ahead else ""
        raise EngineError(
            Category.RESOURCE_EXHAUSTED,
            ErrorReason.MODEL_QUOTA_EXHAUSTED,
            f"model {profile.name}: {admission.reason} of its profile is used up{ahead}; ask again in {wait:.2f}s",
            field="sequence",
            metadata={"model": profile.name, "quota": admission.reason},
            retry_after_seconds=wait,
        )

    async def _admit_batch(
        self, quota: quota_store.Quota, calls: Sequence[quota_store.ModelCall]
    ) -> list[quota_store.Admission]:
        async with self._db.connect() as conn:
            return await quota_store.admit(conn, quota, calls)

    async def release(self, profile: ModelProfile, task_id: uuid.UUID, sequence: int, attempt: int) -> None:
        """Gives back the place of a call this very request admitted but the journal then refused: it
        never ran. (A call admitted earlier is never given back by a later request's refusal.)"""
        try:
            async with self._db.connect() as conn:
                await quota_store.release(conn, task_id, sequence, attempt)
        except Exception:
            log.exception("could not release model call %s/%s of %s", task_id, sequence, profile.name)


def cost_usd(profile: ModelProfile | None, input_tokens: int, output_tokens: int) -> float:
    return profile.price.cost_usd(input_tokens, output_tokens) if profile is not None else 0.0


class Budgets:
    """Spend budgets checked at a model call's STARTED: the node's per task, the process's per instance."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._db = autocommit(engine)

    @staticmethod
    def applies(process: Process, node_id: str) -> bool:
        return process.max_cost_usd is not None or process.node(node_id).limits.max_cost_usd is not None

    @staticmethod
    def shared_by_items(process: Process, node_id: str) -> bool:
        """The node runs `for_each` under a max_cost_usd: one budget for all its items together."""
        node = process.node(node_id)
        return node.fans_out and node.limits.max_cost_usd is not None

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        async with self._engine.begin() as conn:
            yield conn

    async def check_shared(
        self, conn: AsyncConnection, process: Process, node_id: str, task_id: uuid.UUID, estimated_tokens: int
    ) -> None:
        """Inside the transaction that journals the call's STARTED: refuse the call that would take the
        fan-out's items together past their node's max_cost_usd."""
        budget = process.node(node_id).limits.max_cost_usd
        assert budget is not None
        profile = process.model_profile(node_id)
        price = profile.price if profile is not None else Price()
        spend = await fan_out_budget_store.lock_fan_out_spend(
            conn, task_id, price.input_per_million_usd / 1e6, price.output_per_million_usd / 1e6
        )
        if spend is None:
            return  # not an item: the node's budget was checked for the task alone
        spent = price.cost_usd(spend.input_tokens, spend.output_tokens)
        # A call is taken to cost what the dearest finished one did, or this call's estimated input if
        # dearer (before any call has finished, that estimate is all there is to go on).
        this_call = max(spend.dearest_call_usd, price.cost_usd(max(estimated_tokens, 0), 0))
        in_flight = spend.calls_in_flight * this_call
        if spent >= budget or spent + in_flight + this_call > budget:
            in_flight_text = (
                f" and {spend.calls_in_flight} call(s) in flight (about ${in_flight:.6f})"
                if spend.calls_in_flight
                else ""
            )
            raise _over_budget(
                profile=profile,
                message=f"model calls of this node's items have cost ${spent:.6f}{in_flight_text}; this call "
                f"(about ${this_call:.6f}) would pass the node's max_cost_usd ${budget:g}, shared by all items",
                spent=spent,
                budget=budget,
                scope=SHARED_SCOPE,
                extra={"fan_out_id": str(spend.fan_out_id), "calls_in_flight": str(spend.calls_in_flight)},
            )

    async def stop_item(self, task_id: uuid.UUID, worker_id: str, attempt: int, refused: EngineError) -> None:
        """After an item's call was refused for the fan-out's shared budget: the item stops, held, and the
        fan-out's one LIMIT_EXCEEDED incident holds it (raised by the first item stopped; those stopped
        after it are held beside it, and go back to the queue when it is retried)."""
        error = {"code": LIMIT_EXCEEDED, "message": refused.message, "details": refused.metadata}
        async with self._engine.begin() as conn:
            await fan_out_budget_store.lock_fan_out_spend(conn, task_id, 0.0, 0.0)  # one stop at a time
            held = await fan_out_budget_store.hold_item(conn, task_id, worker_id, attempt, error)
            if held is None:
                return  # the lease went meanwhile: whoever holds the item now meets the budget in turn
            incident_id = await fan_out_budget_store.open_incident_of_fan_out(
                conn, held.instance_id, held.fan_out_id, LIMIT_EXCEEDED, SHARED_SCOPE
            )
            if incident_id is None:
                over = IncidentToRaise(held.node_id, LIMIT_EXCEEDED, refused.message, error, task_id)
                await raise_recorded_incident(conn, held.instance_id, over)
                return
            # The fan-out's incident is raised already: this item only stops under it.
            stopped = {"incident_id": str(incident_id), "reason": refused.message, "message": refused.message}
            await history_store.append(
                conn, [HistoryRecord(held.instance_id, "ITEM_STOPPED", held.node_id, task_id, stopped)]
            )

    async def check(self, process: Process, node_id: str, task_id: uuid.UUID) -> None:
        if process.max_cost_usd is None and Budgets.shared_by_items(process, node_id):
            return  # only the fan-out's budget applies: `check_shared` reads what its items spent
        async with self._db.connect() as conn:
            spent = await quota_store.model_tokens_of_instance(conn, task_id)
        task_cost = sum(
            cost_usd(process.model_profile(row.node_id), row.input_tokens, row.output_tokens)
            for row in spent
            if row.this_task
        )
        instance_cost = sum(
            cost_usd(process.model_profile(row.node_id), row.input_tokens, row.output_tokens) for row in spent
        )
        # A budget all of a fan-out's items share is weighed apart (`check_shared`).
        node_budget = (
            None if Budgets.shared_by_items(process, node_id) else process.node(node_id).limits.max_cost_usd
        )
        if node_budget is not None and task_cost >= node_budget:
            raise _over_budget(
                profile=process.model_profile(node_id),
                message=f"model calls of this task have cost ${task_cost:.6f}, reaching the node's "
                f"max_cost_usd ${node_budget:g}",
                spent=task_cost,
                budget=node_budget,
                scope="node",
            )
        if process.max_cost_usd is not None and instance_cost >= process.max_cost_usd:
            raise _over_budget(
                profile=process.model_profile(node_id),
                message=f"model calls of this instance have cost ${instance_cost:.6f}, reaching the process's "
                f"max_cost_usd ${process.max_cost_usd:g}",
                spent=instance_cost,
                budget=process.max_cost_usd,
                scope="instance",
            )


def _over_budget(
    *,
    profile: ModelProfile | None,
    message: str,
    spent: float,
    budget: float,
    scope: str,
    extra: dict[str, str] | None = None,
) -> EngineError:
    metrics.MODEL_CALLS_REFUSED.labels(profile.name if profile else "", "max_cost_usd").inc()
    return EngineError(
        Category.RESOURCE_EXHAUSTED,
        ErrorReason.LIMIT_EXCEEDED,
        message,
        field="sequence",
        metadata={
            "limit": "max_cost_usd",
            "scope": scope,
            "spent_usd": f"{spent:.6f}",
            "max_cost_usd": f"{budget:g}",
            **(extra or {}),
        },
    )
