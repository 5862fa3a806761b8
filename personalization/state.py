"""One user visit as the personalization model sees it, with a compact binary encoding.

The stream stores a user's last K of these in Redis (in arrival order) and the GRU reads them
through `serving_window`, which keeps exactly the states training reads at that visit. Binary
layout (little-endian), version 3:

    magic b"US" | u8 version | f64 ts | u64 url_hash | u64 title_hash | u64 space |
    i32 shown | u16 len(event_id) | u16 D | u16 k | event_id utf-8 | z float16[D] |
    query_ids int32[k] | scores float32[k]

z is stored as float16 (a 300-d state is 600 bytes); query ids fit int32 (< 2^31 labels).
`space` tags the engine label space the query ids belong to (`space_tag` of the engine's
fingerprint, engine.manifest.label_space): after an engine whose label ids moved is promoted, the
states written before it name other queries under the same ids. `shown` is the query id of the
ad shown at the visit (-1: none yet, or none): the stream writes the state before its policy
chooses, then rewrites the field in place (SHOWN_OFFSET) once the ad is chosen, and the policy
reads it as training reads the logged impressions (features.shown_recent). Version 2 records
(no `shown`) are still read with shown -1, version 1 (no `space` either) with space 0 (unknown).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"US"
FORMAT_VERSION = 3
_HEAD = struct.Struct("<2sBdQQQiHHH")
_HEAD_V2 = struct.Struct("<2sBdQQQHHH")
_HEAD_V1 = struct.Struct("<2sBdQQHHH")
SHOWN_OFFSET = struct.calcsize("<2sBdQQQ")  # the byte offset of `shown` in a version-3 record


class StateFormatError(ValueError):
    """Bytes that are not a UserState record (the message says what is wrong)."""


def text_hash(text: str) -> int:
    """A stable 64-bit hash of a URL or title (blake2b, identical across processes and hosts)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def space_tag(label_space: str) -> int:
    """The 64-bit tag a state carries for an engine label-space fingerprint (its first 16 hex
    digits; 0 = unknown, for an empty fingerprint)."""
    return int(label_space[:16], 16) if label_space else 0


