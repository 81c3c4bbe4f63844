"""Call activities (`type: call`): a token starts a child instance and waits for it to end; the child's
result reaches the parent, cancelling the parent cancels the child, a child's trouble shows at the
parent. A real engine over gRPC on PostgreSQL."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from engine_helpers import (
    complete,
    deploy,
    error_info,
    fetch,
    history_types,
    instance,
    plain,
    start,
    struct,
)
from sqlalchemy import text

CHILD = """
processes:
  - id: credit_check
    start: score
    nodes:
      - { id: score, type: service, topic: score, next: done }
      - { id: done, type: end }
"""

PARENT = """
processes:
  - id: loan
    start: check
    nodes:
      - id: check
        type: call
        process: credit_check
        inputs: { customer: "${applicant}" }
        result_variable: credit
        next: decide
      - { id: decide, type: service, topic: decide, next: done }
      - { id: done, type: end }
  - id: loan_merged
    start: check
    nodes:
      - { id: check, type: call, process: credit_check, next: decide }
      - { id: decide, type: service, topic: decide, next: done }
      - { id: done, type: end }
  - id: loan_pinned
    start: check
    nodes:
      - { id: check, type: call, process: credit_check, version: pinned, next: decide }
      - { id: decide, type: service, topic: decide, next: done }
      - { id: done, type: end }
