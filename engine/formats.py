"""Reading and writing the data formats the engine accepts, all to/from float32 scipy CSR.

Formats:
- text TSV: ``text<TAB>id,id,...`` per line, plus a label-names file (line i = name of label i);
- Extreme Classification Repository (XC) single file: ``N F L`` header, ``l1,l2 f:v f:v`` lines;
- XC split files ``*_X_Xf.txt`` / ``*_X_Y.txt``: ``N F`` header, ``f:v f:v`` lines (label files
  may also hold bare ``l1,l2`` lines);
- XC raw-text releases: one title per line, paired with a ``*_X_Y.txt`` label file;
- prediction files: ``id:score id:score`` per line, best first; scipy ``.npz`` score matrices.

Parsing is vectorised: each file is split into lines once, all numeric tokens of the file are
converted by numpy in one call, and CSR ``indptr`` comes from per-line token counts. Only when
that fast path fails does a per-line parser run, to name the exact line and token at fault.
Every malformed input raises :class:`FormatError` naming the file and the 1-based line.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

PathLike = str | os.PathLike

__all__ = [
    "Dataset",
    "FormatError",
    "detect_format",
    "load_dataset",
    "read_label_names",
    "read_npz",
    "read_predictions",
    "read_text_lines",
    "read_text_tsv",
    "read_xc_matrix",
    "read_xc_sparse",
    "write_label_names",
    "write_npz",
    "write_predictions",
    "write_predictions_csr",
    "write_text_lines",
    "write_text_tsv",
    "write_xc_matrix",
    "write_xc_sparse",
]


class FormatError(ValueError):
    """Malformed input; the message names the file, the 1-based line (when known) and the fault."""

    def __init__(self, path: PathLike, line: int | None, reason: str):
        self.path, self.line, self.reason = str(path), line, reason
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}")


@dataclass
class Dataset:
    """One split of a data set: texts and/or sparse features, the label matrix and label names."""

    texts: list[str] | None
    X: sp.csr_matrix | None
    Y: sp.csr_matrix
    label_names: list[str] | None
    source: str  # what was read, e.g. "text-tsv:/path/train.tsv"

    @property
    def num_points(self) -> int:
        return self.Y.shape[0]

    @property
    def num_labels(self) -> int:
        return self.Y.shape[1]


# ---------------------------------------------------------------------------------------------
# low-level helpers


def _gc_paused(fn):
    """Run a reader with the cyclic GC paused: a million per-line tuples otherwise trigger
    repeated full collections that cost more than the parsing itself (3 s of 6 s at 1M lines).
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper


