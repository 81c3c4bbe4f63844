"""docs/operations.md against the chart and the code: its Secrets, callers files and metrics."""

from __future__ import annotations

import pathlib
import re

import yaml
from abada_broker import metrics as broker_metrics
from abada_broker.auth import parse_callers
from abada_engine.auth import CallerRegistry, token_sha256
from abada_engine.metrics import (
    DEPENDENCY_HELD_TASKS,
    DEPENDENCY_UP,
    INCIDENTS_OPEN,
    JOURNAL_STEPS,
    LEASE_EXPIRIES,
    MODEL_CALLS_ADMITTED,
    MODEL_CALLS_REFUSED,
    MODEL_CALLS_WAITING,
    OLDEST_READY,
    REGISTRY,
    RETENTION_LAG,
    ROWS_DELETED,
    RPC_SECONDS,
    TASKS_DELAYED,
    TASKS_DEMAND,
    TASKS_LEASED,
    TASKS_PARKED,
    TASKS_READY,
)
from abada_worker import metrics as worker_metrics
from chart_support import REPO_ROOT, Release, each, env_of, only_container, pod_spec, render_set
from prometheus_client import Counter, Histogram

GUIDE = REPO_ROOT / "docs" / "operations.md"
DATABASE_GAUGES = (
    TASKS_READY,
    TASKS_LEASED,
    TASKS_DEMAND,
    TASKS_DELAYED,
    OLDEST_READY,
    INCIDENTS_OPEN,
    JOURNAL_STEPS,
    MODEL_CALLS_WAITING,
    DEPENDENCY_UP,
    DEPENDENCY_HELD_TASKS,
    TASKS_PARKED,
    RETENTION_LAG,
)


def referenced_secrets(release: Release) -> set[tuple[str, str]]:
    """(Secret, key) pairs that pods and KEDA read."""
    found: set[tuple[str, str]] = set()
    for workload in each(release.workloads(), "workload"):
        spec = pod_spec(workload)
        for container in spec["containers"]:
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    found.add((ref["name"], ref["key"]))
        for volume in spec.get("volumes", []):
            secret = volume.get("secret")
            if secret:
                found.update((secret["secretName"], item["key"]) for item in secret["items"])
    for auth in release.of_kind("TriggerAuthentication"):
        found.update((ref["name"], ref["key"]) for ref in auth["spec"]["secretTargetRef"])
    return found


def test_the_guide_names_every_secret_of_a_default_install() -> None:
    guide = GUIDE.read_text()
    secrets = referenced_secrets(render_set("default"))
    assert len(secrets) >= 8
    for name, key in sorted(secrets):
        assert f"`{name}`" in guide, f"docs/operations.md does not name the Secret {name}"
        table_rows = [line for line in guide.splitlines() if line.startswith(f"| `{name}`")]
        assert any(f"`{key}`" in row for row in table_rows), f"docs/operations.md: no key {key} for {name}"


def test_the_guide_shows_the_vault_role_for_the_brokers_service_account() -> None:
    guide = GUIDE.read_text()
    broker_account = pod_spec(render_set("default").deployment_of("broker"))["serviceAccountName"]
    assert f"bound_service_account_names={broker_account}" in guide
    assert 'path "secret/data/abada/tool-credentials/*"' in guide
    assert 'path "secret/metadata/abada/tool-credentials/*"' in guide


