"""Rendering the chart offline and reading what it would apply; shared by the chart tests.

Helm runs in-process (helm-python-sdk bundles Helm's Go library): no helm binary, no cluster.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Iterator
from typing import Any

import yaml
from helm_python import Chart

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "abada"
CI_DIR = CHART_DIR / "ci"
RELEASE = "abada"
NAMESPACE = "abada"
# The configurations the chart is tested in besides its defaults (TLS through cert-manager).
CI_FILES = (
    "keda-on.yaml",
    "keda-off.yaml",
    "prometheus-trigger.yaml",
    "mtls-on.yaml",
    "plaintext.yaml",
    "servicemonitor-on.yaml",
)
VALUE_SETS = ("default", *CI_FILES)


def tls_on(value_set: str) -> bool:
    """TLS is on by default; only ci/plaintext.yaml turns it off (explicitly)."""
    return value_set != "plaintext.yaml"


Manifest = dict[str, Any]


@functools.cache
def load_chart() -> Chart:
    return Chart.load(CHART_DIR)


def ci_values(value_set: str) -> dict[str, Any]:
    """The values of a named set: "default" is the chart's own, otherwise a file of ci/."""
    if value_set == "default":
        return {}
    loaded = yaml.safe_load((CI_DIR / value_set).read_text())
    return loaded or {}


class Release:
    """The manifests one `helm template` would print, parsed."""

    def __init__(self, rendered: dict[str, str]) -> None:
        self.notes = next((text for path, text in rendered.items() if path.endswith("NOTES.txt")), "")
        self.manifests: list[Manifest] = []
        for path, text in sorted(rendered.items()):
            if path.endswith(".txt"):
                continue
            self.manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)

    def of_kind(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m["kind"] == kind]

    def get(self, kind: str, name: str) -> Manifest:
        matches = [m for m in self.of_kind(kind) if m["metadata"]["name"] == name]
        assert len(matches) == 1, f"expected one {kind} named {name}, found {len(matches)}"
        return matches[0]

    def workloads(self) -> list[Manifest]:
        """Everything that runs pods: Deployments and Jobs."""
        return [m for m in self.manifests if m["kind"] in ("Deployment", "Job")]

    def component(self, manifest: Manifest) -> str:
        return str(manifest["metadata"]["labels"]["app.kubernetes.io/component"])

    def deployment_of(self, component: str) -> Manifest:
        found = [m for m in self.of_kind("Deployment") if self.component(m) == component]
        assert len(found) == 1, f"expected one {component} Deployment, found {len(found)}"
        return found[0]


def render(values: dict[str, Any] | None = None) -> Release:
    """Render the chart; raises HelmValuesError (schema) or HelmRenderError (validations.yaml)."""
    rendered = load_chart().render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return Release(rendered)


@functools.cache
def render_set(value_set: str) -> Release:
    return render(ci_values(value_set))


def pod_spec(workload: Manifest) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"])


def only_container(workload: Manifest) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Env entries by name; asserts no name is set twice (the last would silently win)."""
    entries = container.get("env", [])
    names = [entry["name"] for entry in entries]
    assert len(names) == len(set(names)), f"duplicate env names in {names}"
    return {entry["name"]: entry for entry in entries}


def iter_containers(workload: Manifest) -> Iterator[dict[str, Any]]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def each(items: Any, what: str) -> list[Any]:
    """`items` as a list, asserting there is at least one: a loop over nothing passes every assertion."""
    found = list(items)
    assert found, f"expected at least one {what}, found none"
    return found
