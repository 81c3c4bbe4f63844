"""Replay planning: which steps are reused from the journal, and what the next action is."""

from __future__ import annotations

from dataclasses import replace

from abada_worker.conversation import ModelTurn, ToolResults
from abada_worker.replay import Blocked, CallModel, Finish, RunCalls, plan_replay
from abada_worker.work import JournalEntry, StepState
from worker_support import CREATE_TICKET, GET_CUSTOMER, VARIABLES, agent_work, model_step, tool_step

LOOKUP = ("call_0_0", "crm__get_customer", {"customerId": "C-42"})
TICKET = ("call_1_0", "crm__create_ticket", {"customerId": "C-42", "subject": "Parcel", "priority": "high"})
ALICE = {"content": [], "structuredContent": {"name": "Alice", "tier": "gold"}, "isError": False}


def test_a_fresh_task_asks_the_model_first_at_sequence_one() -> None:
    plan = plan_replay(agent_work(), VARIABLES, [])

    assert plan.next_action == CallModel()
    assert plan.next_sequence == 1
    assert plan.history == ()
    assert plan.prompt.user.endswith('<input name="message">My parcel never arrived</input>')


def test_a_write_left_started_is_resent_with_its_key_at_its_own_sequence() -> None:
    steps = [
        model_step(1, [LOOKUP]),
        tool_step(2, "call_0_0", GET_CUSTOMER, result=ALICE),
        model_step(3, [TICKET]),
        tool_step(4, "call_1_0", CREATE_TICKET, state=StepState.STARTED, key="key-4"),
    ]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    assert isinstance(plan.next_action, RunCalls)
    (planned,) = plan.next_action.calls
    assert planned.call.name == "crm__create_ticket"
    assert planned.result is None
    assert (planned.resend.sequence, planned.resend.idempotency_key) == (4, "key-4")
    # Both model turns and the read's result come from the journal; nothing to pay for again.
    turns = [type(turn) for turn in plan.history]
    assert turns == [ModelTurn, ToolResults, ModelTurn]
    assert plan.history[1].results[0].result == ALICE
    assert plan.next_sequence == 5
    assert (plan.usage.model_calls, plan.usage.tool_calls, plan.usage.tools_used) == (
        2,
        1,
        ("crm/get_customer",),
    )


def test_a_finished_round_leads_to_the_next_model_turn() -> None:
    steps = [model_step(1, [LOOKUP]), tool_step(2, "call_0_0", GET_CUSTOMER, result=ALICE)]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    assert plan.next_action == CallModel()
    assert plan.next_sequence == 3


def test_a_model_call_left_started_is_run_again_after_it() -> None:
    steps = [
        model_step(1, [LOOKUP]),
        tool_step(2, "call_0_0", GET_CUSTOMER, result=ALICE),
        model_step(3, state=StepState.STARTED),
    ]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    assert plan.next_action == CallModel()
    assert plan.next_sequence == 4
    assert len(plan.history) == 2


def test_an_answer_already_in_the_journal_is_used_without_a_model_call() -> None:
    steps = [model_step(1, text='{"ticketId": "T-981", "_confidence": 92}', tokens=(300, 20))]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    assert plan.next_action == Finish('{"ticketId": "T-981", "_confidence": 92}')
    assert (plan.usage.input_tokens, plan.usage.output_tokens) == (300, 20)


def test_a_write_a_person_said_did_not_happen_is_called_again() -> None:
    steps = [
        model_step(1, [TICKET]),
        tool_step(2, "call_1_0", CREATE_TICKET, state=StepState.OUTCOME_UNKNOWN, abandoned=True),
    ]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    assert isinstance(plan.next_action, RunCalls)
    (planned,) = plan.next_action.calls
    assert planned.result is None and planned.resend is None
    assert plan.next_sequence == 3


def test_a_write_a_person_said_happened_gives_the_model_that_result() -> None:
    resolved = {"content": [], "structuredContent": {"ticketId": "T-77"}, "isError": False}
    steps = [model_step(1, [TICKET]), tool_step(2, "call_1_0", CREATE_TICKET, result=resolved)]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    assert plan.next_action == CallModel()
    assert plan.history[-1].results[0].result == resolved


def test_an_unresolved_outcome_or_an_unkeyed_started_write_is_never_sent_again() -> None:
    unkeyed = CREATE_TICKET.__class__(**{**CREATE_TICKET.__dict__, "keyed": False})
    unresolved = [
        model_step(1, [TICKET]),
        tool_step(2, "call_1_0", CREATE_TICKET, state=StepState.OUTCOME_UNKNOWN),
    ]
    started = [model_step(1, [TICKET]), tool_step(2, "call_1_0", unkeyed, state=StepState.STARTED)]

    assert isinstance(plan_replay(agent_work(), VARIABLES, unresolved).next_action, Blocked)
    assert isinstance(plan_replay(agent_work(GET_CUSTOMER, unkeyed), VARIABLES, started).next_action, Blocked)


