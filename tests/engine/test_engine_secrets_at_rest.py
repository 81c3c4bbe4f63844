"""Development secrets and the keys around the journal: created private, long enough, never substituted."""

from __future__ import annotations

import os
import pathlib
import stat

import pytest
from abada_engine.auth import write_dev_callers
from abada_engine.runtime.crypto.keys import (
    MIN_IDEMPOTENCY_SECRET_BYTES,
    JournalIntegrityError,
    KeyRing,
    idempotency_from_env,
    journal_keys_from_env,
)


@pytest.fixture
def permissive_umask():
    previous = os.umask(0)
    yield
    os.umask(previous)


@pytest.fixture
def chmod_never_runs(monkeypatch):
    """If a secret file were written first and chmod'ed after, it would exist world-readable in between:
    with chmod failing, whatever is on disk is what that window showed."""

    def refuse(self, mode, *, follow_symlinks=True):
        raise PermissionError("chmod is not reached in this test")

    monkeypatch.setattr(pathlib.Path, "chmod", refuse)


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("permissive_umask", "chmod_never_runs")
def test_development_secrets_are_owner_only_from_the_first_byte(tmp_path):
    journal_keys_from_env({}, tmp_path)
    idempotency_from_env({}, tmp_path)
    registry = write_dev_callers(tmp_path / "dev-tokens")
    written = [tmp_path / "journal-keys", tmp_path / "idempotency-secret", registry]
    written += sorted((tmp_path / "dev-tokens").glob("*.token"))
    # journal keys, idempotency secret, the callers file, and the operator, approver, worker and broker tokens
    assert len(written) == 7
    for path in written:
        assert _mode(path) == 0o600, path


@pytest.mark.usefixtures("permissive_umask")
def test_a_leftover_token_file_with_loose_permissions_is_replaced_not_reused(tmp_path):
    directory = tmp_path / "dev-tokens"
    directory.mkdir()
    leftover = directory / "operator.token"
    leftover.write_text("old\n")
    leftover.chmod(0o644)
    write_dev_callers(directory)
    assert _mode(leftover) == 0o600
    assert leftover.read_text() != "old\n"


def test_a_short_idempotency_secret_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 32 bytes"):
        idempotency_from_env({"ABADA_IDEMPOTENCY_SECRET": "x" * (MIN_IDEMPOTENCY_SECRET_BYTES - 1)}, tmp_path)
    assert idempotency_from_env({"ABADA_IDEMPOTENCY_SECRET": "x" * MIN_IDEMPOTENCY_SECRET_BYTES}, tmp_path)


def test_the_keyed_digest_refuses_an_unknown_key_like_seal_and_open_do():
    ring = KeyRing.parse("k2:" + "Ag" * 21 + "g=,k1:" + "AQ" * 21 + "Q=")
    assert ring.digest("k1", {"a": 1}) != ring.digest("k2", {"a": 1})
    with pytest.raises(JournalIntegrityError, match="k9"):
        ring.digest("k9", {"a": 1})
