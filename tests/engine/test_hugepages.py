"""engine.hugepages: memory a loader mallocs inside the block ends up in huge pages (where the
kernel supports MADV_COLLAPSE), and nothing breaks where it does not."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

import pytest

from engine.hugepages import huge_pages_for


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping that holds addr (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                a, b = (int(x, 16) for x in head[0].split("-"))
                inside = a <= addr < b
            elif inside and head[0] == "AnonHugePages:":
                return int(head[1])
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_memory_malloced_inside_is_collapsed_into_huge_pages(monkeypatch):
    monkeypatch.delenv("ASTEC_NO_HUGEPAGES", raising=False)
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    n = 64 << 20
    with huge_pages_for("test buffer"):
        p = libc.malloc(n)  # a private anonymous mapping, like hnswlib's graph
        ctypes.memset(p, 1, n)  # faulted in as small pages
    try:
        if _anon_huge_kb(p) == 0:
            # kernels before 6.1 (or a container that forbids it) refuse MADV_COLLAPSE
            madvise = libc.madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            if madvise((p + (2 << 20)) & ~((2 << 20) - 1), 2 << 20, 25) != 0:
                pytest.skip("MADV_COLLAPSE not supported here")
        assert _anon_huge_kb(p) >= 32 << 10
        assert ctypes.string_at(p + n // 2, 4) == b"\x01" * 4  # contents kept
    finally:
        libc.free(p)
