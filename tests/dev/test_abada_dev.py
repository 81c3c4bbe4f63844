"""`abada dev` as a newcomer uses it: start it, `source` its env file, run Alice's triage, Ctrl-C.

Each start is a real `abada dev` process with an embedded PostgreSQL in a temporary state directory
and free ports (`--any-ports`: the suite runs beside other engines).
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import time

from dev_support import ABADA, ROOT, abada_dev, clean_environment, sourced

BUNDLE = ROOT / "examples" / "support-triage.yaml"


def _children(pid: int) -> list[int]:
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _waiting_for_reply(workdir: pathlib.Path, instance_id: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        shown = sourced(workdir, f"abada show {instance_id} -o json")
        assert shown.returncode == 0, shown.stderr
        instance = json.loads(shown.stdout)["instance"]
        if instance.get("currentNodeId") == "customer_reply" or time.monotonic() > deadline:
            assert instance.get("currentNodeId") == "customer_reply", instance
            return instance
        time.sleep(0.5)


def _stop(process: subprocess.Popen[str], workdir: pathlib.Path) -> None:
    """Ctrl-C: every service, and the embedded PostgreSQL, is gone afterwards."""
    services = _children(process.pid)
    postmaster = int((workdir / ".abada/dev/pgdata/postmaster.pid").read_text().split()[0])
    assert len(services) >= 6 and _alive(postmaster)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "stopped" in output
    deadline = time.monotonic() + 30  # pg_ctl's stop returns before the postmaster's last breath
    while _alive(postmaster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in (*services, postmaster) if _alive(pid)] == []
    assert not (workdir / ".abada/dev/dev.pid").exists()


def test_abada_dev_runs_alice_triage_keeps_data_and_stops_on_ctrl_c(workdir: pathlib.Path) -> None:
    with abada_dev(workdir) as dev:
        env = dict(
            line.removeprefix("export ").split("=", 1)
            for line in (workdir / ".abada/dev/env").read_text().splitlines()
            if line.startswith("export ")
        )
        assert {"ABADA_ENGINE_ADDRESS", "ABADA_TOKEN_FILE", "ABADA_WORKER_TOKEN_FILE"} <= env.keys()
        # --any-ports moved the CRM off the port the bundle names; the env file says where it is.
        bundle = workdir / "support-triage.yaml"
        bundle.write_text(BUNDLE.read_text().replace("http://127.0.0.1:8765/mcp", env["ABADA_DEV_CRM_URL"]))
        deployed = sourced(workdir, f"abada deploy {bundle.name}")
        assert deployed.returncode == 0, deployed.stderr
        started = sourced(
            workdir,
            "abada start support_triage --var customerId=C-42 --var message='My parcel never arrived' -o json",
        )
        assert started.returncode == 0, started.stdout + started.stderr
        instance_id = json.loads(started.stdout)["instance"]["id"]
        # After notifying Alice the instance waits for her reply, correlated on her ticket id.
        waiting = _waiting_for_reply(workdir, instance_id)
        assert waiting["variables"]["triage"]["priority"] == "high"
        assert waiting["variables"]["notification"]["to"] == "C-42"
        ticket = waiting["variables"]["triage"]["ticketId"]
        published = sourced(
            workdir, f"abada publish customer_reply --correlation-key {ticket} --var text=thanks -o json"
        )
        assert published.returncode == 0, published.stderr
        assert json.loads(published.stdout)["instanceId"] == instance_id
        shown = sourced(workdir, f"abada show {instance_id} -o json")
        instance = json.loads(shown.stdout)["instance"]
        assert instance["currentNodeId"] == "done"
        assert instance["variables"]["reply"] == {"text": "thanks"}
        _stop(dev, workdir)

    with abada_dev(workdir) as dev:
        listed = sourced(workdir, "abada instances -o json")
        assert listed.returncode == 0, listed.stderr
        assert [i["id"] for i in json.loads(listed.stdout)["instances"]] == [instance["id"]]
        _stop(dev, workdir)

    with abada_dev(workdir, "--fresh") as dev:
        listed = sourced(workdir, "abada instances -o json")
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout).get("instances", []) == []
        _stop(dev, workdir)


def test_a_second_abada_dev_on_the_same_state_is_refused(workdir: pathlib.Path) -> None:
    with abada_dev(workdir) as dev:
        second = subprocess.run(
            [str(ABADA), "dev", "--any-ports"],
            cwd=workdir,
            env=clean_environment(),
            capture_output=True,
            text=True,
        )
        assert second.returncode == 2
        assert f"already running from .abada/dev (pid {dev.pid})" in second.stderr
        _stop(dev, workdir)
