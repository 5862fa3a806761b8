"""One user visit as the personalization model sees it, with a compact binary encoding.

The stream stores a user's last K of these in Redis (oldest first when read back) and the GRU
reads them. Binary layout (little-endian), version 1:

    magic b"US" | u8 version | f64 ts | u64 url_hash | u64 title_hash | u16 len(event_id) |
    u16 D | u16 k | event_id utf-8 | z float16[D] | query_ids int32[k] | scores float32[k]

z is stored as float16 (a 300-d state is 600 bytes); query ids fit int32 (< 2^31 labels).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"US"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<2sBdQQHHH")


class StateFormatError(ValueError):
    """Bytes that are not a UserState record (the message says what is wrong)."""


def text_hash(text: str) -> int:
    """A stable 64-bit hash of a URL or title (blake2b, identical across processes and hosts)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


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
        cls, event_id: str, ts: float, url: str, title: str, z, query_ids, scores
    ) -> UserState:
        return cls(event_id, float(ts), text_hash(url), text_hash(title), z, query_ids, scores)

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
        if len(raw) < _HEAD.size:
            raise StateFormatError(f"record of {len(raw)} bytes is shorter than its header")
        magic, ver, ts, uh, th, le, D, k = _HEAD.unpack_from(raw)
        if magic != MAGIC or ver != FORMAT_VERSION:
            raise StateFormatError(f"bad magic/version {magic!r}/{ver}")
        need = _HEAD.size + le + 2 * D + 8 * k
        if len(raw) != need:
            raise StateFormatError(f"record is {len(raw)} bytes, header says {need}")
        o = _HEAD.size
        eid = raw[o : o + le].decode("utf-8")
        o += le
        z = np.frombuffer(raw, "<f2", D, o)
        o += 2 * D
        ids = np.frombuffer(raw, "<i4", k, o).astype(np.int64)
        o += 4 * k
        sc = np.frombuffer(raw, "<f4", k, o)
        return cls(eid, ts, uh, th, z, ids, sc)

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
        )
