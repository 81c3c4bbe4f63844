"""examples/notify_worker.py, the worker `make demo` runs for Alice's notify_customer node."""

from __future__ import annotations

import pathlib

from abada_sdk import InstanceFailed, InstanceState

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "notify_worker.py"
BUNDLE = """
processes:
  - id: after_triage
    start: notify_customer
    nodes:
      - { id: notify_customer, type: service, topic: notify, next: done }
      - { id: done, type: end }
"""


async def test_the_notify_worker_tells_the_customer_about_the_ticket(engine, sdk_client, sdk_worker):
    await sdk_client.deploy(BUNDLE)
    worker = await sdk_worker(engine.address, app=EXAMPLE)

    try:
        done = await sdk_client.start(
            "after_triage",
            {"customerId": "C-42", "triage": {"ticketId": "T-981", "priority": "high"}},
            wait=True,
            timeout=20,
        )
    except TimeoutError:
        raise AssertionError(worker.log) from None

    assert done.state is InstanceState.COMPLETED and done.current_node_id == "done"
    assert done.variables["notification"] == {
        "to": "C-42",
        "channel": "email",
        "text": "We opened ticket T-981 (priority high) for you.",
        "attempt": 1,
    }
    await worker.wait_for_log("notified C-42: We opened ticket T-981 (priority high) for you.")
    assert await worker.terminate() == 0


async def test_without_a_recipient_it_raises_an_incident_instead_of_retrying(engine, sdk_client, sdk_worker):
    await sdk_client.deploy(BUNDLE)
    await sdk_worker(engine.address, app=EXAMPLE)
    handle = await sdk_client.start("after_triage", {"triage": {"ticketId": "T-1"}})
    try:
        await handle.result(timeout=20)
    except InstanceFailed as failed:
        assert [(i.type, i.message) for i in failed.incidents] == [
            ("NO_RECIPIENT", "no customerId to notify")
        ]
    else:
        raise AssertionError("completed without anyone to notify")
