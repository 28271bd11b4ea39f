"""LLMEngine: a thin façade over one step as data (kvpage.engine.plan).

    plan = scheduler.schedule(step)          the step's sequences, chunks and block operations
    executor.apply_block_ops(plan)           copies, swap-outs, swap-ins, invalidations, in order
    batch = executor.build(plan)             token ids, positions, cu_seqlens, table snapshots
    out = executor.run(batch)                the model, once over the packed batch: StepLogits
    prompt_scorer.score(...)                 prompt logprobs of the rows that asked for them
    scheduler.commit(plan)                   KV written: computed counts, full blocks published
    sampled = sampler.draw(...)              one draw per row (a parallel request forks here)
    outputs = scheduler.update(plan, sampled)

The engine builds the parts (model, KV pool, cache manager, scheduler, executor, sampler), checks
requests before they enter (kvpage.engine.checks), and offers the calls a user or a test driver
makes between steps (abort, kill switches, preemption, suspension). Whoever watches it (the
verifier's tracer, the server's audit log and metrics, tests) attaches an `EngineObserver`
(kvpage.engine.events)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpage.cache.groups import kv_layout
from kvpage.cache.manager import KVCacheManager
from kvpage.config import EngineConfig
from kvpage.engine.adapters import named_adapter, serve_adapters
from kvpage.engine.checks import (
    RequestChecks,
    check_quantization,
    live_sample,
    preemptible,
    suspendable,
    timeout_seconds,
)
from kvpage.engine.events import EngineObserver
from kvpage.engine.executor import Executor
from kvpage.engine.grammars import Grammars
from kvpage.engine.kv_pool import local_storage, num_kv_blocks
from kvpage.engine.namespace import base_namespace
from kvpage.engine.outputs import RequestOutput
from kvpage.engine.plan import StepBatch, StepPlan
from kvpage.engine.prompt_logprobs import PromptScorer
from kvpage.engine.requests import NewRequest, Requests
from kvpage.engine.runner import ModelRunner
from kvpage.engine.sampler import Sampler
from kvpage.engine.scheduler import Scheduler
from kvpage.engine.sequence import Sequence
from kvpage.engine.speculation import build_speculation
from kvpage.engine.stats import engine_stats
from kvpage.engine.tenant_switches import TenantSwitches
from kvpage.errors import InvalidRequest, WorkerFailure
from kvpage.host_memory import keep_freed_memory
from kvpage.kv.format import kv_format
from kvpage.kv.storage import KVShard
from kvpage.kv.swap_space import SwapSpace
from kvpage.lora.adapter import LoraAdapter
from kvpage.lora.request import LoRARequest
from kvpage.model import load_model
from kvpage.model.base import CausalLM
from kvpage.model.kernels import finalize_once
from kvpage.model.tokenizer import Tokenizer, encode_text
from kvpage.parallel.executor import TensorParallelExecutor
from kvpage.sampling_params import SamplingParams


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        if config.device == "cpu":
            keep_freed_memory()
        if model is None:
            model, tokenizer = load_model(
                config.model,
                config.dtype,
                config.device,
                config.quantization,
                config.quantize_lm_head,
            )
        check_quantization(model, config.quantization, config.quantize_lm_head)
        finalize_once(model, config.fast_paths_off)  # bound already, unless asked otherwise
        self.model, self.tokenizer = model, tokenizer
        mcfg = model.config
        limit = mcfg.max_position_embeddings
        self.max_model_len = (
            limit if config.max_model_len is None else min(config.max_model_len, limit)
        )
        # Before any worker starts: a configuration it refuses leaves nothing running.
        self.speculation = build_speculation(config, model, self.max_model_len)
        self.kv_format = kv_format(config.kv_cache_dtype, model.dtype)
        self.kv_layout = kv_layout(mcfg.num_layers, mcfg.layer_windows, config.kv_layer_groups)
        # A page holds `rows` layers of one group: as many pages as the memory of the blocks
        # asked for (num_blocks counts whole-model blocks).
        pages_per_block = self.kv_layout.pages_per_block(mcfg.num_layers)
        num_blocks = num_kv_blocks(config, mcfg, self.max_model_len, self.kv_format)
        num_blocks *= pages_per_block
        self.tp = (
            TensorParallelExecutor(config, model, num_blocks, self.kv_format)
            if config.tensor_parallel_size > 1
            else None
        )
        self.storage = (
            self.tp.storage
            if self.tp
            else local_storage(model, self.kv_layout, num_blocks, config.block_size, self.kv_format)
        )
        # Per-operation checks inside the manager are for its own tests; the engine checks every
        # invariant once per step instead, which catches the same corruption.
        self.cache = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            fast_key_bits=config.fast_key_bits,
            invalidate_freed=self.kv_format.quantized,
            layout=None if self.kv_layout.plain else self.kv_layout,
        )
        self._observers: list[EngineObserver] = []  # shared with the scheduler
        self.swap_space = SwapSpace(config.swap_space_blocks * pages_per_block)
        self.grammars = Grammars(tokenizer, mcfg.vocab_size, mcfg.eos_token_ids)
        self.requests = Requests(
            self.cache, config.seed, model.device, mcfg.eos_token_ids, self.grammars
        )
        self.checks = RequestChecks(
            mcfg.vocab_size, self.max_model_len, config.max_num_seqs, self.cache
        )
        self.lora_slots, lora = serve_adapters(config, model, self.tp)
        decode = tokenizer.decode if tokenizer is not None else None
        self.scheduler = Scheduler(
            config,
            self.cache,
            self.swap_space,
            self.requests,
            self._observers,
            decode,
            self.lora_slots,
            self.speculation,
        )
        self.runner = (
            ModelRunner(
                self.tp.model,
                self.storage.shard,
                self.cache,
                self.tp.forward_on_every_rank,
                lora,
                self.lora_slots,
            )
            if self.tp
            else ModelRunner(model, self.storage, self.cache, None, lora, self.lora_slots)
        )
        self.executor = Executor(self.runner, self.storage, self.swap_space)
        self.sampler = Sampler(self.scheduler, self.grammars, self.speculation)
        self.prompt_scorer = PromptScorer()
        self.namespace = base_namespace(
            model, tokenizer, config.block_size, config.model, self.kv_format
        )
        self.tenant_switches = TenantSwitches(self.cache)
        self.failure: WorkerFailure | None = None  # set when a tensor-parallel worker is lost
        self.step_count = 0

    # --- requests --------------------------------------------------------------------------
    @property
    def seqs(self) -> dict[str, Sequence]:
        """Live requests: request id -> its sample 0 (read-only view)."""
        return self.requests.heads

    @property
    def samples(self) -> dict[str, list[Sequence]]:
        """Live requests: request id -> its samples by index (read-only view)."""
        return self.requests.samples

    @property
    def emit_progress(self) -> bool:
        """Per-token outputs for streaming; offline callers turn them off."""
        return self.scheduler.outputs.emit_progress

    @emit_progress.setter
    def emit_progress(self, on: bool) -> None:
        self.scheduler.outputs.emit_progress = on

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request. A bad request raises InvalidRequest and changes nothing.
        `lora_request` runs it with that adapter (loaded on first use; enable_lora=True)."""
        if self.failure is not None:
            raise WorkerFailure(f"the engine lost its tensor-parallel group: {self.failure}")
        params = self.checks.params(request_id, params, self.requests)
        prompt_ids = self.prompt_ids(prompt)
        self.checks.prompt(prompt_ids, params)
        timeout_seconds(timeout_s)
        now = time.monotonic()
        timeout_s = timeout_s if timeout_s is not None else self.config.request_timeout_s
        deadline = None if timeout_s is None else now + timeout_s
        grammar = self.grammars.matcher_for(params)
        adapter = None if lora_request is None else self.load_lora_adapter(lora_request)
        req = NewRequest(
            request_id, prompt_ids, params, cache_salt, now, deadline, adapter, grammar
        )
        namespace = self.request_namespace(cache_salt, adapter)
        if adapter is not None:
            self.tenant_switches.follow(cache_salt, namespace.digest())
        self.scheduler.add(self.requests.new_sequence(req, namespace))

    def request_namespace(self, cache_salt: str | None, adapter: LoraAdapter | None):
        """What a request's blocks are keyed in (a declared seam): the engine's namespace, the
        tenant's salt, and the adapter's identity (name and weights digest) in its own field."""
        namespace = self.namespace.with_salt(cache_salt)
        return namespace if adapter is None else namespace.with_adapter(adapter.identity)

    # --- adapters --------------------------------------------------------------------------
    def load_lora_adapter(self, lora_request: LoRARequest, reload: bool = False) -> LoraAdapter:
        """The adapter `lora_request` names: the registered one under that name and path, else
        loaded from its PEFT directory and registered (`reload`: loaded again in any case)."""
        mcfg, rank = self.model.config, self.config.max_lora_rank
        return named_adapter(self.lora_slots, lora_request, mcfg, rank, reload)

    def unload_lora_adapter(self, name: str) -> None:
        """Forget adapter `name`; requests already queued with it still finish with it."""
        if self.lora_slots is None:
            raise InvalidRequest("this engine serves no LoRA adapters (enable_lora=False)")
        self.lora_slots.unregister(name)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The token ids a prompt stands for (text is encoded with the model's tokenizer)."""
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt, self.config.model)
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidRequest("prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Abort wherever the request is (waiting, running, swapped); its blocks come back.
        Every unfinished sample of a parallel request goes; a sample id `rid#i` aborts only
        that sample (the server's stop strings end samples one at a time)."""
        aborted = self.scheduler.abort(request_id, reason)
        self._apply_released()
        return aborted

    def _apply_released(self) -> None:
        """Frees outside a plan (requests that finished or were aborted) leave invalidations:
        applied at once, so a freed block's per-generation KV state dies with it."""
        ops = self.cache.take_block_ops()
        if ops:
            self.executor.apply_block_ops(ops)

    # --- calls between steps (a test driver's: kvpage.verify.driver) -----------------------
    def preempt(self, sample_id: str, mode: str | None = None) -> str:
        """Preempt a RUNNING sample now, between steps; `mode` defaults to the engine's.
        Its KV moves at once (a swap-out is copied before this returns); returns the mode
        used (a swap that cannot be stored falls back to recompute)."""
        seq, mode = preemptible(self.requests, sample_id, mode, self.config.preemption_mode)
        plan = StepPlan(self.step_count)
        self.scheduler.preempt(seq, plan, mode)
        self._apply_block_ops(plan)
        return plan.preempted[0].mode

    def suspend(self, sample_id: str) -> None:
        """Keep a waiting or swapped sample out of every step until `resume`."""
        self.scheduler.queues.suspend(suspendable(self.requests, sample_id))

    def resume(self, sample_id: str) -> None:
        seq = live_sample(self.requests, sample_id)
        if seq.seq_id not in self.scheduler.suspended:
            raise InvalidRequest(f"{sample_id!r} is not suspended")
        self.scheduler.queues.resume(seq)

    def patch_kv_shards(self, patch: Callable[[KVShard], None]) -> None:
        """Run `patch` on every rank's KV pool shard, for this engine's life: this process's
        and, under tensor parallelism, each worker's (sent by reference, so a module-level
        function). The declared seam of the KV pool (kvpage.engine.hooks): the verifier's KV
        mutants plant their bug here, and a bug there is on every rank's KV heads."""
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
        for seq in self.requests.unfinished():
            self.scheduler.fail(seq, f"tensor-parallel group lost: {err}")
        return self.scheduler.take_outputs()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (a no-op for a one-process engine)."""
        if self.tp is not None:
            self.tp.shutdown()

    def _step(self) -> list[RequestOutput]:
        self.step_count += 1
        self.scheduler.expire_timeouts()
        plan = self.scheduler.schedule(self.step_count)
        for observer in self._observers:
            observer.on_plan(plan)
        self._apply_block_ops(plan)
        for seq, message in plan.failed:  # stuck with preemption off: failed to free its blocks
            self.scheduler.fail(seq, message)
        outputs = self._run(plan) if plan.scheduled else self.scheduler.take_outputs()
        self._apply_released()
        if self.config.debug_checks:
            self.cache.check_invariants()
        return outputs

    def _apply_block_ops(self, plan: StepPlan) -> None:
        """The plan's copies and swaps, in order; then every sequence preempted by recompute
        (a failed swap-out included) replays its grammar matcher from its tokens."""
        self.scheduler.block_ops_applied(plan, self.executor.apply_block_ops(plan.block_ops))
        for pre in plan.preempted:
            if pre.mode == "recompute" and pre.seq.grammar is not None:
                self.grammars.replay(pre.seq)

    def _run(self, plan: StepPlan) -> list[RequestOutput]:
        batch = self.executor.build(plan)
        for observer in self._observers:
            observer.on_batch(batch)
        try:
            if self.config.debug_checks:
                self._validate(batch)
            out = self.executor.run(batch)
            for observer in self._observers:
                observer.on_step_ran(batch)
        finally:
            self.executor.release(batch)
        if out.prompt_logits is not None:
            self.prompt_scorer.score(batch.prompt_rows, out.prompt_logits)
        self.scheduler.commit(plan)
        logits = out.logits
        sampled = self.sampler.draw(batch.sample_seqs, logits)
        if batch.spec_seqs:
            sampled.verified = self.sampler.verify(batch.spec_seqs, out.spec_logits)
        outputs = self.scheduler.update(plan, sampled)
        if sampled.verified:
            for observer in self._observers:
                observer.on_verified(batch, out.spec_logits, sampled.verified)
        for draw in sampled.forked:
            for observer in self._observers:
                observer.on_forked(draw.parent, draw.seq, logits[draw.row], draw.token)
        tokens = [draw.token for draw in sampled.draws]
        for observer in self._observers:
            observer.on_sampled(batch, logits, tokens)
        return outputs

    def _validate(self, batch: StepBatch) -> None:
        """Debug checks: every table entry the step reads is the incarnation it snapshotted,
        and every slot before the step's own tokens was written."""
        for item, snap in zip(batch.scheduled, batch.snapshots, strict=True):
            self.cache.validate_snapshot(snap)
            self.storage.check_written(snap.block_ids, item.seq.num_computed, f"seq {snap.seq_id}")

    # --- kill switches ----------------------------------------------------------------------
    def set_prefix_caching(self, enabled: bool) -> None:
        """Engine-wide: while off, no request gets a hit and nothing is published."""
        self.cache.enable_prefix_caching = enabled

    def set_namespace_caching(self, cache_salt: str | None, enabled: bool) -> None:
        """Per namespace (tenant): while off, no hit and no publish for requests of that salt,
        with an adapter or without (each adapter keys its own namespace under the salt)."""
        digest = self.namespace.with_salt(cache_salt).digest()
        self.tenant_switches.set(cache_salt, enabled, digest)

    def set_preemption(self, enabled: bool) -> None:
        """While off, admission reserves each request's worst case; a request that still cannot
        grow (preemption switched off while it ran) fails rather than waiting forever."""
        self.scheduler.preemption_enabled = enabled

    # --- observability ---------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        return self.scheduler.counters

    def stats(self) -> dict[str, int]:
        spec = {} if self.speculation is None else self.speculation.stats()
        return {
            **engine_stats(self.cache, self.scheduler, self.swap_space),
            **self.grammars.stats(),
            **spec,
        }
