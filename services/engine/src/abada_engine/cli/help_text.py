"""What `abada COMMAND --help` adds under a command's options: an example and the exit codes.

Kept apart from the commands so each command's help reads the same way and none is forgotten
(a test checks every registered command has its example).
"""

from __future__ import annotations

# Every command that talks to the engine exits with these; a command with its own adds to them.
COMMON_EXIT_CODES = (
    "Exit codes: 0 done; 1 the engine refused or could not be reached (the message says which); "
    "2 invalid input: a bad flag or value here, or the engine's INVALID_ARGUMENT."
)

EXAMPLES: dict[str, str] = {
    "dev": "abada dev --fresh",
    "deploy": "abada deploy examples/support-triage.yaml",
    "definitions": "abada definitions --process support_triage",
    "start": 'abada start support_triage --var customerId=C-42 --var message="My parcel never arrived" --wait',
    "cancel": 'abada cancel INSTANCE --reason "customer withdrew"',
    "instances": "abada instances --var customerId=C-42 -o json",
    "show": "abada show INSTANCE --follow",
    "incidents": "abada incidents --reason DEPENDENCY_UNAVAILABLE",
    "dependencies": "abada dependencies -o json",
    "resolve": "abada resolve INCIDENT --retry",
    "user-tasks": "abada user-tasks",
    "complete-user-task": "abada complete-user-task TASK --var approved=true",
    "journal": "abada journal TASK --json",
    "tasks": "abada tasks --topic notify",
    "topics": "abada topics -o json",
    "approvals": "abada approvals --state pending",
    "approve": """abada approve APPROVAL --args '{"priority": "urgent"}' --comment "gold customer\"""",
    "reject": 'abada reject APPROVAL --reason "not for this customer"',
    "publish": 'abada publish customer_reply --correlation-key T-1042 --var text="It arrived, thanks" --ttl PT1H',
    "purge": "abada purge --before 2026-11-01T00:00:00Z --process support_triage --dry-run",
    "erase": "abada erase --business-key C-42 --cancel-active --yes",
    "modify": "abada modify 01a2... --set customerId=C-43 --move triage=review --reason 'wrong customer'",
    "migrate": "abada migrate --from support_triage:3 --to 4 --map triage=classify --dry-run",
    "batches": "abada batches",
    "batch": "abada batch retry-incidents --process support_triage --type INVALID_OUTPUT",
}

# The `abada batch` group's own commands.
BATCH_EXAMPLES: dict[str, str] = {
    "retry-incidents": "abada batch retry-incidents --process support_triage --type INVALID_OUTPUT --version 3",
    "cancel": 'abada batch cancel --process support_triage --node draft_reply --reason "bad prompt" --yes',
    "migrate": "abada batch migrate --process support_triage --version 3 --to 4 --map triage=classify --yes",
    "modify": 'abada batch modify --process support_triage --business-key C-42 --set tier=gold --reason "upgraded" --yes',
    "show": "abada batch show BATCH --outcome failed",
    "pause": "abada batch pause BATCH",
    "resume": "abada batch resume BATCH",
}

# Commands whose exit codes say more than the common ones.
EXIT_CODES: dict[str, str] = {
    "start": (
        "Exit codes: 0 started (with --wait: completed); 1 the engine refused, or with --wait the "
        "instance was canceled or an incident holds it; 2 invalid input (a bad --var, a missing "
        "required input); 3 with --wait: --timeout passed and the instance goes on."
    ),
    "dev": "Exit codes: 0 stopped by Ctrl-C; 1 a service could not start or stopped on its own; "
    "2 another `abada dev` runs from the same state directory.",
}


def epilog(command: str, examples: dict[str, str] = EXAMPLES) -> str | None:
    """The example and exit codes shown under `command`'s options (paragraphs: one line each)."""
    example = examples.get(command)
    if example is None:
        return None
    exit_codes = EXIT_CODES.get(command, COMMON_EXIT_CODES) if examples is EXAMPLES else COMMON_EXIT_CODES
    return f"Example:  {example}\n\n{exit_codes}"
