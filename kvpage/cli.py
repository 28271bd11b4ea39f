"""`kvpage` command line.

A mistake on the command line (a bad value, a file that cannot be read or written, a device that
is not there) is one `error: ...` line on stderr and exit status 2, found before the model loads
wherever it can be."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from kvpage.audit import cli as audit_cli
from kvpage.audit import faults as audit_faults
from kvpage.config import KV_CACHE_DTYPES, PREEMPTION_MODES
from kvpage.distributed.prefix_router import ROUTERS
from kvpage.errors import KVPageError, WorkerFailure
from kvpage.model import DTYPES
from kvpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpage.config import EngineConfig
    from kvpage.server import ServerOptions

ADMIN_TOKEN_ENV = "KVPAGE_ADMIN_TOKEN"


class CliError(Exception):
    """A bad command line: printed as one `error:` line, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    try:
        args = _build_parser().parse_args(argv)
        return args.func(args)
    except CliError as err:
        print(f"error: {err}", file=sys.stderr)
    except KVPageError as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
    return 2


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except None and flags (nothing useful to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Usage errors become one line in `main` instead of usage text and a SystemExit."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {message} (see {self.prog} --help)")


# --- argument types: checked while parsing, so before anything loads ------------------------
def _number(kind: type, low: float | None = None, high: float | None = None) -> Callable:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse


_count = _number(int, 1)
_port = _number(int, 1, 65535)
_fraction = _number(float, 0.0, 1.0)


def _token_ids(text: str) -> list[int]:
    ids = []
    for part in text.split(","):
        if part.strip():
            if not part.strip().isdigit():
                raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a token id")
            ids.append(int(part))
    if not ids:
        raise argparse.ArgumentTypeError("no token ids")
    return ids