def _read_lines(path: PathLike) -> list[str]:
    """Decode a UTF-8 file strictly and split it on newlines (a final newline ends the last line).

    ``str.splitlines`` is avoided on purpose: it also splits on form feeds, U+2028 etc., which
    can occur inside titles.
    """
    raw = Path(path).read_bytes()
    if not raw:
        raise FormatError(path, None, "empty file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise FormatError(
            path,
            line,
            f"not valid UTF-8 (byte offset {e.start}: {raw[e.start : e.start + 1]!r}, {e.reason})",
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def _row_of(indptr: np.ndarray, pos: int) -> int:
    """Row that holds flat token position ``pos`` (indptr is a CSR row pointer)."""
    return int(np.searchsorted(indptr, pos, side="right") - 1)


def _check_bounds(
    path, ids: np.ndarray, indptr: np.ndarray, bound: int | None, first_line: int, what: str
) -> None:
    """Reject negative ids and ids >= bound, naming the line of the first offender."""
    if ids.size == 0:
        return
    bad = ids < 0 if bound is None else (ids < 0) | (ids >= bound)
    if bad.any():
        pos = int(np.argmax(bad))
        line = first_line + _row_of(indptr, pos)
        limit = "must be >= 0" if bound is None or ids[pos] < 0 else f"must be < {bound}"
        raise FormatError(path, line, f"{what} {int(ids[pos])} out of range ({limit})")


def _parse_int(path, line: int, tok: str, what: str) -> int:
    try:
        return int(tok)
    except ValueError:
        raise FormatError(path, line, f"bad {what} {tok!r} (expected an integer)") from None


def _parse_float(path, line: int, tok: str, what: str) -> float:
    try:
        v = float(tok)
    except ValueError:
        raise FormatError(path, line, f"bad {what} {tok!r} (expected a number)") from None
    if not np.isfinite(v):
        raise FormatError(path, line, f"bad {what} {tok!r} (not finite)")
    return v


def _slow_id_list(path, line: int, field: str, what: str) -> None:
    """Per-line validator for ``1,2,3`` (only run to locate an error)."""
    for tok in field.split(","):
        if tok.strip() == "":
            raise FormatError(path, line, f"empty {what} in {field!r}")
        _parse_int(path, line, tok, what)


def _slow_pairs(path, line: int, field: str, what: str) -> None:
    """Per-line validator for ``i:v i:v`` (only run to locate an error)."""
    for tok in field.split():
        if tok.count(":") != 1:
            raise FormatError(path, line, f"bad pair {tok!r} (expected {what}:value)")
        i, v = tok.split(":")
        _parse_int(path, line, i, f"{what} in pair {tok!r}:")
        _parse_float(path, line, v, f"value in pair {tok!r}:")


def _fast_numbers(s: str, sep: str, expected: int) -> np.ndarray | None:
    """All numbers in ``s`` parsed by numpy in one C pass; None if any token is not a number.

    ``np.fromstring`` in text mode stops (warning or ValueError) at the first bad token, so a
    count that differs from the separators counted beforehand flags a malformed file.
    """
    if expected == 0:
        return np.zeros(0) if not s.strip() else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            nums = np.fromstring(s, sep=sep)
        except (ValueError, DeprecationWarning):
            return None
    return nums if nums.size == expected else None


def _ints(nums: np.ndarray | None) -> np.ndarray | None:
    if nums is None or not np.array_equal(nums, np.floor(nums)):
        return None
    return nums.astype(np.int64)


def _indptr(counts) -> np.ndarray:
    indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.asarray(counts, dtype=np.int64), out=indptr[1:])
    return indptr


def _id_lists(path, fields: list[str], first_line: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Comma-separated id lists (one per row, '' = none) -> (indptr, ids)."""
    indptr = _indptr(
        np.fromiter(
            (f.count(",") + 1 if f else 0 for f in fields), dtype=np.int64, count=len(fields)
        )
    )
    ids = _ints(_fast_numbers(",".join(f for f in fields if f), ",", int(indptr[-1])))
    if ids is None:
        for r, f in enumerate(fields):
            if f:
                _slow_id_list(path, first_line + r, f, what)
        raise FormatError(path, None, f"unparseable {what} list")
    return indptr, ids


_SPACE = np.zeros(256, dtype=bool)
_SPACE[[9, 32]] = True


def _pairs_well_formed(joined: str, n: int) -> bool:
    """True if ``joined`` is exactly n whitespace-separated tokens, each ``a:b`` with one colon.

    Done on the bytes with numpy so no per-token string is created: with n token starts and n
    colons, token i must hold colon i (start_i < colon_i < start_i+1) with non-blank neighbours.
    """
    b = np.frombuffer(joined.encode("utf-8"), dtype=np.uint8)
    if b.size == 0:
        return n == 0
    space = _SPACE[b]
    start_mask = ~space
    start_mask[1:] &= space[:-1]
    starts = np.flatnonzero(start_mask)
    colons = np.flatnonzero(b == 58)
    if starts.size != n or colons.size != n:
        return False
    if n == 0:
        return True
    if colons[-1] == b.size - 1 or space[colons - 1].any() or space[colons + 1].any():
        return False
    return bool((starts < colons).all() and (colons[:-1] < starts[1:]).all())


def _pair_lists(
    path, fields: list[str], first_line: int, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Space-separated ``i:v`` lists (one per row) -> (indptr, ids, float32 values)."""
    indptr = _indptr(np.fromiter((f.count(":") for f in fields), dtype=np.int64, count=len(fields)))
    n = int(indptr[-1])
    joined = " ".join(fields)
    ids = vals = None
    if _pairs_well_formed(joined, n):
        nums = _fast_numbers(joined.replace(":", " "), " ", 2 * n)
        if nums is not None and np.isfinite(nums).all():
            ids, vals = _ints(nums[0::2]), nums[1::2].astype(np.float32)
    if ids is None or vals is None:
        for r, f in enumerate(fields):
            _slow_pairs(path, first_line + r, f, what)
        raise FormatError(path, None, f"unparseable {what}:value list")
    return indptr, ids, vals


def _binary_csr(indptr, ids, shape) -> sp.csr_matrix:
    """0/1 float32 CSR with sorted, de-duplicated indices (a repeated label counts once)."""
    Y = sp.csr_matrix(
        (np.ones(ids.size, dtype=np.float32), ids.astype(np.int32, copy=False), indptr), shape=shape
    )
    Y.sum_duplicates()
    Y.data[:] = 1.0
    return Y


def _valued_csr(indptr, ids, vals, shape) -> sp.csr_matrix:
    M = sp.csr_matrix((vals, ids.astype(np.int32, copy=False), indptr), shape=shape)
    M.sum_duplicates()
    return M


def _as_csr(M) -> sp.csr_matrix:
    return sp.csr_matrix(M, dtype=np.float32)


def _row_strings(indptr: np.ndarray, tokens: list[str], sep: str) -> list[str]:
    return [
        sep.join(tokens[a:b])
        for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist(), strict=True)
    ]


