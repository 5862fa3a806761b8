"""Bad numbers and bad ids on the command line: one line that names the option, or the file and
line, never a traceback (reproductions from trying the CLI as a new user would)."""

import pytest
from click.testing import CliRunner

from infra.cli import cli


@pytest.mark.parametrize(
    "args, option",
    [
        (["simulate", "world", "--out", "W", "--queries", "0"], "--queries"),
        (["simulate", "world", "--out", "W", "--users", "0"], "--users"),
        (["evaluate", "--A", "-1", "--test", "T", "--pred", "P"], "--A"),
        (["stream", "simulate", "--world", ".", "--rate", "-5"], "--rate"),
        (["stream", "simulate", "--world", ".", "--duration", "0"], "--duration"),
        (["demo", "--pages", "0"], "--pages"),
        # the demo passes these on to `stream simulate`: one declaration (stream.traffic_options)
        (["demo", "--rate", "0"], "--rate"),
        (["demo", "--duration", "0"], "--duration"),
        (["demo", "--warmup", "-1"], "--warmup"),
    ],
)
def test_out_of_range_numbers_are_refused_by_name(args, option, tmp_path):
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and f"Invalid value for '{option}'" in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_simulated_logs_need_a_day(tmp_path):
    res = CliRunner().invoke(
        cli, ["simulate", "logs", "--world", str(tmp_path), "--out", "L", "--days", "0"]
    )
    assert res.exit_code == 2 and "Invalid value for '--days'" in res.output


def test_a_label_id_beyond_the_names_is_named_by_file_and_line(tmp_path):
    names = tmp_path / "labels.txt"
    names.write_text("a\nb\nc\n")
    test = tmp_path / "test.tsv"
    test.write_text("first title\t0,1\nsecond title\t2,7\n")
    res = CliRunner().invoke(
        cli, ["evaluate", "--test", str(test), "--labels", str(names), "--pred", str(test)]
    )
    assert res.exit_code == 1
    assert f"{test}:2: label id 7, but {names} names 3 labels (ids 0..2)" in res.output
