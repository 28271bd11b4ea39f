"""Verification suites: a case runs on a fresh engine with a tracer attached; every
sample of every request is diffed step by step against the reference run alone, sampled
draws are checked against the independent sampling oracle, canaries are checked across requests,
KV provenance is checked on every read, the case must finish within a step bound derived
from its work and never stall with ready work (liveness), and the pool, ref_counts, index and
swap space must be back at baseline. Case builders live in kvpage.verify.cases."""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.namespace import base_namespace
from kvpage.kv.format import kv_format
from kvpage.lora.request import LoRARequest
from kvpage.reference.generator import ReferenceOutput, generate, stop_token_ids
from kvpage.reference.grammar import ReferenceGrammars
from kvpage.reference.lora_merge import merged_model
from kvpage.reference.records import StepRecord
from kvpage.sampling_params import SamplingParams
from kvpage.verify.canary import TOPK_MARGIN, find_foreign_canaries
from kvpage.verify.case import Case, RequestSpec
from kvpage.verify.cases import SUITES, build_suites
from kvpage.verify.cases.lora import LoadedAdapter, check_adapters
from kvpage.verify.cases.prompt_logprobs import check_prompt_logprobs
from kvpage.verify.checks import (
    Failure,
    check_baseline,
    check_draw_distribution,
    check_expectations,
    check_provenance,
    check_sampling,
    finding,
)
from kvpage.verify.diff import (
    HALF_DTYPES,
    KV_ROUNDOFF,
    Divergence,
    RequestContext,
    first_divergence,
    logit_atol,
    logit_scale,
    numeric_tie_step,
    quantized_attribution,
)
from kvpage.verify.driver import StepDriver
from kvpage.verify.hit_bounds import HitBounds
from kvpage.verify.kernel_attribution import attribute_kernels
from kvpage.verify.lora_adapters import AdapterFiles, LoraSpec, WrittenAdapter
from kvpage.verify.mutants.base import MissingSeam
from kvpage.verify.properties import StepProperties, check_independence, pin_unseeded
from kvpage.verify.speculative import check_verifications, speculative_draws
from kvpage.verify.structured import check_structured, walk
from kvpage.verify.trace import EngineTracer

__all__ = ["SUITES", "CaseResult", "Failure", "Runtime", "build_suites", "run_case"]


@dataclass(slots=True)
class CaseResult:
    case: str
    suite: str
    failures: list[Failure]
    requests: int
    steps: int
    seconds: float
    stats: dict = field(default_factory=dict)  # the engine's stats() when the case ended

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def first_divergence(self) -> Divergence | None:
        found = [f.divergence for f in self.failures if f.divergence is not None]
        # A crash is what followed a divergence when there is one: the divergence comes first.
        return next((d for d in found if d.attribution.cls != "crash"), found[0] if found else None)


