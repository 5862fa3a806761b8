"""Scenarios: the generative structure of simulated traffic, read from a TOML or JSON file.

A scenario says how users browse and click (session shape, the intent process, the click model,
the catalogue over time); a world says what exists (queries, pages, users). Every field has the
default of the simulator's original traffic, so the empty scenario (`default`) reproduces its
logs byte for byte, and a scenario file states only what it changes. Validation names the file
and the field (`fatigue.toml: click.fatigue.factor: must be in (0, 1], got 1.5`).

Named scenarios ship in simulator/scenarios/*.toml; `--scenario NAME` finds them there, any
other value is read as a path. The scenario a run used is recorded in its simulation.json
(`scenario`), so whoever judges the logs reads it from there.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

SCENARIO_DIR = Path(__file__).with_name("scenarios")


class ScenarioError(ValueError):
    """A scenario that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class SessionShape:
    """Views per session: 1 + Geometric with mean `mean_views` (capped at `max_views`). Gaps
    inside a session: min_gap_s + Exp(mean_gap_s), except that with probability pause_share a
    gap is a pause of pause_min_s + Exp(pause_mean_s) (pauses beyond 30 minutes split a
    session for a reader that cuts at 30 minutes). Session starts: uniform over the days,
    except that with probability follow_share a user's session starts follow_gap_s +
    Exp(follow_gap_mean_s) after the end of their previous one (sessions minutes apart)."""

    mean_views: float = 6.0
    max_views: int = 60
    min_gap_s: float = 3.0
    mean_gap_s: float = 40.0
    pause_share: float = 0.0
    pause_min_s: float = 1800.0
    pause_mean_s: float = 3600.0
    follow_share: float = 0.0
    follow_gap_s: float = 60.0
    follow_gap_mean_s: float = 300.0


@dataclass(frozen=True)
class Transitions:
    """A sub-topic transition kernel P(s' | s): every sub-topic leads to len(weights) others
    (drawn once per world with `seed`, inside its topic when scope = "topic", anywhere when
    "any"), the j-th with probability weights[j]. With probability `share`, an intent redraw
    (a drift inside a session, or a session that does not persist) follows the kernel from the
    current intent instead of drawing afresh from the user's interests."""

    share: float = 0.0
    weights: tuple[float, ...] = (0.7, 0.3)
    scope: str = "topic"
    seed: int = 0


@dataclass(frozen=True)
class IntentProcess:
    """on_intent: P(a view's page is of the view's intent); persist: P(a session continues the
    intent the user's previous one ended on); drift: P(the intent is redrawn at a later view).
    Off-intent pages come from the whole web by popularity (off_intent = "global") or from the
    user's own background mix of `background_subtopics` sub-topics ("background").
    interest_change: P(per user and day) that one of the user's interests is replaced by
    another sub-topic (interests drifting over days)."""

    on_intent: float = 0.7
    persist: float = 0.7
    drift: float = 0.05
    transitions: Transitions = field(default_factory=Transitions)
    off_intent: str = "global"
    background_subtopics: int = 3
    interest_change: float = 0.0


@dataclass(frozen=True)
class Fatigue:
    """A query shown again within the user's last `window` impressions is clicked with its
    probability times `factor` (window 0: no fatigue)."""

    window: int = 0
    factor: float = 1.0


@dataclass(frozen=True)
class ClickModel:
    """p = base + intent * rel(q, intent) + page * rel(q, page) + pop * head(q), clipped to
    [0, 1], then times the fatigue factor (simulator.clickmodel)."""

    base: float = 0.005
    intent: float = 0.10
    intent_same_topic: float = 0.3
    page: float = 0.03
    page_same_subtopic: float = 0.3
    pop: float = 0.02
    fatigue: Fatigue = field(default_factory=Fatigue)


@dataclass(frozen=True)
class Catalogue:
    """popularity_drift: standard deviation per day of a log-normal random walk of every page's
    popularity from the run's first day (0: fixed). new_share: share of the pages that do not
    exist before the UTC date new_from (YYYY-MM-DD), with the queries only they link to: new
    inventory that an engine trained on logs of earlier days does not know. A date, not a day
    of the run, so every run on the world (bootstrap logs, closed loop) agrees on it."""

    popularity_drift: float = 0.0
    new_share: float = 0.0
    new_from: str = ""
    seed: int = 0


@dataclass(frozen=True)
class Scenario:
    name: str = "default"
    description: str = ""
    sessions: SessionShape = field(default_factory=SessionShape)
    intent: IntentProcess = field(default_factory=IntentProcess)
    click: ClickModel = field(default_factory=ClickModel)
    catalogue: Catalogue = field(default_factory=Catalogue)

    def to_dict(self) -> dict:
        return asdict(self)

    def with_chain(self, persist: float | None, drift: float | None) -> Scenario:
        """This scenario with its intent chain's persist / drift overridden where given."""
        ip = replace(
            self.intent,
            persist=self.intent.persist if persist is None else persist,
            drift=self.intent.drift if drift is None else drift,
        )
        return replace(self, intent=ip)


DEFAULT = Scenario()


def _unit(v: float) -> bool:
    return 0.0 <= v <= 1.0


def _is_date(v: str) -> bool:
    try:
        datetime.strptime(v, "%Y-%m-%d")
    except ValueError:
        return False
    return True


