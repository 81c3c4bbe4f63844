"""The console's sealed session cookie: opened only by a replica with the same secret, unaltered and
in time; its key is derived for this use, not the shared secret itself."""

from __future__ import annotations

from abada_engine.console.session import SESSION_SECONDS, Sealer, session_key

SECRET = b"x" * 40


def test_a_session_opens_on_any_replica_with_the_secret_and_nowhere_else() -> None:
    session = Sealer(SECRET).new("the-token", frozenset({"approver"}), now=1000.0)
    cookie = Sealer(SECRET).seal(session)
    assert "the-token" not in cookie
    assert Sealer(SECRET).open(cookie, now=1001.0) == session
    assert Sealer(b"y" * 40).open(cookie, now=1001.0) is None
    assert session_key(SECRET) != SECRET[:32]


def test_an_altered_truncated_or_expired_cookie_is_no_session() -> None:
    sealer = Sealer(SECRET)
    cookie = sealer.seal(sealer.new("the-token", frozenset({"operator"}), now=1000.0))
    flipped = cookie[:20] + ("A" if cookie[20] != "A" else "B") + cookie[21:]
    assert sealer.open(flipped, now=1001.0) is None
    assert sealer.open(cookie[:-5], now=1001.0) is None
    assert sealer.open("", now=1001.0) is None
    assert sealer.open(cookie, now=1000.0 + SESSION_SECONDS) is None


def test_each_session_has_its_own_csrf_token_compared_whole() -> None:
    sealer = Sealer(SECRET)
    first, second = sealer.new("t", frozenset()), sealer.new("t", frozenset())
    assert first.csrf != second.csrf
    assert first.csrf_matches(first.csrf)
    assert not first.csrf_matches(second.csrf)
    assert not first.csrf_matches("")
    assert not first.csrf_matches(first.csrf[:-1])
