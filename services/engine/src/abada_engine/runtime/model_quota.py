"""Admitting model calls against their profile's quotas, and refusing calls a spend budget forbids.

The engine sees every model call before it happens (its STARTED step) and after (COMPLETED, with
tokens), so it is where a provider's quota and a spend budget hold for every worker at once:

- quotas: at STARTED the call is admitted against the profile's windows, shared by every replica
  through PostgreSQL (`store.model_quotas`), or refused with RESOURCE_EXHAUSTED,
  `MODEL_QUOTA_EXHAUSTED` and the wait in `google.rpc.RetryInfo`. Calls are admitted in order of
  arrival per model: a call that has waited goes before later ones. Its tokens are estimated from
  the request's size (sent by the worker with the STARTED step) and settled at COMPLETED;
- budgets: a call whose STARTED would begin once the task has spent its node's `max_cost_usd`, or
  the instance its process's, is refused LIMIT_EXCEEDED naming the budget. Cost is the profile's
  prices times the journaled tokens.
"""

from __future__ import annotations

import logging
import uuid

from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine import metrics
from abada_engine.db.database import autocommit
from abada_engine.definitions.model import ModelProfile, Process
from abada_engine.errors import Category, EngineError
from abada_engine.store import model_quotas as quota_store
from abada_engine.store.hand_written import HotPath

from .quota_window import QUOTA_SPAN_SECONDS

log = logging.getLogger(__name__)

# What a call is taken to cost before it happens when the worker sent no estimate of its size.
DEFAULT_ESTIMATED_TOKENS = 1_000
QUOTA_EXHAUSTED = "MODEL_QUOTA_EXHAUSTED"


def has_quota(profile: ModelProfile | None) -> bool:
    return profile is not None and any(
        limit is not None
        for limit in (profile.requests_per_minute, profile.tokens_per_minute, profile.max_concurrent_calls)
    )


class ModelQuotas:
    def __init__(self, engine: AsyncEngine, hot: HotPath | None = None) -> None:
        # Admission and settlement run beside every model call's AppendStep: on the hot path's pool.
        self._db = hot if hot is not None else HotPath(engine)

    async def admit(
        self, profile: ModelProfile, task_id: uuid.UUID, sequence: int, attempt: int, estimated_tokens: int
    ) -> None:
        """Admits the model call or raises MODEL_QUOTA_EXHAUSTED with the time to wait."""
        async with self._db.connect() as conn:
            admission = await quota_store.admit(
                conn,
                model=profile.name,
                task_id=task_id,
                sequence=sequence,
                attempt=attempt,
                requests_per_minute=profile.requests_per_minute,
                tokens_per_minute=profile.tokens_per_minute,
                max_concurrent=profile.max_concurrent_calls,
                tokens=estimated_tokens if estimated_tokens > 0 else DEFAULT_ESTIMATED_TOKENS,
                span_seconds=QUOTA_SPAN_SECONDS,
            )
        if admission.admitted:
            metrics.MODEL_CALLS_ADMITTED.labels(profile.name).inc()
            return
        metrics.MODEL_CALLS_REFUSED.labels(profile.name, admission.reason).inc()
        wait = admission.retry_after_ms / 1000
        ahead = f", {admission.waiting_ahead} call(s) waiting before it" if admission.waiting_ahead else ""
        raise EngineError(
            Category.RESOURCE_EXHAUSTED,
            QUOTA_EXHAUSTED,
            f"model {profile.name}: {admission.reason} of its profile is used up{ahead}; ask again in {wait:.2f}s",
            field="sequence",
            metadata={"model": profile.name, "quota": admission.reason},
            retry_after_seconds=wait,
        )

    async def settle(self, profile: ModelProfile, task_id: uuid.UUID, sequence: int, tokens: int) -> None:
        """The finished call's real tokens replace its estimate; its concurrency slot is freed."""
        try:
            async with self._db.connect() as conn:
                await quota_store.settle(conn, task_id, sequence, tokens)
        except Exception:  # the step is journaled; a window slightly off must not fail the worker's call
            log.exception("could not settle model call %s/%s of %s", task_id, sequence, profile.name)

    async def release(self, profile: ModelProfile, task_id: uuid.UUID, sequence: int) -> None:
        """Gives back the place of a call admitted but then refused by the journal: it never ran."""
        try:
            async with self._db.connect() as conn:
                await quota_store.release(conn, task_id, sequence)
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
        "LIMIT_EXCEEDED",
        message,
        field="sequence",
        metadata={
            "limit": "max_cost_usd",
            "scope": scope,
            "spent_usd": f"{spent:.6f}",
            "max_cost_usd": f"{budget:g}",
        },
    )