"""


async def children(engine: Any, parent_id: str) -> list[process_pb2.Instance]:
    listed = await engine.processes.ListInstances(
        process_pb2.ListInstancesRequest(parent_instance_id=parent_id)
    )
    return list(listed.instances)


async def cancel(engine: Any, instance_id: str, reason: str = "no longer needed") -> None:
    await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=instance_id, reason=reason)
    )


async def open_incidents(engine: Any, instance_id: str) -> list[incident_pb2.Incident]:
    listed = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=instance_id))
    return list(listed.incidents)


async def test_the_child_finishes_and_its_result_reaches_the_parent(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(engine, PARENT)
    parent = await start(engine, "loan", applicant="Ada", amount=500)
    waiting = await instance(engine, parent.id)
    assert list(waiting.active_node_ids) == ["check"]
    [child] = waiting.children
    assert (child.process_id, child.version, child.node_id) == ("credit_check", 1, "check")
    assert child.state == process_pb2.INSTANCE_STATE_ACTIVE
    # Only the inputs mapping reaches the child; it is a full instance that knows its parent.
    [score] = await fetch(engine, "w", "score")
    assert score.instance_id == child.instance_id
    assert plain(score.variables) == {"customer": "Ada"}
    shown_child = await instance(engine, child.instance_id)
    assert shown_child.parent_instance_id == parent.id
    assert [c.id for c in await children(engine, parent.id)] == [child.instance_id]

    await complete(engine, score, "w", {"score": 720})
    [decide] = await fetch(engine, "w", "decide")
    assert decide.instance_id == parent.id
    # The child's variables at its end, under result_variable; the parent's own are untouched.
    assert plain(decide.variables) == {
        "applicant": "Ada",
        "amount": 500,
        "credit": {"customer": "Ada", "score": 720},
    }
    assert (await instance(engine, child.instance_id)).state == process_pb2.INSTANCE_STATE_COMPLETED
    history = await history_types(engine, parent.id)
    assert ("CALL_STARTED", "check") in history and ("CALL_COMPLETED", "check") in history
    await complete(engine, decide, "w", {})
    done = await instance(engine, parent.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED
    [finished_child] = done.children
    assert finished_child.state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_without_inputs_or_result_variable_the_variables_pass_whole_both_ways(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(engine, PARENT)
    parent = await start(engine, "loan_merged", applicant="Bo")
    [score] = await fetch(engine, "w", "score")
    assert plain(score.variables) == {"applicant": "Bo"}
    await complete(engine, score, "w", {"score": 610})
    [decide] = await fetch(engine, "w", "decide")
    assert plain(decide.variables) == {"applicant": "Bo", "score": 610}
    assert decide.instance_id == parent.id


async def test_pinned_keeps_the_child_version_of_its_deploy_and_latest_follows_redeploys(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(engine, PARENT)
    # A new version of the child, deployed after the parents.
    await deploy(engine, CHILD.replace("topic: score", "topic: score-v2"))
    latest = await start(engine, "loan", applicant="Al")
    pinned = await start(engine, "loan_pinned")
    [latest_child] = (await instance(engine, latest.id)).children
    [pinned_child] = (await instance(engine, pinned.id)).children
    assert latest_child.version == 2 and pinned_child.version == 1
    assert [t.instance_id for t in await fetch(engine, "w", "score-v2")] == [latest_child.instance_id]
    assert [t.instance_id for t in await fetch(engine, "w", "score")] == [pinned_child.instance_id]
    # Deploying the parent again pins the version current then.
    await deploy(engine, PARENT.replace("topic: decide", "topic: decide-v2"))
    again = await start(engine, "loan_pinned")
    [again_child] = (await instance(engine, again.id)).children
    assert again_child.version == 2


async def test_cancelling_the_parent_cancels_the_child_and_withdraws_its_leased_task(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(engine, PARENT)
    parent = await start(engine, "loan", applicant="Cy")
    [score] = await fetch(engine, "w", "score")
    await cancel(engine, parent.id)
    child = await instance(engine, score.instance_id)
    assert child.state == process_pb2.INSTANCE_STATE_CANCELED
    assert list(child.active_node_ids) == []
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await complete(engine, score, "w", {"score": 1})
    assert error_info(refused.value).reason == "TASK_NOT_LEASED"
    shown = await instance(engine, parent.id)
    assert shown.state == process_pb2.INSTANCE_STATE_CANCELED and shown.open_incidents == 0
    assert [c.state for c in shown.children] == [process_pb2.INSTANCE_STATE_CANCELED]
    assert await fetch(engine, "w", "decide") == []


async def test_an_incident_in_the_child_is_visible_from_the_parent(engine) -> None:
    await deploy(engine, CHILD.replace("next: done }", "retries: 0, next: done }"))
    await deploy(engine, PARENT)
    parent = await start(engine, "loan", applicant="Di")
    [score] = await fetch(engine, "w", "score")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=score.id, worker_id="w", lease_token=score.lease_token, error_message="scoring down"
        )
    )
    [child] = (await instance(engine, parent.id)).children
    assert child.state == process_pb2.INSTANCE_STATE_ACTIVE and child.open_incidents == 1
    # The incident is the child's; the parent waits at its call, holding none of its own.
    assert await open_incidents(engine, parent.id) == []
    [incident] = await open_incidents(engine, child.instance_id)
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(incident_id=incident.id, resolution=incident_pb2.RESOLUTION_RETRY)
    )
    [again] = await fetch(engine, "w", "score")
    await complete(engine, again, "w", {"score": 700})
    [decide] = await fetch(engine, "w", "decide")
    assert plain(decide.variables)["credit"]["score"] == 700


async def test_a_cancelled_child_raises_an_incident_at_the_parent_and_retry_calls_again(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(engine, PARENT)
    parent = await start(engine, "loan", applicant="Ed")
    [score] = await fetch(engine, "w", "score")
    await cancel(engine, score.instance_id, "wrong applicant")
    held = await instance(engine, parent.id)
    assert held.state == process_pb2.INSTANCE_STATE_ACTIVE and held.open_incidents == 1
    assert list(held.active_node_ids) == ["check"]
    [incident] = await open_incidents(engine, parent.id)
    assert incident.type == "CALLED_INSTANCE_ENDED" and incident.node_id == "check"
    assert score.instance_id in incident.message
    assert plain(incident.details)["child_instance_id"] == score.instance_id

    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(incident_id=incident.id, resolution=incident_pb2.RESOLUTION_RETRY)
    )
    shown = await instance(engine, parent.id)
    assert [c.state for c in shown.children] == [
        process_pb2.INSTANCE_STATE_CANCELED,
        process_pb2.INSTANCE_STATE_ACTIVE,
    ]
    [again] = await fetch(engine, "w", "score")
    assert again.instance_id == shown.children[1].instance_id
    await complete(engine, again, "w", {"score": 5})
    [decide] = await fetch(engine, "w", "decide")
    assert plain(decide.variables)["credit"] == {"customer": "Ed", "score": 5}


async def test_a_child_that_ends_at_once_moves_the_parent_in_the_same_start(engine) -> None:
    await deploy(
        engine,
        """