def test_a_failed_tool_call_goes_back_to_the_model_as_an_error() -> None:
    error = {"content": [{"type": "text", "text": "No customer with id 'C-999'."}], "isError": True}
    steps = [
        model_step(1, [LOOKUP]),
        tool_step(2, "call_0_0", GET_CUSTOMER, state=StepState.FAILED, result=error),
    ]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    (result,) = plan.history[-1].results
    assert result.is_error and result.result == error
    assert plan.usage.tool_calls == 1


def test_only_calls_still_missing_in_the_may_be_last_are_due() -> None:
    both = [LOOKUP, ("call_0_1", "crm__get_customer", {"customerId": "C-7"})]
    steps = [model_step(1, both), tool_step(2, "call_0_0", GET_CUSTOMER, result=ALICE)]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    assert isinstance(plan.next_action, RunCalls)
    done, due = plan.next_action.calls
    assert done.result is not None and done.result.result == ALICE
    assert due.call.id == "call_0_1" and due.result is None


def test_an_undeclared_function_gets_the_same_error_every_time() -> None:
    steps = [model_step(1, [("call_0_0", "crm__delete_everything", {})]), model_step(2, text="{}")]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    (result,) = plan.history[1].results
    assert result.is_error
    assert "no function named 'crm__delete_everything'" in result.result["content"][0]["text"]
    assert plan.next_action == Finish("{}")


def test_abandoned_model_calls_are_not_part_of_the_conversation() -> None:
    steps = [
        model_step(1, state=StepState.STARTED, abandoned=True),
        model_step(2, [LOOKUP], attempt=2),
        tool_step(3, "call_0_0", GET_CUSTOMER, result=ALICE, attempt=2),
    ]
    plan = plan_replay(agent_work(), VARIABLES, steps)

    assert [type(turn) for turn in plan.history] == [ModelTurn, ToolResults]
    assert plan.usage.model_calls == 1
    assert plan.next_sequence == 4


def _approval_steps(decided: JournalEntry) -> list[JournalEntry]:
    return [
        model_step(1, [LOOKUP]),
        tool_step(2, "call_0_0", GET_CUSTOMER, result=ALICE),
        model_step(3, [TICKET]),
        decided,
    ]


def test_a_call_awaiting_approval_waits_again_and_pays_no_turn() -> None:
    awaiting = replace(
        tool_step(4, "call_1_0", CREATE_TICKET, state=StepState.AWAITING_APPROVAL), response={}
    )
    plan = plan_replay(agent_work(), VARIABLES, _approval_steps(awaiting))

    assert isinstance(plan.next_action, RunCalls)
    (planned,) = plan.next_action.calls
    assert (planned.awaiting_at, planned.approved, planned.result) == (4, False, None)
    assert plan.next_sequence == 5


def test_an_approved_call_runs_with_the_approved_arguments() -> None:
    edited = {"customerId": "C-42", "subject": "Lost parcel", "priority": "urgent"}
    approved = replace(
        tool_step(4, "call_1_0", CREATE_TICKET, state=StepState.APPROVED),
        response={"approval": {"decision": "APPROVED", "arguments": edited}},
    )
    plan = plan_replay(agent_work(), VARIABLES, _approval_steps(approved))

    (planned,) = plan.next_action.calls  # type: ignore[union-attr]
    assert planned.approved and planned.resend is None and planned.result is None
    assert (planned.call.id, planned.call.name, planned.call.args) == (
        "call_1_0",
        "crm__create_ticket",
        edited,
    )
    # Once started at a later sequence, a re-send carries the approved arguments too.
    started = tool_step(5, "call_1_0", CREATE_TICKET, state=StepState.STARTED, key="key-5")
    started = replace(started, request={**started.request, "arguments": edited})
    plan = plan_replay(agent_work(), VARIABLES, [*_approval_steps(approved), started])
    (planned,) = plan.next_action.calls  # type: ignore[union-attr]
    assert (planned.resend.sequence, planned.call.args) == (5, edited)  # type: ignore[union-attr]


def test_a_rejected_call_gives_the_model_the_reason() -> None:
    rejection = {"content": [{"type": "text", "text": "rejected by a person: no"}], "isError": True}
    rejected = tool_step(4, "call_1_0", CREATE_TICKET, result=rejection)
    plan = plan_replay(agent_work(), VARIABLES, _approval_steps(rejected))

    assert plan.next_action == CallModel()
    last = plan.history[-1]
    assert isinstance(last, ToolResults) and last.results[0].is_error
    assert last.results[0].result == rejection


def test_an_approval_without_arguments_blocks_instead_of_guessing() -> None:
    approved = replace(tool_step(4, "call_1_0", CREATE_TICKET, state=StepState.APPROVED), response={})
    plan = plan_replay(agent_work(), VARIABLES, _approval_steps(approved))

    assert isinstance(plan.next_action, Blocked)
