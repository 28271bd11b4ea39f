"""Fault injection to prove the auditor (`kvpage serve --inject-fault NAME`): the server starts
with one of the verifier's named mutants (kvpage.verify.mutants) bound into its engine, so an
audit can be shown to catch, through the API alone, bugs planted where they really occur.

A server with a planted bug must never be mistaken for a real one: it is refused unless
`--allow-unsafe-faults` is also given, warns loudly at start, and every reply carries the
`X-Kvpage-Injected-Fault` header."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from kvpage.errors import KVPageError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvpage.engine.engine import LLMEngine
    from kvpage.verify.mutants import Mutant

FAULT_HEADER = "X-Kvpage-Injected-Fault"


class UnsafeFaultRefused(KVPageError):
    """--inject-fault without --allow-unsafe-faults, or a fault that does not exist."""


def add_serve_args(srv: argparse.ArgumentParser) -> None:
    srv.add_argument(
        "--inject-fault",
        metavar="NAME",
        help="TESTING ONLY: start with this verifier mutant planted in the engine (to prove "
        "`kvpage audit`); needs --allow-unsafe-faults",
    )
    srv.add_argument(
        "--allow-unsafe-faults",
        action="store_true",
        help="allow --inject-fault (the server then gives wrong answers on purpose)",
    )


def chosen(args: argparse.Namespace) -> Mutant | None:
    """The fault `kvpage serve` was asked to plant, checked before the model loads."""
    name = getattr(args, "inject_fault", None)
    if name is None:
        return None
    if not args.allow_unsafe_faults:
        raise UnsafeFaultRefused(
            f"--inject-fault {name} makes the server wrong on purpose; add --allow-unsafe-faults"
        )
    return find(name)


def find(name: str) -> Mutant:
    from kvpage.verify.mutants import MUTANTS

    by_name = {m.name: m for m in MUTANTS}
    if name not in by_name:
        raise UnsafeFaultRefused(f"no fault named {name!r}; one of: {', '.join(sorted(by_name))}")
    return by_name[name]


def config_overrides(fault: Mutant | None) -> dict[str, Any]:
    """EngineConfig fields the fault needs (an 8-bit fast key, say)."""
    return dict(fault.config) if fault is not None else {}


def inject(app: FastAPI, engine: LLMEngine, fault: Mutant | None) -> None:
    """Plant the fault, mark every reply, and say so on stderr."""
    if fault is None:
        return
    fault.apply(engine)
    app.add_middleware(FaultHeader, name=fault.name)
    line = "!" * 78
    print(
        f"{line}\nWARNING: fault {fault.name!r} injected ({fault.bug}).\n"
        f"This server gives wrong answers ON PURPOSE; every reply carries {FAULT_HEADER}.\n{line}",
        file=sys.stderr,
        flush=True,
    )


class FaultHeader:
    """Pure ASGI (streams pass through untouched): adds the header to every response."""

    def __init__(self, app, name: str) -> None:
        self.app, self.value = app, name.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def marked(message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (FAULT_HEADER.lower().encode(), self.value)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, marked)
