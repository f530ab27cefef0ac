"""The host-memory sampler the benchmarks and calibration read (``notebookkit.memory.meters``): memory a process
allocates counts as resident and as anonymous; a memory-mapped file it reads counts as resident only (the
system can drop those pages again, so they do not run a T4 session out of its 12.7 GB)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from notebookkit.memory.meters import HostMemorySampler, process_memory

MiB = 2**20

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc (Linux)")


def test_allocated_memory_is_resident_and_anonymous():
    anon_before = process_memory()[1]
    with HostMemorySampler(0.005) as host:
        block = np.ones(128 * MiB // 8)  # written: every page resident
        host.sample()
        del block
    assert host.peak_rss - host.before >= 100 * MiB
    assert host.peak_anon - anon_before >= 100 * MiB


def test_a_memory_mapped_file_is_resident_but_not_anonymous(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(96 * MiB))
    rss_before, anon_before = process_memory()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        checksum = sum(mapped[i] for i in range(0, len(mapped), 4096))  # touch every page
        rss, anon = process_memory()
    assert checksum >= 0
    assert rss - rss_before >= 80 * MiB
    assert anon - anon_before <= 16 * MiB


def test_a_process_that_has_ended_counts_nothing():
    assert process_memory(2**22 + 12345) == (0, 0)  # above Linux's largest pid
