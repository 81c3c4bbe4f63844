"""`helm lint --strict` on the chart, with its defaults and with every ci/ values file."""

from __future__ import annotations

from typing import Any

import pytest
from chart_support import CHART_DIR, CI_DIR, CI_FILES, VALUE_SETS, ci_values
from helm_python import lint

WARNING = 2


def findings(values: dict[str, Any]) -> list[dict[str, Any]]:
    report = lint(CHART_DIR, values, strict=True, namespace="abada")
    assert report["total_charts_linted"] == 1
    return [m for m in report["messages"] if m["severity"] >= WARNING] + [
        {"severity": "error", "path": "", "error": e} for e in report["errors"]
    ]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_strict_lint_finds_nothing(value_set: str) -> None:
    assert findings(ci_values(value_set)) == []


def test_every_ci_values_file_is_linted_and_rendered() -> None:
    # A ci/ file nobody tests would rot; the test suites iterate CI_FILES.
    assert sorted(p.name for p in CI_DIR.glob("*.yaml")) == sorted(CI_FILES)


def test_lint_reports_values_the_schema_rejects() -> None:
    # The same lint that passes above must fail loudly on bad values, or passing means nothing.
    problems = findings({"workers": [{"topic": "abada:agent", "concurrency": 0}]})
    assert any("/workers/0/concurrency" in p["error"] for p in problems), problems
