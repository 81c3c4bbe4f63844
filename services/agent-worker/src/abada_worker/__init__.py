"""Abada's agent worker: serves topic `abada:agent`, runs the LLM loop with MCP tools under a lease.

Entry point: the `abada-worker` console script (`abada_worker.main:main`). The loop itself is in
`agent_task`; one task's attempt (its lease, how it ended) is `task_runs`; polling, slots, lease
renewal and the drain deadline are the SDK's worker parts (`abada_sdk.worker`), shared with every
worker written on the SDK.
"""
