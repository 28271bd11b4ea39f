"""`kvpage serve`: the OpenAI-compatible server, alone or as Ray Serve replicas. Every file and
the address are checked before the model loads."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from kvpage.audit import faults as audit_faults
from kvpage.cli.common import (
    ADMIN_TOKEN_ENV,
    CliError,
    add_engine_args,
    count,
    engine_fields,
    fraction,
    number,
    port,
    reason,
)
from kvpage.serve_replicas.prefix_router import ROUTERS

if TYPE_CHECKING:
    from kvpage.config import EngineConfig
    from kvpage.server import ServerOptions


def add_parser(sub) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(srv)
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=(),
        metavar="NAME=PATH",
        type=_lora_module,
        help="PEFT adapter directories served as models NAME (implies --enable-lora)",
    )
    srv.add_argument(
        "--chat-template",
        metavar="FILE|TEMPLATE",
        help="the chat template, in place of the model's (as vLLM: a file's path, else the "
        "Jinja template itself, backslash escapes decoded)",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default with tools): tool calls are parsed out of the '
        "reply (needs --tool-call-parser)",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=("hermes",),  # kvpage.server.tool_calls.PARSERS (not imported: fastapi)
        help="the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>, the "
        "Qwen2.5/Qwen3/Hermes templates')",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=port, default=8000, help="port to listen on")
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
    srv.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's names in the API (as vLLM: requests may use any, responses and "
        "/v1/models give the first; default: the model argument)",
    )
    srv.add_argument("--shadow-rate", type=fraction, default=0.01, help="cache hits re-checked")
    srv.add_argument(
        "--audit-log",
        default="kvpage-audit.jsonl",
        help="JSON-lines audit file, appended to (relative to the working directory); "
        "'-' writes the lines to stderr instead",
    )
    srv.add_argument("--audit-sample-rate", type=fraction, default=1.0, help="lines kept")
    srv.add_argument(
        "--max-body-bytes",
        type=count,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413 before they are parsed",
    )
    srv.add_argument(
        "--body-read-timeout",
        type=number(float, 0.1),
        default=30.0,
        help="seconds a request body has to arrive whole; a slower one gets 408",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=number(float, 0.0),
        default=10.0,
        help="seconds in-flight requests get on shutdown; then streams end with an error event",
    )
    audit_faults.add_serve_args(srv)
    _add_replicas(srv)
    srv.set_defaults(func=run)


def _add_replicas(srv: argparse.ArgumentParser) -> None:
    """Scale-out on Ray Serve; with --replicas 1 none of it applies and Ray is not imported."""
    srv.add_argument(
        "--replicas",
        type=count,
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
        type=number(int, 0),
        default=4,
        help="prefix router: requests in flight a prefix match may cost over the least-loaded replica",
    )
    srv.add_argument(
        "--replica-cpus", type=number(float, 0.0), default=1.0, help="Ray CPUs per replica"
    )
    srv.add_argument(
        "--ray-address",
        default=None,
        help="attach to this Ray cluster (e.g. ray://head:10001 or auto) instead of starting "
        "a local one; needs --replicas > 1",
    )


def run(args: argparse.Namespace) -> int:
    from kvpage.engine.engine import LLMEngine
    from kvpage.server import create_app
    from kvpage.server.background import serve

    check_replica_args(args)
    if args.replicas > 1:
        return _cmd_serve_replicas(args)
    options = server_options(args)  # every file and the address, before the model loads
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

    fields = engine_fields(args)
    if args.lora_modules:
        fields["enable_lora"] = True
    return EngineConfig(**{**fields, **overrides})


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH")
    return name, path


def check_replica_args(args: argparse.Namespace) -> None:
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

    from kvpage.serve_replicas.prefix_router import RouterConfig

    options = server_options(args)
    if options.audit_log is not None:  # the replicas' working directory is Ray's, not ours
        options = replace(options, audit_log=str(Path(options.audit_log).resolve()))
    # One secret for all replicas (and their replacements): a tenant's salt is the same on each.
    options = replace(options, tenant_secret=secrets.token_bytes(32))
    if args.ray_address is None:
        _check_listen(args.host, args.port)
    try:
        from kvpage.serve_replicas import ray_serve
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
    wait_for_stop_signal()
    ray_serve.stop()
    return 0


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_POLL_S = 0.5  # a signal the kernel hands to one of Ray's threads is seen by the next look


def wait_for_stop_signal() -> None:
    """Until Ctrl-C or SIGTERM (how a service manager stops a server); a second one stops at
    once (KeyboardInterrupt). Both handlers are ours: Ray's driver answers SIGTERM with a
    stack dump and an exit that skips Serve's shutdown, and a process started in the
    background of a non-interactive shell (`make test &`, a CI runner's job) inherits SIGINT
    ignored, which Python keeps: Ctrl-C then did nothing at all."""
    stop = threading.Event()

    def stopping(signum, frame) -> None:
        stop.set()
        for sig in STOP_SIGNALS:  # the next one is a KeyboardInterrupt wherever the stop is
            signal.signal(sig, signal.default_int_handler)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stopping)
    while not stop.wait(STOP_POLL_S):
        pass


def server_options(args: argparse.Namespace) -> ServerOptions:
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
    chat_template = _chat_template(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CliError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    names = tuple(args.served_model_name or (args.model,))
    if any(not name for name in names):
        raise CliError("--served-model-name: names must be non-empty")
    return ServerOptions(
        model_name=names[0],
        served_model_names=names,
        api_keys=api_keys,
        admin_token=_admin_token(args),
        shadow_rate=args.shadow_rate,
        audit_log=audit_log,
        audit_sample_rate=args.audit_sample_rate,
        max_body_bytes=args.max_body_bytes,
        body_read_timeout=args.body_read_timeout,
        shutdown_timeout=args.shutdown_timeout,
        lora_modules=tuple(args.lora_modules),
        chat_template=chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )


def _chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template's text; it and the model's own templates are compiled now, so that one
    that does not compile stops the server before the model loads."""
    from kvpage.server.chat import ChatTemplateInvalid, load_chat_template, template_text

    try:
        text = None if args.chat_template is None else template_text(args.chat_template)
        load_chat_template(args.model, text)
    except ChatTemplateInvalid as err:
        raise CliError(str(err)) from None
    return text


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
            raise CliError(f"{source}: cannot read it ({reason(err)})") from None
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
        raise CliError(f"--audit-log {path}: cannot write to it ({reason(err)})") from None


def _check_listen(host: str, port: int) -> None:
    """Fail now rather than after the model has loaded (a race remains, but not the common case
    of a port already taken or a host that is not this machine's)."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise CliError(
            f"--host {host} --port {port}: cannot listen there ({reason(err)})"
        ) from None
