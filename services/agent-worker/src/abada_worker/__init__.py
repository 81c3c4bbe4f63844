"""Abada's agent worker: serves topic `abada:agent`, runs the LLM loop with MCP tools under a lease.

Entry point: the `abada-worker` console script (`abada_worker.main:main`). The loop itself is in
`agent_task`; polling, executing and routing are `job_poller`, `job_executor` and `task_router`.
"""
