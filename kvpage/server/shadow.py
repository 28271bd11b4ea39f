"""Shadow comparison: a sampled fraction of the requests served with a prefix-cache hit is
recomputed on the reference path (contiguous KV, no sharing) in a worker thread, off the serving
path, and its tokens compared with what the client got. A mismatch counts as pollution and writes an
alert with the first differing step.

Only reproducible requests are comparable: greedy, or sampled with an explicit seed (an unseeded
request's generator is seeded from the engine's per-sequence counter)."""

from __future__ import annotations

import logging
import queue
import random
import threading
from dataclasses import dataclass, replace

import torch

from kvpage.model.base import CausalLM
from kvpage.reference.generator import generate
from kvpage.reference.grammar import ReferenceGrammars
from kvpage.sampling_params import SamplingParams
from kvpage.server.audit import AuditLog

log = logging.getLogger("kvpage.server")


@dataclass(frozen=True, slots=True)
class ShadowJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    served_ids: list[int]  # what the client received
    cached_tokens: int


class ShadowChecker:
    def __init__(
        self,
        model: CausalLM,
        audit: AuditLog,
        rate: float,
        seed: int = 0,
        backlog: int = 64,
        kv_cache_dtype: str = "auto",
        model_name: str = "",
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"shadow rate must be in [0, 1], got {rate}")
        self.model, self.audit, self.rate = model, audit, rate
        self.kv_cache_dtype = kv_cache_dtype  # the reference rounds K/V as the served pool does
        # a constrained request replays through the reference's own grammars (its tokenizer
        # read from `model_name` by itself), built at the first one; "": none are checked
        self.model_name = model_name
        self._grammars: ReferenceGrammars | None = None
        self.checked = self.mismatched = self.dropped = 0
        self._random = random.Random(seed)
        self._jobs: queue.Queue[ShadowJob | None] = queue.Queue(maxsize=backlog)
        self._thread = threading.Thread(target=self._run, name="kvpage-shadow", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def counts(self) -> tuple[int, int]:
        return self.checked, self.mismatched

    def offer(self, job: ShadowJob) -> None:
        """Called for every finished request; samples, never blocks the serving path."""
        comparable = job.params.greedy or job.params.seed is not None
        if job.params.structured_outputs is not None and not self.model_name:
            return
        if job.cached_tokens <= 0 or not job.served_ids or not comparable:
            return
        if self._random.random() >= self.rate:
            return
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.dropped += 1  # the shadow falls behind; serving must not

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self.check(job)
            except Exception:
                log.exception("shadow comparison of %s failed", job.request_id)

    def check(self, job: ShadowJob) -> int | None:
        """Recompute and compare; returns the first differing step, or None if equal."""
        # The served tokens may end early (stop string, client gone): compare that many.
        params = replace(job.params, max_tokens=len(job.served_ids), logprobs=None)
        with torch.inference_mode():
            reference = generate(
                self.model,
                job.prompt_ids,
                params,
                kv_cache_dtype=self.kv_cache_dtype,
                grammars=self._grammars_for(params),
            ).token_ids
        step = first_difference(reference, job.served_ids)
        self.checked += 1
        if step is not None:
            self.mismatched += 1
            self.audit.write(
                "shadow_mismatch",
                always=True,
                request_id=job.request_id,
                step=step,
                reference_token=_at(reference, step),
                served_token=_at(job.served_ids, step),
                cached_tokens=job.cached_tokens,
                prompt_tokens=len(job.prompt_ids),
            )
            log.error("shadow comparison: %s diverged at step %d", job.request_id, step)
        return step

    def _grammars_for(self, params: SamplingParams) -> ReferenceGrammars | None:
        if params.structured_outputs is None:
            return None
        if self._grammars is None:
            cfg = self.model.config
            self._grammars = ReferenceGrammars(self.model_name, cfg.vocab_size, cfg.eos_token_ids)
        return self._grammars


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _at(ids: list[int], i: int) -> int | None:
    return ids[i] if i < len(ids) else None
