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
  prices times the journaled tokens.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Sequence

from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common.group_commit import GroupCommit
from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine import metrics
from abada_engine.db.database import autocommit
from abada_engine.definitions.model import ModelProfile, Process
from abada_engine.errors import Category, EngineError
from abada_engine.runtime.quota.window import QUOTA_SPAN_SECONDS
from abada_engine.store import model_quotas as quota_store
from abada_engine.store.hand_written import HotPath

log = logging.getLogger(__name__)

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
        self._db = autocommit(engine)

    @staticmethod
    def applies(process: Process, node_id: str) -> bool:
        return process.max_cost_usd is not None or process.node(node_id).limits.max_cost_usd is not None

    async def check(self, process: Process, node_id: str, task_id: uuid.UUID) -> None:
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
        node_budget = process.node(node_id).limits.max_cost_usd
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
    *, profile: ModelProfile | None, message: str, spent: float, budget: float, scope: str
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
        },
    )
