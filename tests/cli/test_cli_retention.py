"""`abada purge` and `abada erase`: counting first, asking before deleting, refusing over active instances."""

from __future__ import annotations

import datetime as dt
import json

from abada.engine.v1 import process_pb2
from cli_support import abada, fetch_one
from engine_helpers import complete, deploy, struct

BUNDLE = """
processes:
  - id: notify_later
    start: send
    nodes:
      - { id: send, type: service, topic: cli-retention-send, next: done }
      - { id: done, type: end }
"""


async def _finished(engine, business_key: str) -> str:
    started = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(
            process_id="notify_later",
            business_key=business_key,
            variables=struct({"customerId": business_key}),
        )
    )
    await complete(engine, await fetch_one(engine, "cli-retention-send"), "cli-test-worker", {"sent": True})
    return started.instance.id


async def _listed(engine) -> set[str]:
    listed = await engine.processes.ListInstances(process_pb2.ListInstancesRequest(process_id="notify_later"))
    return {i.id for i in listed.instances}


async def test_purge_dry_run_counts_and_yes_deletes(engine):
    await deploy(engine, BUNDLE)
    done = await _finished(engine, "C-1")
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)).isoformat()
    dry = await abada(engine.address, "purge", "--before", later, "--dry-run", "-o", "json")
    assert dry.exit_code == 0, dry.stderr
    assert json.loads(dry.stdout) == {"instances": 1, "rows": 0, "dryRun": True}
    unasked = await abada(engine.address, "purge", "--before", later)
    assert unasked.exit_code == 2 and "add --yes" in unasked.stderr
    assert await _listed(engine) == {done}
    purged = await abada(engine.address, "purge", "--before", later, "--process", "notify_later", "--yes")
    assert purged.exit_code == 0, purged.stderr
    assert "purged 1 finished instance(s)" in purged.stdout
    assert await _listed(engine) == set()


async def test_erase_is_refused_over_active_instances_unless_asked_to_cancel_them(engine):
    await deploy(engine, BUNDLE)
    done = await _finished(engine, "C-7")
    active = (
        await engine.processes.StartInstance(
            process_pb2.StartInstanceRequest(process_id="notify_later", business_key="C-7")
        )
    ).instance.id
    refused = await abada(engine.address, "erase", "--business-key", "C-7", "--yes")
    assert refused.exit_code == 1
    assert "INSTANCES_ACTIVE" in refused.stderr and active in refused.stderr
    assert await _listed(engine) == {done, active}
    erased = await abada(engine.address, "erase", "--var", "customerId=C-7", "--yes", "-o", "json")
    assert erased.exit_code == 0, erased.stderr
    assert json.loads(erased.stdout)["instances"] == 1  # by variables: the active one holds none
    both = await abada(engine.address, "erase", "--business-key", "C-7", "--cancel-active", "--yes")
    assert both.exit_code == 0, both.stderr
    assert "erased 1 instance(s), 1 cancelled first" in both.stdout
    assert await _listed(engine) == set()
    nobody = await abada(engine.address, "erase", "--yes")
    assert nobody.exit_code == 2 and "--business-key" in nobody.stderr