class Runtime:
    """The model, its reference memo, and how to build an engine (mutants override it).

    `engine`: the user's EngineConfig fields (`kvpage verify --block-size ...`), the base of
    every case's engine. A case's own overrides win over them: a case sets a field only when
    the case is built around it (prompt lengths at its block size +-1, a pool small enough to
    force preemption, unquantized KV for the quantized-path control run), and under another
    value it would test nothing. Fields no case sets (dtype, KV format, tensor-parallel size,
    usually the token budget and preemption mode) run as the user gave them."""

    def __init__(
        self,
        model,
        tokenizer,
        model_name: str,
        debug_checks: bool = True,
        engine_factory: Callable[[EngineConfig], LLMEngine] | None = None,
        tensor_parallel_size: int = 1,
        engine: dict | None = None,
    ) -> None:
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.debug_checks = debug_checks
        self.tensor_parallel_size = tensor_parallel_size
        self.engine_overrides = dict(engine or {})
        self.engine_factory = engine_factory or (lambda cfg: LLMEngine(cfg, model, tokenizer))
        self._refs: dict[tuple, ReferenceOutput] = {}
        self.adapter_files: AdapterFiles | None = None  # written at the first adapter asked for
        self._merged: dict[str, object] = {}  # adapter identity -> the reference's merged model
        self._grammars: ReferenceGrammars | None = None  # built at the first constrained request
        # A diverging case runs again with the fast paths off to name a kernel
        # (kvpage.verify.kernel_attribution); a caller that only asks whether a case still
        # fails (shrinking a reproducer) turns it off.
        self.kernel_reruns = True

    def adapter(self, spec: LoraSpec) -> WrittenAdapter:
        """The case's adapter written for this model as a PEFT directory (once per spec), with
        the verifier's own digest of what it wrote; the engine loads it by its path."""
        if self.adapter_files is None:
            self.adapter_files = AdapterFiles(self.model.config)
        return self.adapter_files(spec)

    def reference_model(self, lora: LoraSpec | None):
        """The base model, or its copy with the adapter's files merged by the reference's own
        code (its own read of the directory: never the engine's loaded adapter or scale)."""
        if lora is None:
            return self.model
        written = self.adapter(lora)
        if written.identity not in self._merged:
            self._merged[written.identity] = merged_model(self.model, written.path)
        return self._merged[written.identity]

    @property
    def grammars(self) -> ReferenceGrammars:
        """The reference's own constraint compiler over this model's vocabulary (its tokenizer
        read by itself, never the engine's; kvpage.reference.grammar)."""
        if self._grammars is None:
            cfg = self.model.config
            self._grammars = ReferenceGrammars(self.model_name, cfg.vocab_size, cfg.eos_token_ids)
        return self._grammars

    def make_engine(self, overrides: dict) -> LLMEngine:
        args = dict(model=self.model_name, tensor_parallel_size=self.tensor_parallel_size)
        args.update(self.engine_overrides)  # the configuration under test
        args.update(overrides)  # the case's own fields: the point of the case
        args["debug_checks"] = self.debug_checks  # the gate's choice, never the user's
        return self.engine_factory(EngineConfig(**args))

    def reference(
        self,
        spec: RequestSpec,
        block_size: int,
        sample: int = 0,
        max_tokens: int | None = None,
        kv_cache_dtype: str = "auto",
        forced: tuple[int, ...] | None = None,
    ) -> ReferenceOutput:
        """Sample `sample` of the request, run alone on the contiguous reference (with the K/V
        round trip of `kv_cache_dtype`); `max_tokens` cuts it short (the first k steps do not
        depend on how many follow); `forced`: tokens it takes instead of drawing."""
        fmt = kv_format(kv_cache_dtype, self.model.dtype)
        ns = base_namespace(self.model, self.tokenizer, block_size, self.model_name, fmt)
        ns = ns.with_salt(spec.cache_salt)
        if spec.lora is not None:
            ns = ns.with_adapter(self.adapter(spec.lora).identity)
        params = spec.params.for_sample(sample)
        if max_tokens is not None and max_tokens < params.max_tokens:
            params = replace(params, max_tokens=max(1, max_tokens))
        span = block_size if fmt.quantized else 0
        return self._generate(
            spec.prompt, params, ns.digest().hex(), kv_cache_dtype, span, spec.lora, forced
        )

    def resolve(self, spec: RequestSpec, kv_cache_dtype: str = "auto") -> RequestSpec:
        """Fix a stop-at-reference-step request's stop token from its reference run (with the
        K/V round trip of the pool's format: a rounded KV may draw another token there)."""
        if spec.stop_at_ref_step is None:
            return spec
        free = replace(spec.params, stop_token_ids=())
        tokens = self._generate(
            spec.prompt, free.for_sample(0), "", kv_cache_dtype, lora=spec.lora
        ).token_ids
        stop = tokens[min(spec.stop_at_ref_step, len(tokens) - 1)]
        return replace(spec, params=replace(spec.params, stop_token_ids=(stop,)))

    def resolve_continuations(self, case: Case, kv_cache_dtype: str = "auto") -> Case:
        """Give each request that continues another (RequestSpec.continues) its prompt: the
        other's prompt and the first n tokens its reference decodes."""
        if not any(s.continues for s in case.requests):
            return case
        by_id = {s.request_id: s for s in case.requests}
        specs = []
        for spec in case.requests:
            if spec.continues is not None:
                other, n = by_id[spec.continues[0]], spec.continues[1]
                out = self._generate(
                    other.prompt, other.params.for_sample(0), "", kv_cache_dtype, lora=other.lora
                )
                spec = replace(spec, prompt=other.prompt + out.token_ids[:n], continues=None)
            specs.append(spec)
        return replace(case, requests=specs)

    def _generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        ns_hex: str,
        kv_cache_dtype: str = "auto",
        span: int = 0,
        lora: LoraSpec | None = None,
        forced: tuple[int, ...] | None = None,
    ):
        key = (tuple(prompt), params, ns_hex, kv_cache_dtype, span, lora, forced)
        if key not in self._refs:
            out = generate(
                self.reference_model(lora),
                prompt,
                params,
                trace_as="ref",
                namespace=ns_hex,
                kv_cache_dtype=kv_cache_dtype,
                scale_span=span,
                grammars=None if params.structured_outputs is None else self.grammars,
                forced=forced,
            )
            identity = "" if lora is None else self.adapter(lora).identity
            for record in out.records:
                record.adapter = identity
            self._refs[key] = out
        return self._refs[key]


