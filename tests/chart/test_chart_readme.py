"""charts/abada/README.md against the chart: its values file renders, and the names it uses exist."""

from __future__ import annotations

import re

import yaml
from chart_support import REPO_ROOT, env_of, only_container, render

README = REPO_ROOT / "charts" / "abada" / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)


def _values() -> dict:
    [block] = [b for b in _blocks("yaml") if b.startswith("# values-first.yaml")]
    return yaml.safe_load(block)


def test_the_minimal_values_file_installs_with_tls_and_the_names_the_readme_uses() -> None:
    release = render(_values())
    # The Issuer the operator's client Certificate names, and the Service the port-forward reaches.
    assert release.get("Issuer", "abada-ca")
    service = release.get("Service", "abada-engine")
    assert 50051 in [port["port"] for port in service["spec"]["ports"]]
    engine_certificate = release.get("Certificate", "abada-engine-tls")
    assert "localhost" in engine_certificate["spec"]["dnsNames"]
    assert engine_certificate["spec"]["secretName"] == "abada-engine-tls"
    assert "ABADA_TLS_CLIENT_CA_FILE" in env_of(only_container(release.deployment_of("engine")))


def test_tokens_over_tls_as_the_readme_turns_them_on() -> None:
    values = _values()
    values["tls"] = {"requireClientCertificates": False}
    env = env_of(only_container(render(values).deployment_of("engine")))
    assert "ABADA_TLS_CERT_FILE" in env and "ABADA_TLS_CLIENT_CA_FILE" not in env


def test_the_readme_creates_every_secret_the_chart_names() -> None:
    commands = "\n".join(_blocks("sh"))
    created = set(re.findall(r"create secret generic (\S+)", commands))
    assert created >= {
        "abada-database",
        "abada-engine-keys",
        "abada-engine-auth",
        "abada-broker-auth",
        "abada-worker-token",
        "abada-keda-stats",
        "abada-gemini",
    }
    assert "make images REGISTRY=" in README.read_text()
