"""The one thread that owns the engine (which is not thread-safe).

Handlers never touch the engine: they send commands (add, abort, or any function to run between
steps) through a queue and receive each request's outputs on its own asyncio queue. While there is
no work the thread blocks on the command queue, so an idle server burns no CPU."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from kvpage.engine.engine import LLMEngine
from kvpage.engine.outputs import RequestOutput
from kvpage.errors import KVPageError
from kvpage.lora.request import LoRARequest
from kvpage.sampling_params import SamplingParams

log = logging.getLogger("kvpage.server")

_STOP = object()


class EngineFailure(KVPageError, RuntimeError):
    """The engine raised during a step; every request in flight is failed with it."""

    status = 500  # what a request that has not started its response answers
    kind = "server_error"  # OpenAI's error `type`, in the answer and in a stream's error event


class ServerShutdown(EngineFailure):
    """The server stopped before the request finished (its shutdown timeout ran out)."""

    status = 503
    kind = "service_unavailable"  # as a request refused while draining: retry elsewhere


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="kvpage-engine", daemon=True)

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        """Requests whose outputs someone still waits for."""
        return len(self._sinks)

    def fail_in_flight(self, failure: EngineFailure) -> None:
        """End every request in flight with `failure` (aborted in the engine, blocks freed)."""
        self._commands.put((self._fail_all, (failure,), None))

    # --- called from the event loop --------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the engine thread between two steps and return its result."""
        future: Future = Future()
        self._commands.put((fn, args, future))
        return await asyncio.wrap_future(future)

    async def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        salt: str | None,
        lora: LoRARequest | None = None,
    ) -> asyncio.Queue:
        """Queue a request; raises InvalidRequest (from the engine thread) if it is rejected."""
        sink: asyncio.Queue = asyncio.Queue()
        self._sinks[request_id] = (asyncio.get_running_loop(), sink)
        add = self.engine.add_request
        try:
            await self.call(add, request_id, prompt_ids, params, salt, None, lora)
        except BaseException:
            self._sinks.pop(request_id, None)
            raise
        return sink

    def run_later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget: fn(*args) on the engine thread, after every command queued before
        it (an abort included, with the engine events it emits)."""
        self._commands.put((fn, args, None))

    def abort(self, request_id: str) -> None:
        """Fire and forget: the engine frees the request's blocks at its next command drain."""
        self._commands.put((self.engine.abort_request, (request_id,), None))

    async def outputs(self, request_id: str, sink: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes. If the consumer stops early (client gone,
        stop string, cancellation) the request is aborted, so its blocks come back."""
        finished = False
        try:
            while not finished:
                out = await sink.get()
                if isinstance(out, EngineFailure):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)
            self._sinks.pop(request_id, None)

    # --- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self._drain_commands(block=not self.engine.has_unfinished_requests()):
                return
            if self.engine.has_unfinished_requests():
                self._step()

    def _drain_commands(self, block: bool) -> bool:
        """Run every queued command; wait for the first one if `block`. False means stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            if cmd is _STOP:
                return False
            self._execute(*cmd)
            block = False

    def _execute(self, fn: Callable, args: tuple, future: Future | None) -> None:
        try:
            result = fn(*args)
        except Exception as err:  # a bad command fails its caller, never the loop
            if future is None:
                log.exception("engine command %s failed", getattr(fn, "__name__", fn))
            else:
                future.set_exception(err)
            return
        if future is not None:
            future.set_result(result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # an engine bug: fail the live requests, keep serving
            log.error(json.dumps({"event": "engine_step_failed", "error": repr(err)}))
            self._fail_all(EngineFailure(repr(err)))
            return
        for out in outputs:
            self._deliver(out)

    def _fail_all(self, failure: EngineFailure) -> None:
        for request_id in list(self._sinks):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort of %s after a failed step failed too", request_id)
            self._deliver(failure, request_id)

    def _deliver(self, out: RequestOutput | EngineFailure, request_id: str = "") -> None:
        target = self._sinks.get(request_id or out.request_id)
        if target is not None:
            loop, sink = target
            loop.call_soon_threadsafe(sink.put_nowait, out)
