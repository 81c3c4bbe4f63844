"""Which model provider serves an agent node, decided once at deploy and frozen with the version.

The order, first that applies: the model profile the node's `model` names (its `provider`), the
node's own `provider:` field, then the model name's family. A node nothing decides is refused at deploy, never guessed
at run time: a worker must not pick a wire protocol for a model it does not recognise.
"""

from __future__ import annotations

import re

PROVIDERS: tuple[str, ...] = ("gemini", "openai", "anthropic")

# Model-name families as their vendors name them; `o<digit>` covers OpenAI's reasoning models.
_FAMILIES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^gemini-"), "gemini"),
    (re.compile(r"^gpt-"), "openai"),
    (re.compile(r"^o\d"), "openai"),
    (re.compile(r"^claude-"), "anthropic"),
)


class ProviderUndecided(ValueError):
    """Neither a profile, the node nor the model name says which provider serves the node."""


def provider_of_model(model: str) -> str | None:
    """The provider a model name belongs to, or None when the name is of no known family."""
    name = model.strip().lower()
    return next((provider for pattern, provider in _FAMILIES if pattern.match(name)), None)


def resolve_provider(model: str, node_provider: str | None, profile_provider: str | None = None) -> str:
    """The provider serving a node; raises ProviderUndecided when nothing decides it.

    The model profile's provider wins over the node's field, which wins over the model name.
    """
    for chosen in (profile_provider, node_provider):
        if chosen:
            return chosen
    inferred = provider_of_model(model)
    if inferred is None:
        raise ProviderUndecided(
            f"cannot tell which provider serves model {model!r}; set provider: to one of "
            f"{', '.join(PROVIDERS)}"
        )
    return inferred
