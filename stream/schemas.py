"""Versioned, validated JSON message schemas of the stream's topics.

Every message is one UTF-8 JSON object with `"v": <schema version>`. Readers accept the versions in
SUPPORTED and ignore unknown extra fields (producers may add fields without a version bump;
removing or retyping a field bumps the version). A message that fails `decode` goes to the dead-
letter topic with the reason and its raw bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
from typing import Any

VERSION = 1
SUPPORTED = {1}

_S, _N, _B, _LS, _LI, _LN = "str", "number", "bool", "list[str]", "list[int]", "list[number]"
# list type -> what each item must be an instance of
_ITEM: dict[str, type | tuple[type, ...]] = {_LS: str, _LI: int, _LN: (int, float)}

# topic kind -> field -> (type, required, max length for strings/lists)
SCHEMAS: dict[str, dict[str, tuple[str, bool, int]]] = {
    "page_view": {
        "event_id": (_S, True, 128),
        "user_id": (_S, True, 128),
        "ts": (_N, True, 0),
        "url": (_S, True, 2048),
        "title": (_S, True, 1024),
        "session_id": (_S, False, 128),
    },
    "ad_query": {
        "event_id": (_S, True, 128),
        "user_id": (_S, True, 128),
        "ts": (_N, True, 0),
        "event_ts": (_N, True, 0),
        "query": (_S, True, 1024),
        "query_id": (_N, True, 0),
        "score": (_N, True, 0),
        "candidates": (_LS, True, 1000),
        "candidate_ids": (_LI, False, 1000),
        "propensity": (_N, False, 0),
        "candidate_scores": (_LN, False, 1000),
        "candidate_propensities": (_LN, False, 1000),
        "explored": (_B, False, 0),
        "policy": (_S, False, 64),
        "model_version": (_S, True, 256),
        "url": (_S, False, 2048),
        "title": (_S, False, 1024),
        "session_id": (_S, False, 128),
        "source_visits_ago": (_N, False, 0),
        "source_event_id": (_S, False, 128),
        "margin": (_N, False, 0),
    },
    "ad_click": {
        "event_id": (_S, True, 128),
        "user_id": (_S, True, 128),
        "query": (_S, True, 1024),
        "clicked": (_B, True, 0),
        "ts": (_N, True, 0),
    },
    "dead_letter": {
        "reason": (_S, True, 4096),
        "source_topic": (_S, True, 256),
        "partition": (_N, True, 0),
        "offset": (_N, True, 0),
        "raw_b64": (_S, True, 0),
        "ts": (_N, True, 0),
        "consumer": (_S, False, 256),
    },
}
_NON_EMPTY = {"event_id", "user_id", "title", "query", "url"}
TS_MAX = 1e10  # seconds since the epoch: year 2286; beyond is a unit mistake (ms, us)


class SchemaError(ValueError):
    """A message that does not match its schema; str() is the dead-letter reason."""


def validate(kind: str, msg: Any) -> dict:
    """Return msg if it is a valid `kind` message, else raise SchemaError naming the field."""
    if not isinstance(msg, dict):
        raise SchemaError(f"expected a JSON object, got {type(msg).__name__}")
    v = msg.get("v")
    if v not in SUPPORTED or isinstance(v, bool):
        raise SchemaError(
            f"field 'v': unsupported schema version {v!r} (supported {sorted(SUPPORTED)})"
        )
    for name, (typ, required, cap) in SCHEMAS[kind].items():
        val = msg.get(name)
        if val is None:
            if required:
                raise SchemaError(f"missing field {name!r}")
            continue
        if typ == _S:
            if not isinstance(val, str):
                raise SchemaError(f"field {name!r} must be a string, got {type(val).__name__}")
            if name in _NON_EMPTY and not val.strip():
                raise SchemaError(f"field {name!r} is empty")
            if cap and len(val) > cap:
                raise SchemaError(f"field {name!r} longer than {cap} characters ({len(val)})")
            try:
                val.encode("utf-8")
            except UnicodeEncodeError as exc:  # a JSON "\ud800" escape: no text has it
                raise SchemaError(
                    f"field {name!r} holds a lone surrogate at character {exc.start}"
                ) from None
        elif typ == _N:
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
                raise SchemaError(f"field {name!r} must be a finite number, got {val!r}")
            if name in ("ts", "event_ts") and not 0 < val < TS_MAX:
                raise SchemaError(f"field {name!r} must be seconds since the epoch, got {val!r}")
        elif typ == _B:
            if not isinstance(val, bool):
                raise SchemaError(f"field {name!r} must be true/false, got {val!r}")
        else:
            item = _ITEM[typ]
            if not isinstance(val, list) or not all(
                isinstance(x, item) and not isinstance(x, bool) for x in val
            ):
                raise SchemaError(f"field {name!r} must be a {typ}")
            if typ == _LN and not all(math.isfinite(x) for x in val):
                raise SchemaError(f"field {name!r} must hold finite numbers")
            if item is str:
                try:
                    "".join(val).encode("utf-8")
                except UnicodeEncodeError:
                    raise SchemaError(f"field {name!r} holds a lone surrogate") from None
            if cap and len(val) > cap:
                raise SchemaError(f"field {name!r} has more than {cap} items")
    return msg


def decode(kind: str, raw: bytes | None, max_bytes: int) -> dict:
    """Bytes from Kafka -> validated message dict; SchemaError says why not."""
    if raw is None:
        raise SchemaError("empty message (null value)")
    if len(raw) > max_bytes:
        raise SchemaError(f"oversized message: {len(raw)} bytes > limit {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(f"not UTF-8: {exc}") from None
    try:
        msg = json.loads(text)
    except ValueError as exc:
        raise SchemaError(f"not JSON: {exc}") from None
    return validate(kind, msg)


def encode(kind: str, msg: dict, check: bool = False) -> bytes:
    """Message dict -> compact UTF-8 JSON with the schema version added."""
    out = {"v": VERSION, **msg}
    if check:
        validate(kind, out)
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


DEAD_LETTER_RAW_MAX = 256 * 1024


def dead_letter(
    raw: bytes | None, reason: str, topic: str, partition: int, offset: int, consumer: str = ""
) -> bytes:
    """The dead-letter message for a rejected record: its raw bytes (base64), cut to the first
    DEAD_LETTER_RAW_MAX with their length and sha256 beside them, so the dead letter always fits
    the producer's message limit; the whole record stays at topic/partition/offset."""
    raw = raw or b""
    msg = {
        "reason": reason[:4096],
        "source_topic": topic,
        "partition": partition,
        "offset": offset,
        "raw_b64": base64.b64encode(raw[:DEAD_LETTER_RAW_MAX]).decode("ascii"),
        "ts": time.time(),
        "consumer": consumer,
    }
    if len(raw) > DEAD_LETTER_RAW_MAX:
        msg.update(
            raw_truncated=True, raw_bytes=len(raw), raw_sha256=hashlib.sha256(raw).hexdigest()
        )
    return encode("dead_letter", msg)


def dead_letter_raw(msg: dict) -> bytes:
    """The original bytes of a dead-letter message."""
    return base64.b64decode(msg["raw_b64"])
