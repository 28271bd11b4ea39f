"""The release gate: suites on the real engine (debug invariant checks on), then the mutation
check (every mutant caught, its first divergence attributed to its own class), then a report.
Passes only when every case passes, every mutant is caught and correctly attributed, and every
divergence report carries the fields its class needs."""

from __future__ import annotations

import contextlib
import math
import platform
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace

import torch

from kvpage.config import KV_CACHE_DTYPES, EngineConfig
from kvpage.engine.adapters import LORA_MODEL_TYPES
from kvpage.engine.engine import LLMEngine
from kvpage.model import load_model
from kvpage.model.int8 import Int8Linear
from kvpage.model.loader import build_model
from kvpage.model.quantize import head_quantized, weight_quantization
from kvpage.verify import path_coverage
from kvpage.verify.cases import BLOCK_SIZES, quantized_suite_names
from kvpage.verify.cases.prefix import prefix_cases
from kvpage.verify.diff import MutantAttribution
from kvpage.verify.generated.alone import alone_summary, generated_alone
from kvpage.verify.generated.stage import GeneratedResult, GeneratedStage, run_stage
from kvpage.verify.model_oracle.stage import ModelStageResult, run_model_stage
from kvpage.verify.mutants import MUTANTS, Mutant
from kvpage.verify.stack import STACK_MUTANTS, TextTarget, run_stack_stage
from kvpage.verify.suites import SUITES, CaseResult, Runtime, build_suites, run_case

STACK_SUITES = ("server", "router")
# The model stage (kvpage.verify.model_oracle): "served" compares the model under test with
# transformers on its weights; "full" adds every family's checkpoint and the stage's mutants.
MODEL_CHECKS = ("none", "served", "full")

# The KV formats the gate runs the prefix, batching and preemption suites in besides the model's.
DEFAULT_GATE_KV_DTYPES = ("int8",)


@dataclass(slots=True)
class MutantResult(MutantAttribution):
    mutant: Mutant
    caught: bool
    caught_by: list[str]
    first_failure: str | None
    divergence: dict | None  # Divergence.to_dict() of the first divergence found
    seconds: float
    not_applicable: str | None = None  # why the bug cannot be expressed on this model (not run)


@dataclass(slots=True)
class GateResult:
    model: str
    suites: tuple[str, ...]
    cases: list[CaseResult]
    mutants: list[MutantResult]
    seconds: float
    environment: dict = field(default_factory=dict)
    mutants_run: bool = True  # False with --no-mutants
    engine: dict = field(default_factory=dict)  # the configuration under test (Runtime)
    cases_not_applicable: dict[str, str] = field(default_factory=dict)  # case -> why not run
    generated: GeneratedResult | None = None  # the generated stage, when it ran
    generated_alone: dict | None = None  # alone_summary() of the mutants against it alone
    # kvpage.verify.path_coverage.summary(): each fast path, available here, calls taken by the
    # honest engine's cases
    fast_paths: dict = field(default_factory=dict)

    @property
    def applicable(self) -> list[MutantResult]:
        """The mutants run: a not-applicable one counts neither as caught nor as missed."""
        return [m for m in self.mutants if m.not_applicable is None]

    @property
    def mutation_score(self) -> float | None:
        """Caught / run; None when the mutation check was skipped (never a vacuous 100%)."""
        if not self.mutants_run or not self.applicable:
            return None
        return sum(m.caught for m in self.applicable) / len(self.applicable)

    @property
    def attribution_score(self) -> float | None:
        if not self.mutants_run or not self.applicable:
            return None
        return sum(m.attribution_ok for m in self.applicable) / len(self.applicable)

    @property
    def passed(self) -> bool:
        generated_ok = self.generated is None or self.generated.passed
        return (
            generated_ok
            and all(c.passed for c in self.cases)
            and all(m.caught and m.attribution_ok for m in self.applicable)
        )

    def to_dict(self) -> dict:
        per_suite = {}
        for suite in self.suites:
            results = [c for c in self.cases if c.suite == suite]
            per_suite[suite] = {
                "cases": len(results),
                "failures": sum(not c.passed for c in results),
                "results": [_case_dict(c) for c in results],
            }
        return {
            "passed": self.passed,
            "model": self.model,
            "engine": self.engine,
            "environment": self.environment,
            "seconds": round(self.seconds, 2),
            "suites": per_suite,
            "cases_not_applicable": self.cases_not_applicable,
            "mutation_score": self.mutation_score,
            "attribution_score": self.attribution_score,
            "mutation_check": "run" if self.mutants_run else "skipped",
            "mutants": {m.mutant.name: _mutant_dict(m) for m in self.mutants},
            "generated": self._generated_dict(),
            "fast_paths": self.fast_paths,
        }

    def _generated_dict(self) -> dict | None:
        if self.generated is None:
            return None
        return {**self.generated.to_dict(), "alone": self.generated_alone}


