"""Back the memory a loader allocates with transparent huge pages (Linux, best effort).

A graph search walks ~1,100 nodes scattered over tens of MB; with 4 KiB pages nearly every hop
is also a TLB miss. The graph's arrays (numpy's, or a library's) come from malloc, which the
kernel backs with small pages unless told otherwise, and neither offers a hook. So
`huge_pages_for` notes the process's anonymous mappings before a load and, after it, asks the
kernel to collapse the new ones into 2 MiB pages (madvise MADV_COLLAPSE, Linux >= 6.1; it
works whatever the THP sysfs mode says, except "never"). Anything unsupported (another OS, an
older kernel, a locked-down container) just leaves the small pages: the answers are the same
either way, only the speed differs (README: the predictor's p50).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

MADV_COLLAPSE = 25
_MIN_BYTES = 8 << 20  # only mappings this large are worth collapsing
_HUGE = 2 << 20


def _anon_mappings() -> dict[int, int]:
    """{start: end} of the anonymous, private, read-write mappings of this process."""
    out = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 or not parts[1].startswith("rw") or parts[1][3] != "p":
                    continue  # file-backed or named ([heap], [stack]) or shared
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out[a] = b
    except OSError:
        pass
    return out


def _madvise():
    if not sys.platform.startswith("linux") or os.environ.get("ASTEC_NO_HUGEPAGES"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@contextlib.contextmanager
def huge_pages_for(what: str = "memory"):
    """Collapse into huge pages the large anonymous mappings created inside the block."""
    madvise = _madvise()
    before = _anon_mappings() if madvise else {}
    yield
    if not madvise:
        return
    collapsed = 0
    for a, b in _anon_mappings().items():
        if before.get(a) == b:
            continue  # an old mapping, unchanged
        lo = (a + _HUGE - 1) // _HUGE * _HUGE
        hi = b // _HUGE * _HUGE
        if hi - lo < _MIN_BYTES:
            continue
        if madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            collapsed += hi - lo
        else:
            log.debug("MADV_COLLAPSE of %s failed: errno %d", what, ctypes.get_errno())
    if collapsed:
        log.debug("%s: %d MiB in huge pages", what, collapsed >> 20)
