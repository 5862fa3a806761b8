"""The `astec` root command: help text lists every registered command and each one imports."""

from click.testing import CliRunner

from infra.cli import cli
from infra.commands import BENCH_COMMANDS, COMMANDS


def test_root_help_lists_registered_commands():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0, result.output
    for name in COMMANDS:
        assert name in result.output
    assert "bench" in result.output


def test_every_registered_command_has_help():
    runner = CliRunner()
    for name in COMMANDS:
        result = runner.invoke(cli, [name, "--help"])
        assert result.exit_code == 0, (name, result.output, result.exception)
    for name in BENCH_COMMANDS:
        result = runner.invoke(cli, ["bench", name, "--help"])
        assert result.exit_code == 0, (name, result.output, result.exception)
