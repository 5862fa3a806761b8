"""A real short-text extreme multi-label data set from the Debian package catalogue.

Any Debian-family machine prints its catalogue with `apt-cache dumpavail`, so the demo and the
benchmarks get real text with nothing downloaded. A package is a point: its text is the one-line
description (a product-title-like short text), its labels are the packages its Depends,
Pre-Depends, Recommends and Suggests fields name ("related items"; version constraints and
architecture qualifiers stripped, alternatives kept). Labels named by fewer than
`min_label_points` packages are dropped, then points left with no label. The split is by a hash
of the package name, so a package stays on its side however the catalogue grows.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from engine.formats import write_label_names, write_text_tsv

RELATION_FIELDS = ("Depends", "Pre-Depends", "Recommends", "Suggests")
_NAME = re.compile(r"^[a-z0-9][a-z0-9+.\-]+$")


class CatalogueError(ValueError):
    """The catalogue text is not what `apt-cache dumpavail` prints."""


@dataclass
class PackageDataset:
    """The debian-related train/test split (engine.formats.Dataset is one loaded file)."""

    train_texts: list[str]
    train_labels: sp.csr_matrix
    test_texts: list[str]
    test_labels: sp.csr_matrix
    label_names: list[str]
    dropped_no_label: int


def read_catalogue(source: str | Path | None = None) -> str:
    """The catalogue text: SOURCE's contents, or `apt-cache dumpavail` when SOURCE is None."""
    if source is not None:
        return Path(source).read_text(encoding="utf-8", errors="replace")
    try:
        out = subprocess.run(
            ["apt-cache", "dumpavail"], capture_output=True, text=True, check=True, timeout=300
        )
    except FileNotFoundError:
        raise CatalogueError(
            "apt-cache not found: build the data set on a Debian-family machine, or pass the "
            "output of `apt-cache dumpavail` saved elsewhere with --from"
        ) from None
    except subprocess.CalledProcessError as e:
        raise CatalogueError(f"apt-cache dumpavail failed: {e.stderr.strip()[:300]}") from None
    return out.stdout


def packages(text: str, origin: str = "catalogue") -> Iterator[tuple[str, str, list[str]]]:
    """(name, one-line description, related package names) per stanza; the first stanza of a
    package wins when the catalogue lists several versions."""
    seen: set[str] = set()
    line_no = 0
    for stanza in text.split("\n\n"):
        start = line_no + 1
        line_no += stanza.count("\n") + 2
        fields: dict[str, str] = {}
        key = None
        for line in stanza.split("\n"):
            if line[:1] in (" ", "\t"):
                if key is not None:
                    fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        name = fields.get("Package")
        if not name:
            if fields:
                raise CatalogueError(f"{origin}:{start}: a stanza without a Package field")
            continue
        if name in seen:
            continue
        seen.add(name)
        desc = fields.get("Description", "").split("\n", 1)[0].strip()
        if desc:
            yield name, desc, related(fields)


def related(fields: dict[str, str]) -> list[str]:
    """Package names in the relation fields, alternatives kept, each once, in field order."""
    out: dict[str, None] = {}
    for f in RELATION_FIELDS:
        for alt in re.split(r"[,|]", fields.get(f, "").replace("\n", " ")):
            name = re.sub(r"\(.*?\)|\[.*?\]|<.*?>", "", alt).strip().split(":", 1)[0].strip()
            if _NAME.match(name):
                out[name] = None
    return list(out)


def _hash01(name: str) -> float:
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big") / 2.0**64


def build(
    pkgs: Iterable[tuple[str, str, list[str]]],
    test_share: float = 0.3,
    min_label_points: int = 2,
    max_points: int | None = None,
    max_label_share: float | None = None,
) -> PackageDataset:
    """The data set of PKGS; MAX_POINTS keeps the packages whose name hashes lowest (a
    deterministic sample that keeps the catalogue's label structure). MAX_LABEL_SHARE drops the
    labels more than that share of packages name (libc6 is related to 40% of them: plumbing,
    not what a package is about; the demo drops them so its ads can be judged by eye)."""
    rows = list(pkgs)
    if max_points is not None and len(rows) > max_points:
        rows = sorted(rows, key=lambda r: _hash01("sample:" + r[0]))[:max_points]
    counts = Counter(lab for _, _, labs in rows for lab in set(labs))
    most = len(rows) * max_label_share if max_label_share is not None else len(rows)
    names = sorted(lab for lab, c in counts.items() if min_label_points <= c <= most)
    index = {n: i for i, n in enumerate(names)}
    split: dict[str, tuple[list[str], list[list[int]]]] = {"train": ([], []), "test": ([], [])}
    dropped = 0
    for name, desc, labs in sorted(rows):
        ids = sorted({index[lab] for lab in labs if lab in index})
        if not ids:
            dropped += 1
            continue
        side = split["test" if _hash01(name) < test_share else "train"]
        side[0].append(" ".join(desc.split()))
        side[1].append(ids)

    def csr(lists: list[list[int]]) -> sp.csr_matrix:
        indptr = np.cumsum([0] + [len(x) for x in lists])
        ind = np.fromiter((i for x in lists for i in x), np.int64, int(indptr[-1]))
        return sp.csr_matrix(
            (np.ones(len(ind), np.float32), ind, indptr), shape=(len(lists), len(names))
        )

    return PackageDataset(
        split["train"][0],
        csr(split["train"][1]),
        split["test"][0],
        csr(split["test"][1]),
        names,
        dropped,
    )


def stats(ds: PackageDataset) -> dict:
    tr = ds.train_labels
    per_label = np.asarray(tr.sum(axis=0)).ravel()
    return {
        "name": "debian-related",
        "N_train": tr.shape[0],
        "N_test": ds.test_labels.shape[0],
        "L": len(ds.label_names),
        "avg_labels_per_point": round(tr.nnz / max(tr.shape[0], 1), 3),
        "avg_points_per_label": round(tr.nnz / max(len(ds.label_names), 1), 3),
        "avg_words_per_point": round(
            float(np.mean([len(t.split()) for t in ds.train_texts])) if ds.train_texts else 0, 3
        ),
        "points_dropped_no_label": ds.dropped_no_label,
        "labels_with_0_train_points": int((per_label == 0).sum()),
    }


def write(ds: PackageDataset, out: str | Path) -> dict:
    """train.tsv, test.tsv, labels.txt and stats.json under OUT; returns the stats."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_tsv(out / "train.tsv", ds.train_texts, ds.train_labels)
    write_text_tsv(out / "test.tsv", ds.test_texts, ds.test_labels)
    write_label_names(out / "labels.txt", ds.label_names)
    st = stats(ds)
    (out / "stats.json").write_text(json.dumps(st, indent=1) + "\n")
    return st