# --- running a case ------------------------------------------------------------------------
def run_case(case: Case, runtime: Runtime) -> CaseResult:
    start = time.perf_counter()
    failures: list[Failure] = []
    engine = props = None
    steps = 0
    try:
        engine = runtime.make_engine({**lora_fields(case, runtime.engine_overrides), **case.engine})
        kv = engine.config.kv_cache_dtype  # a stop token is the reference's in the pool's format
        case = replace(case, requests=[runtime.resolve(s, kv) for s in case.requests])
        case = runtime.resolve_continuations(case, kv)
        engine.add_observer(EngineTracer(engine))
        props = StepProperties(engine)
        engine.add_observer(props)
        bounds = HitBounds(engine, case)
        drive = _Drive(engine, case, runtime)
        finished, steps = drive.run()
        # First: a broken step rule is the cause of what the later checks see.
        failures += props.failures + check_independence(
            case, engine.tracer.records, _grammar_masks(runtime)
        )
        failures += drive.liveness  # when the engine stalls, the rest follows from it
        refs: dict[str, list[StepRecord]] = {}
        pinned, outputs = pin_unseeded(case, engine.tracer.records, finished)
        tied: set[str] = set()
        failures += _check_requests(pinned, runtime, engine, outputs, refs, tied)
        failures += check_adapters(drive.loaded, engine.tracer.records, refs)
        failures += check_provenance(engine.tracer, refs)
        failures += check_verifications(case, engine.tracer, refs)
        failures += check_expectations(case, engine, finished, refs, frozenset(tied))
        failures += bounds.check(finished, refs, drive.driver.switch_log)
        failures += check_prompt_logprobs(
            case,
            runtime.model,
            finished,
            engine.config.kv_cache_dtype,
            lambda spec: runtime.reference_model(spec.lora),
        )
        failures += check_baseline(engine)
        if engine.kv_format.quantized or engine.kv_format.cast_only:
            _attribute_rounded_kv(case, runtime, failures)
        attribute_kernels(case, runtime, failures, run_case)
    except MissingSeam:
        raise  # a mutant that cannot be planted is the verifier's error, never a catch
    except Exception as err:  # a crash is a failure of the case, not of the verifier
        # What the engine produced before it crashed is still diffed: the first divergence
        # usually says more than the exception that followed it.
        if engine is not None and engine.tracer is not None and not failures:
            failures += props.failures if props is not None else []
            pinned = pin_unseeded(case, engine.tracer.records, {})[0]
            failures += _partial_divergences(pinned, runtime, engine)
        failures.append(crash_failure(err, case, engine))
    stats = {} if engine is None else engine.stats()
    return CaseResult(
        case.full_name,
        case.suite,
        failures,
        len(case.requests),
        steps,
        time.perf_counter() - start,
        stats,
    )


def _grammar_masks(runtime: Runtime):
    """(constraint, tokens) -> the verifier's own grammar mask before each token."""
    return lambda constraint, tokens: walk(runtime.grammars, constraint, tokens).masks


