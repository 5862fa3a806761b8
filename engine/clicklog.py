"""Durable click logs: JSON-lines schemas, a date-partitioned append-only writer, a validating
reader.

Layout: LOG_DIR/<kind>/<YYYY-MM-DD>/part-<writer>.jsonl, one JSON object a line, the date being the
UTC date of the record's `ts` (seconds since the epoch). Each writer process appends to its own part
file, so concurrent writers never interleave bytes. Logs hold users' behaviour: the writer creates
directories 0700 and part files 0600 whatever the umask. The reader streams partitions in date
order, merging parts by `ts`, and reports and skips corrupt lines (bad JSON, missing or mistyped
fields, a torn last line) with counts and file:line examples: one bad line never aborts a retrain,
and none is dropped silently. `ad_outcomes` reads each impression once (an at-least-once producer
can log one twice), so training never counts an impression twice.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from engine.private_dirs import private_dir

log = logging.getLogger(__name__)

_STR, _NUM, _BOOL, _LIST = "str", "number", "bool", "list[str]"

# kind -> {field: (type, required)}. Extra fields are allowed (forward compatible).
SCHEMAS: dict[str, dict[str, tuple[str, bool]]] = {
    # A search-engine click: someone searched `query` and clicked the page `url` titled `title`.
    "search_clicks": {
        "query": (_STR, True),
        "url": (_STR, True),
        "title": (_STR, True),
        "ts": (_NUM, True),
        "user_id": (_STR, False),
    },
    # A page view of a browsing session (the stream's page-views topic).
    "page_views": {
        "event_id": (_STR, True),
        "user_id": (_STR, True),
        "ts": (_NUM, True),
        "url": (_STR, True),
        "title": (_STR, True),
        "session_id": (_STR, False),
    },
    # One query shown to a user (an ad impression); `candidates` are the queries it was chosen
    # from, `propensity` the probability the logging policy gave to the shown query.
    "ad_impressions": {
        "event_id": (_STR, True),
        "user_id": (_STR, True),
        "ts": (_NUM, True),
        "query": (_STR, True),
        "candidates": (_LIST, True),
        "url": (_STR, False),
        "title": (_STR, False),
        "score": (_NUM, False),
        "propensity": (_NUM, False),
        "policy": (_STR, False),
        "model_version": (_STR, False),
        "session_id": (_STR, False),
    },
    # The outcome of an impression, keyed by the impression's event_id (the ad-clicks topic).
    "ad_clicks": {
        "event_id": (_STR, True),
        "user_id": (_STR, True),
        "query": (_STR, True),
        "clicked": (_BOOL, True),
        "ts": (_NUM, True),
    },
}
NON_EMPTY = {"query", "url", "event_id", "user_id"}
TS_MAX = 1e10  # seconds since the epoch: year 2286; beyond is a unit mistake (ms, us)
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class ClickLogError(ValueError):
    """A record that does not match its schema (the message says which field and why)."""


def validate(kind: str, rec: Any) -> dict:
    """Return `rec` if it matches SCHEMAS[kind], else raise ClickLogError naming the field."""
    try:
        schema = SCHEMAS[kind]
    except KeyError:
        raise ClickLogError(
            f"unknown log kind {kind!r}; expected one of {sorted(SCHEMAS)}"
        ) from None
    if not isinstance(rec, dict):
        raise ClickLogError(f"expected a JSON object, got {type(rec).__name__}")
    for name, (typ, required) in schema.items():
        if name not in rec or rec[name] is None:
            if required:
                raise ClickLogError(f"missing field {name!r}")
            continue
        v = rec[name]
        if typ == _STR:
            if not isinstance(v, str):
                raise ClickLogError(f"field {name!r} must be a string, got {type(v).__name__}")
            if name in NON_EMPTY and not v.strip():
                raise ClickLogError(f"field {name!r} is empty")
        elif typ == _NUM:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ClickLogError(f"field {name!r} must be a finite number, got {v!r}")
            if name == "ts" and not 0 < v < TS_MAX:
                raise ClickLogError(f"field 'ts' must be seconds since the epoch, got {v!r}")
            if name == "propensity" and not 0 < v <= 1:
                raise ClickLogError(f"field 'propensity' must be in (0, 1], got {v!r}")
        elif typ == _BOOL:
            if not isinstance(v, bool):
                raise ClickLogError(f"field {name!r} must be true/false, got {v!r}")
        elif typ == _LIST and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
            raise ClickLogError(f"field {name!r} must be a list of strings")
    return rec


def partition_of(ts: float) -> str:
    """The UTC date a record with timestamp `ts` is stored under."""
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


def encode_record(kind: str, rec: Any, check: bool = True) -> tuple[str, bytes]:
    """(date partition, JSON line) of a record; anything wrong with the record itself (schema,
    text that is not UTF-8, a value JSON cannot hold) raises ClickLogError saying what."""
    if check:
        validate(kind, rec)
    try:
        line = json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ClickLogError(f"a field holds a lone surrogate: {e.reason} at {e.start}") from None
    except (TypeError, ValueError) as e:
        raise ClickLogError(f"not representable as JSON: {e}") from None
    return partition_of(rec["ts"]), line + b"\n"


class ClickLogWriter:
    """Appends validated records of one kind to LOG_DIR/<kind>/<date>/part-<writer_id>.jsonl
    (directories 0700, files 0600, readable by their owner only)."""

    def __init__(
        self,
        log_dir: str | Path,
        kind: str,
        writer_id: str = "0",
        fsync: bool = False,
        validate_records: bool = True,
    ):
        if kind not in SCHEMAS:
            raise ClickLogError(f"unknown log kind {kind!r}; expected one of {sorted(SCHEMAS)}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", writer_id):
            raise ValueError(f"writer_id {writer_id!r}: use letters, digits, '_', '-', '.'")
        self.log_dir = Path(log_dir)
        self.root = self.log_dir / kind
        self.kind, self.writer_id = kind, writer_id
        self.fsync, self.validate_records = fsync, validate_records
        self._date: str | None = None
        self._f: BinaryIO | None = None
        self.written = 0

    def _open(self, date: str) -> BinaryIO:
        if self._date == date and self._f is not None:
            return self._f
        self.close()
        path = self.root / date / f"part-{self.writer_id}.jsonl"
        private_dir(path.parent, self.log_dir)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        f = os.fdopen(fd, "ab")
        # A writer killed mid-line leaves a torn tail: end it so the next record starts clean
        # (the reader then reports the torn line once instead of losing the next record too).
        if f.tell() > 0:
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    f.write(b"\n")
        self._f, self._date = f, date
        return f

    def write(self, rec: dict) -> None:
        self.write_many([rec])

    def encode(self, rec: Any) -> tuple[str, bytes]:
        """(date, line) of one record of this writer's kind, or ClickLogError (encode_record)."""
        return encode_record(self.kind, rec, self.validate_records)

    def write_many(self, recs: Iterable[dict]) -> int:
        """Append records (any order of dates); one write per date run, flushed before return.
        A bad record raises ClickLogError before anything of the call is written."""
        return self.write_encoded([self.encode(r) for r in recs])

    def write_encoded(self, lines: Iterable[tuple[str, bytes]]) -> int:
        """Append (date, line) pairs from `encode`; one write per date run, flushed (and fsynced
        when asked) before return."""
        buf: list[bytes] = []
        date = ""
        n = 0
        for d, line in lines:
            if d != date and buf:
                self._open(date).write(b"".join(buf))
                buf = []
            date = d
            buf.append(line)
            n += 1
        if buf:
            self._open(date).write(b"".join(buf))
        self.flush()
        self.written += n
        return n

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self.flush()
            self._f.close()
        self._f, self._date = None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class ReadReport:
    """What a read saw: every line is either a record or a counted, explained corrupt line."""

    kind: str
    files: int = 0
    lines: int = 0
    records: int = 0
    corrupt: int = 0
    duplicates: int = 0  # records skipped by ad_outcomes: an event id read before
    reasons: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    max_examples: int = 20

    def add_corrupt(self, where: str, reason: str) -> None:
        self.corrupt += 1
        self.reasons[reason.split(":")[0]] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{where}: {reason}")
            log.warning("skipping corrupt line %s: %s", where, reason)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "files": self.files,
            "lines": self.lines,
            "records": self.records,
            "corrupt": self.corrupt,
            "duplicates": self.duplicates,
            "reasons": dict(self.reasons),
            "examples": list(self.examples),
        }

    def summary(self) -> str:
        s = (
            f"{self.kind}: {self.records} records from {self.files} files, "
            f"{self.corrupt} corrupt lines skipped"
        )
        if self.corrupt:
            s += " (" + ", ".join(f"{k}: {v}" for k, v in self.reasons.most_common()) + ")"
        if self.duplicates:
            s += f", {self.duplicates} duplicate event ids skipped"
        return s


