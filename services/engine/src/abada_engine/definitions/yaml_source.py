"""A bundle's YAML, read safely and with the line of every value, so each problem can name its line.

Aliases are refused (a few hundred bytes of nested aliases expand to billions of nodes) and so is a
bundle of more than `MAX_YAML_NODES` nodes; both as `Refused`, a YAML error with the position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml


@dataclass
class Located:
    """A YAML value with the line of every path in it, so errors can point at the source."""

    value: Any
    lines: dict[tuple[str | int, ...], int]


# Far more nodes than any real bundle has; a bundle that needs more is not configuration.
MAX_YAML_NODES = 100_000


class Refused(yaml.MarkedYAMLError):
    """Valid YAML that a bundle may not use."""


class _BundleLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and caps the node count.

    An alias is walked again wherever it is used, so a few hundred bytes of nested aliases expand to
    billions of nodes (the "billion laughs"); a bundle gains nothing from them, so they are refused.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise Refused(
                None,
                None,
                "aliases (*name) are not allowed in a bundle; write the value out",
                event.start_mark,
            )
        self._nodes += 1
        if self._nodes > MAX_YAML_NODES:
            raise Refused(
                None,
                None,
                f"the bundle has more than {MAX_YAML_NODES} YAML nodes",
                self.peek_event().start_mark,
            )
        return super().compose_node(parent, index)


def load(text: str) -> Located:
    loader = _BundleLoader(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    lines: dict[tuple[str | int, ...], int] = {}

    def build(node: yaml.Node, path: tuple[str | int, ...]) -> Any:
        lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            result: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = yaml.SafeLoader.construct_scalar(yaml.SafeLoader(""), key_node)
                key = str(key)
                result[key] = build(value_node, (*path, key))
                lines[(*path, key)] = key_node.start_mark.line + 1
            return result
        if isinstance(node, yaml.SequenceNode):
            return [build(item, (*path, index)) for index, item in enumerate(node.value)]
        loader = yaml.SafeLoader("")
        return loader.construct_object(node, deep=True)

    value = build(root, ()) if root is not None else None
    return Located(value, lines)


def path_text(path: tuple[str | int, ...]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or "(bundle)"
