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


def test_a_users_error_is_one_line_for_every_command(tmp_path):
    """`astec bench predict --input EMPTY.tsv` ended in a FormatError traceback: the root turns
    the project's user errors (a bad file, not a model, ...) into `Error: ...` for any command."""
    from engine.formats import FormatError
    from infra.cli import user_error

    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    res = CliRunner().invoke(
        cli, ["bench", "predict", "--predictor", str(tmp_path), "--input", str(empty)]
    )
    assert res.exit_code == 1, (res.output, res.exception)
    assert "Traceback" not in res.output and res.output.startswith("Error: ")
    assert res.output.count("\n") == 1 and str(tmp_path) in res.output
    assert user_error(FormatError(empty, 3, "bad label")) is not None
    assert user_error(FileNotFoundError(2, "No such file or directory", "x.tsv")) == (
        "x.tsv: No such file or directory"
    )
    assert user_error(KeyError("a bug")) is None  # anything else keeps its traceback