def partitions(log_dir: str | Path, kind: str) -> list[str]:
    """Dates stored for `kind`, oldest first."""
    root = Path(log_dir) / kind
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and _DATE_RE.match(d.name))


def _read_part(path: Path, kind: str, date: str, report: ReadReport) -> Iterator[dict]:
    report.files += 1
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            report.lines += 1
            where = f"{path}:{lineno}"
            if not raw.endswith(b"\n"):
                report.add_corrupt(
                    where, "torn line: no newline at end of file (writer died mid-write?)"
                )
                continue
            if not raw.strip():
                report.add_corrupt(where, "empty line")
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                report.add_corrupt(where, f"invalid JSON: {e}")
                continue
            try:
                validate(kind, rec)
            except ClickLogError as e:
                report.add_corrupt(where, f"schema: {e}")
                continue
            if partition_of(rec["ts"]) != date:
                report.add_corrupt(
                    where, f"wrong partition: ts {rec['ts']} is {partition_of(rec['ts'])}"
                )
                continue
            report.records += 1
            yield rec


def read_log(
    log_dir: str | Path,
    kind: str,
    report: ReadReport | None = None,
    since: str | None = None,
    until: str | None = None,
) -> Iterator[dict]:
    """Stream valid records of `kind` in time order (dates `since`..`until` inclusive, UTC).

    Corrupt lines are skipped and counted in `report` (pass one in to read the counts).
    """
    if kind not in SCHEMAS:
        raise ClickLogError(f"unknown log kind {kind!r}; expected one of {sorted(SCHEMAS)}")
    report = report if report is not None else ReadReport(kind)
    for date in partitions(log_dir, kind):
        if (since and date < since) or (until and date > until):
            continue
        parts = sorted((Path(log_dir) / kind / date).glob("part-*.jsonl"))
        streams = [_read_part(p, kind, date, report) for p in parts]
        if len(streams) == 1:
            yield from streams[0]
        else:
            yield from heapq.merge(*streams, key=lambda r: r["ts"])


def ad_outcomes(
    log_dir: str | Path, reports: dict[str, ReadReport] | None = None
) -> Iterator[dict]:
    """Ad impressions in time order, each once, with `clicked` joined from ad_clicks by event_id.

    An impression logged twice (an ad query repeated by an at-least-once worker, or a click
    logger killed between its write and its dedupe record) is yielded once: the first in time
    order wins and the others are counted in reports["ad_impressions"].duplicates."""
    reports = reports if reports is not None else {}
    reports.setdefault("ad_clicks", ReadReport("ad_clicks"))
    reports.setdefault("ad_impressions", ReadReport("ad_impressions"))
    clicked = {
        r["event_id"] for r in read_log(log_dir, "ad_clicks", reports["ad_clicks"]) if r["clicked"]
    }
    rep = reports["ad_impressions"]
    seen: set[str] = set()
    for rec in read_log(log_dir, "ad_impressions", rep):
        eid = rec["event_id"]
        if eid in seen:
            rep.duplicates += 1
            continue
        seen.add(eid)
        yield {**rec, "clicked": eid in clicked}
