"""Parallel branches and their join, on their own: the parser's structure checks and the navigator's
decisions, no database, no gRPC."""

from __future__ import annotations

import pytest
from abada_engine.definitions.model import Process
from abada_engine.definitions.parser import parse_bundle
from abada_engine.errors import EngineError
from abada_engine.runtime.flow.navigator import JoinNeedsTokens, advance

FORKED = """\
processes:
  - id: quotes
    start: ask
    nodes:
      - {{ id: ask, type: parallel, branches: [a, b, c] }}
      - {{ id: a, type: service, topic: supplier_a, next: gather }}
      - {{ id: b, type: service, topic: supplier_b, next: gather }}
      - {{ id: c, type: user_task, next: gather }}
      - {{ id: gather, type: join, wait_for: {wait_for}, next: done }}
      - {{ id: done, type: end }}
"""


def quotes(wait_for: str = "all") -> Process:
    return parse_bundle(FORKED.format(wait_for=wait_for)).processes[0]


def refusal(text: str) -> str:
    with pytest.raises(EngineError) as refused:
        parse_bundle(text)
    return str(refused.value) + repr(refused.value.__dict__)


def test_a_fork_gives_each_branch_its_own_task_and_history() -> None:
    moved = advance(quotes(), {}, "ask")
    assert [entry.type for entry in moved.history] == ["NODE_ENTERED", "FORKED"]
    assert moved.task is None and not moved.completed
    assert [b.current_node_id for b in moved.forked] == ["a", "b", "c"]
    assert [b.task.topic if b.task else None for b in moved.forked] == ["supplier_a", "supplier_b", None]
    assert all([e.node_id for e in b.history] == [b.current_node_id] for b in moved.forked)


def test_a_join_for_all_waits_while_other_branches_live_and_passes_with_the_last() -> None:
    process = quotes()
    waiting = advance(process, {}, "gather", tokens_elsewhere=2)
    assert waiting.joined and waiting.task is None and not waiting.completed
    assert waiting.history[-1].type == "JOIN_WAITING"
    last = advance(process, {}, "gather", tokens_elsewhere=0)
    assert not last.joined and last.completed
    assert [e.type for e in last.history] == [
        "NODE_ENTERED",
        "JOIN_PASSED",
        "NODE_ENTERED",
        "INSTANCE_COMPLETED",
    ]


def test_a_join_for_any_passes_the_first_and_withdraws_the_others() -> None:
    first = advance(quotes("any"), {}, "gather", tokens_elsewhere=2)
    assert first.completed and first.withdraw_other_branches


def test_a_join_is_never_guessed_without_the_live_tokens() -> None:
    with pytest.raises(JoinNeedsTokens):
        advance(quotes(), {}, "gather")


def test_branches_that_reach_the_join_at_once_are_joined_in_the_fork() -> None:
    process = parse_bundle(
        """\
processes:
  - id: p
    start: f
    nodes:
      - { id: f, type: parallel, branches: [j, x] }
      - { id: x, type: service, topic: t, next: j }
      - { id: j, type: join, next: done }
      - { id: done, type: end }
"""
    ).processes[0]
    moved = advance(process, {}, "f")
    assert [b.current_node_id for b in moved.forked] == ["x"]
    assert moved.history[-1].type == "JOIN_WAITING"


@pytest.mark.parametrize(
    ("nodes", "says"),
    [
        (
            "- { id: f, type: parallel, branches: [a, b] }\n"
            "- { id: a, type: service, topic: t, next: done }\n"
            "- { id: b, type: service, topic: t, next: j }\n"
            "- { id: j, type: join, next: done }\n"
            "- { id: done, type: end }",
            "reaches end 'done' before a join",
        ),
        (
            "- { id: s, type: service, topic: t, next: j }\n"
            "- { id: j, type: join, next: done }\n"
            "- { id: done, type: end }",
            "is reached by no parallel branch",
        ),
        (
            "- { id: f, type: parallel, branches: [a] }\n"
            "- { id: a, type: service, topic: t, next: j }\n"
            "- { id: j, type: join, next: done }\n"
            "- { id: done, type: end }",
            "at least two node ids",
        ),
        (
            "- { id: f, type: parallel, branches: [a, b] }\n"
            "- { id: a, type: service, topic: t, next: j }\n"
            "- { id: b, type: service, topic: t, next: j }\n"
            "- { id: j, type: join, wait_for: most, next: done }\n"
            "- { id: done, type: end }",
            "'most' is not one of: all, any",
        ),
        (
            "- { id: f, type: parallel, branches: [a, b] }\n"
            "- { id: a, type: timer, duration: PT1S, next: j }\n"
            "- { id: b, type: service, topic: t, next: j }\n"
            "- { id: j, type: join, next: done }\n"
            "- { id: done, type: end }",
            "leads straight to 'j': not supported yet",
        ),
    ],
)
def test_fan_out_shapes_the_engine_cannot_join_are_refused_at_deploy(nodes: str, says: str) -> None:
    indented = "\n".join("      " + line for line in nodes.splitlines())
    text = (
        f"processes:\n  - id: p\n    start: {nodes.split('id: ')[1].split(',')[0]}\n    nodes:\n{indented}\n"
    )
    assert says in refusal(text)
