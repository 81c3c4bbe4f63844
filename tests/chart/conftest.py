from __future__ import annotations

import pytest
from chart_support import VALUE_SETS, Release, render_set


@pytest.fixture(params=VALUE_SETS)
def value_set(request: pytest.FixtureRequest) -> str:
    """Each configuration the chart is tested in: its defaults and every file of ci/."""
    return str(request.param)


@pytest.fixture
def release(value_set: str) -> Release:
    return render_set(value_set)
