"""kvpage.host_memory: freed activation memory stays in the heap, so that asking for the same
size again (the next layer's activations) touches no fresh pages. Each case runs in its own
process: the setting is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# 40 MB, above glibc's largest dynamic mmap threshold (32 MiB): without the setting every such
# request is a fresh mmap, and writing it faults in every page.
PROBE = """
import json, resource, torch
from kvpage.host_memory import keep_freed_memory
kept = keep_freed_memory()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(10_000_000).fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""
# A fresh 40 MB mapping faults at least once per page: 9,766 with 4 KiB pages, 20 where
# transparent huge pages are always on. Memory kept in the heap faults none.
FRESH = 40_000_000 // (2 << 20)
FEW = 8


def _probe(keep: str) -> dict:
    env = {**os.environ, "KVPAGE_KEEP_FREED_MEMORY": keep}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_freed_activation_is_reused_without_page_faults():
    kept = _probe("1")
    assert kept["kept"] is True
    # The first few requests may still fault (the heap grows while torch's threads start).
    assert all(f < FEW for f in kept["faults"][4:]), kept
    # The same probe with the setting off faults the pages in again (the check can fail).
    plain = _probe("0")
    assert plain["kept"] is False
    assert all(f >= FRESH for f in plain["faults"][4:]), plain
