"""The console as `abada-engine` serves it: a real engine process with mutual TLS on its gRPC port
(as the chart runs it) still serves the console, which reaches the engine over its private Unix
socket, needs no client certificate, and signs people in by their own tokens."""

from __future__ import annotations

import base64
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import yaml
from abada_engine.auth import token_sha256
from certificates import make_pki


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signed_in(http: httpx2.Client, token: str) -> httpx2.Response:
    page = http.get("/console/login")
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None
    return http.post("/console/login", data={"csrf": found.group(1), "token": token})


def test_an_engine_with_mutual_tls_serves_the_console_by_tokens(database_url: str, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    (tmp_path / "server.pem").write_bytes(pki.server_cert)
    (tmp_path / "server.key").write_bytes(pki.server_key)
    operator, approver = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    callers = [
        {"identity": "ops", "roles": ["operator"], "token_sha256": token_sha256(operator)},
        {"identity": "carol", "roles": ["approver"], "token_sha256": token_sha256(approver)},
    ]
    (tmp_path / "callers.yaml").write_text(yaml.safe_dump({"callers": callers}))
    http_port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ABADA_")}
    env.update(
        ABADA_DATABASE_URL=database_url,
        ABADA_GRPC_ADDRESS=f"127.0.0.1:{_free_port()}",
        ABADA_HTTP_ADDRESS=f"127.0.0.1:{http_port}",
        ABADA_AUTH_TOKENS_FILE=str(tmp_path / "callers.yaml"),
        ABADA_JOURNAL_KEYS="k1:" + base64.b64encode(os.urandom(32)).decode(),
        ABADA_IDEMPOTENCY_SECRET=secrets.token_urlsafe(32),
        ABADA_TLS_CERT_FILE=str(tmp_path / "server.pem"),
        ABADA_TLS_KEY_FILE=str(tmp_path / "server.key"),
        ABADA_TLS_CLIENT_CA_FILE=str(pki.ca),
        ABADA_STATE_DIR=str(tmp_path / "state"),
        TMPDIR=str(tmp_path),
    )
    log = tmp_path / "engine.log"
    engine = subprocess.Popen(
        [sys.executable, "-m", "abada_engine.main"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    try:
        with httpx2.Client(base_url=f"http://127.0.0.1:{http_port}") as http:
            deadline = time.monotonic() + 60
            while True:
                assert engine.poll() is None, log.read_text()[-3000:]
                try:
                    if (http.get("/healthz")).status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            [private] = [p for p in tmp_path.iterdir() if p.name.startswith("abada-console-")]
            assert private.stat().st_mode & 0o077 == 0  # the socket's directory is the engine's alone

            signed = _signed_in(http, operator)
            assert signed.status_code == 303 and signed.headers["location"] == "/console/instances"
            for page in ("/console/instances", "/console/approvals", "/console/incidents", "/console/queues"):
                assert (http.get(page)).status_code == 200, page
        with httpx2.Client(base_url=f"http://127.0.0.1:{http_port}") as http:
            signed = _signed_in(http, approver)
            assert signed.headers["location"] == "/console/approvals"
            assert (http.get("/console/instances")).status_code == 403
    finally:
        engine.terminate()
        engine.wait(30)
    text = log.read_text()
    assert operator not in text and approver not in text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("abada-console-")]
