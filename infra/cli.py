"""The `astec` command line: a thin root that loads each area's commands lazily."""

from __future__ import annotations

import importlib
import logging
import os

import click

from infra.commands import BENCH_COMMANDS, COMMANDS, SUBCOMMANDS

# The errors a user causes (a bad file, a wrong model directory, services not running, a bad
# setting): every command's are one line `Error: ...` that names the file or field, exit 1. They
# are matched by name along the exception's classes, so nothing is imported to recognise them.
USER_ERRORS = frozenset(
    {
        "engine.formats.FormatError",
        "engine.manifest.ManifestError",  # PredictorError too
        "engine.model_paths.ModelPathError",
        "engine.astec.io.ModelDirError",
        "engine.astec.config.ConfigError",
        "engine.clicklog.ClickLogError",
        "engine.debian_packages.CatalogueError",
        "engine.export.ExportError",
        "engine.registry.RegistryError",
        "engine.retrain.RetrainError",
        "simulator.world.WorldFormatError",
        "personalization.state.StateFormatError",
        "personalization.artifact.PolicyFileError",
        "personalization.evaluate.OverlapError",
        "stream.settings.ConfigError",  # PolicyMismatch too
        "stream.topics.KafkaUnavailable",
        "infra.services.ServiceError",
        "dashboard.sources.SourceError",
        "dashboard.models.ModelsError",
    }
)
# a missing or unreadable path the user gave: the message names it
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def user_error(exc: BaseException) -> str | None:
    """The one line to show for a user's error, or None for anything else (a bug: traceback)."""
    if isinstance(exc, PATH_ERRORS) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
    if names & USER_ERRORS:
        return str(exc) or type(exc).__name__
    return None


class LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def invoke(self, ctx):
        """Run the command; a user's error (USER_ERRORS) is one line, not a traceback
        (ASTEC_TRACEBACK=1 shows the traceback)."""
        try:
            return super().invoke(ctx)
        except Exception as exc:
            line = None if os.environ.get("ASTEC_TRACEBACK") else user_error(exc)
            if line is None or isinstance(exc, click.ClickException):
                raise
            raise click.ClickException(line) from exc

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
    "torch": "train",
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
