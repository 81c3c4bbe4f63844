"""The final reply: JSON bare or fenced, `_confidence` moved out, anything else a clear reason."""

from __future__ import annotations

import pytest
from abada_worker.answer import InvalidAnswer, parse_answer

TICKET = '{"ticketId": "T-981", "priority": "high", "_confidence": 92}'


def test_a_bare_json_answer_loses_its_confidence_to_the_metadata() -> None:
    answer = parse_answer(TICKET)
    assert answer.value == {"ticketId": "T-981", "priority": "high"}
    assert answer.confidence == 92.0


def test_a_fenced_json_block_is_the_answer_too() -> None:
    answer = parse_answer(f"Here is the result:\n```json\n{TICKET}\n```\nAnything else?")
    assert answer.value == {"ticketId": "T-981", "priority": "high"}
    assert answer.confidence == 92.0


def test_an_answer_without_confidence_has_none() -> None:
    assert parse_answer('{"ticketId": "T-981"}').confidence is None
    assert parse_answer("[1, 2]").value == [1, 2]


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("I think a ticket should be opened with high priority.", "not JSON"),
        ("", "empty"),
        ('{"ticketId": "T-981", "_confidence": "high"}', "_confidence must be a number"),
        ('{"ticketId": "T-981", "_confidence": 920}', "between 0 and 100"),
        ("```json\n{not json}\n```", "not JSON"),
    ],
)
def test_a_reply_that_is_no_usable_answer_says_why(reply: str, reason: str) -> None:
    with pytest.raises(InvalidAnswer, match=reason):
        parse_answer(reply)
