"""`kvpage` command line.

A mistake on the command line (a bad value, a file that cannot be read or written, a device that
is not there) is one `error: ...` line on stderr and exit status 2, found before the model loads
wherever it can be."""

# One module per command (generate, verify, experiment, serve); audit's parser is kvpage.audit.cli.

from __future__ import annotations

import argparse
import sys

from kvpage.audit import cli as audit_cli
from kvpage.cli import experiment, generate, serve, verify
from kvpage.cli.common import CliError, Parser
from kvpage.errors import KVPageError


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except CliError as err:
        print(f"error: {err}", file=sys.stderr)
    except KVPageError as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvpage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    verify.add_parser(sub)
    experiment.add_parser(sub)
    serve.add_parser(sub)
    audit_cli.add_parser(sub)
    return parser