def _pair_tokens(ids: np.ndarray, vals: np.ndarray, precision: int) -> list[str]:
    """'i:v' strings for all entries (an f-string pass is 4x faster than numpy.char here)."""
    fmt = f".{int(precision)}g"
    return [
        f"{i}:{v:{fmt}}"
        for i, v in zip(ids.tolist(), vals.astype(np.float64).tolist(), strict=True)
    ]


def _write_text(path: PathLike, lines: list[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        if lines:
            f.write("\n".join(lines))
            f.write("\n")


def _header(path, line: str, n_fields: int, names: str) -> list[int]:
    parts = line.split()
    if len(parts) != n_fields or not all(p.isdigit() for p in parts):
        raise FormatError(
            path, 1, f"bad header {line!r} (expected '{names}', {n_fields} non-negative integers)"
        )
    return [int(p) for p in parts]


def _check_rows(path, header_n: int, body_len: int) -> None:
    if header_n != body_len:
        line = body_len + 1 if body_len < header_n else header_n + 2
        raise FormatError(path, line, f"header says N={header_n} data lines, file has {body_len}")


# ---------------------------------------------------------------------------------------------
# text TSV + label names


@_gc_paused
def read_text_tsv(path: PathLike, num_labels: int | None = None) -> tuple[list[str], sp.csr_matrix]:
    """Read ``text<TAB>id,id,...`` lines; Y is n x L with L = num_labels or max id + 1."""
    lines = _read_lines(path)
    parts = [ln.split("\t") for ln in lines]
    bad = [i for i, p in enumerate(parts) if len(p) != 2]
    if bad:
        i = bad[0]
        what = (
            "tab missing (expected text<TAB>id,id,...)"
            if len(parts[i]) == 1
            else f"{len(parts[i]) - 1} tabs (tabs are not allowed inside the text)"
        )
        raise FormatError(path, i + 1, what)
    texts = [p[0] for p in parts]
    fields = [p[1].strip() for p in parts]
    indptr, ids = _id_lists(path, fields, 1, "label id")
    _check_bounds(path, ids, indptr, num_labels, 1, "label id")
    L = num_labels if num_labels is not None else (int(ids.max()) + 1 if ids.size else 0)
    return texts, _binary_csr(indptr, ids, (len(texts), L))


def write_text_tsv(path: PathLike, texts: list[str], Y) -> None:
    """Write ``text<TAB>id,id,...`` lines (ids ascending); texts may not hold tabs or newlines."""
    Y = _as_csr(Y)
    if len(texts) != Y.shape[0]:
        raise ValueError(f"{len(texts)} texts but Y has {Y.shape[0]} rows")
    for i, t in enumerate(texts):
        if "\t" in t or "\n" in t or "\r" in t:
            raise ValueError(f"text {i} contains a tab or newline: {t!r}")
    Y = Y.copy()
    Y.sort_indices()
    rows = _row_strings(Y.indptr, Y.indices.astype(str).tolist(), ",")
    _write_text(path, [f"{t}\t{r}" for t, r in zip(texts, rows, strict=True)])


def read_label_names(path: PathLike) -> list[str]:
    """Label-names file: line i is the name of label i (empty lines are unnamed labels)."""
    return _read_lines(path)


def _write_one_per_line(path: PathLike, items: list[str], what: str) -> None:
    for i, t in enumerate(items):
        if "\n" in t or "\r" in t:
            raise ValueError(f"{what} {i} contains a newline: {t!r}")
    _write_text(path, list(items))


def write_label_names(path: PathLike, names: list[str]) -> None:
    _write_one_per_line(path, names, "label name")


def read_text_lines(path: PathLike) -> list[str]:
    """XC raw-text release titles: one text per line, kept verbatim."""
    return _read_lines(path)


def write_text_lines(path: PathLike, texts: list[str]) -> None:
    _write_one_per_line(path, texts, "text")


# ---------------------------------------------------------------------------------------------
# Extreme Classification Repository sparse formats


@_gc_paused
def read_xc_sparse(path: PathLike) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Single-file XC format: ``N F L`` header then ``l1,l2 f:v f:v`` lines -> (X, Y)."""
    lines = _read_lines(path)
    N, F, L = _header(path, lines[0], 3, "N F L")
    body = lines[1:]
    _check_rows(path, N, len(body))
    labs, feats = [], []
    for ln in body:
        lab, _, feat = ln.partition(" ")
        if ":" in lab:  # no label field and no leading space: the line is all features
            lab, feat = "", ln
        labs.append(lab)
        feats.append(feat)
    yptr, yids = _id_lists(path, labs, 2, "label id")
    _check_bounds(path, yids, yptr, L, 2, "label id")
    xptr, xids, xvals = _pair_lists(path, feats, 2, "feature id")
    _check_bounds(path, xids, xptr, F, 2, "feature id")
    return _valued_csr(xptr, xids, xvals, (N, F)), _binary_csr(yptr, yids, (N, L))


def write_xc_sparse(path: PathLike, X, Y, precision: int = 6) -> None:
    """Write the single-file XC format; a point without labels starts with a space."""
    X, Y = _as_csr(X).copy(), _as_csr(Y).copy()
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but Y has {Y.shape[0]}")
    X.sort_indices()
    Y.sort_indices()
    labs = _row_strings(Y.indptr, Y.indices.astype(str).tolist(), ",")
    feats = _row_strings(X.indptr, _pair_tokens(X.indices, X.data, precision), " ")
    lines = [f"{X.shape[0]} {X.shape[1]} {Y.shape[1]}"]
    lines += [f"{lb} {ft}" if ft else lb for lb, ft in zip(labs, feats, strict=True)]
    _write_text(path, lines)


@_gc_paused
def read_xc_matrix(path: PathLike) -> sp.csr_matrix:
    """One XC split file (``*_X_Xf.txt`` or ``*_X_Y.txt``): ``N F`` header, ``f:v f:v`` lines.

    Label files written as bare ``l1,l2`` (or ``l1 l2``) lines are accepted too (values 1); the
    choice is made per file: any ``:`` in the body means ``i:v`` pairs throughout.
    """
    lines = _read_lines(path)
    N, F = _header(path, lines[0], 2, "N F")
    body = lines[1:]
    _check_rows(path, N, len(body))
    if any(":" in ln for ln in body):
        ptr, ids, vals = _pair_lists(path, body, 2, "column id")
        _check_bounds(path, ids, ptr, F, 2, "column id")
        return _valued_csr(ptr, ids, vals, (N, F))
    fields = [",".join(ln.replace(",", " ").split()) for ln in body]
    ptr, ids = _id_lists(path, fields, 2, "column id")
    _check_bounds(path, ids, ptr, F, 2, "column id")
    return _binary_csr(ptr, ids, (N, F))


def write_xc_matrix(path: PathLike, M, precision: int = 6) -> None:
    """Write one XC split file: ``N F`` header, ``i:v i:v`` lines (as pyxclib writes them)."""
    M = _as_csr(M).copy()
    M.sort_indices()
    lines = [f"{M.shape[0]} {M.shape[1]}"]
    lines += _row_strings(M.indptr, _pair_tokens(M.indices, M.data, precision), " ")
    _write_text(path, lines)


# ---------------------------------------------------------------------------------------------
# predictions


@_gc_paused
def read_predictions(path: PathLike, num_labels: int | None = None) -> sp.csr_matrix:
    """``id:score`` lines (best first) -> n x L CSR whose row order is kept best-first.

    The indices are deliberately left unsorted so ``M.indices[M.indptr[i]:M.indptr[i+1]]`` is
    the ranked list; an empty line is a point with no predictions.
    """
    lines = _read_lines(path)
    ptr, ids, vals = _pair_lists(path, [ln.strip() for ln in lines], 1, "label id")
    _check_bounds(path, ids, ptr, num_labels, 1, "label id")
    L = num_labels if num_labels is not None else (int(ids.max()) + 1 if ids.size else 0)
    M = sp.csr_matrix((vals, ids.astype(np.int32), ptr), shape=(len(lines), L))
    M.has_sorted_indices = False
    return M


def write_predictions(
    path: PathLike, ids: np.ndarray, scores: np.ndarray, precision: int = 6
) -> None:
    """Write dense top-k arrays (n x k, best first as given); ids < 0 are padding and skipped."""
    ids, scores = np.asarray(ids), np.asarray(scores)
    if ids.shape != scores.shape or ids.ndim != 2:
        raise ValueError(f"ids {ids.shape} and scores {scores.shape} must be equal n x k arrays")
    keep = ids >= 0
    indptr = np.zeros(ids.shape[0] + 1, dtype=np.int64)
    np.cumsum(keep.sum(axis=1), out=indptr[1:])
    toks = _pair_tokens(ids[keep], scores[keep], precision)
    _write_text(path, _row_strings(indptr, toks, " "))


def write_predictions_csr(path: PathLike, M, precision: int = 6) -> None:
    """Write a score matrix as ``id:score`` lines, each row sorted best first."""
    M = sp.csr_matrix(M)
    rows = np.repeat(np.arange(M.shape[0]), np.diff(M.indptr))
    order = np.lexsort((-M.data, rows))  # by row, then score descending
    toks = _pair_tokens(M.indices[order], M.data[order], precision)
    _write_text(path, _row_strings(M.indptr, toks, " "))


def read_npz(path: PathLike) -> sp.csr_matrix:
    """A scipy ``.npz`` sparse matrix (pyxclib/deepxml score files), loaded without pickle."""
    try:
        M = sp.load_npz(path)
    except (ValueError, KeyError, OSError) as e:
        raise FormatError(path, None, f"not a scipy sparse .npz file ({e})") from None
    return sp.csr_matrix(M, dtype=np.float32)


def write_npz(path: PathLike, M) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sp.save_npz(path, sp.csr_matrix(M, dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# format detection

_HEADER3 = re.compile(r"^\s*\d+\s+\d+\s+\d+\s*$")
_HEADER2 = re.compile(r"^\s*\d+\s+\d+\s*$")


def _first_line(path: PathLike) -> str:
    with open(path, "rb") as f:
        head = f.readline(1 << 20)
    if not head:
        raise FormatError(path, None, "empty file")
    return head.decode("utf-8", errors="replace").lstrip("\ufeff").rstrip("\r\n")


def detect_format(path: PathLike) -> str:
    """One of 'text-tsv', 'xc-sparse', 'xc-matrix', 'npz', 'text-lines' (from the content)."""
    with open(path, "rb") as f:
        if f.read(4) == b"PK\x03\x04":
            return "npz"
    first = _first_line(path)
    if "\t" in first:
        return "text-tsv"
    if _HEADER3.match(first):
        return "xc-sparse"
    if _HEADER2.match(first):
        return "xc-matrix"
    return "text-lines"


def _sibling(path: Path, candidates: list[str]) -> Path | None:
    for name in candidates:
        p = path.with_name(name)
        if name and p != path and p.is_file():
            return p
    return None


def _label_matrix_sibling(path: Path) -> Path | None:
    """``trn_X_Xf.txt`` / ``trn_X.txt`` -> ``trn_X_Y.txt`` (XC naming)."""
    name = path.name
    cands = []
    if "X_Xf" in name:
        cands.append(name.replace("X_Xf", "X_Y"))
    stem, ext = os.path.splitext(name)
    if stem.endswith("X"):
        cands.append(f"{stem}_Y{ext}")
    return _sibling(path, cands)


def load_dataset(
    path: PathLike, labels_path: PathLike | None = None, *, y_path: PathLike | None = None
) -> Dataset:
    """Read any supported data file, detecting its format from the content.

    ``labels_path`` is a label-names file (line i = name of label i); when omitted, a sibling
    ``labels.txt`` or ``Y.txt`` is used if present. It may instead be an XC label matrix
    (``N L`` header), which is how a titles file or a ``*_X_Xf.txt`` gets its labels; ``y_path``
    says that explicitly, and a sibling ``*_X_Y.txt`` is found by name when neither is given.
    When names are known, L is the number of names.
    """
    path = Path(path)
    fmt = detect_format(path)
    if (
        labels_path is not None
        and y_path is None
        and detect_format(labels_path) == "xc-matrix"
        and fmt in ("text-lines", "xc-matrix")
    ):
        y_path, labels_path = labels_path, None
    if labels_path is None:
        labels_path = _sibling(path, ["labels.txt", "Y.txt"])
        if labels_path is not None and detect_format(labels_path) != "text-lines":
            labels_path = None
    names = read_label_names(labels_path) if labels_path is not None else None

    texts = X = None
    if fmt == "text-tsv":
        texts, Y = read_text_tsv(path)
    elif fmt == "xc-sparse":
        X, Y = read_xc_sparse(path)
    elif fmt == "npz":
        raise FormatError(path, None, "an .npz score matrix is not a data set (no labels)")
    else:
        if y_path is None:
            y_path = _label_matrix_sibling(path)
        if y_path is None:
            if fmt == "xc-matrix" and re.search(r"X_Y", path.name):
                Y = read_xc_matrix(path)
            else:
                raise FormatError(
                    path,
                    None,
                    f"{fmt} file without labels: pass the matching "
                    "*_X_Y.txt label file (e.g. --labels)",
                )
        else:
            Y = read_xc_matrix(y_path)
            if fmt == "xc-matrix":
                X = read_xc_matrix(path)
                n_body = X.shape[0]
            else:
                texts = read_text_lines(path)
                n_body = len(texts)
            if n_body != Y.shape[0]:
                raise FormatError(
                    y_path, None, f"{Y.shape[0]} label rows but {path} has {n_body} points"
                )
        fmt = f"{fmt}+{y_path}" if y_path is not None else fmt

    if names is not None:
        if len(names) >= Y.shape[1]:
            Y = sp.csr_matrix((Y.data, Y.indices, Y.indptr), shape=(Y.shape[0], len(names)))
        elif labels_path is not None:
            # name the line of the first id beyond the names (XC files have a header line)
            Yc = sp.csr_matrix(Y)
            pos = int(np.flatnonzero(Yc.indices >= len(names))[0])
            src = Path(y_path) if y_path is not None else path
            raise FormatError(
                src,
                _row_of(Yc.indptr, pos) + (1 if fmt == "text-tsv" else 2),
                f"label id {int(Yc.indices[pos])}, but {labels_path} names {len(names)} labels "
                f"(ids 0..{len(names) - 1})",
            )
        else:
            names = None
    source = f"{fmt}:{path}" + (f" (names: {labels_path})" if names is not None else "")
    return Dataset(texts=texts, X=X, Y=Y, label_names=names, source=source)
