"""`kvpage verify`: the release gate (suites, mutation check, reports)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvpage.cli.common import (
    add_tensor_parallel,
)
from kvpage.config import KV_CACHE_DTYPES
from kvpage.model import DTYPES

if TYPE_CHECKING:
    pass


def add_parser(sub) -> None:
    ver = sub.add_parser("verify", help="release gate: suites + mutation check + report")
    ver.add_argument("--model", default="builtin:tiny-llama", help="builtin:NAME or a HF dir")
    from kvpage.verify.cases import SUITES

    ver.add_argument(
        "--suite",
        default="all",
        help=f"comma-separated suite names, or all; one of {', '.join(SUITES)}. The mutation "
        "check runs against the chosen suites only, so a subset misses mutants of other "
        "classes: add --no-mutants for a quick partial run",
    )
    ver.add_argument("--no-mutants", action="store_true", help="skip the mutation check")
    ver.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="int8",
        help="KV format the prefix, batching and preemption suites run in once more (with a "
        "copy-on-write fork case), against a reference with the same K/V round trip; auto: "
        "run them once, and skip the quantized-KV mutants",
    )
    ver.add_argument(
        "--dtype",
        default="float32",
        choices=tuple(DTYPES),
        help="model (and reference) compute dtype; 16-bit: logits agree within 0.25 and a greedy "
        "near-tie decided by rounding ends a comparison instead of failing it",
    )
    ver.add_argument("--report", default="reports/gate", help="directory for the reports")
    ver.add_argument("--quiet", action="store_true", help="no progress bar")
    add_tensor_parallel(ver)
    ver.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpage.verify.gate import run_gate
    from kvpage.verify.report import summary_table, write_reports
    from kvpage.verify.suites import SUITES

    suites = SUITES if args.suite == "all" else tuple(args.suite.split(","))
    unknown = set(suites) - set(SUITES)
    if unknown:
        print(f"error: unknown suite(s) {sorted(unknown)}; choose from {SUITES}", file=sys.stderr)
        return 2
    result = run_gate(
        args.model,
        suites,
        mutants=not args.no_mutants,
        progress=not args.quiet,
        kv_cache_dtypes=(args.kv_cache_dtype,),
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    data = write_reports(result, args.report)
    print(summary_table(data))
    print(f"reports: {args.report}/report.json, report.md, report.html")
    return 0 if result.passed else 1
