"""The demo CRM MCP server: customer look-ups and support tickets over MCP streamable-http.

Entry points: the `abada-demo-crm` console script (`crm_mcp.server:main`), `crm_mcp.app.build_app`
to serve it in-process, and `crm_mcp.testing.running_crm_server` to run it as a subprocess.
"""