def crash_failure(err: Exception, case: Case, engine: LLMEngine | None) -> Failure:
    """An exception out of the engine (or a check) as a finding of class `crash`: the error,
    the engine step it was raised in (-1: before the first) and where in the code."""
    where = traceback.extract_tb(err.__traceback__)[-3:]
    step = -1 if engine is None else engine.step_count
    error = f"{type(err).__name__}: {err}"
    fields = {
        "error": error,
        "step": step,
        "case": case.full_name,
        "raised_at": [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in where],
    }
    message = f"crash at engine step {step}: {error}"
    return Failure("crash", message, divergence=finding("crash", "crash", message, fields))


def _attribute_rounded_kv(case: Case, runtime: Runtime, failures: list[Failure]) -> None:
    """The quantized_kv class: a divergence that appears only on the quantized path. When a
    case with the pool in a rounded KV format diverges, it runs again with unquantized KV (the
    same engine factory, so the same build); if that run shows no divergence, the divergences
    found are re-attributed to quantized_kv with the scales and layout they read."""
    diverged = [f for f in failures if f.divergence is not None and f.divergence.reference]
    if not diverged:
        return
    plain = replace(case, engine={**case.engine, "kv_cache_dtype": "auto"})
    if any(f.divergence is not None for f in run_case(plain, runtime).failures):
        return  # not specific to the KV format: the matrix's class stands
    for f in diverged:
        div = f.divergence
        if div.candidate is not None:
            div.attribution = quantized_attribution(div.reference, div.candidate, div.attribution)


_DEFAULT_BUDGET = EngineConfig().max_num_batched_tokens


def step_bound(case: Case) -> int:
    """Steps a correct engine needs at most: every request's prefill chunks and decode steps
    one after the other (as if nothing ran in parallel), after the last arrival and any
    forced hold, with each preemption paying a full re-prefill."""
    budget = case.engine.get("max_num_batched_tokens", _DEFAULT_BUDGET)
    work = sum(
        math.ceil(len(s.prompt) / budget) + s.params.n * s.params.max_tokens for s in case.requests
    )
    last_arrival = max((s.arrive_step for s in case.requests), default=0)
    return last_arrival + case.hold_steps + 2 * work + 16


def lora_fields(case: Case, given: dict) -> dict:
    """The engine fields a case with adapters needs: adapters on, the user's slot count (else
    2) and a rank bound that fits the case's adapters."""
    specs = {s.lora for s in case.requests if s.lora is not None}
    if not specs:
        return {}
    rank = max(given.get("max_lora_rank", 1), *(s.max_rank for s in specs))
    return {"enable_lora": True, "max_loras": given.get("max_loras", 2), "max_lora_rank": rank}


