"""`kvpage` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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

    exp = sub.add_parser("experiment", help="experiments built on the engine")
    exp_sub = exp.add_subparsers(dest="experiment", required=True)
    pp = exp_sub.add_parser("passphrase", help="KV sharing contamination study (R26-R28)")
    pp.add_argument("--runs", type=int, default=100)
    pp.add_argument("--concurrency", type=int, default=2)
    pp.add_argument("--block-size", type=int, default=16)
    pp.add_argument("--num-blocks", type=int, default=256)
    pp.add_argument("--max-model-len", type=int, default=128)
    pp.add_argument("--strategies", default="no_sharing,shared_no_cow,shared_cow")
    pp.add_argument("--secrets", help="file with one secret per line (6-10 letters/digits)")
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--model", default="builtin:passphrase-mini")
    pp.add_argument("--out", required=True, help="directory for results.json, report.md, PNGs")
    pp.set_defaults(func=_cmd_passphrase)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (R31)")
    srv.add_argument("--model", default="builtin:tiny-llama", help="builtin:NAME or a HF directory")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--block-size", type=int, default=16)
    srv.add_argument("--num-blocks", type=int, default=None)
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--max-num-batched-tokens", type=int, default=2048)
    srv.add_argument("--no-prefix-caching", action="store_true")
    srv.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    srv.add_argument("--dtype", default="float32")
    srv.add_argument("--device", default="cpu")
    srv.add_argument(
        "--api-keys", help="file of API keys: JSON {key: tenant} or lines `key tenant`"
    )
    srv.add_argument("--admin-token", help="enables /admin (header X-Admin-Token)")
    srv.add_argument("--shadow-rate", type=float, default=0.01, help="cache hits re-checked")
    srv.add_argument("--audit-log", help="JSON-lines audit file (default: the kvpage.audit logger)")
    srv.add_argument("--audit-sample-rate", type=float, default=1.0)
    srv.set_defaults(func=_cmd_serve)
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


def _cmd_passphrase(args: argparse.Namespace) -> int:
    from kvpage.experiments.passphrase import ExperimentConfig, load_secrets, run_experiment

    cfg = ExperimentConfig(
        runs=args.runs,
        concurrency=args.concurrency,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        strategies=tuple(args.strategies.split(",")),
        secrets=load_secrets(args.secrets) if args.secrets else None,
        seed=args.seed,
        model=args.model,
    )
    results = run_experiment(cfg, Path(args.out))
    print(f"{'group':<15}{'runs':>6}{'requests':>10}{'correct':>9}{'contaminated':>14}")
    for name, g in results["groups"].items():
        print(
            f"{name:<15}{g['runs']:>6}{g['requests']:>10}{g['correct']:>9}{g['contaminated']:>14}"
        )
    print(f"{results['seconds']}s; results in {args.out}/results.json, report.md")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvpage.config import EngineConfig
    from kvpage.engine.engine import LLMEngine
    from kvpage.server import ServerOptions, create_app
    from kvpage.server.tenants import load_api_keys

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            preemption_mode=args.preemption_mode,
            dtype=args.dtype,
            device=args.device,
        )
    )
    options = ServerOptions(
        model_name=args.model,
        api_keys=load_api_keys(args.api_keys) if args.api_keys else {},
        admin_token=args.admin_token,
        shadow_rate=args.shadow_rate,
        audit_log=args.audit_log,
        audit_sample_rate=args.audit_sample_rate,
    )
    uvicorn.run(create_app(engine, options), host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
