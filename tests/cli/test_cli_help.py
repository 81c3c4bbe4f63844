"""`abada COMMAND --help` is that command's help: its options, an example and what its exit codes mean."""

from __future__ import annotations

import pytest
from abada_engine.cli.app import app
from abada_engine.cli.help_text import EXAMPLES
from typer.main import get_command
from typer.testing import CliRunner

COMMANDS = sorted(get_command(app).commands)  # type: ignore[attr-defined]


def _help(*args: str) -> str:
    result = CliRunner().invoke(
        app, list(args), env={"COLUMNS": "240", "TERMINAL_WIDTH": "240"}, prog_name="abada"
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_every_command_has_an_example() -> None:
    assert sorted(EXAMPLES) == COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_a_commands_help_is_its_own(command: str, flag: str) -> None:
    shown = _help(command, flag)
    assert f"Usage: abada {command} " in shown
    assert f"Example:  {EXAMPLES[command]}" in shown
    assert "Exit codes: 0 " in shown


def test_start_help_shows_wait_and_its_exit_codes() -> None:
    shown = _help("start", "--help")
    assert "--wait" in shown and "--business-key" in shown
    assert "3 with --wait: --timeout passed" in shown
    assert "--engine" not in shown  # the connection options are the top-level help's


def test_resolve_help_shows_its_resolutions() -> None:
    shown = _help("resolve", "-h")
    for flag in ("--retry", "--happened", "--did-not-happen", "--cancel", "--all"):
        assert flag in shown


def test_help_needs_no_connection_settings() -> None:
    shown = _help("--token-file", "/nonexistent/token", "incidents", "--help")
    assert "Usage: abada incidents " in shown
    shown = _help("journal", "-h", "--token-file", "/nonexistent/token")
    assert "Usage: abada journal " in shown


def test_the_top_level_help_points_at_the_commands_help() -> None:
    shown = _help("-h")
    assert "`abada COMMAND --help` (or -h)" in shown
    assert "2 invalid input" in shown
