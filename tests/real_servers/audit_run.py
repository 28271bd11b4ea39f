"""One `kvpage audit` run from its command line, its report read back, and a failure message
that carries what a reader needs: the verdicts, the findings and the server's log tail."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpage.cli import main
from tests.real_servers.process import Served

# A full audit at the servers' one block size (32), sized for 2 CI cores.
ARGS = ["--block-sizes", "32", "--probes", "6", "--timing-trials", "6", "--timeout", "120"]


@dataclass(slots=True)
class Run:
    exit_code: int
    report: dict[str, Any] | None
    wall_s: float
    served: Served

    def verdicts(self) -> dict[str, str]:
        return {n: s["verdict"] for n, s in (self.report or {}).get("suites", {}).items()}

    def explain(self) -> str:
        """For assertion messages."""
        if self.report is None:
            return f"exit {self.exit_code}, no report; server log:\n{self.served.log_tail()}"
        lines = [f"exit {self.exit_code}; verdict {self.report['verdict']}; {self.verdicts()}"]
        for key, items in self.report["findings"].items():
            lines += [f"{key}: {s}" for s in items]
        lines.append(f"server log (tail):\n{self.served.log_tail(15)}")
        return "\n".join(lines)


def audit(served: Served, model: str, report: Path, *extra: str) -> Run:
    args = ["audit", "--base-url", served.url, "--model", model, "--quiet", "--report"]
    shutil.rmtree(report, ignore_errors=True)  # never read an earlier run's report
    t0 = time.perf_counter()
    code = main([*args, str(report), *ARGS, *extra])
    wall = time.perf_counter() - t0
    path = report / "report.json"
    data = json.loads(path.read_text()) if path.is_file() else None
    return Run(code, data, wall, served)
