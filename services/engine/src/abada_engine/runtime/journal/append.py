"""Appending steps to a task's journal, and reading the journal back.

Every model and tool call is journaled; the engine checks the lease, the attempt, the sequence,
the binding and the limits before a step is accepted, so a worker that takes over after a crash
can replay finished steps instead of paying for them again, and a write is never re-sent blindly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.definitions.catalog import Definition, DefinitionCatalog
from abada_engine.definitions.model import ModelProfile, Node, Process, ToolBinding
from abada_engine.errors import Category, EngineError, not_found, precondition
from abada_engine.runtime.background.handed_out import HandedOut, LeaseHeld
from abada_engine.runtime.crypto.keys import IdempotencyKeys, KeyRing
from abada_engine.runtime.crypto.sealing import Place, StepSealer
from abada_engine.runtime.dependencies import Dependencies, dependency_key
from abada_engine.runtime.journal.rules import StepRequest, binding_for, check_limits, check_shape
from abada_engine.runtime.leases import hash_token, held_from_row
from abada_engine.runtime.quota.model_quota import SHARED_SCOPE, Budgets, ModelQuotas, cost_usd, has_quota
from abada_engine.runtime.views import StepView
from abada_engine.store import approvals as approval_store
from abada_engine.store import journal_steps as step_store
from abada_engine.store import tasks as task_store
from abada_engine.store.hand_written import Executor, HotPath
from abada_engine.store.journal_steps import AppendContext
from abada_engine.store.states import FINISHED_STEP_STATES, ApprovalState, StepKind, StepState


@dataclass(frozen=True)
class AppendResult:
    step: StepView
    idempotency_key: str


class Journal:
    """The worker-facing journal: append a step under the lease, read the steps back opened."""

    def __init__(
        self,
        engine: AsyncEngine,
        catalog: DefinitionCatalog,
        keys: KeyRing,
        idempotency: IdempotencyKeys,
        handed_out: HandedOut | None = None,
        hot: HotPath | None = None,
        dependencies: Dependencies | None = None,
    ) -> None:
        # Refuses calls to a dependency that is down before they begin (see `runtime/dependencies`).
        self.dependencies = dependencies
        self._reads = autocommit(engine)
        self._hot = hot if hot is not None else HotPath(engine)
        self._catalog = catalog
        self.sealer = StepSealer(keys, idempotency)
        self.handed_out = handed_out if handed_out is not None else HandedOut()
        self._quotas = ModelQuotas(engine, self._hot)
        self._budgets = Budgets(engine)

    async def append(self, step: StepRequest) -> AppendResult:
        """Check and journal one step.

        The common case is one statement that checks the lease, the sequence and the limits itself
        and writes the step; it needs only to know which node the task is at (remembered from the
        lock or an earlier step, never trusted for anything the statement does not re-check).
        Anything else (a re-send, a conflict, a refusal to explain) takes the careful path.
        """
        check_shape(step)
        starts_model_call = step.kind == StepKind.MODEL_CALL and step.state == StepState.STARTED
        gated = (
            step.state == StepState.STARTED
            and self.dependencies is not None
            and self.dependencies.board.anything_down
        )
        # Who may spend a budget, a quota or a dependency's probe is settled first: the lease holder,
        # its attempt, at the task's next free sequence. Nothing a stranger sends reaches them.
        resent = await self._prove_claim(step) if starts_model_call or gated else False
        if gated:
            await self._hold_for_dependency(step)
        if not starts_model_call:
            # A model call's finished step settles its quota in the same transaction (the database's
            # trigger: see `model_quota`), so it is journaled like any other step.
            return await self._append(step)
        # At STARTED the worker sends the request's estimated size as its input tokens: the quota
        # counts it until COMPLETED brings the real figures; the journal keeps only what was spent.
        estimated = step.input_tokens + step.output_tokens
        step = dataclasses.replace(step, input_tokens=0, output_tokens=0)
        if resent:
            return await self._append(step)  # admitted and budgeted when it was first sent
        profile, budgeted = await self._model_call_rules(step.task_id)
        if budgeted is not None:
            await self._budgets.check(*budgeted, step.task_id)
            if Budgets.shared_by_items(*budgeted):
                return await self._append_within_shared_budget(step, profile, budgeted, estimated)
        if not has_quota(profile):
            return await self._append(step)
        assert profile is not None
        admitted_now = await self._quotas.admit(profile, step.task_id, step.sequence, step.attempt, estimated)
        try:
            return await self._append(step)
        except BaseException:
            if admitted_now:
                await self._quotas.release(profile, step.task_id, step.sequence, step.attempt)
            raise

    async def _append_within_shared_budget(
        self, step: StepRequest, profile: ModelProfile | None, budgeted: tuple[Process, str], estimated: int
    ) -> AppendResult:
        """An item of a `for_each` whose node's max_cost_usd all its items share: the budget is decided
        and the STARTED journaled in one transaction, holding the fan-out's budget lock, so items
        beginning calls at once are decided one after the other, each seeing the calls begun before."""
        try:
            async with self._budgets.transaction() as conn:
                await self._budgets.check_shared(conn, *budgeted, step.task_id, estimated)
                return await self._admit_and_append(step, profile, estimated, conn)
        except EngineError as refused:
            if refused.metadata.get("scope") == SHARED_SCOPE:
                await self._budgets.stop_item(step.task_id, step.worker_id, step.attempt, refused)
            raise

    async def _admit_and_append(
        self, step: StepRequest, profile: ModelProfile | None, estimated: int, conn: Executor
    ) -> AppendResult:
        admitted_now = False
        if profile is not None and has_quota(profile):
            admitted_now = await self._quotas.admit(
                profile, step.task_id, step.sequence, step.attempt, estimated
            )
        try:
            return await self._append(step, conn)
        except BaseException:
            if admitted_now and profile is not None:
                await self._quotas.release(profile, step.task_id, step.sequence, step.attempt)
            raise

    @contextlib.asynccontextmanager
    async def _connection(self, executor: Executor | None) -> AsyncIterator[Executor]:
        """The caller's connection (inside its transaction), else one of the hot path's."""
        if executor is not None:
            yield executor
            return
        async with self._hot.connect() as conn:
            yield conn

    async def _prove_claim(self, step: StepRequest) -> bool:
        """Refuse a STARTED step unless its sender holds the live lease, for this attempt, at the next
        free sequence; True when the sequence already holds this STARTED (a re-send)."""
        async with self._hot.connect() as conn:
            context = await step_store.append_context(conn, step.task_id, step.sequence)
        _held_for_attempt(context, step)
        assert context is not None  # held_from_row refused a missing task
        if context.taken_sequence is not None:
            if (context.kind, context.step_state) == (step.kind, StepState.STARTED):
                return True  # the same STARTED again, or a different one `_append` refuses
            raise EngineError(
                Category.ABORTED,
                ErrorReason.SEQUENCE_CONFLICT,
                f"sequence {step.sequence} of task {step.task_id} already holds a different step "
                f"({context.kind} {context.step_state})",
                field="sequence",
            )
        if step.sequence != context.steps + 1:
            raise precondition(
                ErrorReason.SEQUENCE_GAP,
                f"the next sequence of task {step.task_id} is {context.steps + 1}, not {step.sequence}",
                "sequence",
            )
        return False

    async def _append(self, step: StepRequest, executor: Executor | None = None) -> AppendResult:
        placed = self.handed_out.placement(step.task_id)
        if placed is not None:
            direct = await self._append_directly(step, *placed, executor=executor)
            if direct is not None:
                return direct
        return await self._append_checked(step, executor)

    async def _hold_for_dependency(self, step: StepRequest) -> None:
        """A call about to start that would reach a dependency which is down is refused (unless this
        task is its probe): the worker parks the task instead of calling."""
        assert self.dependencies is not None
        if step.kind == StepKind.MODEL_CALL:
            definition, node_id = await self._placed(step.task_id)
            model = definition.process.nodes[node_id].model if node_id in definition.process.nodes else None
            key = dependency_key("model", model or "")
        else:
            key = dependency_key("tool_server", step.tool_ref.partition("/")[0])
        await self.dependencies.gate(step.task_id, key)

    async def _placed(self, task_id: uuid.UUID) -> tuple[Definition, str]:
        """The task's definition version and node, remembered once read."""
        placed = self.handed_out.placement(task_id)
        if placed is None:
            async with self._reads.connect() as conn:
                found = await task_store.placement(conn, task_id)
            if found is None:
                raise not_found("task", str(task_id), "task_id")
            placed = (found.definition_id, found.node_id)
            self.handed_out.place(task_id, *placed)
        return await self._catalog.get(placed[0]), placed[1]

    async def _model_call_rules(
        self, task_id: uuid.UUID
    ) -> tuple[ModelProfile | None, tuple[Process, str] | None]:
        """The model profile of the task's node, and (process, node id) when a spend budget applies."""
        definition, node_id = await self._placed(task_id)
        process = definition.process
        if node_id not in process.nodes:
            return None, None
        budgeted = (process, node_id) if Budgets.applies(process, node_id) else None
        return process.model_profile(node_id), budgeted

    async def journal(self, task_id: uuid.UUID) -> list[StepView]:
        async with self._reads.connect() as conn:
            placed = await task_store.placement(conn, task_id)
            if placed is None:
                raise not_found("task", str(task_id), "task_id")
            rows = (await step_store.steps_of(conn, [task_id])).get(task_id, [])
        definition = await self._catalog.get(placed.definition_id)
        views = self.sealer.views(rows, definition.bindings_for(placed.node_id))
        profile = definition.process.model_profile(placed.node_id)
        if profile is None:
            return views
        return [
            dataclasses.replace(
                view, cost_usd=round(cost_usd(profile, view.input_tokens, view.output_tokens), 9)
            )
            if view.kind == StepKind.MODEL_CALL
            else view
            for view in views
        ]

    async def _append_directly(
        self, step: StepRequest, definition_id: uuid.UUID, node_id: str, *, executor: Executor | None = None
    ) -> AppendResult | None:
        definition = await self._catalog.get(definition_id)
        node = definition.process.node(node_id)
        bindings = {b.ref: b for b in definition.bindings_for(node.id)}
        # A step this node may not journal goes the careful way, which says why.
        if step.kind == StepKind.TOOL_CALL:
            binding = bindings.get(step.tool_ref)
            if binding is None or binding.approval_required or step.state == StepState.AWAITING_APPROVAL:
                return None  # a call under approval is checked against the approvals: the careful path
        else:
            binding = None
            if step.tool_ref:
                return None
        place = self._new_place(step)
        starts_first = step.kind == StepKind.MODEL_CALL or (binding is not None and binding.policy == "write")
        async with self._connection(executor) as conn:
            if step.state in FINISHED_STEP_STATES and starts_first:
                if step.request is not None:
                    return None  # the request must be compared with the STARTED one: the careful path
                row = await step_store.finish_checked(
                    conn, self._write_params(step, place, with_request=False)
                )
                if row is None:
                    return None
                return AppendResult(
                    self.sealer.view(row, response=step.response), self.sealer.key_for(row, binding)
                )
            row = await step_store.insert_checked(
                conn,
                {
                    **self._write_params(step, place),
                    "max_model_calls": node.limits.max_model_calls,
                    "max_tool_calls": node.limits.max_tool_calls,
                    "max_tokens": node.limits.max_tokens,
                },
                finished=step.state in FINISHED_STEP_STATES,
            )
        if row is None:
            return None
        return AppendResult(
            self.sealer.view(row, step.request, step.response), self.sealer.key_for(row, binding)
        )

    async def opened_request(self, task_id: uuid.UUID, sequence: int) -> dict[str, Any] | None:
        """The request of one journal step, opened: for an operator reading an incident about it."""
        async with self._reads.connect() as conn:
            row = await step_store.step_at(conn, task_id, sequence)
        return self.sealer.open(row, "request") if row is not None else None

    async def _append_checked(self, step: StepRequest, executor: Executor | None = None) -> AppendResult:
        """One read of everything `append` decides on, then one write guarded by the lease.

        The sequence's primary key settles races: the loser re-reads and is answered as a re-send
        (identical step) or refused (SEQUENCE_CONFLICT).
        """
        for _ in range(3):
            async with self._connection(executor) as conn:
                context = await step_store.append_context(conn, step.task_id, step.sequence)
                # A finished step is kept from a holder whose lease ran out with nobody taking over.
                held = _held_for_attempt(context, step, expired_ok=step.state in FINISHED_STEP_STATES)
                assert context is not None  # held_from_row refused a missing task
                self.handed_out.place(step.task_id, held.definition_id, held.node_id)
                definition = await self._catalog.get(held.definition_id)
                node = definition.process.node(held.node_id)
                bindings = {b.ref: b for b in definition.bindings_for(node.id)}
                if context.taken_sequence is not None:
                    result = await self._revisit(conn, step, context, bindings)
                else:
                    result = await self._insert(conn, step, context, node, bindings)
            if result is not None:
                return result
        raise EngineError(
            Category.ABORTED, ErrorReason.CONCURRENT_CHANGE, f"task {step.task_id} kept changing; try again"
        )

    async def _insert(
        self,
        conn: Executor,
        step: StepRequest,
        context: AppendContext,
        node: Node,
        bindings: dict[str, ToolBinding],
    ) -> AppendResult | None:
        next_free = context.steps + 1
        if step.sequence != next_free:
            raise precondition(
                ErrorReason.SEQUENCE_GAP,
                f"the next sequence of task {step.task_id} is {next_free}, not {step.sequence}",
                "sequence",
            )
        binding = binding_for(step, bindings)
        if binding is not None and binding.approval_required and step.state != StepState.AWAITING_APPROVAL:
            await self._check_approved(conn, step)
        check_limits(step, context, node.limits)
        inserted = await step_store.insert_guarded(
            conn,
            self._write_params(step, self._new_place(step)),
            finished=step.state in FINISHED_STEP_STATES,
        )
        if inserted is None:
            return None  # the lease or the sequence changed under us: read again
        return AppendResult(
            self.sealer.view(inserted, step.request, step.response), self.sealer.key_for(inserted, binding)
        )

    async def _check_approved(self, conn: Executor, step: StepRequest) -> None:
        """A call under approval runs only as a person approved it: these very arguments, this call,
        once. Each approval is used up by the first such call journaled after it (in sequence order),
        so one APPROVE never authorises a second run of the same call."""
        asked = await approval_store.approvals_of_task(conn, step.task_id)
        request = step.request
        approved = [
            a.sequence
            for a in asked
            if request is not None
            and a.state == ApprovalState.APPROVED
            and a.key_id is not None
            and a.approved_request_digest is not None
            and self.sealer.digest(a.key_id, request) == a.approved_request_digest
            and a.sequence < step.sequence
        ]
        if approved and request is not None:
            asked_at = {a.sequence for a in asked}
            for call in await step_store.tool_calls_of(conn, step.task_id, step.tool_ref):
                if call.sequence in asked_at or not approved or call.sequence >= step.sequence:
                    continue
                if self.sealer.digest(call.key_id, request) == call.request_digest:
                    # This earlier run used the earliest approval still unused that came before it.
                    earlier = [sequence for sequence in approved if sequence < call.sequence]
                    if earlier:
                        approved.remove(earlier[0])
        if not approved:
            raise precondition(
                ErrorReason.APPROVAL_REQUIRED,
                f"{step.tool_ref} needs a person's approval of exactly this call, and each approval "
                "runs the call once: journal it AWAITING_APPROVAL and hand the task back",
                "state",
            )

    async def _revisit(
        self,
        conn: Executor,
        step: StepRequest,
        taken: AppendContext,
        bindings: dict[str, ToolBinding],
    ) -> AppendResult | None:
        """A step at a taken sequence: the same step again, a STARTED step finishing, or a conflict."""
        assert taken.key_id is not None and taken.tool_ref is not None and taken.kind is not None
        assert taken.step_attempt is not None and taken.aad_version is not None
        binding = bindings.get(taken.tool_ref)
        same_request = step.request is None or self.sealer.digest(taken.key_id, step.request) == bytes(
            taken.request_digest or b""
        )
        same_response = (step.response is None and taken.response_digest is None) or (
            step.response is not None
            and taken.response_digest is not None
            and self.sealer.digest(taken.key_id, step.response) == bytes(taken.response_digest)
        )
        if (
            (taken.kind, taken.step_state, taken.tool_ref) == (step.kind, step.state, step.tool_ref)
            and same_request
            and same_response
            and (taken.input_tokens, taken.output_tokens) == (step.input_tokens, step.output_tokens)
        ):
            full = await step_store.step_at(conn, step.task_id, step.sequence)
            assert full is not None  # steps are never deleted
            return AppendResult(self.sealer.view(full), self.sealer.key_for(full, binding))
        finishing = (
            taken.step_state == StepState.STARTED
            and step.state in FINISHED_STEP_STATES
            and (taken.kind, taken.tool_ref) == (step.kind, step.tool_ref)
            and same_request
            and not taken.abandoned
            # A later attempt may finish a read it ran again (a read has no side effect; a batch of
            # parallel calls journals its reads STARTED to keep call order), or a write it re-sent
            # under the same key; never an unkeyed write.
            and (
                taken.step_attempt == step.attempt
                or (binding is not None and (binding.policy == "read" or binding.idempotency == "key"))
            )
        )
        if not finishing:
            raise EngineError(
                Category.ABORTED,
                ErrorReason.SEQUENCE_CONFLICT,
                f"sequence {step.sequence} of task {step.task_id} already holds a different step "
                f"({taken.kind} {taken.step_state}{' ' + taken.tool_ref if taken.tool_ref else ''})",
                field="sequence",
            )
        # The rest of a row is sealed as the row is: its key, its attempt, its associated data version.
        place = Place(
            step.task_id,
            step.sequence,
            taken.step_attempt,
            taken.kind,
            taken.tool_ref,
            taken.key_id,
            taken.aad_version,
        )
        finished = await step_store.finish_guarded(conn, self._write_params(step, place, with_request=False))
        if finished is None:
            return None
        return AppendResult(
            self.sealer.view(finished, response=step.response), self.sealer.key_for(finished, binding)
        )

    def _new_place(self, step: StepRequest) -> Place:
        """Where a new row's payloads are sealed: the primary key, the current associated data."""
        return Place(
            step.task_id, step.sequence, step.attempt, step.kind, step.tool_ref, self.sealer.primary_key_id
        )

    def _write_params(self, step: StepRequest, place: Place, with_request: bool = True) -> dict[str, Any]:
        """The parameters every step write takes: the lease guard, the step, its sealed payloads."""
        request_ct, request_digest = self.sealer.seal(
            place, "request", step.request if with_request else None
        )
        response_ct, response_digest = self.sealer.seal(place, "response", step.response)
        return {
            "task_id": step.task_id,
            "worker_id": step.worker_id,
            "token_hash": hash_token(step.lease_token),
            "attempt": step.attempt,
            "sequence": step.sequence,
            "kind": step.kind,
            "state": step.state,
            "tool_ref": step.tool_ref,
            "key_id": place.key_id,
            "aad_version": place.aad_version,
            "request_ct": request_ct,
            "request_digest": request_digest,
            "response_ct": response_ct,
            "response_digest": response_digest,
            "input_tokens": step.input_tokens,
            "output_tokens": step.output_tokens,
        }


def _held_for_attempt(
    context: AppendContext | None, step: StepRequest, *, expired_ok: bool = False
) -> LeaseHeld:
    """The lease the step's sender holds, for the step's attempt; refused otherwise."""
    held = held_from_row(context, step.task_id, step.worker_id, step.lease_token, expired_ok=expired_ok)
    if step.attempt != held.attempt:
        raise precondition(
            ErrorReason.ATTEMPT_MISMATCH,
            f"the lease is for attempt {held.attempt}, not {step.attempt}",
            "attempt",
        )
    return held
