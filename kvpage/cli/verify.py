"""`kvpage verify`: the release gate (suites, mutation check, reports), on the configuration you
serve or, with no --model, on the verification matrix (kvpage.verify.matrix)."""

from __future__ import annotations

import argparse
import os
import sys

from kvpage.cli.common import CliError, add_engine_args, count, engine_fields, number

# The engine flags that are a dimension of the matrix: given without --model, they fix that
# dimension in every cell; the other engine flags are the base of every cell's engine.
CELL_FIELDS = (
    "dtype",
    "kv_cache_dtype",
    "quantization",
    "quantize_lm_head",
    "tensor_parallel_size",
)


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
    from kvpage.verify.cases import ALL_SUITES
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
        help=f"comma-separated suite names, or all; one of {', '.join(ALL_SUITES)}, or the parts "
        "generated (the generated stage), stack (server and router) and model (transformers "
        "on the same weights, before any engine case). The mutation "
        "check runs against the chosen suites only, so a subset misses mutants of other "
        "classes: add --no-mutants for a quick partial run",
    )
    ver.add_argument("--no-mutants", action="store_true", help="skip the mutation check")
    ver.add_argument(
        "--generated",
        type=count,
        default=None,
        metavar="N",
        help="scenarios of the generated stage (a seeded generator of engine configurations x "
        "requests x events, each run as a case against the reference); default "
        "60 in the matrix's generated cell",
    )
    ver.add_argument("--seed", type=int, default=0, help="the generated stage's seed")
    ver.add_argument(
        "--time-budget",
        type=number(float, 0.0),
        default=None,
        metavar="SEC",
        help="stop the generated stage after SEC seconds (the report says how many ran)",
    )
    ver.add_argument(
        "--replay",
        default=None,
        metavar="FILE",
        help="run one scenario file (a reproducer the generated stage wrote) and exit: 0 when "
        "it passes, 1 when it fails",
    )
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
    from kvpage.verify.generated.stage import GeneratedStage
    from kvpage.verify.matrix import DEFAULT_SCENARIOS, run_matrix
    from kvpage.verify.report import summary_table, write_reports

    if args.replay is not None:
        return _replay(args)
    suites = _suites(args.suite)
    if suites is None:
        return 2
    engine = engine_fields(args)
    cells = _cells(args, engine, suites)
    base = {k: v for k, v in engine.items() if k not in ("model", *CELL_FIELDS)}
    count = args.generated if args.generated is not None else DEFAULT_SCENARIOS
    stage = GeneratedStage(seed=args.seed, count=count, budget_s=args.time_budget)
    result = run_matrix(
        cells,
        base,
        jobs=args.jobs,
        progress=not args.quiet,
        generated=stage,
        report_dir=args.report,
    )
    data = write_reports(result, args.report)
    print(summary_table(data))
    print(f"reports: {args.report}/report.json, report.md, report.html")
    return 0 if result.passed else 1


def _suites(text: str) -> tuple[str, ...] | None:
    from kvpage.verify.cases import ALL_SUITES
    from kvpage.verify.matrix import PARTS

    known = (*ALL_SUITES, *PARTS)
    suites = known if text == "all" else tuple(text.split(","))
    unknown = set(suites) - set(known)
    if unknown:
        print(f"error: unknown suite(s) {sorted(unknown)}; choose from {known}", file=sys.stderr)
        return None
    return suites


def _replay(args: argparse.Namespace) -> int:
    """One scenario on the configured model (the honest engine, debug checks on)."""
    from kvpage.model import load_model
    from kvpage.verify.generated import Scenario, run_scenario
    from kvpage.verify.suites import Runtime

    try:
        scenario = Scenario.read(args.replay)
    except (OSError, ValueError, TypeError) as err:
        raise CliError(f"--replay {args.replay}: {err}") from err
    engine = engine_fields(args)
    model_name = engine.pop("model", None) or "builtin:tiny-llama"
    dtype = engine.pop("dtype", "float32")
    model, tokenizer = load_model(
        model_name,
        dtype,
        quantization=engine.get("quantization", "none"),
        quantize_lm_head=engine.get("quantize_lm_head", False),
    )
    result = run_scenario(scenario, Runtime(model, tokenizer, model_name, engine=engine))
    verdict = "passed" if result.passed else "FAILED"
    print(f"scenario {scenario.name}: {verdict} ({result.steps} steps, {result.seconds:.1f}s)")
    for failure in result.failures:
        print(f"  {failure.kind}: {failure.message}")
    return 0 if result.passed else 1


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
