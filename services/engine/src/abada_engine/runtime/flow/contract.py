"""The output contract: whether an agent's answer may advance the process.

The model proposes; this decides. Only the node's `result_variable` may be
written, it must match `output_schema` (JSON Schema 2020-12) and the
confidence must reach `confidence_threshold`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.definitions.model import Node
from abada_engine.definitions.schemas import output_errors
from abada_engine.errors import invalid


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    INVALID_OUTPUT = "invalid_output"
    LOW_CONFIDENCE = "low_confidence"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""
    # Where the token goes when the contract fails; None means an incident.
    route: str | None = None

    @property
    def incident_type(self) -> str:
        return self.verdict.name


def check_written_variables(node: Node, variables: dict[str, Any]) -> None:
    """Refuse (without any change) a completion that writes what the node does not own."""
    if node.type != "agent":
        return
    extra = sorted(set(variables) - {node.result_variable})
    if extra:
        raise invalid(
            ErrorReason.VARIABLE_NOT_ALLOWED,
            "variables",
            f"node {node.id!r} may only write {node.result_variable!r}, not {', '.join(extra)}",
        )


def judging_can_take_long(node: Node) -> bool:
    """Whether `judge` validates against an output schema (patterns on model output): the only part
    of judging that is more than a few comparisons."""
    return node.type == "agent" and node.output_schema is not None


def judge(
    node: Node, variables: dict[str, Any], confidence: float | None, invalid_output_reason: str = ""
) -> Decision:
    """Decide on an agent node's completion; other nodes are always accepted."""
    if node.type != "agent":
        return Decision(Verdict.ACCEPTED)
    assert node.result_variable is not None
    problem = invalid_output_reason
    if not problem and node.result_variable not in variables:
        problem = f"the result variable {node.result_variable!r} was not written"
    if not problem and node.output_schema is not None:
        errors = output_errors(node.output_schema, variables[node.result_variable])
        if errors:
            first = errors[0]
            where = "/".join(str(p) for p in first.absolute_path) or "(root)"
            problem = f"output does not match output_schema at {where}: {first.message}"
    if problem:
        return Decision(Verdict.INVALID_OUTPUT, problem, node.on_invalid_output)
    if node.confidence_threshold is not None:
        if confidence is None:
            return Decision(
                Verdict.LOW_CONFIDENCE,
                f"no confidence reported; {node.confidence_threshold:g} required",
                node.on_low_confidence,
            )
        if confidence < node.confidence_threshold:
            return Decision(
                Verdict.LOW_CONFIDENCE,
                f"confidence {confidence:g} is below the threshold {node.confidence_threshold:g}",
                node.on_low_confidence,
            )
    return Decision(Verdict.ACCEPTED)