def _device(text: str) -> str:
    """A device this machine has: `--device cuda` without CUDA fails here, not in the loader."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device ({err})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text}: CUDA is not available on this machine")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s)")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text}: only cpu and cuda devices are supported")
    return text


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvpage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_verify(sub)
    _add_experiment(sub)
    _add_serve(sub)
    audit_cli.add_parser(sub)
    return parser


def _add_model_args(p: argparse.ArgumentParser, model: str = "builtin:tiny-llama") -> None:
    p.add_argument("--model", default=model, help="builtin:NAME or a Hugging Face directory")
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="weights and KV")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")


def _add_tensor_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=_count,
        default=1,
        help="processes the model is split across (gloo; 1: this process only)",
    )


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="comma-separated prompt token ids")
    gen.add_argument("--max-tokens", type=_count, default=32, help="tokens to generate")
    gen.add_argument("--temperature", type=_number(float, 0.0), default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=-1, help="-1: all tokens")
    gen.add_argument("--top-p", type=_number(float, 0.0, 1.0), default=1.0, help="nucleus mass")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens")
    gen.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="K/V round trip of the reference (auto: as computed)",
    )
    _add_tensor_parallel(gen)
    gen.set_defaults(func=_cmd_generate)


def _add_verify(sub) -> None:
    ver = sub.add_parser("verify", help="release gate: suites + mutation check + report (R24)")
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
    _add_tensor_parallel(ver)
    ver.set_defaults(func=_cmd_verify)


def _add_experiment(sub) -> None:
    exp = sub.add_parser("experiment", help="experiments built on the engine")
    exp_sub = exp.add_subparsers(dest="experiment", required=True)
    pp = exp_sub.add_parser("passphrase", help="KV sharing contamination study (R26-R28)")
    pp.add_argument("--runs", type=_count, default=100, help="runs per strategy")
    pp.add_argument("--concurrency", type=_count, default=2, help="requests sharing a run")
    pp.add_argument("--block-size", type=_count, default=16, help="tokens per KV block")
    pp.add_argument("--num-blocks", type=_count, default=256, help="KV pool blocks")
    pp.add_argument("--max-model-len", type=_count, default=128, help="tokens per sequence")
    pp.add_argument(
        "--strategies", default="no_sharing,shared_no_cow,shared_cow", help="comma-separated"
    )
    pp.add_argument("--secrets", help="file with one secret per line (6-10 letters/digits)")
    pp.add_argument("--seed", type=int, default=0, help="experiment seed")
    pp.add_argument("--model", default="builtin:passphrase-mini", help="builtin:NAME or HF dir")
    pp.add_argument("--out", required=True, help="directory for results.json, report.md, PNGs")
    pp.set_defaults(func=_cmd_passphrase)


def _add_serve(sub) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (R31)")
    _add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=_port, default=8000, help="port to listen on")
    srv.add_argument("--block-size", type=_count, default=16, help="tokens per KV block")
    srv.add_argument(
        "--num-blocks",
        type=_count,
        default=None,
        help="KV pool blocks (default: sized from the model and --max-num-seqs)",
    )
    srv.add_argument("--max-num-seqs", type=_count, default=64, help="requests per step")
    srv.add_argument("--max-num-batched-tokens", type=_count, default=2048, help="per step")
    srv.add_argument("--no-prefix-caching", action="store_true", help="never share KV blocks")
    srv.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="how the KV pool stores K/V (auto: the model dtype; int8/fp8_e4m3: quantized)",
    )
    srv.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default="recompute",
        help="what happens to a preempted request's KV",
    )
    srv.add_argument(
        "--api-keys",
        help="file of API keys: JSON {key: tenant} or lines `key tenant` "
        "(default: none, an open server)",
    )
    token = srv.add_mutually_exclusive_group()
    token.add_argument(
        "--admin-token",
        help="enables /admin (header X-Admin-Token); visible in the process "
        f"list: prefer --admin-token-file or ${ADMIN_TOKEN_ENV}",
    )
    token.add_argument(
        "--admin-token-file",
        help=f"file holding the admin token (else ${ADMIN_TOKEN_ENV}; with neither, /admin is off)",
    )
    srv.add_argument("--shadow-rate", type=_fraction, default=0.01, help="cache hits re-checked")
    srv.add_argument(
        "--audit-log",
        default="kvpage-audit.jsonl",
        help="JSON-lines audit file, appended to (relative to the working directory); "
        "'-' writes the lines to stderr instead",
    )
    srv.add_argument("--audit-sample-rate", type=_fraction, default=1.0, help="lines kept")
    srv.add_argument(
        "--max-body-bytes",
        type=_count,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413 before they are parsed",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=_number(float, 0.0),
        default=10.0,
        help="seconds in-flight requests get on shutdown; then streams end with an error event",
    )
    audit_faults.add_serve_args(srv)
    _add_tensor_parallel(srv)
    _add_replicas(srv)
    srv.set_defaults(func=_cmd_serve)


def _add_replicas(srv: argparse.ArgumentParser) -> None:
    """Scale-out on Ray Serve (R36); with --replicas 1 none of it applies and Ray is not imported."""
    srv.add_argument(
        "--replicas",
        type=_count,
        default=1,
        help="engine replicas on Ray Serve behind one ingress (1: this process only, no Ray)",
    )
    srv.add_argument(
        "--router",
        choices=ROUTERS,
        default=None,
        help="how requests are spread over replicas (default: prefix, the prefix-affinity router)",
    )
    srv.add_argument(
        "--router-max-imbalance",
        type=_number(int, 0),
        default=4,
        help="prefix router: requests in flight a prefix match may cost over the least-loaded replica",
    )
    srv.add_argument(
        "--replica-cpus", type=_number(float, 0.0), default=1.0, help="Ray CPUs per replica"
    )
    srv.add_argument(
        "--ray-address",
        default=None,
        help="attach to this Ray cluster (e.g. ray://head:10001 or auto) instead of starting "
        "a local one; needs --replicas > 1",
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvpage.model import load_model
    from kvpage.model.tokenizer import encode_text
    from kvpage.verify.reference import generate

    params = SamplingParams(  # checked before the model loads
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.prompt is not None:
        prompt_ids = encode_text(tokenizer, args.prompt, args.model)
    else:
        prompt_ids = args.prompt_ids
    if args.tensor_parallel_size > 1:
        out = _generate_tensor_parallel(args, model, tokenizer, prompt_ids, params)
    else:
        out = generate(model, prompt_ids, params, kv_cache_dtype=args.kv_cache_dtype)
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(out.token_ids)!r}")
    print(f"prompt_ids: {prompt_ids}")
    print(f"token_ids: {out.token_ids}")
    print(f"finish_reason: {out.finish_reason}")
    return 0


def _generate_tensor_parallel(args, model, tokenizer, prompt_ids, params):
    """One request through a tensor-parallel engine (the one-process path above runs the
    contiguous reference, which has no paged pool to shard)."""
    from kvpage.config import EngineConfig
    from kvpage.engine.engine import LLMEngine

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    engine = LLMEngine(config, model, tokenizer)
    finished = []
    try:
        engine.add_request("0", prompt_ids, params)
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
    finally:
        engine.shutdown()
    out = finished[0]
    if out.outputs[0].finish_reason == "error":
        raise WorkerFailure(out.error)
    return out.outputs[0]


def _cmd_verify(args: argparse.Namespace) -> int:
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
    from kvpage.engine.engine import LLMEngine
    from kvpage.server import create_app
    from kvpage.server.background import serve

    _check_replica_args(args)
    if args.replicas > 1:
        return _cmd_serve_replicas(args)
    options = _server_options(args)  # every file and the address, before the model loads
    fault = audit_faults.chosen(args)
    _check_listen(args.host, args.port)
    engine = LLMEngine(_engine_config(args, **audit_faults.config_overrides(fault)))
    app = create_app(engine, options)
    audit_faults.inject(app, engine, fault)
    print("kvpage serve", *(f"  {line}" for line in app.state.server.describe()), sep="\n")
    print(f"  listening on http://{args.host}:{args.port}", flush=True)
    serve(app, args.host, args.port)
    return 0


def _engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    from kvpage.config import EngineConfig

    return EngineConfig(
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        **overrides,
    )


def _check_replica_args(args: argparse.Namespace) -> None:
    """Options that only mean something with replicas, and what replicas cannot combine with."""
    if args.replicas == 1:
        for flag, value in (("--router", args.router), ("--ray-address", args.ray_address)):
            if value is not None:
                raise CliError(f"{flag} needs --replicas > 1 (one replica is this process)")
        return
    if args.tensor_parallel_size > 1:
        raise CliError("--replicas > 1 with --tensor-parallel-size > 1 is not supported")
    if audit_faults.chosen(args) is not None:
        raise CliError("planted faults (audit targets) run on a single server: drop --replicas")


def _cmd_serve_replicas(args: argparse.Namespace) -> int:
    """N engine replicas on Ray Serve; blocks until Ctrl-C or SIGTERM, then deletes the application."""
    import secrets
    from dataclasses import replace

    from kvpage.distributed.prefix_router import RouterConfig

    options = _server_options(args)
    if options.audit_log is not None:  # the replicas' working directory is Ray's, not ours
        options = replace(options, audit_log=str(Path(options.audit_log).resolve()))
    # One secret for all replicas (and their replacements): a tenant's salt is the same on each.
    options = replace(options, tenant_secret=secrets.token_bytes(32))
    if args.ray_address is None:
        _check_listen(args.host, args.port)
    try:
        from kvpage.distributed import ray_serve
    except ImportError as err:
        raise CliError(f"--replicas needs Ray Serve: pip install 'kvpage[ray]' ({err})") from None
    router = RouterConfig(
        policy=args.router or "prefix",
        chunk_tokens=args.block_size,
        min_match_tokens=args.block_size,
        max_imbalance=args.router_max_imbalance,
    )
    spec = ray_serve.ReplicaSpec(_engine_config(args), options, cpus=args.replica_cpus)
    ray_serve.start(
        ray_serve.ServiceConfig(spec, args.replicas, router), args.host, args.port, args.ray_address
    )
    print(f"kvpage serve: {args.replicas} replicas on Ray Serve, router {router.policy}")
    print(f"  listening on http://{args.host}:{args.port}", flush=True)
    _wait_for_stop_signal()
    ray_serve.stop()
    return 0


def _wait_for_stop_signal() -> None:
    """Until Ctrl-C or SIGTERM (how a service manager stops a server). Ray's driver answers
    SIGTERM with a stack dump and an exit that skips Serve's shutdown: ours replaces it here."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        while not stop.wait(1.0):
            pass