processes:
  - id: noop
    start: done
    nodes:
      - { id: done, type: end }
  - id: outer
    start: call_noop
    nodes:
      - { id: call_noop, type: call, process: noop, result_variable: out, next: done }
      - { id: done, type: end }
""",
    )
    started = await start(engine, "outer", x=1)
    shown = await instance(engine, started.id)
    assert shown.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain(shown.variables) == {"x": 1, "out": {"x": 1}}
    [child] = shown.children
    assert child.state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_calls_nest_and_the_business_key_is_inherited_or_given(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(
        engine,
        """
processes:
  - id: middle
    start: inner
    nodes:
      - { id: inner, type: call, process: credit_check, business_key: "inner-${who}", next: done }
      - { id: done, type: end }
  - id: top
    start: mid
    nodes:
      - { id: mid, type: call, process: middle, result_variable: got, next: done }
      - { id: done, type: end }
""",
    )
    response = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(
            process_id="top", business_key="case-9", variables=struct({"who": "Flo"})
        )
    )
    top = response.instance
    [mid] = (await instance(engine, top.id)).children
    middle = await instance(engine, mid.instance_id)
    assert middle.business_key == "case-9"
    [inner] = middle.children
    [score] = await fetch(engine, "w", "score")
    assert score.instance_id == inner.instance_id
    assert (await instance(engine, inner.instance_id)).business_key == "inner-Flo"
    await complete(engine, score, "w", {"score": 3})
    done = await instance(engine, top.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain(done.variables)["got"] == {"who": "Flo", "score": 3}


async def test_cancelling_the_top_cancels_the_whole_subtree(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(
        engine,
        """
processes:
  - id: middle
    start: inner
    nodes:
      - { id: inner, type: call, process: credit_check, next: done }
      - { id: done, type: end }
  - id: top
    start: mid
    nodes:
      - { id: mid, type: call, process: middle, next: done }
      - { id: done, type: end }
""",
    )
    top = await start(engine, "top")
    [score] = await fetch(engine, "w", "score")
    await cancel(engine, top.id)
    [mid] = (await instance(engine, top.id)).children
    assert mid.state == process_pb2.INSTANCE_STATE_CANCELED
    assert (await instance(engine, score.instance_id)).state == process_pb2.INSTANCE_STATE_CANCELED
    with pytest.raises(grpc.aio.AioRpcError):
        await complete(engine, score, "w", {})


async def test_a_call_inside_a_parallel_branch_waits_like_a_task(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(
        engine,
        """
processes:
  - id: both
    start: fork
    nodes:
      - { id: fork, type: parallel, branches: [check, other] }
      - { id: check, type: call, process: credit_check, result_variable: credit, next: gather }
      - { id: other, type: service, topic: other, next: gather }
      - { id: gather, type: join, next: decide }
      - { id: decide, type: service, topic: decide, next: done }
      - { id: done, type: end }
""",
    )
    parent = await start(engine, "both", who="Gil")
    assert sorted((await instance(engine, parent.id)).active_node_ids) == ["check", "other"]
    [other] = await fetch(engine, "w", "other")
    await complete(engine, other, "w", {"other_done": True})
    assert await fetch(engine, "w", "decide") == []
    [score] = await fetch(engine, "w", "score")
    await complete(engine, score, "w", {"score": 9})
    [decide] = await fetch(engine, "w", "decide")
    assert plain(decide.variables) == {"who": "Gil", "other_done": True, "credit": {"who": "Gil", "score": 9}}


@pytest.mark.parametrize(
    ("bundle", "field", "why"),
    [
        (
            """
processes:
  - id: lonely
    start: c
    nodes:
      - { id: c, type: call, process: nowhere, next: done }
      - { id: done, type: end }
