"""`kvpage` command line."""

from __future__ import annotations

import argparse
import sys

from kvpage.errors import KVPageError
from kvpage.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KVPageError as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("--model", default="builtin:tiny-llama", help="builtin:NAME or a HF directory")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--device", default="cpu")
    gen.set_defaults(func=_cmd_generate)

    ver = sub.add_parser("verify", help="release gate: suites + mutation check + report (R24)")
    ver.add_argument("--model", default="builtin:tiny-llama")
    ver.add_argument(
        "--suite",
        default="all",
        help="comma-separated: prefix,batching,preemption,failure (default all)",
    )
    ver.add_argument("--no-mutants", action="store_true", help="skip the mutation check")
    ver.add_argument("--report", default="reports/gate", help="directory for the reports")
    ver.add_argument("--quiet", action="store_true", help="no progress bar")
    ver.set_defaults(func=_cmd_verify)
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvpage.model import load_model
    from kvpage.model.tokenizer import encode_text
    from kvpage.verify.reference import generate

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.prompt is not None:
        prompt_ids = encode_text(tokenizer, args.prompt, args.model)
    else:
        prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    out = generate(model, prompt_ids, params)
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(out.token_ids)!r}")
    print(f"prompt_ids: {prompt_ids}")
    print(f"token_ids: {out.token_ids}")
    print(f"finish_reason: {out.finish_reason}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from kvpage.verify.gate import run_gate
    from kvpage.verify.report import summary_table, write_reports
    from kvpage.verify.suites import SUITES

    suites = SUITES if args.suite == "all" else tuple(args.suite.split(","))
    unknown = set(suites) - set(SUITES)
    if unknown:
        print(f"error: unknown suite(s) {sorted(unknown)}; choose from {SUITES}", file=sys.stderr)
        return 2
    result = run_gate(args.model, suites, mutants=not args.no_mutants, progress=not args.quiet)
    data = write_reports(result, args.report)
    print(summary_table(data))
    print(f"reports: {args.report}/report.json, report.md, report.html")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