def fenced_blocks(text: str, first_line: str) -> list[str]:
    """The bodies of the fenced code blocks whose first line is `first_line`."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    return [block for block in blocks if block.splitlines()[0] == first_line]


def with_tokens(example: str) -> tuple[str, dict[str, str]]:
    """The example with each `<sha256 of NAME>` replaced by the digest of a made-up token for NAME."""
    tokens: dict[str, str] = {}

    def digest(match: re.Match[str]) -> str:
        tokens[match.group(1)] = f"made-up-{match.group(1)}"
        return token_sha256(tokens[match.group(1)])

    return re.sub(r"<sha256 of ([^>]+)>", digest, example), tokens


def default_pool_identity() -> str:
    worker = render_set("default").deployment_of("worker")
    worker_id = env_of(only_container(worker))["ABADA_WORKER_ID"]["value"]
    return str(worker_id).split("/")[0]


def test_the_engine_callers_example_is_read_by_the_engine(tmp_path: pathlib.Path) -> None:
    (example,) = fenced_blocks(GUIDE.read_text(), "# ./engine-callers")
    text, tokens = with_tokens(example)
    path = tmp_path / "callers"
    path.write_text(text)
    registry = CallerRegistry(path)
    callers = {name: registry.by_token(token) for name, token in tokens.items()}
    assert None not in callers.values()
    pool = callers["worker.token"]
    assert pool is not None and pool.roles == {"worker"}
    # The pool's entry matches the chart's default pods: their ids and their topic.
    assert pool.identity == default_pool_identity()
    assert pool.may_act_as(f"{pool.identity}/abada-worker-abada-agent-5d8f7c9b4-x2x7q")
    assert pool.may_fetch("abada:agent")
    roles = {name: caller.roles for name, caller in callers.items() if caller is not None}
    assert roles["broker-to-engine.token"] == {"broker"}
    assert roles["keda-stats.token"] == {"metrics"}
    assert roles["alice.token"] == {"operator"}
    assert not any(caller.act_as_any_worker for caller in callers.values() if caller is not None)


def test_the_mtls_callers_example_names_callers_by_certificate(tmp_path: pathlib.Path) -> None:
    (example,) = fenced_blocks(GUIDE.read_text(), "# ./engine-callers, with tls.enabled")
    text, tokens = with_tokens(example)
    path = tmp_path / "callers"
    path.write_text(text)
    registry = CallerRegistry(path)
    worker, broker = registry.by_certificate("agent-pool"), registry.by_certificate("abada-broker")
    assert worker is not None and worker.roles == {"worker"}
    assert broker is not None and broker.roles == {"broker"}
    # The chart's workers and broker send their token along with the certificate; an unknown token
    # is refused, so the same entries must know it.
    assert registry.by_token(tokens["worker.token"]) == worker
    assert registry.by_token(tokens["broker-to-engine.token"]) == broker


def test_the_broker_callers_example_is_read_by_the_broker() -> None:
    (example,) = fenced_blocks(GUIDE.read_text(), "# ./broker-callers")
    text, _ = with_tokens(example)
    entries = parse_callers(yaml.safe_load(text), "docs/operations.md")
    callers = {entry.caller.identity: entry.caller for entry in entries}
    assert callers[default_pool_identity()].roles == {"worker"}
    assert callers["abada-engine"].roles == {"engine"}


def metrics_table(guide: str) -> dict[str, tuple[str, set[str]]]:
    """Rows of the metrics table: name -> (type, label names)."""
    start = guide.index("## Reading the metrics")
    section = guide[start : guide.index("\n## ", start + 1)]
    rows: dict[str, tuple[str, set[str]]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`abada_\w+`", cells[0]):
            labels = set(re.findall(r"`(\w+)`", cells[2]))
            rows[cells[0].strip("`")] = (cells[1], labels)
    return rows


def test_the_metrics_tables_are_what_the_engine_the_workers_and_the_broker_export() -> None:
    # prometheus_client has no public accessor for a metric's label names.
    replica_figures = (RPC_SECONDS, LEASE_EXPIRIES, MODEL_CALLS_ADMITTED, MODEL_CALLS_REFUSED, ROWS_DELETED)
    label_names = {c._name: set(c._labelnames) for c in (*replica_figures, *DATABASE_GAUGES)}
    exported: dict[str, tuple[str, set[str]]] = {}
    for family in REGISTRY.collect():
        assert family.name in label_names, f"metrics.py exports {family.name}, unknown to this test"
        name = family.name + ("_total" if family.type == "counter" else "")
        exported[name] = (family.type, label_names[family.name])
    # The worker's and the broker's live in prometheus_client's default registry: every one they define.
    for module in (worker_metrics, broker_metrics):
        for figure in vars(module).values():
            if isinstance(figure, Counter | Histogram):
                kind = "counter" if isinstance(figure, Counter) else "histogram"
                exported[figure._name + ("_total" if kind == "counter" else "")] = (
                    kind,
                    set(figure._labelnames),
                )
    assert metrics_table(GUIDE.read_text()) == exported


def test_the_guide_gives_the_rpc_histogram_buckets() -> None:
    guide = GUIDE.read_text()
    milliseconds = [b * 1000 for b in RPC_SECONDS._upper_bounds if b < 1]
    seconds = [b for b in RPC_SECONDS._upper_bounds if 1 <= b < float("inf")]
    written = (
        ", ".join(f"{m:g}" for m in milliseconds) + " ms, " + ", ".join(f"{s:g}" for s in seconds) + " s"
    )
    assert f"Buckets: {written}." in guide