""",
            "processes[0].nodes[0].process",
            "'nowhere', a process neither deployed nor in this bundle",
        ),
        (
            """
processes:
  - id: selfish
    start: c
    nodes:
      - { id: c, type: call, process: selfish, next: done }
      - { id: done, type: end }
""",
            "processes[0].nodes[0].process",
            "a cycle of calls: selfish -> selfish",
        ),
        (
            """
processes:
  - id: ping
    start: c
    nodes:
      - { id: c, type: call, process: pong, next: done }
      - { id: done, type: end }
  - id: pong
    start: c
    nodes:
      - { id: c, type: call, process: ping, next: done }
      - { id: done, type: end }
""",
            "processes[0].nodes[0].process",
            "a cycle of calls: ping -> pong -> ping",
        ),
        (
            """
processes:
  - id: bad_version
    start: c
    nodes:
      - { id: c, type: call, process: bad_version, version: newest, next: done }
      - { id: done, type: end }
""",
            "processes[0].nodes[0].version",
            "'newest' is not one of: latest, pinned",
        ),
    ],
)
async def test_deploy_refuses_calls_that_cannot_run(engine, bundle: str, field: str, why: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bundle, "calls.yaml")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(caught.value)
    assert info.reason == "DEFINITION_INVALID"
    assert info.metadata["field"] == field, caught.value.details()
    assert why in caught.value.details()


async def test_deploy_refuses_a_cycle_through_a_deployed_process(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(engine, PARENT)
    # credit_check calling loan again would close loan -> credit_check -> loan.
    cyclic = CHILD.replace(
        "{ id: score, type: service, topic: score, next: done }",
        "{ id: score, type: call, process: loan, next: done }",
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, cyclic, "child.yaml")
    assert "a cycle of calls: credit_check -> loan -> credit_check" in caught.value.details()
    assert error_info(caught.value).metadata["line"] == "6"


async def test_moving_the_token_away_from_a_call_cancels_its_child(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(engine, PARENT)
    parent = await start(engine, "loan", applicant="Hal")
    [score] = await fetch(engine, "w", "score")
    modified = await engine.processes.ModifyInstance(
        process_pb2.ModifyInstanceRequest(
            instance_id=parent.id,
            set_variables=struct({"credit": {"score": 0}}),
            moves=[process_pb2.NodeMapping(from_node_id="check", to_node_id="decide")],
            reason="scored by hand",
        )
    )
    assert list(modified.instance.active_node_ids) == ["decide"]
    assert (await instance(engine, score.instance_id)).state == process_pb2.INSTANCE_STATE_CANCELED
    with pytest.raises(grpc.aio.AioRpcError):
        await complete(engine, score, "w", {"score": 1})
    # No incident at the parent: it moved on on purpose.
    assert await open_incidents(engine, parent.id) == []
    [decide] = await fetch(engine, "w", "decide")
    assert decide.instance_id == parent.id


async def test_a_join_on_any_cancels_the_child_of_the_branch_it_withdraws(engine) -> None:
    await deploy(engine, CHILD)
    await deploy(
        engine,
        """
processes:
  - id: race
    start: fork
    nodes:
      - { id: fork, type: parallel, branches: [check, quick] }
      - { id: check, type: call, process: credit_check, next: first }
      - { id: quick, type: service, topic: quick, next: first }
      - { id: first, type: join, wait_for: any, next: done }
      - { id: done, type: end }
""",
    )
    parent = await start(engine, "race")
    [score] = await fetch(engine, "w", "score")
    [quick] = await fetch(engine, "w", "quick")
    await complete(engine, quick, "w", {"quick": True})
    assert (await instance(engine, parent.id)).state == process_pb2.INSTANCE_STATE_COMPLETED
    assert (await instance(engine, score.instance_id)).state == process_pb2.INSTANCE_STATE_CANCELED
    with pytest.raises(grpc.aio.AioRpcError):
        await complete(engine, score, "w", {"score": 1})


async def test_a_child_ended_by_its_timer_moves_the_parent_on(engine) -> None:
    await deploy(
        engine,
        """
