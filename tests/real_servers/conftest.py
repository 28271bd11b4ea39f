"""The real-server tests (vLLM, llama.cpp's server) install and build servers no one here wrote
(minutes on a cold cache), so `make test` leaves them out: they run from `.ci/run` after it,
with KVPAGE_REAL_SERVERS=1. Left out means deselected (reported as such), never skipped."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ENABLE = "KVPAGE_REAL_SERVERS"
REPORTS = "KVPAGE_REAL_SERVERS_REPORTS"  # keep each test's audit report there (default: tmp)


@pytest.fixture
def report_dir(request, tmp_path) -> Path:
    base = os.environ.get(REPORTS)
    if not base:
        return tmp_path / "report"
    return Path(base) / re.sub(r"[^\w.-]+", "_", request.node.name)


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ENABLE) == "1":
        return
    ours = [i for i in items if HERE in Path(str(i.path)).parents]
    if ours:
        config.hook.pytest_deselected(items=ours)
        items[:] = [i for i in items if i not in ours]
