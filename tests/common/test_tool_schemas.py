"""Deploy-time and run-time contract checks hash tool schemas with the one shared function."""

from __future__ import annotations

import hashlib

from abada_common.tool_schemas import schema_sha256
from abada_engine.definitions import tool_contracts
from abada_worker import tool_session


def test_the_engine_and_the_worker_use_the_shared_schema_hash():
    assert tool_contracts.schema_sha256 is schema_sha256
    assert tool_session.schema_sha256 is schema_sha256


def test_the_hash_is_over_canonical_json_so_key_order_does_not_matter():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    reordered = {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "type": "object"}
    expected = hashlib.sha256(
        b'{"properties":{"a":{"type":"integer"},"b":{"type":"string"}},"type":"object"}'
    ).hexdigest()
    assert schema_sha256(schema) == schema_sha256(reordered) == expected
