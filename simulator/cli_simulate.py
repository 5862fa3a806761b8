"""`astec simulate world|logs`: build a synthetic (or dataset-backed) world, simulate its logs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

SCENARIO_HELP = (
    "Scenario of the traffic's structure: a shipped name (default, transitions, fatigue, "
    "page-first, drifting-interests, short-memory, ...) or a .toml/.json file (docs/formats.md)."
)


def scenario_option(help_tail: str = ""):
    """--scenario, shared by every command that simulates traffic."""
    return click.option("--scenario", default=None, help=SCENARIO_HELP + help_tail)


def resolve_scenario(spec, world_dir=None):
    """The scenario named by --scenario, else the one the world records, else the default; a
    bad file is a usage error naming the field."""
    from simulator.scenario import ScenarioError, load_scenario, world_scenario

    try:
        if spec is None and world_dir is not None:
            return world_scenario(world_dir)
        return load_scenario(spec)
    except ScenarioError as e:
        raise click.BadParameter(str(e), param_hint="--scenario") from None


@click.group()
def simulate() -> None:
    """Traffic simulator: a world of queries/pages/users, then click logs on it."""


@simulate.command("world")
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    help="World directory to write.",
)
@click.option(
    "--queries",
    type=click.IntRange(10, None),
    default=50_000,
    show_default=True,
    help="Size of the query catalogue.",
)
@click.option(
    "--pages",
    type=click.IntRange(10, None),
    default=100_000,
    show_default=True,
    help="Number of web pages.",
)
@click.option(
    "--users",
    type=click.IntRange(1, None),
    default=10_000,
    show_default=True,
    help="Number of users.",
)
@click.option(
    "--seed", default=0, show_default=True, help="Random seed (the world is deterministic in it)."
)
@click.option(
    "--topics",
    default=None,
    type=click.IntRange(1, None),
    help="Number of topics (default: sqrt(queries)/10).",
)
@click.option("--subtopics-per-topic", type=click.IntRange(1, None), default=8, show_default=True)
@click.option(
    "--from-dataset",
    "dataset",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Build on a TSV data set (train.tsv/test.tsv/labels.txt): pages = points, "
    "queries = label names, topics from label co-occurrence. --queries/--pages are ignored.",
)
@scenario_option(" Recorded in world.json: the traffic simulated on this world follows it.")
def world_cmd(out, queries, pages, users, seed, topics, subtopics_per_topic, dataset, scenario):
    """Write a world: queries.tsv, pages.jsonl, subtopics.tsv, users.jsonl, truth/."""
    from simulator.world import generate_world, save_world, world_from_dataset

    sc = resolve_scenario(scenario) if scenario is not None else None
    t0 = time.perf_counter()
    if dataset:
        w = world_from_dataset(
            dataset,
            n_users=users,
            seed=seed,
            n_topics=topics,
            subtopics_per_topic=subtopics_per_topic,
        )
    else:
        w = generate_world(
            queries,
            pages,
            users,
            seed=seed,
            n_topics=topics,
            subtopics_per_topic=subtopics_per_topic,
        )
    if sc is not None:
        w.meta["scenario"] = sc.to_dict()
    save_world(w, out)
    click.echo(
        f"world: {w.n_queries} queries, {w.n_pages} pages, {len(w.link_query)} links, "
        f"{w.n_subtopics} subtopics, {w.n_users} users -> {out} "
        f"({time.perf_counter() - t0:.1f}s)"
    )


@simulate.command("logs")
@click.option("--world", "world_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--out", "out", required=True, type=click.Path(file_okay=False), help="Log directory to create."
)
@click.option("--days", type=click.IntRange(1, None), default=3, show_default=True)
@click.option(
    "--start", default="2026-01-05", show_default=True, help="First UTC day (YYYY-MM-DD)."
)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--search-clicks-per-day",
    default=None,
    type=click.IntRange(0, None),
    help="Default: 5 x pages.",
)
@click.option(
    "--epsilon",
    type=click.FloatRange(0.0, 1.0),
    default=0.3,
    show_default=True,
    help="Exploration of the logging policy.",
)
@click.option(
    "--history",
    type=click.IntRange(1, None),
    default=5,
    show_default=True,
    help="Session pages whose queries are ad candidates.",
)
@click.option(
    "--persist",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="P(a session continues the intent the user's previous session ended on) "
    "[default: the scenario's, 0.7 in the default scenario].",
)
@click.option(
    "--drift",
    type=click.FloatRange(0.0, 1.0),
    default=None,
    help="P(the intent is redrawn at each view after a session's first) "
    "[default: the scenario's, 0.05 in the default scenario].",
)
@scenario_option(" Default: the world's (world.json), else the default scenario.")
def logs_cmd(
    world_dir,
    out,
    days,
    start,
    seed,
    search_clicks_per_day,
    epsilon,
    history,
    persist,
    drift,
    scenario,
):
    """Simulate search clicks, browsing sessions and ad impressions/clicks into LOG_DIR."""
    from simulator.traffic import LogSettings, simulate_logs, with_scenario
    from simulator.world import load_world

    sc = resolve_scenario(scenario, world_dir)
    w = load_world(world_dir)
    s = LogSettings(
        days=days,
        start=start,
        seed=seed,
        search_clicks_per_day=search_clicks_per_day,
        epsilon=epsilon,
        history=history,
    )
    s = with_scenario(s, sc)
    if persist is not None or drift is not None:
        s = with_scenario(s, sc.with_chain(persist, drift))
    summary = simulate_logs(w, out, s, world_dir=str(Path(world_dir).resolve()))
    click.echo(
        json.dumps(
            {"counts": summary["counts"], "ctr": summary["ctr"], "seconds": summary["seconds"]}
        )
    )
