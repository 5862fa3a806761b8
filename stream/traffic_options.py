"""The live-traffic options (--rate, --duration, --warmup) of `astec stream simulate`, declared
once: `astec demo` passes them on to it and takes them with its own defaults, so the ranges and
help cannot drift apart. `scenario_options` adds the traffic's structure (--scenario, the
simulator's own option) and the model whose vocabulary tells a page without an ad by design
(--model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def traffic_options(
    rate: float, duration: float, warmup: float
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding --rate, --duration and --warmup with these defaults."""
    options = [
        click.option(
            "--rate",
            type=click.FloatRange(min=0, min_open=True),
            default=rate,
            show_default=True,
            help="Page views per second.",
        ),
        click.option(
            "--duration",
            type=click.FloatRange(min=0, min_open=True),
            default=duration,
            show_default=True,
            help="Seconds of measured traffic.",
        ),
        click.option(
            "--warmup",
            type=click.FloatRange(min=0),
            default=warmup,
            show_default=True,
            help="Seconds of traffic before the measured part (kernel compilation, first "
            "fetches, the group settling); their latency is reported apart (warmup_e2a_ms_*).",
        ),
    ]

    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


def scenario_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator adding --scenario (simulator.cli_simulate's) and --model."""
    from simulator.cli_simulate import scenario_option

    f = click.option(
        "--model",
        "known_model",
        default=None,
        type=click.Path(exists=True, file_okay=False),
        help="The engine the workers serve (registry root or predictor directory): a page "
        "whose title holds no word it knows gets no ad by design, reported as no_ad rather "
        "than unanswered.",
    )(f)
    return scenario_option(" Default: the world's (world.json), else the default scenario.")(f)