class _Drive:
    """Runs a case's requests and actions to completion, watching liveness: a step with ready
    work must schedule something (or preempt), and the case must end within its step bound."""

    def __init__(self, engine: LLMEngine, case: Case, runtime: Runtime | None = None) -> None:
        self.engine, self.case, self.runtime = engine, case, runtime
        self.driver = StepDriver(engine)
        self.liveness: list[Failure] = []
        self.bound = step_bound(case)
        self.loaded: list[LoadedAdapter] = []  # what the engine loaded for each adapter request

    def _add(self, spec: RequestSpec) -> None:
        """Add the request; one with an adapter names its PEFT directory (LoRARequest(name,
        path)) and the engine loads it there, as a server does: a later spec with the same name
        and another directory is a reload (the name now stands for the new weights)."""
        written = None if spec.lora is None else self.runtime.adapter(spec.lora)
        self.engine.add_request(
            spec.request_id,
            spec.prompt,
            spec.params,
            cache_salt=spec.cache_salt,
            timeout_s=spec.timeout_s,
            lora_request=None if written is None else LoRARequest(spec.lora.name, written.path),
        )
        if written is not None:
            got = self.engine.lora_slots.registered.get(spec.lora.name)
            self.loaded.append(LoadedAdapter(spec.request_id, written, got))

    def run(self):
        engine, case = self.engine, self.case
        pending = sorted(case.requests, key=lambda r: r.arrive_step)
        actions = list(case.actions)
        finished: dict = {}
        steps = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].arrive_step <= steps:
                self._add(pending.pop(0))
            for action in [a for a in actions if a.when(self.driver, steps)]:
                action.do(self.driver)
                actions.remove(action)
            self.driver.prepare()  # forced preemptions and holds, before what is ready is read
            ready = self._ready_work()
            ended = {o.request_id: o for o in self.driver.step() if o.finished}
            finished.update(ended)
            steps += 1
            if ready and not ended and not self._progressed():
                self._stall(steps, ready)
                break
            if steps > self.bound:
                self._overrun(steps)
                break
        finished.update({o.request_id: o for o in self.driver.step() if o.finished})
        return finished, steps

    def _ready_work(self) -> list[str]:
        """Requests the coming step could work on: running or queued (a held one is out of
        the queues until the driver lets it back)."""
        sched = self.engine.scheduler
        return [s.sample_id for q in (sched.running, sched.waiting, sched.swapped) for s in q]

    def _progressed(self) -> bool:
        last = self.driver.last_plan
        return last is not None and bool(last.scheduled or last.preempted)

    def _stall(self, steps: int, ready: list[str]) -> None:
        message = f"step {steps} scheduled nothing although {ready[:8]} were ready"
        self.liveness.append(self._failure(message, steps, ready))

    def _overrun(self, steps: int) -> None:
        sched = self.engine.scheduler
        stuck = [s.sample_id for q in (sched.running, sched.waiting, sched.swapped) for s in q]
        message = f"not finished after {steps} steps (bound {self.bound} from the case's work)"
        self.liveness.append(self._failure(message, steps, stuck))

    def _failure(self, message: str, steps: int, stuck: list[str]) -> Failure:
        sched = self.engine.scheduler
        fields = {
            "steps": steps,
            "bound": self.bound,
            "stalled": stuck[:16],
            "queues": {
                "running": len(sched.running),
                "waiting": len(sched.waiting),
                "swapped": len(sched.swapped),
            },
            "uncomputed": {
                s.sample_id: s.num_uncomputed
                for q in (sched.running, sched.waiting, sched.swapped)
                for s in q
            },
            "free_blocks": self.engine.cache.num_free_blocks(),
        }
        return Failure(
            "liveness", message, divergence=finding("liveness", "liveness", message, fields)
        )


def _check_requests(
    case: Case,
    runtime: Runtime,
    engine: LLMEngine,
    finished,
    refs: dict[str, list[StepRecord]],
    tied: set[str],
) -> list[Failure]:
    """Diffs every sample against its reference; fills `refs` (sample id -> reference records)
    and `tied` (the samples whose comparison a numeric tie ended)."""
    failures: list[Failure] = []
    block_size, kv_dtype = engine.config.block_size, engine.config.kv_cache_dtype
    records = dict(engine.tracer.records)  # cut at a numeric tie (16-bit) for the canary check
    masks: dict[str, list] = {}  # constrained sample -> the verifier's mask before each token
    for spec in case.requests:
        out = finished.get(spec.request_id)
        if out is None:
            failures.append(Failure("expectation", "request never finished", spec.request_id))
            continue
        for sample, sample_id in enumerate(spec.sample_ids()):
            cand = records.get(sample_id, [])
            completion = _completion(out, sample)
            cut = completion is None or completion.finish_reason not in ("stop", "length")
            forced = speculative_draws(engine, spec.params.for_sample(sample), cand)
            ref = runtime.reference(
                spec, block_size, sample, len(cand) if cut else None, kv_dtype, forced
            )
            if forced is not None:  # its own draws, rightly: not the reference's free ones
                tied.add(sample_id)
            tie = _tie_step(runtime, spec, sample, ref.records, cand, kv_dtype)
            if tie is not None:  # both sides follow other tokens after it: compare up to it
                records[sample_id] = cand = cand[:tie]
                tied.add(sample_id)
            refs[sample_id] = ref.records if tie is None else ref.records[:tie]
            # Up to a tie every step matched (numeric_tie_step stops at the first difference).
            div = None
            if tie is None:
                div = _diff_sample(runtime, spec, sample, ref, cand, completion, kv_dtype)
            if div is not None:
                div.request_id = sample_id
                message = f"{sample_id} diverged at step {div.step} ({div.kind}: {div.detail})"
                failures.append(Failure("divergence", message, sample_id, div))
            if spec.params.structured_outputs is not None:
                found, masks[sample_id] = _check_structured(
                    runtime, spec, sample, ref, cand, completion
                )
                failures += found
            failures += check_sampling(
                spec, sample, ref.records, cand, completion, masks.get(sample_id)
            )
    canaries = {sid: s.canary for s in case.requests if s.canary for sid in s.sample_ids()}
    scale = logit_scale([r for recs in refs.values() for r in recs])
    margin = max(TOPK_MARGIN, logit_atol(kv_dtype, runtime.model.dtype, scale))
    for leak in find_foreign_canaries(canaries, records, refs, margin):
        failures.append(Failure("canary", str(leak), leak.victim))
    if case.check_sampling:
        failures += check_draw_distribution(case, records, masks)
    return failures