def _case_dict(c: CaseResult) -> dict:
    return {
        "case": c.case,
        "passed": c.passed,
        "requests": c.requests,
        "steps": c.steps,
        "seconds": round(c.seconds, 3),
        "failures": [f.to_dict() for f in c.failures],
    }


def _mutant_dict(m: MutantResult) -> dict:
    return {
        "bug": m.mutant.bug,
        "caught": m.caught,
        "caught_by": m.caught_by,
        "first_failure": m.first_failure,
        "expected_class": m.mutant.expected_class,
        "attributed_class": m.attributed_class,
        "attribution_ok": m.attribution_ok,
        "first_divergence": m.divergence,
        "seconds": round(m.seconds, 2),
        "not_applicable": m.not_applicable,
    }


class Progress:
    """One line on stderr, rewritten in place on a terminal, plain lines otherwise."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}"
        print(
            f"\r{line[:110]:<110}" if self.tty else line,
            end="" if self.tty else "\n",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def run_gate(
    model_name: str = "builtin:tiny-llama",
    suites: tuple[str, ...] = SUITES,
    mutants: bool | Collection[str] = True,
    progress: bool = True,
    kv_cache_dtypes: tuple[str, ...] = DEFAULT_GATE_KV_DTYPES,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    engine: dict | None = None,
    generated: GeneratedStage | None = None,
    stack: bool = False,
    report_dir: str | None = None,
    model_check: str = "none",
    paths_off: tuple[str, ...] = (),
) -> GateResult:
    """`kv_cache_dtypes`: quantized KV formats whose copies of the prefix, batching and
    preemption suites (and a CoW fork case) run too; a mutant bound to a KV format runs only
    when its format is among them or is the pool's. `dtype`: the model's (and so the
    reference's) compute dtype. `tensor_parallel_size` > 1: every engine (case, mutant) runs
    split over that many processes, one set of workers reused by all of them. `mutants`: all
    (True), none (False), or only the named ones. `engine`: EngineConfig fields of the
    configuration under test, the base of every case's engine (Runtime: a case's own fields
    win); its `dtype` and `tensor_parallel_size`, when present, win over the arguments.
    `generated`: the generated stage to run after the suites (its failures' reproducers go
    under `report_dir`), and with mutants, every mutant against it alone (the generality
    figure, reported apart from the mutation check). `stack`: the whole-stack suite (server
    and router) and, with mutants, its own mutants, which count in the mutation check.
    `model_check` (MODEL_CHECKS): the model stage, before any engine case; its mutants (with
    "full") count in the mutation check too. `paths_off`: fast paths (kvpage.model.kernels)
    the whole run keeps off, so the paths behind them run (the widened int8 tiles where the
    GEMV would take every row count)."""
    engine = dict(engine or {})
    dtype = engine.pop("dtype", dtype)
    tp = engine.pop("tensor_parallel_size", tensor_parallel_size)
    if model_check not in MODEL_CHECKS:
        raise ValueError(f"model_check must be one of {MODEL_CHECKS}, got {model_check!r}")
    plan = GatePlan(
        model_name, suites, mutants, kv_cache_dtypes, dtype, tp, engine, generated, stack
    )
    plan.model_check, plan.paths_off = model_check, tuple(paths_off)
    plan.report_dir = report_dir
    if paths_off:  # every engine binds its model without them (kvpage.model.kernels)
        plan.engine["fast_paths_off"] = tuple(paths_off)
    with _tensor_parallel_workers(tp):
        return _run_gate(plan, progress)


@dataclass(slots=True)
class GatePlan:
    """What one gate run covers; each stage reads what it needs from it."""

    model_name: str
    suites: tuple[str, ...]
    mutants: bool | Collection[str]
    kv_cache_dtypes: tuple[str, ...]
    dtype: str
    tensor_parallel_size: int
    engine: dict
    generated: GeneratedStage | None = None
    stack: bool = False
    report_dir: str | None = None
    model_check: str = "none"
    paths_off: tuple[str, ...] = ()

    @property
    def pool_kv_dtype(self) -> str:
        return self.engine.get("kv_cache_dtype", "auto")

    def wants(self, mutant: Mutant, formats: tuple[str, ...] | None = None) -> bool:
        """`formats`: the KV formats the cases run in (default: the pool's and the copies'). A
        mutant bound to a weight format runs only on those weights (Mutant.weights)."""
        if self.mutants is False:
            return False
        if self.mutants is not True and mutant.name not in self.mutants:
            return False
        if mutant.weights not in (None, self.engine.get("quantization", "none")):
            return False
        formats = (*self.kv_cache_dtypes, self.pool_kv_dtype) if formats is None else formats
        return mutant.kv_cache_dtype in (None, *formats)


def _tensor_parallel_workers(tensor_parallel_size: int):
    if tensor_parallel_size == 1:
        return contextlib.nullcontext()
    from kvpage.parallel.executor import shared_workers  # only a TP gate loads it

    return shared_workers()


def _run_gate(plan: GatePlan, progress: bool) -> GateResult:
    """The stages in order, on one model and one set of references: suites, then mutants."""
    start = time.perf_counter()
    model, tokenizer = load_model(
        plan.model_name,
        plan.dtype,
        plan.engine.get("device", "cpu"),
        plan.engine.get("quantization", "none"),
        plan.engine.get("quantize_lm_head", False),
    )
    model_stage = _model_stage(plan, model)
    kv_copies = tuple(d for d in plan.kv_cache_dtypes if d not in ("auto", plan.pool_kv_dtype))
    cases, unfit = _cases(plan, model.config, kv_copies, tokenizer is not None)
    suites = (*plan.suites, *quantized_suite_names(plan.suites, kv_copies))
    mutant_list = [m for m in MUTANTS if plan.wants(m)]
    scenarios = 0 if plan.generated is None else plan.generated.count or 0
    bar = Progress(len(cases) + len(mutant_list) + scenarios, progress)
    runtime = Runtime(
        model,
        tokenizer,
        plan.model_name,
        debug_checks=True,
        tensor_parallel_size=plan.tensor_parallel_size,
        engine=plan.engine,
    )
    with path_coverage.counting() as counts:  # the honest engine's runs only
        case_results = _suite_stage(cases, runtime, bar)
        generated = _generated_stage(plan, runtime, bar)
    # Engine mutants need the suites' cases; without any (a generated-only run) they run
    # against the generated scenarios alone, below.
    mutant_results = _mutant_stage(mutant_list, cases, runtime, bar) if cases else []
    alone = None
    if generated is not None and mutant_list:
        # the scenarios draw every KV format (unless one is fixed): format-bound mutants too
        mutant_list = [m for m in MUTANTS if plan.wants(m, formats=_drawn_formats(plan))]
        alone = alone_summary(
            generated_alone(mutant_list, *_model_of(runtime), generated, runtime, run_mutant)
        )
    if plan.stack:
        stack_cases, stack_mutants = _stack_stage(plan, runtime)
        case_results += stack_cases
        mutant_results += stack_mutants
        suites = (*suites, *STACK_SUITES)
    if model_stage is not None:
        case_results = model_stage.cases + case_results
        mutant_results = _model_mutant_results(model_stage) + mutant_results
        unfit = {**model_stage.not_applicable, **unfit}
        suites = ("model", *suites)
    bar.close()
    return GateResult(
        plan.model_name,
        suites,
        case_results,
        mutant_results,
        time.perf_counter() - start,
        {**_environment(model), "fast_paths_off": list(plan.paths_off)},
        mutants_run=plan.mutants is not False,
        engine=dict(plan.engine),
        cases_not_applicable=unfit,
        generated=generated,
        generated_alone=alone,
        fast_paths=path_coverage.summary(counts),
    )


def _model_stage(plan: GatePlan, model) -> ModelStageResult | None:
    """transformers against the reference's forward, before any engine case runs."""
    if plan.model_check == "none":
        return None
    full = plan.model_check == "full"
    mutants = plan.mutants if full else False
    adapters = "lora" in plan.suites and _lora_unfit(model.config) is None
    return run_model_stage(
        model, plan.model_name, mutants, families=None if full else (), adapters=adapters
    )


