"""CLI tests talk to the authenticating test engine with the suite's operator token."""

from __future__ import annotations

import cli_support
import pytest


@pytest.fixture(autouse=True)
def cli_token_for_the_test_engine(engine_channel, engine_tokens):
    _, address = engine_channel
    cli_support.ENGINE_TOKENS[address] = engine_tokens.suite
    yield
    cli_support.ENGINE_TOKENS.pop(address, None)
