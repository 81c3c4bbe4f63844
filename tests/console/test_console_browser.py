"""The web console in a real browser, against the suite's engine, real workers, the demo CRM and the
scripted Gemini endpoint: Alice's triage under approval, decided and then looked into on the console.

An approver signs in, is refused the instances page, has a form posted without its CSRF token
refused (nothing decided), then edits the proposed ticket's subject and approves; the ticket the CRM
stores carries the edit. An operator finds Alice's instance by `customerId = C-42`, sees it reached
its next node, and reads in the agent task's journal the idempotency key the CRM stored the ticket
under. Every page is screenshotted into .abada/console-screenshots/.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from typing import Any

import pytest
from abada.engine.v1 import approval_pb2, process_pb2
from crm_mcp.testing import RunningCrmServer
from engine_helpers import struct
from worker_process import WorkerLauncher
from worker_support import deploy_bundle

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "examples" / "support-triage-approval.yaml"
POOL = "agent-pool"
EDITED_SUBJECT = "Parcel lost in transit (checked by a lead)"

pytestmark = pytest.mark.timeout(120)


async def until(what: str, probe: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = await probe()
        if found:
            return found
        assert time.monotonic() < deadline, f"waited {timeout}s for {what}"
        await asyncio.sleep(0.1)


# Script errors and refused resources (a CSP violation, a missing file) of every page, to be none.
PAGE_ERRORS: list[str] = []


async def sign_in(browser: Any, console_url: str, token: str, screenshot: pathlib.Path | None = None) -> Any:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    page = await context.new_page()
    page.on("pageerror", lambda error: PAGE_ERRORS.append(str(error)))
    page.on("console", lambda message: PAGE_ERRORS.append(message.text) if message.type == "error" else None)
    await page.goto(f"{console_url}/login")
    if screenshot is not None:
        await page.screenshot(path=str(screenshot))
    await page.get_by_label("Caller token").fill(token)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_load_state()
    return page


async def test_approver_decides_and_operator_reads_the_journal(  # type: ignore[no-untyped-def]
    engine,
    engine_tokens,
    crm: RunningCrmServer,
    gemini_url: str,
    workers: WorkerLauncher,
    browser: Any,
    console_url: str,
    screenshots: pathlib.Path,
) -> None:
    await deploy_bundle(engine, BUNDLE.read_text().replace("http://127.0.0.1:8765/mcp", crm.url))
    started = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(
            process_id="support_triage_approved",
            variables=struct({"customerId": "C-42", "message": "My parcel never arrived"}),
            business_key="C-42/parcel",
        )
    )
    instance_id = started.instance.id
    await workers.start(ABADA_WORKER_ID=f"{POOL}/console-1")

    async def pending() -> list[approval_pb2.Approval]:
        return list((await engine.approvals.ListApprovals(approval_pb2.ListApprovalsRequest())).approvals)

    [approval] = await until("the create_ticket call to wait for a person", pending)

    # --- an operator looks at the queues while the task is parked for the decision
    operator = await sign_in(browser, console_url, engine_tokens.operator, screenshots / "sign-in.png")
    await operator.goto(f"{console_url}/queues")
    assert (await operator.inner_text("#awaiting")).startswith("1 tool call waiting")
    await operator.screenshot(path=str(screenshots / "queues.png"), full_page=True)

    # --- the approver
    page = await sign_in(browser, console_url, engine_tokens.approver)
    assert page.url.endswith("/console/approvals")
    await page.get_by_role("heading", name="Approvals").wait_for()
    # The keyboard reaches the content first: a skip link, then the navigation.
    await page.keyboard.press("Tab")
    assert await page.evaluate("document.activeElement.textContent") == "Skip to content"
    await page.screenshot(path=str(screenshots / "approvals.png"), full_page=True)

    refused = await page.goto(f"{console_url}/instances")
    assert refused is not None and refused.status == 403
    assert "for operators" in await page.inner_text("main")
    await page.screenshot(path=str(screenshots / "approver-refused-instances.png"))

    await page.goto(f"{console_url}/approvals")
    await page.get_by_role("link", name="crm/create_ticket").click()
    await page.get_by_role("heading", name="What the model said").wait_for()
    await page.screenshot(path=str(screenshots / "approval.png"), full_page=True)

    # A form sent without its CSRF token is refused, and nothing is decided.
    await page.evaluate("document.querySelector('form[data-approval] input[name=csrf]').remove()")
    await page.get_by_label("Comment").fill("not this one")
    async with page.expect_navigation() as navigation:
        await page.get_by_role("button", name="Reject").click()
    response = await navigation.value
    assert response is not None and response.status == 403
    assert "without its security token" in await page.inner_text("main")
    await page.screenshot(path=str(screenshots / "csrf-refused.png"))
    still = (
        await engine.approvals.GetApproval(approval_pb2.GetApprovalRequest(approval_id=approval.id))
    ).approval
    assert still.state == approval_pb2.APPROVAL_STATE_PENDING

    # The form is the tool's frozen input schema: priority is one of its enum, and an edit that
    # breaks the schema is refused on the page, before anything reaches the engine.
    await page.goto(f"{console_url}/approvals/{approval.id}")
    assert await page.locator("select[name='field.priority']").count() == 1
    await page.get_by_label("subject").fill("")
    async with page.expect_navigation() as navigation:
        await page.get_by_role("button", name="Approve").click()
    response = await navigation.value
    assert response is not None and response.status == 422
    assert await page.locator(".field.invalid #f-subject").count() == 1
    await page.screenshot(path=str(screenshots / "approval-invalid-edit.png"), full_page=True)
    still = (
        await engine.approvals.GetApproval(approval_pb2.GetApprovalRequest(approval_id=approval.id))
    ).approval
    assert still.state == approval_pb2.APPROVAL_STATE_PENDING

    await page.get_by_label("subject").fill(EDITED_SUBJECT)
    await page.get_by_role("button", name="Approve").click()
    await page.get_by_text("The call was approved.").wait_for()

    decided = (
        await engine.approvals.GetApproval(approval_pb2.GetApprovalRequest(approval_id=approval.id))
    ).approval
    assert decided.state == approval_pb2.APPROVAL_STATE_APPROVED
    assert decided.decided_by == "carol"

    async def completed() -> bool:
        reply = await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance_id))
        return reply.instance.state == process_pb2.INSTANCE_STATE_COMPLETED

    await until("Alice's instance to go on past triage", completed)
    [ticket] = crm.tickets()
    assert ticket["subject"] == EDITED_SUBJECT

    # --- the operator
    await page.context.close()
    page = operator
    await page.goto(f"{console_url}/")
    assert page.url.endswith("/console/instances")
    await page.get_by_label("Variable equals").fill("customerId = C-42")
    await page.get_by_role("button", name="Search").click()
    await page.wait_for_load_state()
    rows = page.locator("table.list tbody tr")
    assert await rows.count() == 1
    await page.screenshot(path=str(screenshots / "instances.png"), full_page=True)

    await page.get_by_label("Variable equals").fill("customerId = C-7")
    await page.get_by_role("button", name="Search").click()
    await page.get_by_text("No instance matches.").wait_for()

    await page.get_by_label("Variable equals").fill("customerId = C-42")
    await page.get_by_role("button", name="Search").click()
    await page.locator("table.list tbody tr a").first.click()
    await page.get_by_role("heading", name="Variables").wait_for()
    assert (await page.inner_text("#current-node")).strip() == "done"
    journal = await page.inner_text("section.journal")
    assert ticket["idempotencyKey"] and ticket["idempotencyKey"] in journal
    assert "crm/create_ticket" in journal and "Model turn" in journal
    assert EDITED_SUBJECT in journal
    assert "Approval: approved by carol" in journal
    await page.screenshot(path=str(screenshots / "instance.png"), full_page=True)

    for name in ("incidents", "user-tasks"):
        response = await page.goto(f"{console_url}/{name}")
        assert response is not None and response.status == 200, name
        await page.screenshot(path=str(screenshots / f"{name}.png"), full_page=True)
    await page.context.close()
    # The refusals above (403, 422) are logged by the browser as failed loads; nothing else may be.
    assert [e for e in PAGE_ERRORS if "status of 403" not in e and "status of 422" not in e] == []
