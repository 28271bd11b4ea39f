"""`kvpage audit`: the subcommand's options and what it runs. Exit status: 0 isolated, 1 an
isolation failure, a cross-tenant leak or failed requests under sharing (isolation not shown),
2 a usage error or a server that cannot be audited (unreachable, 401, no usable endpoint)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvpage.audit.config import SUITES, AuditConfig, Tolerances
from kvpage.audit.errors import AuditError, AuditUsageError

DESCRIPTION = (
    "Audit a running OpenAI-compatible server through its API only: baseline determinism, batch "
    "invariance under concurrency and pressure, prefix reuse at block boundaries, canaries, "
    "cross-tenant timing and isolation between the models it lists (LoRA adapters); every "
    "divergence classed as noise, numeric drift or isolation failure. "
    "Exit 0: no isolation failure found; 1: isolation failure, cross-tenant leak or requests "
    "failing under sharing; 2: usage error or a server that cannot be audited."
)
KEY_ENV, SECOND_KEY_ENV = "KVPAGE_AUDIT_API_KEY", "KVPAGE_AUDIT_SECOND_API_KEY"


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _suites(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = sorted(set(names) - set(SUITES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}"
        )
    return names


def _number(cast, accepts, requirement: str):
    """An argparse type: `cast` the text, then refuse a value `accepts` rejects."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            kind = "an integer" if cast is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value

    return parse


def _int_at_least(low: int):
    return _number(int, lambda v: v >= low, f">= {low}")


_fraction = _number(float, lambda v: 0 < v < 1, "in (0, 1)")
_non_negative = _number(float, lambda v: v >= 0, ">= 0")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "audit",
        help="black-box audit of any OpenAI-compatible server for cache isolation",
        description=DESCRIPTION,
    )
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument("--api-key", help=f"API key (Bearer); else ${KEY_ENV} (not in the process list)")
    p.add_argument(
        "--second-api-key",
        help=f"a second tenant's key, for cross-tenant timing; else ${SECOND_KEY_ENV}",
    )
    p.add_argument(
        "--block-sizes",
        type=_positive_ints,
        default="16,32,64",
        help="candidate KV block sizes, comma-separated",
    )
    p.add_argument(
        "--budget-requests",
        type=_int_at_least(1),
        default=400,
        help="most requests sent, probing included",
    )
    p.add_argument("--report", default="reports/audit", help="directory for report.json/.md/.html")
    p.add_argument(
        "--suites",
        type=_suites,
        default=",".join(SUITES),
        help=f"comma-separated subset of {','.join(SUITES)}",
    )
    p.add_argument(
        "--max-tokens", type=_int_at_least(1), default=16, help="tokens per judged probe"
    )
    p.add_argument(
        "--probes", type=_int_at_least(2), default=6, help="baseline probes (= batch concurrency)"
    )
    p.add_argument(
        "--canary-group",
        type=_int_at_least(2),
        default=6,
        help="concurrent requests per canary group",
    )
    p.add_argument(
        "--timing-trials", type=_int_at_least(3), default=8, help="victim prefixes timed"
    )
    p.add_argument(
        "--timing-prefix-tokens",
        type=_int_at_least(1),
        default=1024,
        help="victim prefix length (halved if refused)",
    )
    p.add_argument(
        "--model-pairs",
        type=_int_at_least(1),
        default=6,
        help="most pairs of the models /v1/models lists (base, adapters) probed for isolation",
    )
    p.add_argument(
        "--alpha", type=_fraction, default=0.01, help="significance level of the timing tests"
    )
    p.add_argument(
        "--logprob-tolerance",
        type=_non_negative,
        default=0.1,
        help="largest logprob change still numeric drift",
    )
    p.add_argument(
        "--gap-tolerance",
        type=_non_negative,
        default=0.1,
        help="largest solo top-2 gap at which a flip may be drift",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the audit's prompts and salts (default: fresh per run; a repeated seed repeats "
        "prompts the server may have cached)",
    )
    p.add_argument("--timeout", type=_non_negative, default=60.0, help="seconds per request")
    p.add_argument(
        "--ignore-usage",
        action="store_true",
        help="judge cross-tenant timing by TTFT alone, not by the server's usage.cached_tokens",
    )
    p.add_argument(
        "--reference-model",
        metavar="DIR",
        help="the checkpoint the server serves (a Hugging Face folder): every judged answer is "
        "also compared with kvpage's contiguous reference generator's answer to the same prompt",
    )
    p.add_argument(
        "--reference-dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the reference's dtype (default float32)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def config_from(args: argparse.Namespace) -> AuditConfig:
    return AuditConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key or os.environ.get(KEY_ENV) or None,
        second_api_key=args.second_api_key or os.environ.get(SECOND_KEY_ENV) or None,
        block_sizes=args.block_sizes,
        budget_requests=args.budget_requests,
        suites=args.suites,
        max_tokens=args.max_tokens,
        probes=args.probes,
        canary_group=args.canary_group,
        timing_trials=args.timing_trials,
        timing_prefix_tokens=args.timing_prefix_tokens,
        model_pairs=args.model_pairs,
        alpha=args.alpha,
        tolerances=Tolerances(logprob=args.logprob_tolerance, gap=args.gap_tolerance),
        seed=args.seed,
        timeout_s=args.timeout,
        progress=not args.quiet,
        trust_usage=not args.ignore_usage,
        reference_model=args.reference_model,
        reference_dtype=args.reference_dtype,
    )


def _check_report_dir(path: str) -> None:
    """Before any request: an audit whose report cannot be written is wasted."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / ".kvpage-audit-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise AuditUsageError(
            f"--report {path}: cannot write there ({err.strerror or err})"
        ) from None


def run(args: argparse.Namespace) -> int:
    from kvpage.audit.report import summary_lines, write_reports
    from kvpage.audit.runner import run_audit

    try:
        cfg = config_from(args)
        _check_report_dir(args.report)
        result = run_audit(cfg)
    except AuditError as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    data = write_reports(result, args.report)
    print("\n".join(summary_lines(data)))
    print(f"reports: {args.report}/report.json, report.md, report.html")
    return result.exit_code
