"""The worker for topic `notify`: tells the customer about their ticket once the agent has triaged.

Run it beside an engine (address and token from ABADA_ENGINE_ADDRESS and ABADA_TOKEN_FILE):

    ABADA_WORKER_ID=notifier python examples/notify_worker.py

A real one would send an e-mail or a text; this one writes the message to its log and hands it
back as the `notification` variable, so the instance's history shows what was sent.
"""

from __future__ import annotations

import logging

from abada_sdk import Task, TaskFailed, Worker

log = logging.getLogger("notify")
worker = Worker()


@worker.task("notify")
async def notify(task: Task) -> dict:
    triage = task.variables.get("triage") or {}
    customer = task.variables.get("customerId")
    if not customer:
        raise TaskFailed("no customerId to notify", retry=False, code="NO_RECIPIENT")
    text = f"We opened ticket {triage.get('ticketId', '?')} (priority {triage.get('priority', '?')}) for you."
    log.info("notified %s: %s", customer, text)
    return {"notification": {"to": customer, "channel": "email", "text": text, "attempt": task.attempt}}


if __name__ == "__main__":
    worker.run()
