"""Security regression tests: each one is an attack from a review, run against the real parts.

The demo CRM MCP server, for bundles whose tool servers the engine checks live at deploy.
"""

from __future__ import annotations

import pytest
from crm_mcp.testing import running_crm_server


@pytest.fixture(scope="session")
def crm():
    with running_crm_server(enable_control=True) as server:
        yield server


@pytest.fixture
def crm_credentials(crm, deploy_credentials):
    """The CRM with its token in the engine's deploy credentials, and its standard tool set."""
    deploy_credentials.write_text(f"crm-token: {crm.token}\n")
    crm.set_variant("standard")
    yield crm
    crm.set_variant("standard")