def _model_mutant_results(stage: ModelStageResult) -> list[MutantResult]:
    return [
        MutantResult(
            o.mutant,
            o.caught,
            o.caught_by,
            None if o.divergence is None else f"{o.caught_by[0]}: {o.divergence['detail']}",
            o.divergence,
            o.seconds,
        )
        for o in stage.mutants
    ]


def _drawn_formats(plan: GatePlan) -> tuple[str, ...]:
    fixed = plan.engine.get("kv_cache_dtype")
    return (fixed,) if fixed else KV_CACHE_DTYPES


def _model_of(runtime: Runtime):
    return runtime.model, runtime.tokenizer, runtime.model_name


def _generated_stage(plan: GatePlan, runtime: Runtime, bar: Progress) -> GeneratedResult | None:
    if plan.generated is None:
        return None

    def show(scenario, result) -> None:
        bar.step(f"generated {scenario.name}: {'ok' if result.passed else 'FAIL'}")

    # What the user fixed (`kvpage verify --block-size ...`) every scenario keeps.
    stage = replace(plan.generated, fixed={**plan.engine, **plan.generated.fixed})
    return run_stage(stage, runtime, plan.report_dir, show)


def _stack_stage(plan: GatePlan, runtime: Runtime):
    """The server cases on the served tokenizer and two trained ones, the router cases, then
    (with mutants) each stack mutant against them."""
    wanted = [
        m
        for m in STACK_MUTANTS
        if plan.mutants is True or (plan.mutants is not False and m.name in plan.mutants)
    ]
    return run_stack_stage(TextTarget(*_model_of(runtime)), wanted)