# field -> (check, what it must be); a value is checked after its type
_RULES: dict[str, tuple[Any, str]] = {
    "sessions.mean_views": (lambda v: v > 1.0, "must be > 1"),
    "sessions.max_views": (lambda v: v >= 1, "must be >= 1"),
    "sessions.min_gap_s": (lambda v: v >= 0, "must be >= 0"),
    "sessions.mean_gap_s": (lambda v: v > 0, "must be > 0"),
    "sessions.pause_share": (_unit, "must be in [0, 1]"),
    "sessions.pause_min_s": (lambda v: v >= 0, "must be >= 0"),
    "sessions.pause_mean_s": (lambda v: v > 0, "must be > 0"),
    "sessions.follow_share": (_unit, "must be in [0, 1]"),
    "sessions.follow_gap_s": (lambda v: v >= 0, "must be >= 0"),
    "sessions.follow_gap_mean_s": (lambda v: v > 0, "must be > 0"),
    "intent.on_intent": (_unit, "must be in [0, 1]"),
    "intent.persist": (_unit, "must be in [0, 1]"),
    "intent.drift": (_unit, "must be in [0, 1]"),
    "intent.transitions.share": (_unit, "must be in [0, 1]"),
    "intent.transitions.weights": (
        lambda v: len(v) >= 1 and all(w > 0 for w in v) and abs(sum(v) - 1.0) < 1e-6,
        "must be positive and sum to 1",
    ),
    "intent.transitions.scope": (lambda v: v in ("topic", "any"), 'must be "topic" or "any"'),
    "intent.off_intent": (
        lambda v: v in ("global", "background"),
        'must be "global" or "background"',
    ),
    "intent.background_subtopics": (lambda v: v >= 1, "must be >= 1"),
    "intent.interest_change": (_unit, "must be in [0, 1]"),
    "click.base": (_unit, "must be in [0, 1]"),
    "click.intent": (lambda v: v >= 0, "must be >= 0"),
    "click.intent_same_topic": (_unit, "must be in [0, 1]"),
    "click.page": (lambda v: v >= 0, "must be >= 0"),
    "click.page_same_subtopic": (_unit, "must be in [0, 1]"),
    "click.pop": (lambda v: v >= 0, "must be >= 0"),
    "click.fatigue.window": (lambda v: v >= 0, "must be >= 0"),
    "click.fatigue.factor": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    "catalogue.popularity_drift": (lambda v: 0.0 <= v <= 2.0, "must be in [0, 2]"),
    "catalogue.new_share": (lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
    "catalogue.new_from": (lambda v: v == "" or _is_date(v), "must be a date YYYY-MM-DD"),
}


def _build(cls, data: Any, where: str, src: str):
    """An instance of dataclass `cls` from a mapping, type-checked field by field."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{src}: {where or 'the file'}: expected a table, got {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        at = f"{where}." if where else ""
        raise ScenarioError(
            f"{src}: {at}{unknown[0]}: unknown field (known: {', '.join(sorted(known))})"
        )
    kw = {}
    defaults = cls()
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        default = getattr(defaults, name)
        if is_dataclass(default):
            kw[name] = _build(type(default), value, path, src)
            continue
        kw[name] = _coerce(value, default, path, src)
        rule = _RULES.get(path)
        if rule is not None and not rule[0](kw[name]):
            raise ScenarioError(f"{src}: {path}: {rule[1]}, got {value!r}")
    return cls(**kw)


def _coerce(value: Any, default: Any, path: str, src: str) -> Any:
    """`value` as the type of `default` (an int is a float where a float is expected)."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok = isinstance(value, str)
    elif isinstance(default, tuple):
        ok = isinstance(value, list | tuple) and all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in value
        )
        value = tuple(float(x) for x in value) if ok else value
    else:  # pragma: no cover - every field has one of the types above
        ok = True
    if not ok:
        kind = "a list of numbers" if isinstance(default, tuple) else type(default).__name__
        raise ScenarioError(f"{src}: {path}: expected {kind}, got {value!r}")
    return value


def scenario_from_dict(data: dict, src: str = "scenario") -> Scenario:
    """A validated Scenario from its mapping (missing fields keep their defaults)."""
    sc = _build(Scenario, data, "", src)
    if not sc.name:
        raise ScenarioError(f"{src}: name: must not be empty")
    if sc.catalogue.new_share > 0 and not sc.catalogue.new_from:
        raise ScenarioError(f"{src}: catalogue.new_from: required when new_share > 0")
    return sc


def scenario_names() -> list[str]:
    """The shipped scenarios (simulator/scenarios/*.toml)."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def load_scenario(spec: str | Path | None) -> Scenario:
    """A shipped scenario by name, or a .toml / .json file by path (None: the default)."""
    if spec is None:
        return DEFAULT
    path = Path(spec)
    if not path.is_file() and (SCENARIO_DIR / f"{spec}.toml").is_file():
        path = SCENARIO_DIR / f"{spec}.toml"
    if not path.is_file():
        raise ScenarioError(
            f"{spec}: no such scenario file or shipped scenario "
            f"(shipped: {', '.join(scenario_names())})"
        )
    raw = path.read_bytes()
    try:
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ScenarioError(f"{path.name}: not valid {path.suffix[1:] or 'toml'}: {e}") from e
    data = dict(data)
    data.setdefault("name", path.stem)
    return scenario_from_dict(data, path.name)


def recorded_scenario(sim: dict) -> Scenario:
    """The scenario a simulation.json records (logs written before scenarios: the default)."""
    raw = sim.get("scenario")
    return DEFAULT if raw is None else scenario_from_dict(raw, "simulation.json: scenario")


def world_scenario(world_dir: str | Path) -> Scenario:
    """The scenario a world directory records in world.json (`astec simulate world
    --scenario`), else the default."""
    meta = Path(world_dir) / "world.json"
    raw = json.loads(meta.read_text()).get("scenario") if meta.is_file() else None
    return DEFAULT if raw is None else scenario_from_dict(raw, f"{meta}: scenario")