@dataclass
class UserState:
    """A visit: its event id and time, page hashes, Astec features z and top-k predicted queries."""

    event_id: str
    ts: float
    url_hash: int
    title_hash: int
    z: np.ndarray  # float16[D]
    query_ids: np.ndarray  # int64[k]
    scores: np.ndarray  # float32[k]
    space: int = 0  # space_tag of the engine label space of query_ids (0: unknown)
    shown: int = -1  # query id of the ad shown at this visit (-1: none / not yet chosen)

    def __post_init__(self):
        self.z = np.asarray(self.z, np.float16).reshape(-1)
        self.query_ids = np.asarray(self.query_ids, np.int64).reshape(-1)
        self.scores = np.asarray(self.scores, np.float32).reshape(-1)
        if self.query_ids.shape != self.scores.shape:
            raise StateFormatError(
                f"query_ids {self.query_ids.shape} and scores {self.scores.shape} differ in length"
            )

    @classmethod
    def from_visit(
        cls, event_id: str, ts: float, url: str, title: str, z, query_ids, scores, space: int = 0
    ) -> UserState:
        return cls(
            event_id, float(ts), text_hash(url), text_hash(title), z, query_ids, scores, space
        )

    def encode(self) -> bytes:
        eid = self.event_id.encode("utf-8")
        if len(eid) > 0xFFFF or self.z.size > 0xFFFF or self.query_ids.size > 0xFFFF:
            raise StateFormatError("event_id, z or query list too long for the record format")
        head = _HEAD.pack(
            MAGIC,
            FORMAT_VERSION,
            self.ts,
            self.url_hash,
            self.title_hash,
            self.space,
            self.shown,
            len(eid),
            self.z.size,
            self.query_ids.size,
        )
        return b"".join(
            (
                head,
                eid,
                self.z.astype("<f2").tobytes(),
                self.query_ids.astype("<i4").tobytes(),
                self.scores.astype("<f4").tobytes(),
            )
        )

    @classmethod
    def decode(cls, raw: bytes) -> UserState:
        ver = raw[2] if len(raw) > 2 else -1
        head = {1: _HEAD_V1, 2: _HEAD_V2}.get(ver, _HEAD)
        if len(raw) < head.size:
            raise StateFormatError(f"record of {len(raw)} bytes is shorter than its header")
        if raw[:2] != MAGIC or ver not in (1, 2, FORMAT_VERSION):
            raise StateFormatError(f"bad magic/version {raw[:2]!r}/{ver}")
        space, shown = 0, -1
        if ver == 1:
            _, _, ts, uh, th, le, D, k = head.unpack_from(raw)
        elif ver == 2:
            _, _, ts, uh, th, space, le, D, k = head.unpack_from(raw)
        else:
            _, _, ts, uh, th, space, shown, le, D, k = head.unpack_from(raw)
        need = head.size + le + 2 * D + 8 * k
        if len(raw) != need:
            raise StateFormatError(f"record is {len(raw)} bytes, header says {need}")
        o = head.size
        eid = raw[o : o + le].decode("utf-8")
        o += le
        z = np.frombuffer(raw, "<f2", D, o)
        o += 2 * D
        ids = np.frombuffer(raw, "<i4", k, o).astype(np.int64)
        o += 4 * k
        sc = np.frombuffer(raw, "<f4", k, o)
        return cls(eid, ts, uh, th, z, ids, sc, space, shown)

    def to_json(self) -> dict:
        """A readable form (dashboard, debugging); z as a list of floats."""
        return {
            "event_id": self.event_id,
            "ts": self.ts,
            "url_hash": f"{self.url_hash:016x}",
            "title_hash": f"{self.title_hash:016x}",
            "z": self.z.astype(float).tolist(),
            "query_ids": self.query_ids.tolist(),
            "scores": self.scores.astype(float).tolist(),
            "space": f"{self.space:016x}",
            "shown": self.shown,
        }

    @classmethod
    def from_json(cls, d: dict | str) -> UserState:
        d = json.loads(d) if isinstance(d, str) else d
        return cls(
            d["event_id"],
            float(d["ts"]),
            int(d["url_hash"], 16),
            int(d["title_hash"], 16),
            d["z"],
            d["query_ids"],
            d["scores"],
            int(d.get("space", "0"), 16),
            int(d.get("shown", -1)),
        )


def serving_window(history, current, K: int, ttl_s: float) -> list:
    """The states a policy reads at this visit, as training reads them (VisitLog.window): the
    user's earlier states of the current page's label space, no later than the current visit
    and at most ttl_s older than it, in timestamp order (arrival order among equal times), the
    last K - 1 of them, then the current state.

    Redis holds states in arrival order and keeps the whole list alive on every append, so a
    late event would otherwise read states after it, a stale state would count after a long
    absence, and states of an engine whose label ids moved would name other queries. States
    without a usable `ts` are dropped here; a current state without one comes back alone (the
    caller's cold-start rule)."""
    try:
        now = float(current.ts)
        space = int(getattr(current, "space", 0))
    except (AttributeError, TypeError, ValueError):
        return [current]
    kept = []
    for s in history:
        try:
            t = float(s.ts)
            other = int(getattr(s, "space", 0))
        except (AttributeError, TypeError, ValueError):
            continue
        # now - t <= ttl_s exactly as VisitLog.window computes it (NaN fails both tests)
        if t <= now and now - t <= ttl_s and (not space or not other or other == space):
            kept.append((t, s))
    kept.sort(key=lambda p: p[0])
    return [s for _, s in kept[max(len(kept) - (K - 1), 0) :]] + [current]
