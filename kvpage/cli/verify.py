"""`kvpage verify`: the release gate (suites, mutation check, reports), on the configuration you
serve or, with no --model, on the verification matrix (kvpage.verify.matrix)."""

from __future__ import annotations

import argparse
import os
import sys

from kvpage.cli.common import CliError, add_engine_args, count, engine_fields

# The engine flags that are a dimension of the matrix: given without --model, they fix that
# dimension in every cell; the other engine flags are the base of every cell's engine.
CELL_FIELDS = ("dtype", "kv_cache_dtype", "tensor_parallel_size")


def add_parser(sub) -> None:
    ver = sub.add_parser(
        "verify",
        help="release gate: suites + mutation check + report",
        description="Verifies the configuration given by the engine flags (the same as "
        "`kvpage serve`'s). With --model: that one configuration, every suite and mutant in "
        "it. Without: the matrix of built-in models x dtypes x KV formats x TP sizes "
        "(--matrix), with any of --dtype/--kv-cache-dtype/--tensor-parallel-size fixed in every "
        "cell. A case's own engine fields (its block size, a pool small enough to preempt) "
        "win over the flags: the case is built around them; fields no case sets run as given.",
    )
    add_engine_args(ver, defaults=False)
    from kvpage.verify.cases import SUITES
    from kvpage.verify.matrix import MATRICES

    ver.add_argument(
        "--matrix",
        choices=tuple(MATRICES),
        default=None,
        help="cells to run (default: the default matrix without --model, one cell with it); "
        "with --model, the matrix's cells on that model",
    )
    ver.add_argument(
        "--suite",
        default="all",
        help=f"comma-separated suite names, or all; one of {', '.join(SUITES)}. The mutation "
        "check runs against the chosen suites only, so a subset misses mutants of other "
        "classes: add --no-mutants for a quick partial run",
    )
    ver.add_argument("--no-mutants", action="store_true", help="skip the mutation check")
    ver.add_argument(
        "--jobs",
        type=count,
        default=min(2, os.cpu_count() or 1),
        help="matrix cells run at once, each in its own process",
    )
    ver.add_argument("--report", default="reports/gate", help="directory for the reports")
    ver.add_argument("--quiet", action="store_true", help="no progress bar")
    ver.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpage.verify.matrix import run_matrix
    from kvpage.verify.report import summary_table, write_reports

    suites = _suites(args.suite)
    if suites is None:
        return 2
    engine = engine_fields(args)
    cells = _cells(args, engine, suites)
    base = {k: v for k, v in engine.items() if k not in ("model", *CELL_FIELDS)}
    result = run_matrix(cells, base, jobs=args.jobs, progress=not args.quiet)
    data = write_reports(result, args.report)
    print(summary_table(data))
    print(f"reports: {args.report}/report.json, report.md, report.html")
    return 0 if result.passed else 1


def _suites(text: str) -> tuple[str, ...] | None:
    from kvpage.verify.suites import SUITES

    suites = SUITES if text == "all" else tuple(text.split(","))
    unknown = set(suites) - set(SUITES)
    if unknown:
        print(f"error: unknown suite(s) {sorted(unknown)}; choose from {SUITES}", file=sys.stderr)
        return None
    return suites


def _cells(args: argparse.Namespace, engine: dict, suites: tuple[str, ...]):
    """--model alone: that configuration; otherwise the matrix, with the given dimensions fixed,
    each cell narrowed to `suites` (a cell left with none is dropped)."""
    from kvpage.verify.matrix import matrix_cells, pin, single_cell

    mutants = not args.no_mutants
    if args.model is not None and args.matrix is None:
        return [single_cell(args.model, engine, suites, mutants)]
    dims = {k: v for k, v in engine.items() if k in ("model", *CELL_FIELDS)}
    cells = pin(matrix_cells(args.matrix or "default"), dims, suites, mutants)
    if not cells:
        raise CliError(f"--suite {args.suite}: no cell of the matrix runs it")
    return cells
