"""LLMEngine: add / abort / step. Owns the model, the KV pool, the cache manager and the scheduler;
one `step()` schedules, runs the model once over the packed batch, samples and retires requests.

Whoever watches the engine (the verifier's tracer, the server's audit log and metrics, tests)
attaches an `EngineObserver` (kvpage.engine.events) with `add_observer`; nothing else reaches in."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from kvpage.cache.block_table import blocks_for
from kvpage.cache.events import AuditEvent, CorruptionEvent, CowEvent
from kvpage.cache.manager import KVCacheManager
from kvpage.config import EngineConfig
from kvpage.engine.events import (
    Aborted,
    CacheCorruption,
    CowCopy,
    EngineObserver,
    Finished,
    Freed,
    TimedOut,
    emit,
    held_blocks,
    who,
)
from kvpage.engine.namespace import base_namespace
from kvpage.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpage.engine.runner import ModelRunner, StepBatch
from kvpage.engine.sampler import Sampler
from kvpage.engine.scheduler import Scheduler
from kvpage.engine.sequence import ForcedPreemption, SeqStatus, Sequence
from kvpage.engine.swap import KVSwapper
from kvpage.errors import InvalidRequest, WorkerFailure
from kvpage.kv.format import kv_format
from kvpage.kv.storage import KVShard, KVStorage
from kvpage.kv.swap_space import SwapSpace
from kvpage.model import load_model
from kvpage.model.base import CausalLM
from kvpage.model.tokenizer import Tokenizer, encode_text
from kvpage.sampling import chosen_logprobs, make_generator
from kvpage.sampling_params import SamplingParams

DEFAULT_KV_CACHE_MEMORY = 512 * 2**20


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        if model is None:
            model, tokenizer = load_model(config.model, config.dtype, config.device)
        self.model, self.tokenizer = model, tokenizer
        mcfg = model.config
        self.max_model_len = min(
            config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
        )
        self.kv_format = kv_format(config.kv_cache_dtype, model.dtype)
        num_blocks = self._num_blocks()
        self.tp = _tensor_parallel(config, model, num_blocks, self.kv_format)
        self.storage = (
            self.tp.storage
            if self.tp
            else KVStorage(
                mcfg.num_layers,
                num_blocks,
                config.block_size,
                mcfg.num_kv_heads,
                mcfg.head_dim,
                self.kv_format,
                model.device,
            )
        )
        self.cache = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            # Per-operation checks inside the manager are for its own tests; the engine checks
            # every invariant once per step instead (R22), which catches the same corruption.
            fast_key_bits=config.fast_key_bits,
            debug_checks=False,
            copy_block_fn=self._copy_block,
            listener=self._on_cache_event,
            # A block's scales belong to its generation: invalidated when it is freed.
            free_block_fn=self._block_freed if self.kv_format.quantized else None,
        )
        self._observers: list[EngineObserver] = []  # shared with the scheduler and the swapper
        self.swap_space = SwapSpace(config.swap_space_blocks)
        self.swapper = KVSwapper(self.cache, self.storage, self.swap_space, self._observers)
        self.scheduler = Scheduler(config, self.cache, self.swapper, self._observers)
        self.runner = (
            self.tp.runner(self.cache) if self.tp else ModelRunner(model, self.storage, self.cache)
        )
        self.failure: WorkerFailure | None = None  # set when a tensor-parallel worker is lost
        self.sampler = Sampler()
        self.namespace = base_namespace(
            model, tokenizer, config.block_size, config.model, self.kv_format
        )
        self.seqs: dict[str, Sequence] = {}  # request id -> its sample 0 (the only one if n == 1)
        self.samples: dict[str, list[Sequence]] = {}  # request id -> its samples, by index
        self._by_seq_id: dict[int, Sequence] = {}  # live sequences: cache events name seq ids
        self._to_fork: set[int] = set()  # seq ids of n > 1 requests before their first token
        self._forced_later: dict[str, ForcedPreemption] = {}  # sample id -> plan, until forked
        self.step_count = 0
        self.counters = {"aborts": 0, "timeouts": 0}  # swap counts are the swapper's
        self._pending: list[RequestOutput] = []
        self._with_deadline: set[str] = set()  # request ids with a timeout still in flight
        self.emit_progress = True  # per-token outputs for streaming; offline callers turn it off
        self._seq_ids = itertools.count()

    # --- construction helpers --------------------------------------------------------------
    def _num_blocks(self) -> int:
        cfg, mcfg = self.config, self.model.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        per_block = KVStorage.bytes_per_block(
            mcfg.num_layers, cfg.block_size, mcfg.num_kv_heads, mcfg.head_dim, self.kv_format
        )
        by_memory = (cfg.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // per_block
        by_workload = cfg.max_num_seqs * blocks_for(self.max_model_len, cfg.block_size)
        return max(1, min(by_memory, by_workload) if cfg.kv_cache_memory is None else by_memory)

    # --- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Validate and queue a request. A bad request raises InvalidRequest and changes nothing."""
        if self.failure is not None:
            raise WorkerFailure(f"the engine lost its tensor-parallel group: {self.failure}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"sampling_params must be SamplingParams, got {type(params)}")
        if request_id in self.seqs:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        self._check_request(prompt_ids, params)
        now = time.monotonic()
        timeout_s = timeout_s if timeout_s is not None else self.config.request_timeout_s
        seq = self._new_sequence(request_id, prompt_ids, params, cache_salt, now)
        seq.deadline = None if timeout_s is None else now + timeout_s
        if seq.deadline is not None:
            self._with_deadline.add(request_id)
        self.seqs[request_id] = seq
        self.samples[request_id] = [seq]
        self._by_seq_id[seq.seq_id] = seq
        if params.n > 1:
            self._to_fork.add(seq.seq_id)  # R33: one sequence until its prefill is done
        self.scheduler.add(seq)

    def _new_sequence(self, request_id, prompt_ids, params, cache_salt, now) -> Sequence:
        seq_id = next(self._seq_ids)
        chain = self.cache.new_key_chain(self.namespace.with_salt(cache_salt))
        chain.extend(prompt_ids)
        eos = () if params.ignore_eos else self.model.config.eos_token_ids
        return Sequence(
            seq_id=seq_id,
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            chain=chain,
            table=self.cache.new_table(seq_id),
            # Sample 0's seed is params.seed, which is what params.for_sample(0) would give.
            generator=make_generator(params, self.config.seed + seq_id, self.model.device),
            stop_ids=frozenset((*eos, *params.stop_token_ids)),
            arrival_time=now,
            cache_salt=cache_salt,
            logprobs=[] if params.logprobs is not None else None,
            token_logprobs=[] if params.logprobs is not None else None,
        )

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt, self.config.model)
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidRequest("prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise InvalidRequest("prompt is empty: at least one token is needed")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len}"
            )
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(
                f"max_tokens {params.max_tokens} + prompt {len(prompt_ids)} tokens exceeds the "
                f"model's context of {self.max_model_len}"
            )
        need = self.cache.blocks_for(total)
        if need > self.cache.pool.num_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens needs {need} KV blocks; the pool has only "
                f"{self.cache.pool.num_blocks}"
            )

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Abort wherever the request is (waiting, running, swapped); its blocks come back.
        Every unfinished sample of a parallel request goes; a sample id `rid#i` aborts only
        that sample (the server's stop strings end samples one at a time)."""
        live = [seq for seq in self._samples_named(request_id) if not seq.finished]
        if not live:
            return False
        self.counters["aborts" if reason == "abort" else "timeouts"] += 1
        if self._observers:
            self._emit_abort(request_id, live, reason)
        for seq in live:
            self._finish(seq, reason)
        return True

    def _emit_abort(self, name: str, live: list[Sequence], reason: str) -> None:
        """One event for the call; it names the request (or sample) as the caller did."""
        fields = {**who(live[0]), "sample_id": name, "samples": tuple(s.sample_id for s in live)}
        if reason == "timeout":
            overdue = time.monotonic() - live[0].deadline
            emit(self._observers, TimedOut(**fields, overdue_s=overdue))
        else:
            emit(self._observers, Aborted(**fields))

    def _samples_named(self, name: str) -> list[Sequence]:
        """A request id names all its samples; `rid#i` names sample i once it exists."""
        if name in self.samples:
            return self.samples[name]
        ref = self._split_sample_id(name)
        if ref is None or ref[1] >= len(self.samples[ref[0]]):
            return []
        return [self.samples[ref[0]][ref[1]]]

    def _split_sample_id(self, sample_id: str) -> tuple[str, int] | None:
        """`rid#i` of a live parallel request -> (rid, i); anything else -> None."""
        rid, sep, index = sample_id.rpartition("#")
        head = self.seqs.get(rid)
        if not sep or head is None or not index.isdigit() or int(index) >= head.params.n:
            return None
        return rid, int(index)

    def force_preempt(
        self,
        request_id: str,
        after_tokens: int,
        resume_after_steps: int = 1,
        mode: str | None = None,
    ) -> None:
        """R20: preempt the request once it has `after_tokens` outputs; keep it out for
        `resume_after_steps` steps; `mode` defaults to the engine's preemption mode. A request
        id targets its sample 0; `rid#i` targets sample i, also before it is forked."""
        ref = None if request_id in self.seqs else self._split_sample_id(request_id)
        if request_id not in self.seqs and ref is None:
            raise InvalidRequest(f"unknown request_id {request_id!r}")
        mode = mode or self.config.preemption_mode
        if mode not in ("recompute", "swap"):
            raise InvalidRequest(f"mode must be 'recompute' or 'swap', got {mode!r}")
        plan = ForcedPreemption(after_tokens, resume_after_steps, mode)
        if ref is None:
            self.seqs[request_id].forced = plan
        elif ref[1] < len(self.samples[ref[0]]):
            self.samples[ref[0]][ref[1]].forced = plan
        else:
            self._forced_later[f"{ref[0]}#{ref[1]}"] = plan

    def inject_swap_failure(self, count: int = 1) -> None:
        """R21: the next `count` swap-out writes fail; the engine must fall back to recompute."""
        self.swap_space.fail_next_writes += count

    def patch_kv_shards(self, patch: Callable[[KVShard], None]) -> None:
        """Run `patch` on every rank's KV pool shard, for this engine's life: this process's
        and, under tensor parallelism, each worker's (sent by reference, so a module-level
        function). The verifier's KV mutants plant their bug here: code that runs on a KV
        shard runs on every rank, and a bug in it is on every rank's KV heads."""
        if self.tp:
            self.tp.patch_kv_shards(f"{patch.__module__}.{patch.__qualname__}", patch)
        else:
            patch(KVShard(self.storage))

    # --- observers ---------------------------------------------------------------------------
    def add_observer(self, observer: EngineObserver) -> None:
        """Attach an observer: it sees every event and tracing hook from now on."""
        if observer not in self._observers:
            self._observers.append(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        self._observers.remove(observer)

    @property
    def tracer(self) -> EngineObserver | None:
        """The attached step tracer (verify.trace.EngineTracer), if any: the verifier reads its
        records through here. Attach one with add_observer."""
        return next((o for o in self._observers if o.traces_steps), None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # --- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except WorkerFailure as err:  # only a tensor-parallel engine raises it
            return self._lose_group(err)

    def _lose_group(self, err: WorkerFailure) -> list[RequestOutput]:
        """A worker died or hung: the model cannot run any more. Every request fails with the
        reason, the group is shut down, and later requests are refused."""
        self.failure = err
        self.tp.shutdown()
        for seq in [s for samples in self.samples.values() for s in samples if not s.finished]:
            self._fail(seq, f"tensor-parallel group lost: {err}")
        out, self._pending = self._pending, []
        return out

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (a no-op for a one-process engine)."""
        if self.tp is not None:
            self.tp.shutdown()

    def _step(self) -> list[RequestOutput]:
        self.step_count += 1
        self._expire_timeouts()
        plan = self.scheduler.schedule(self.step_count)
        for seq, message in plan.failed:  # stuck with preemption off: failed to free its blocks
            self._fail(seq, message)
        if plan.scheduled:
            batch = self.runner.build(plan.scheduled)
            for observer in self._observers:
                observer.on_batch(batch)
            try:
                if self.config.debug_checks:
                    for item, snap in zip(batch.scheduled, batch.snapshots, strict=True):
                        self.cache.validate_snapshot(snap)
                        who = f"seq {snap.seq_id}"
                        self.storage.check_written(snap.block_ids, item.seq.num_computed, who)
                logits = self.runner.run(batch)
                for observer in self._observers:
                    observer.on_step_ran(batch)
            finally:
                self.runner.release(batch)
            self._commit(batch, logits)
        if self.config.debug_checks:
            self.cache.check_invariants()
        out, self._pending = self._pending, []
        return out

    def _commit(self, batch: StepBatch, logits: torch.Tensor) -> None:
        for item in batch.scheduled:
            item.seq.num_computed += item.num_new_tokens
            self.cache.publish_full_blocks(item.seq.table, item.seq.chain)
        seqs = [item.seq for item in batch.sample_seqs]
        tokens = self.sampler.sample(logits, seqs)
        if self._to_fork:  # empty unless a parallel request is before its first token
            self._fork_ready(seqs, logits)
        for row, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            self._append_token(seq, token, logits[row])
        for observer in self._observers:
            observer.on_sampled(batch, logits, tokens)

    # --- parallel sampling (R33) -----------------------------------------------------------
    def _fork_ready(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Fork every parallel request whose prefill just completed, before sample 0's first
        token is appended: the children must share the prompt's KV, not sample 0's output."""
        for row, seq in enumerate(seqs):
            if seq.seq_id in self._to_fork:
                self._to_fork.discard(seq.seq_id)
                self._fork(seq, logits[row])

    def _fork(self, parent: Sequence, logits_row: torch.Tensor) -> None:
        """Samples 1..n-1 share every block of sample 0 (the partial last one is copied on its
        first write) and draw their first token from the same logits with their own generator."""
        children = [self._new_sample(parent, i) for i in range(1, parent.params.n)]
        at = self.scheduler.running.index(parent) + 1
        self.scheduler.running[at:at] = children  # right after the parent: same age
        self.samples[parent.request_id].extend(children)
        for child in children:
            self._by_seq_id[child.seq_id] = child
            token = self.sampler.sample(logits_row[None], [child])[0]  # the seam counts draws
            self._append_token(child, token, logits_row)
            for observer in self._observers:
                observer.on_forked(parent, child, logits_row, token)

    def _new_sample(self, parent: Sequence, index: int) -> Sequence:
        seq_id = next(self._seq_ids)
        params = parent.params  # n kept, so sample_id reads `rid#index`
        seed_params = params.for_sample(index)
        return Sequence(
            seq_id=seq_id,
            request_id=parent.request_id,
            prompt_ids=parent.prompt_ids,
            params=params,
            chain=parent.chain.copy(),
            table=self.cache.fork(parent.table, seq_id),
            generator=make_generator(seed_params, self.config.seed + seq_id, self.model.device),
            stop_ids=parent.stop_ids,
            arrival_time=parent.arrival_time,
            deadline=parent.deadline,
            cache_salt=parent.cache_salt,
            logprobs=[] if params.logprobs is not None else None,
            token_logprobs=[] if params.logprobs is not None else None,
            status=SeqStatus.RUNNING,
            num_computed=parent.num_computed,
            num_cached_tokens=parent.num_cached_tokens,
            # Its later re-prefills (after recompute) are not new prefix queries.
            admitted_once=True,
            forced=self._forced_later.pop(f"{parent.request_id}#{index}", None),
            sample_index=index,
        )

    def _append_token(self, seq: Sequence, token: int, logits: torch.Tensor) -> None:
        seq.output_ids.append(token)
        seq.chain.extend((token,))
        if seq.logprobs is not None:
            top, chosen = chosen_logprobs(logits, seq.params.logprobs, token)
            seq.logprobs.append(top)
            seq.token_logprobs.append(chosen)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if token in seq.stop_ids:
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= seq.params.max_tokens:
            self._finish(seq, "length")
        elif self.emit_progress:
            self._pending.append(self._output(seq, [token]))

    def _fail(self, seq: Sequence, message: str) -> None:
        """End a sample with finish reason "error"; `message` reaches RequestOutput.error."""
        seq.error = message
        self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        held = held_blocks(seq, self.cache.pool) if self._observers else None
        self.scheduler.remove(seq)
        self.swapper.discard(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if held is not None:
            self._emit_finish(seq, reason, held)
        new = seq.output_ids[-1:] if reason in ("stop", "length") else []
        if seq.params.n == 1:
            self._pending.append(self._output(seq, new))
            self._retire(seq.request_id)
        else:
            self._finish_sample(seq, new)

    def _finish_sample(self, seq: Sequence, new: list[int]) -> None:
        """One sample of a parallel request is done; the request is once every sample is (a
        request that ends before its fork has only sample 0)."""
        self._to_fork.discard(seq.seq_id)
        if self.emit_progress:
            self._pending.append(self._output(seq, new))
        samples = self.samples[seq.request_id]
        if all(s.finished for s in samples):
            self._pending.append(self._final_output(samples))
            self._retire(seq.request_id)

    def _emit_finish(self, seq: Sequence, reason: str, held: dict) -> None:
        emit(self._observers, Freed(**who(seq), reason=reason, **held))
        count = len(seq.output_ids)
        emit(
            self._observers,
            Finished(**who(seq), reason=reason, num_output_tokens=count, error=seq.error),
        )

    def _retire(self, request_id: str) -> None:
        del self.seqs[request_id]
        for seq in self.samples.pop(request_id):
            self._by_seq_id.pop(seq.seq_id, None)
        self._with_deadline.discard(request_id)
        if self._forced_later:  # plans for samples that were never forked
            prefix = f"{request_id}#"
            for key in [k for k in self._forced_later if k.startswith(prefix)]:
                del self._forced_later[key]

    def _expire_timeouts(self) -> None:
        """Only requests that have a deadline are looked at: none, no per-step scan."""
        now = time.monotonic()
        expired = [r for r in self._with_deadline if now > self.seqs[r].deadline]
        for request_id in expired:
            self.abort_request(request_id, reason="timeout")

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        """The request's output for n == 1; for n > 1 one sample's progress (never finished:
        `_final_output` ends a parallel request). A finished output is complete; a progress
        output carries only this step's tokens (copying the whole list per token would make a
        request's streaming cost quadratic in its length)."""
        finished = seq.finished and seq.params.n == 1
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            outputs=[self._completion(seq) if finished else self._delta(seq, new_tokens)],
            finished=finished,
            metrics=self._metrics(seq, seq.num_preemptions),
            new_token_ids=new_tokens,
            error=seq.error,
        )

    def _delta(self, seq: Sequence, new_tokens: list[int]) -> CompletionOutput:
        """One sample's progress: the step's tokens and their logprobs, from output position
        `offset`; no text (it comes with the finished output)."""
        offset = len(seq.output_ids) - len(new_tokens)
        return CompletionOutput(
            seq.sample_index,
            list(new_tokens),
            "",
            None if seq.logprobs is None else seq.logprobs[offset:],
            seq.finish_reason,
            None if seq.token_logprobs is None else seq.token_logprobs[offset:],
            offset=offset,
        )

    def _final_output(self, samples: list[Sequence]) -> RequestOutput:
        """All n samples by index. Samples never forked (the request ended before its first
        token) are empty, with sample 0's finish reason."""
        head = samples[0]
        outputs = [self._completion(s) for s in samples]
        empty_logprobs = None if head.logprobs is None else []
        outputs += [
            CompletionOutput(i, [], "", empty_logprobs, head.finish_reason, empty_logprobs)
            for i in range(len(samples), head.params.n)
        ]
        preemptions = sum(s.num_preemptions for s in samples)
        error = next((s.error for s in samples if s.error), None)
        return RequestOutput(
            head.request_id,
            head.prompt_ids,
            outputs,
            True,
            self._metrics(head, preemptions),
            error=error,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = ""
        if seq.finished and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids)
        return CompletionOutput(
            seq.sample_index,
            list(seq.output_ids),
            text,
            None if seq.logprobs is None else list(seq.logprobs),
            seq.finish_reason,
            None if seq.token_logprobs is None else list(seq.token_logprobs),
        )

    def _metrics(self, seq: Sequence, num_preemptions: int) -> RequestMetrics:
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        return RequestMetrics(
            seq.arrival_time, seq.first_token_time, ttft, seq.num_cached_tokens, num_preemptions
        )

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of one block's KV (the cache manager's copy callback)."""
        self.storage.copy_block(src, dst)
        for observer in self._observers:
            observer.on_kv_copy(src, dst)

    def _block_freed(self, block_id: int) -> None:
        """A block went FREE: what its generation held (a quantized block's scales) goes."""
        self.storage.invalidate(block_id)

    def _on_cache_event(self, event: AuditEvent) -> None:
        """The cache manager's listener: its events name sequence ids; observers get the
        request. Prefix hits are reported by the scheduler, once the admission is final."""
        if not self._observers:
            return
        seq = self._by_seq_id.get(event.seq_id)
        if seq is None:
            return
        if isinstance(event, CowEvent):
            emit(
                self._observers,
                CowCopy(
                    **who(seq),
                    logical_block=event.logical_block,
                    src_block=event.src_block,
                    dst_block=event.dst_block,
                ),
            )
        elif isinstance(event, CorruptionEvent):
            emit(
                self._observers,
                CacheCorruption(
                    **who(seq),
                    fast_key=event.fast_key,
                    wanted_digest=event.wanted_digest.hex(),
                    found_digest=event.found_digest.hex(),
                    block_id=event.block_id,
                    depth=event.depth,
                ),
            )

    # --- kill switches (R30) ----------------------------------------------------------------
    def set_prefix_caching(self, enabled: bool) -> None:
        """Engine-wide: while off, no request gets a hit and nothing is published."""
        self.cache.enable_prefix_caching = enabled

    def set_namespace_caching(self, cache_salt: str | None, enabled: bool) -> None:
        """Per namespace (tenant): while off, no hit and no publish for requests of that salt."""
        self.cache.set_namespace_enabled(self.namespace.with_salt(cache_salt).digest(), enabled)

    def set_preemption(self, enabled: bool) -> None:
        """While off, admission reserves each request's worst case; a request that still cannot
        grow (preemption switched off while it ran) fails rather than waiting forever."""
        self.scheduler.preemption_enabled = enabled

    # --- observability ---------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        usage, cs = self.cache.usage(), self.cache.stats
        pre = self.scheduler.preemptions
        return {
            "num_blocks": usage.total,
            "free_blocks": usage.free,
            "private_blocks": usage.private,
            "shared_blocks": usage.shared,
            "cached_blocks": usage.cached,
            "evicting_blocks": usage.evicting,
            "restoring_blocks": usage.restoring,
            "index_entries": len(self.cache.index),
            "prefix_queries": self.scheduler.prefix_queries,
            "prefix_hits": self.scheduler.prefix_hits,
            "prefill_tokens": self.scheduler.prefill_tokens,  # prompt tokens fed to the model
            "corruptions": cs.corruption_count,
            "key_collisions": cs.key_collisions,
            "cow_copies": cs.cow_copies,
            "evictions": cs.evictions,
            "block_allocations": cs.allocations,
            "block_frees": cs.frees,
            "generation_bumps": cs.generation_bumps,
            "preemptions": pre["recompute"] + pre["swap"],
            "preemptions_recompute": pre["recompute"],
            "preemptions_swap": pre["swap"],
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped),
            "swap_space_used": self.swap_space.used_blocks,
            **self.swapper.counts,
            **self.counters,
        }


def _tensor_parallel(config: EngineConfig, model: CausalLM, num_blocks: int, fmt):
    """Rank 0 of a tensor-parallel group (workers started), or None for one process. Imported
    here, not at the top: kvpage.distributed builds on the engine, and a one-process engine
    never loads it."""
    if config.tensor_parallel_size == 1:
        return None
    from kvpage.parallel.executor import TensorParallelExecutor

    return TensorParallelExecutor(config, model, num_blocks, fmt)
