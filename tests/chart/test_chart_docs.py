"""docs/operations.md tells an operator every Secret the chart expects, by name and key."""

from __future__ import annotations

from chart_support import REPO_ROOT, Release, pod_spec, render_set

GUIDE = REPO_ROOT / "docs" / "operations.md"


def referenced_secrets(release: Release) -> set[tuple[str, str]]:
    """(Secret, key) pairs that pods and KEDA read."""
    found: set[tuple[str, str]] = set()
    for workload in release.workloads():
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
