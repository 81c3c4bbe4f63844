"""The providers this worker can serve, and which one serves a given agent node.

The engine freezes the provider with the definition version and hands it out in the agent work;
the model name's family is only read when an older engine sent none. A provider this worker has
no credentials or endpoint for fails the attempt without a retry: another attempt on the same
worker pool would fail the same way, and a person has to configure the pool or the node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import AttemptFailed
from .base import ModelProvider

PROVIDER_NAMES: tuple[str, ...] = ("gemini", "openai", "anthropic")
PROVIDER_UNAVAILABLE = "MODEL_PROVIDER_UNAVAILABLE"
# The same families the engine infers at deploy (abada_engine.definitions.providers).
_FAMILIES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^gemini-"), "gemini"),
    (re.compile(r"^gpt-"), "openai"),
    (re.compile(r"^o\d"), "openai"),
    (re.compile(r"^claude-"), "anthropic"),
)


def provider_of_model(model: str) -> str | None:
    name = model.strip().lower()
    return next((provider for pattern, provider in _FAMILIES if pattern.match(name)), None)


class ProviderSet:
    def __init__(self, providers: Mapping[str, ModelProvider], missing: Mapping[str, str]) -> None:
        """`missing` says, per provider not configured, what would configure it."""
        self._providers = dict(providers)
        self._missing = dict(missing)

    @property
    def names(self) -> list[str]:
        return sorted(self._providers)

    def for_node(self, provider: str, model: str) -> ModelProvider:
        name = provider or provider_of_model(model)
        if name is None:
            raise AttemptFailed(
                PROVIDER_UNAVAILABLE,
                f"the agent work names no provider and model {model!r} is of no known family",
                no_retry=True,
                details={"model": model},
            )
        found = self._providers.get(name)
        if found is None:
            how = self._missing.get(name, "this worker does not know that provider")
            raise AttemptFailed(
                PROVIDER_UNAVAILABLE,
                f"this worker has no credentials for provider {name!r} (model {model!r}): {how}",
                no_retry=True,
                details={"provider": name, "model": model},
            )
        return found

    async def aclose(self) -> None:
        for provider in self._providers.values():
            await provider.aclose()
