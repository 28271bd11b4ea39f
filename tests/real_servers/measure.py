"""Repeated audits of one real server, for the numbers quoted about real servers:

    KVPAGE_REAL_SERVERS=1 .venv/bin/python -m tests.real_servers.measure vllm --dtype bfloat16 \\
        --runs 3 [--reference] [--plant NAME]
    .venv/bin/python -m tests.real_servers.measure llama --runs 3

Each run is a fresh `kvpage audit` (fresh prompts and salts) against the same server; one line
per run: exit code, verdict, suite verdicts, retries, phantom hits, reference agreement, time."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tests.real_servers import plants
from tests.real_servers.audit_run import audit
from tests.real_servers.models import SPECS, build

NAME = "audit-tiny"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("server", choices=("vllm", "llama"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also --reference-model")
    ap.add_argument("--plant", choices=sorted(plants.PLANTS))
    ap.add_argument("--model", choices=sorted(SPECS), default="tiny")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build(work / "model", SPECS[args.model])
        extra = ["--reference-model", str(model)] if args.reference else []
        with _server(args, model, work) as served:
            for i in range(args.runs):
                run = audit(served, NAME, work / f"report{i}", *extra)
                print(json.dumps(_line(run)), flush=True)


def _server(args, model: Path, work: Path):
    if args.server == "llama":
        from bench.peers import llama_cpp as peer
        from tests.real_servers.llama_server import llama_server

        return llama_server(peer.convert(model, "f32"), NAME, work)
    from tests.real_servers.vllm_server import VllmOptions, core_package, vllm_server

    core = None
    if args.plant:
        core = plants.planted_core(core_package(), plants.PLANTS[args.plant], work)
    return vllm_server(model, NAME, VllmOptions(dtype=args.dtype, core=core), work)


def _line(run) -> dict:
    data = run.report or {}
    ref = (data.get("suites") or {}).get("reference", {}).get("data", {})
    return {
        "exit": run.exit_code,
        "verdict": data.get("verdict"),
        "suites": run.verdicts(),
        "requests": data.get("requests"),
        "retries": data.get("retries"),
        "phantom_hits": len(data.get("accounting_anomalies") or []),
        "resolution": (data.get("suites") or {})
        .get("baseline", {})
        .get("data", {})
        .get("logprob_resolution"),
        "reference": {k: ref.get(k) for k in ("answers", "same_tokens", "drift_flips", "isolation")}
        | {"max_dlp": ref.get("max_logprob_delta_same_tokens")},
        "wall_s": round(run.wall_s, 1),
    }


if __name__ == "__main__":
    main()