def _cases(plan: GatePlan, config, kv_copies: tuple[str, ...], has_tokenizer: bool = True):
    """The suites' cases that fit the model, and why the others do not. A block size the user
    verifies that the prefix suite does not already run gets the prefix cases at that size too
    (every other case keeps its own block size). Constrained requests need the model's
    tokenizer (`has_tokenizer`)."""
    cases = build_suites(config.vocab_size, plan.suites, kv_copies)
    block_size = plan.engine.get("block_size")
    if "prefix" in plan.suites and block_size is not None and block_size not in BLOCK_SIZES:
        cases += prefix_cases(config.vocab_size, block_size)
    limit = min(config.max_position_embeddings, plan.engine.get("max_model_len") or math.inf)
    lora_unfit = _lora_unfit(config)
    unfit = {
        c.full_name: _too_long(c, limit)
        or (lora_unfit if _has_adapters(c) else None)
        or (None if has_tokenizer else _constrained(c))
        for c in cases
    }
    return [c for c in cases if unfit[c.full_name] is None], {
        name: why for name, why in unfit.items() if why is not None
    }


def _lora_unfit(config) -> str | None:
    """Why the engine serves no adapter on this configuration (None: it does): the engine
    refuses these at start-up, and rightly, so a case with adapters tests nothing there."""
    if config.model_type not in LORA_MODEL_TYPES:
        return f"LoRA adapters are served on Llama-shaped models, not {config.model_type}"
    return None


NO_TOKENIZER = "structured outputs compile over the model's tokenizer, and this model has none"


def _constrained(case) -> str | None:
    """Why a case with constrained requests cannot run without a tokenizer (None: it has none)."""
    if any(s.params.structured_outputs is not None for s in case.requests):
        return NO_TOKENIZER
    return None


def _has_adapters(case) -> bool:
    return any(s.lora is not None for s in case.requests)