processes:
  - id: cool_off
    start: wait
    nodes:
      - { id: wait, type: timer, duration: PT1S, next: done }
      - { id: done, type: end }
  - id: patient
    start: pause
    nodes:
      - { id: pause, type: call, process: cool_off, result_variable: paused, next: after }
      - { id: after, type: service, topic: after-call, next: done }
      - { id: done, type: end }
""",
    )
    parent = await start(engine, "patient", n=1)
    [after] = await fetch(engine, "w", "after-call", wait_ms=10_000)
    assert after.instance_id == parent.id
    assert plain(after.variables) == {"n": 1, "paused": {"n": 1}}


async def test_a_fan_out_ends_into_a_call_and_a_childs_fan_out_ends_its_call(engine) -> None:
    await deploy(
        engine,
        """
processes:
  - id: price_lines
    start: price
    nodes:
      - id: price
        type: service
        topic: price-line
        for_each: "${lines}"
        as: line
        result_variable: price
        collect: prices
        next: done
      - { id: done, type: end }
  - id: invoice
    start: check
    nodes:
      - id: check
        type: service
        topic: check-line
        for_each: "${lines}"
        as: line
        result_variable: ok
        collect: checks
        next: pricing
      - { id: pricing, type: call, process: price_lines, result_variable: priced, next: after }
      - { id: after, type: service, topic: after-pricing, next: done }
      - { id: done, type: end }
""",
    )
    parent = await start(engine, "invoice", lines=["a", "b"])
    # The parent's own fan-out: its last item's end moves the token into the call, which starts a child.
    for task in await fetch(engine, "w", "check-line", max_tasks=2):
        await complete(engine, task, "w", {"ok": True})
    [child] = (await instance(engine, parent.id)).children
    assert child.process_id == "price_lines"
    # The child's fan-out ends the child, which moves the parent on with the child's variables.
    items = await fetch(engine, "w", "price-line", max_tasks=2)
    assert {task.instance_id for task in items} == {child.instance_id}
    for task in items:
        await complete(engine, task, "w", {"price": 10})
    [after] = await fetch(engine, "w", "after-pricing", wait_ms=5_000)
    assert after.instance_id == parent.id
    seen = plain(after.variables)
    assert seen["checks"] == [True, True]
    assert seen["priced"]["prices"] == [10, 10]


async def test_a_child_that_cannot_be_written_takes_the_parents_move_with_it(engine, db) -> None:
    """The parent's token reaches the call and the child is written in one transaction: when the
    child's row is refused, the worker's Complete changes nothing, and sent again once the database
    accepts it, it starts exactly one child."""
    await deploy(engine, CHILD)
    await deploy(
        engine,
        """
processes:
  - id: prepared
    start: prep
    nodes:
      - { id: prep, type: service, topic: prep, next: check }
      - { id: check, type: call, process: credit_check, next: done }
      - { id: done, type: end }
""",
    )
    parent = await start(engine, "prepared")
    [prep] = await fetch(engine, "w", "prep")
    async with db.begin() as conn:
        await conn.execute(
            text(
                "CREATE FUNCTION refuse_credit_checks() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'no room for %', NEW.process_id; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER refuse_credit_checks BEFORE INSERT ON instances FOR EACH ROW "
                "WHEN (NEW.process_id = 'credit_check') EXECUTE FUNCTION refuse_credit_checks()"
            )
        )
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await complete(engine, prep, "w", {"prepared": True})
        held = await instance(engine, parent.id)
        assert list(held.active_node_ids) == ["prep"] and list(held.children) == []
        assert "prepared" not in plain(held.variables)
    finally:
        async with db.begin() as conn:
            await conn.execute(text("DROP TRIGGER refuse_credit_checks ON instances"))
            await conn.execute(text("DROP FUNCTION refuse_credit_checks()"))
    await complete(engine, prep, "w", {"prepared": True})
    moved = await instance(engine, parent.id)
    assert list(moved.active_node_ids) == ["check"] and len(moved.children) == 1
    [score] = await fetch(engine, "w", "score")
    assert score.instance_id == moved.children[0].instance_id
