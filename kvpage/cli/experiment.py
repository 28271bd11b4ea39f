"""`kvpage experiment passphrase`: the KV-sharing contamination study."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from kvpage.cli.common import (
    count,
)

if TYPE_CHECKING:
    pass


def add_parser(sub) -> None:
    exp = sub.add_parser("experiment", help="experiments built on the engine")
    exp_sub = exp.add_subparsers(dest="experiment", required=True)
    pp = exp_sub.add_parser("passphrase", help="KV sharing contamination study")
    pp.add_argument("--runs", type=count, default=100, help="runs per strategy")
    pp.add_argument("--concurrency", type=count, default=2, help="requests sharing a run")
    pp.add_argument("--block-size", type=count, default=16, help="tokens per KV block")
    pp.add_argument("--num-blocks", type=count, default=256, help="KV pool blocks")
    pp.add_argument("--max-model-len", type=count, default=128, help="tokens per sequence")
    pp.add_argument(
        "--strategies", default="no_sharing,shared_no_cow,shared_cow", help="comma-separated"
    )
    pp.add_argument("--secrets", help="file with one secret per line (6-10 letters/digits)")
    pp.add_argument("--seed", type=int, default=0, help="experiment seed")
    pp.add_argument("--model", default="builtin:passphrase-mini", help="builtin:NAME or HF dir")
    pp.add_argument("--out", required=True, help="directory for results.json, report.md, PNGs")
    pp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpage.experiments.passphrase import ExperimentConfig, load_secrets, run_experiment

    # Every field has the flag of its name; two are parsed further.
    given = {f.name: getattr(args, f.name) for f in fields(ExperimentConfig)}
    given["strategies"] = tuple(args.strategies.split(","))
    given["secrets"] = load_secrets(args.secrets) if args.secrets else None
    cfg = ExperimentConfig(**given)
    results = run_experiment(cfg, Path(args.out))
    print(f"{'group':<15}{'runs':>6}{'requests':>10}{'correct':>9}{'contaminated':>14}")
    for name, g in results["groups"].items():
        print(
            f"{name:<15}{g['runs']:>6}{g['requests']:>10}{g['correct']:>9}{g['contaminated']:>14}"
        )
    print(f"{results['seconds']}s; results in {args.out}/results.json, report.md")
    return 0