def _too_long(case, limit: float) -> str | None:
    """A case whose request cannot fit the model's context is not applicable to the model (like
    a mutant its shape cannot express): the engine would refuse it, and rightly."""
    longest = max((len(s.prompt) + s.params.max_tokens for s in case.requests), default=0)
    if longest <= limit:
        return None
    return f"a request needs {longest} positions, the model has {int(limit)}"


def _suite_stage(cases, runtime: Runtime, bar: Progress) -> list[CaseResult]:
    results = []
    for case in cases:
        results.append(run_case(case, runtime))
        bar.step(f"{case.full_name}: {'ok' if results[-1].passed else 'FAIL'}")
    return results


def _mutant_stage(mutant_list, cases, runtime: Runtime, bar: Progress) -> list[MutantResult]:
    results = []
    for mutant in mutant_list:
        reason = (
            mutant.not_applicable(runtime.model.config)
            or _own_model_unfit(mutant, runtime)
            or (NO_TOKENIZER if mutant.needs_tokenizer and runtime.tokenizer is None else None)
        )
        if reason is not None:
            results.append(MutantResult(mutant, False, [], None, None, 0.0, reason))
            bar.step(f"mutant {mutant.name}: not applicable")
            continue
        results.append(
            run_mutant(mutant, runtime.model, runtime.tokenizer, runtime.model_name, cases, runtime)
        )
        bar.step(f"mutant {mutant.name}: {'caught' if results[-1].caught else 'MISSED'}")
    return results


def _own_model_unfit(mutant: Mutant, runtime: Runtime) -> str | None:
    """Why a bug in the model's own kernels cannot be planted and attributed here (None: it
    can): a copy of int8 weights is not made, and the fast paths of other ranks cannot be
    switched off from this process (kvpage.verify.kernel_attribution)."""
    if not mutant.own_model:
        return None
    if any(isinstance(m, Int8Linear) for m in runtime.model.modules()):
        return "int8 weights: the mutant's own model copy is made for float weights only"
    if runtime.tensor_parallel_size != 1:
        return "tensor parallel: the kernel re-run switches fast paths in this process only"
    return None


def run_mutant(mutant: Mutant, model, tokenizer, model_name: str, cases, base: Runtime):
    """Suites against the mutant with the engine's debug checks off (the verifier must catch
    it from outside), in order, until the first case that shows a divergence."""

    engine_model = own_copy(model) if mutant.own_model else model

    def factory(cfg: EngineConfig) -> LLMEngine:
        engine = LLMEngine(replace(cfg, **mutant.config), engine_model, tokenizer)
        mutant.apply(engine)
        return engine

    runtime = Runtime(
        model,
        tokenizer,
        model_name,
        debug_checks=False,
        engine_factory=factory,
        tensor_parallel_size=base.tensor_parallel_size,
        engine=base.engine_overrides,
    )
    runtime._refs = base._refs  # the references do not depend on the engine
    start = time.perf_counter()
    caught_by, first_failure, divergence = [], None, None
    focus = [c for c in cases if c.suite in mutant.suites]
    for case in focus + [c for c in cases if c.suite not in mutant.suites]:
        result = run_case(case, runtime)
        if result.passed:
            continue
        caught_by.append(result.case)
        first_failure = first_failure or f"{result.case}: {result.failures[0].message}"
        # A crash's case diffs what ran before it: a divergence it followed comes first.
        if result.first_divergence is not None:
            divergence = result.first_divergence.to_dict()
            break
    return MutantResult(
        mutant, bool(caught_by), caught_by, first_failure, divergence, time.perf_counter() - start
    )


def own_copy(model):
    """A model of the same config and weights, none of its kernels' objects shared."""
    twin = build_model(model.config).to(device=model.device, dtype=model.dtype)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def _environment(model) -> dict:
    """What the baseline depends on: re-run the reference when any of it changes, since an old
    baseline would make a real numeric change look like a cache bug."""
    return {
        "model_revision": model.config.revision,
        "dtype": str(model.dtype),
        "weights": weight_quantization(model) + ("+lm_head" if head_quantized(model) else ""),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