def _server_options(args: argparse.Namespace) -> ServerOptions:
    from kvpage.server import ServerOptions
    from kvpage.server.tenants import load_api_keys

    try:
        api_keys = load_api_keys(args.api_keys) if args.api_keys else {}
    except ValueError as err:
        raise CliError(f"--api-keys {err}") from None
    audit_log = None if args.audit_log == "-" else args.audit_log
    if audit_log:
        _check_writable(audit_log)
    else:
        _audit_to_stderr()
    return ServerOptions(
        model_name=args.model,
        api_keys=api_keys,
        admin_token=_admin_token(args),
        shadow_rate=args.shadow_rate,
        audit_log=audit_log,
        audit_sample_rate=args.audit_sample_rate,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )


def _admin_token(args: argparse.Namespace) -> str | None:
    """--admin-token, else --admin-token-file, else $KVPAGE_ADMIN_TOKEN, else None (no /admin).
    A token given but empty is an error; an empty environment variable counts as unset."""
    if args.admin_token is not None:
        token, source = args.admin_token, "--admin-token"
    elif args.admin_token_file is not None:
        source = f"--admin-token-file {args.admin_token_file}"
        try:
            token = Path(args.admin_token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise CliError(f"{source}: cannot read it ({_reason(err)})") from None
    else:
        return os.environ.get(ADMIN_TOKEN_ENV, "").strip() or None
    if not token.strip():
        raise CliError(f"{source}: the admin token is empty")
    return token


def _audit_to_stderr() -> None:
    """Without a file the audit lines go to the `kvpage.audit` logger: send it to stderr."""
    import logging

    logger = logging.getLogger("kvpage.audit")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _check_writable(path: str) -> None:
    """Open for append once; a file that did not exist is not left behind by the check."""
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
        if not existed:
            os.remove(path)
    except OSError as err:
        raise CliError(f"--audit-log {path}: cannot write to it ({_reason(err)})") from None


def _check_listen(host: str, port: int) -> None:
    """Fail now rather than after the model has loaded (a race remains, but not the common case
    of a port already taken or a host that is not this machine's)."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise CliError(
            f"--host {host} --port {port}: cannot listen there ({_reason(err)})"
        ) from None


def _reason(err: Exception) -> str:
    return err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
