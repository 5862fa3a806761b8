"""The `astec` command line: a thin root that loads each area's commands lazily."""

from __future__ import annotations

import importlib
import logging
import os

import click

from infra.commands import BENCH_COMMANDS, COMMANDS, SUBCOMMANDS


class LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy:
            cmd = _load(self.lazy[name])
            for sub, target in SUBCOMMANDS.get(name, {}).items():
                if isinstance(cmd, click.Group) and sub not in cmd.commands:
                    cmd.add_command(_load(target), sub)
            return cmd
        return super().get_command(ctx, name)


def _load(target: str):
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


@click.group(
    cls=LazyGroup,
    lazy=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """Astec: extreme multi-label query prediction for streaming personalized ads.

    Train the Astec engine from click logs or benchmark files, evaluate it, export a fast CPU
    predictor, run the Kafka/Redis stream, train the GRU personalization and run the demo.
    Every command has --help.
    """
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(
        level=int(os.environ.get("ASTEC_LOG_LEVEL", level)),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@cli.group(cls=LazyGroup, lazy=BENCH_COMMANDS)
def bench() -> None:
    """Benchmarks that print figures (accuracy, speed, memory) measured side by side."""


# packages of the optional extras (pyproject.toml), and the extra that brings each
EXTRA_OF = {
    "kafka": "stream",
    "confluent_kafka": "stream",
    "redis": "stream",
    "prometheus_client": "stream",
    "streamlit": "dashboard",
}


def main() -> None:
    try:
        cli(prog_name="astec")
    except ModuleNotFoundError as e:  # an engine-only install running a stream/dashboard command
        extra = EXTRA_OF.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        click.echo(
            f"Error: this command needs {e.name}, which an install without the '{extra}' extra "
            f"leaves out: pip install 'astec-ads[{extra}]'",
            err=True,
        )
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