def _check_structured(runtime: Runtime, spec, sample: int, ref, cand, completion):
    """A constrained sample: its draws walked by the verifier's own matcher, its end and text
    checked (kvpage.verify.structured); the walk's masks go to the sampling oracle."""
    stop_ids = stop_token_ids(runtime.model, spec.params.for_sample(sample))
    return check_structured(spec, sample, ref.records, cand, completion, runtime.grammars, stop_ids)


def _partial_divergences(case: Case, runtime: Runtime, engine: LLMEngine) -> list[Failure]:
    failures = []
    records = engine.tracer.records
    for spec in case.requests:
        for sample, sample_id in enumerate(spec.sample_ids()):
            cand = records.get(sample_id, [])
            if not cand:
                continue
            kv_dtype = engine.config.kv_cache_dtype
            ref = runtime.reference(spec, engine.config.block_size, sample, len(cand), kv_dtype)
            scale = logit_scale(ref.records)
            atol = logit_atol(kv_dtype, runtime.model.dtype, scale, spec.lora is not None)
            ties = _ties(runtime, kv_dtype)
            # a constrained request's token is its grammar's first: the diff must know it is one
            params = spec.params.for_sample(sample)
            context = None if params.structured_outputs is None else RequestContext(params)
            div = first_divergence(ref.records[: len(cand)], cand, atol, context, ties)
            if div is not None:
                div.request_id = sample_id
                message = f"{sample_id} diverged at step {div.step} ({div.kind}: {div.detail})"
                failures.append(Failure("divergence", message, sample_id, div))
    return failures


def _completion(out, sample: int):
    by_index = {c.index: c for c in out.outputs}
    return by_index.get(sample)


def _tie_step(runtime: Runtime, spec, sample: int, ref, cand, kv_dtype: str) -> int | None:
    if not _ties(runtime, kv_dtype):
        return None
    greedy = spec.params.for_sample(sample).temperature == 0.0
    atol = logit_atol(kv_dtype, runtime.model.dtype, logit_scale(ref), spec.lora is not None)
    return numeric_tie_step(ref, cand, atol, greedy)


def _ties(runtime: Runtime, kv_dtype: str) -> bool:
    """16-bit models, and pools in a rounded KV format: a greedy near-tie decided by rounding
    ends a comparison (diff.is_numeric_tie). A rounded format turns float32 K/V ~1e-7 apart
    (kernels that sum in another order: a decode-sized weight kernel against a full pass's GEMM)
    into one code step where they straddle a rounding boundary; a reference that scores two
    tokens 8e-4 apart then flips with a drift of 3e-3, inside the format's bound."""
    return runtime.model.dtype in HALF_DTYPES or KV_ROUNDOFF[kv_dtype] > 0


def _diff_sample(
    runtime: Runtime, spec, sample, ref: ReferenceOutput, cand, completion, kv_dtype: str
):
    params = spec.params.for_sample(sample)
    finish_cand = None if completion is None else completion.finish_reason
    ref_records = ref.records
    if finish_cand not in ("stop", "length"):
        ref_records = ref_records[: len(cand)]  # cut short on purpose: the rest must match
        finish_cand = None
    context = RequestContext(
        params,
        ref.finish_reason if finish_cand is not None else None,
        finish_cand,
        tuple(sorted(stop_token_ids(runtime.model, params))),
    )
    adapter = spec.lora is not None
    atol = logit_atol(kv_dtype, runtime.model.dtype, logit_scale(ref.records), adapter)
    ties = _ties(runtime, kv_dtype)
    return first_divergence(ref_records, cand, atol, context=context, ties_allowed=ties)
