"""Fault injection to prove the auditor (`kvpage serve --inject-fault NAME`): the server starts
with one of the verifier's named mutants (kvpage.verify.mutants) bound into its engine, so an
audit can be shown to catch, through the API alone, bugs planted where they really occur.

A server with a planted bug must never be mistaken for a real one: it is refused unless
`--allow-unsafe-faults` is also given, warns loudly at start, and every reply carries the
`X-Kvpage-Injected-Fault` header.

A bug on a path only pressure reaches (a swap-in) would show only when the audit's own load made
the server swap, which depends on how its requests happen to arrive (a loaded machine spreads
them out): such a fault brings its trigger, so the path runs on every request whatever the
timing (`plant`). Likewise a bug that frees a block another request still reads shows only once
the block is written again first, which on a small pool depends on the traffic: its trigger
overwrites every block as it is freed."""

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


def plant(engine: LLMEngine, fault: Mutant) -> None:
    """The fault's bug in `engine`, and its trigger when it has one."""
    fault.apply(engine)
    if fault.name in SWAP_TRIGGERED:
        swap_each_request_once(engine)
    if fault.name in REUSE_TRIGGERED:
        overwrite_freed_blocks(engine)


# Bugs in what a swap-in restores: the answer is wrong only after a swap-out and swap-in.
SWAP_TRIGGERED = frozenset({"restore_visible_before_copy", "swap_in_without_scales"})
# Bugs that free a block while another request still holds it: the answer is wrong only once
# the block is written again before that request reads it.
REUSE_TRIGGERED = frozenset({"no_refcount"})
FREED_KV = 7  # what a freed block's K and V read after its trigger: far from any real K/V


def overwrite_freed_blocks(engine: LLMEngine) -> None:
    """Every block's K and V overwritten when it is freed (its invalidation, in order with the
    step's other block operations), as if another request had reused it at once. An honest
    engine never reads a free block, so this alone changes no token. A tensor-parallel
    engine's pool lives in its ranks: left as it is."""
    from kvpage.verify.mutants.base import bind

    storage = engine.storage
    if not hasattr(storage, "data"):
        return
    engine.cache.invalidate_on_free()  # ordered: a pending swap-out copies the block first
    invalidate = storage.invalidate

    def invalidate_and_overwrite(self, block_id: int) -> None:
        invalidate(block_id)
        self.data[:, :, block_id].fill_(FREED_KV)

    bind(storage, "invalidate", invalidate_and_overwrite)


def swap_each_request_once(engine: LLMEngine) -> None:
    """Between steps, every running sample with an output token is swapped out once and kept
    out for a step (others run meanwhile and reuse its blocks), then swapped back in: the
    verifier's own forced preemption (StepDriver), on the server's engine thread."""
    from kvpage.verify.driver import StepDriver
    from kvpage.verify.mutants.base import bind

    driver, step, planned = StepDriver(engine), engine.step, set()

    def step_after_forced_swaps(self):
        live = {seq.sample_id for seq in self.requests.unfinished()}
        for sample_id in live - planned:
            driver.force_preempt(sample_id, after_tokens=1, mode="swap")
        planned.clear()
        planned.update(live)  # a finished sample's id is never seen again
        driver.forced = [p for p in driver.forced if not p.done and p.sample_id in live]
        driver.prepare()
        return step()

    bind(engine, "step", step_after_forced_swaps)


def inject(app: FastAPI, engine: LLMEngine, fault: Mutant | None) -> None:
    """Plant the fault, mark every reply, and say so on stderr."""
    if fault is None:
        return
    plant(engine, fault)
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
