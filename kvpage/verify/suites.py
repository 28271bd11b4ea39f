"""Verification suites (R19-R21): cases of requests with arrival steps, forced preemptions, aborts
and injected failures. A case runs on a fresh engine with a tracer attached; every request that
finished normally is diffed step by step against the reference run alone (R16), canaries are
checked across requests (R18), and the pool, ref_counts and index must be back at baseline (R21).

Suites: `prefix` (deterministic prefix set per block size), `batching` (chunked prefill and
decode-heavy budgets), `preemption` (forced preemption incl. the A/B/C script of seed 000 §9, tiny
pools, swap and recompute), `failure` (abort while waiting/running/swapped, timeout, swap-write
failure, cancelled recompute)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.engine.namespace import base_namespace
from kvpage.engine.sequence import SeqStatus
from kvpage.sampling_params import SamplingParams
from kvpage.verify.canary import find_foreign_canaries, make_canaries
from kvpage.verify.diff import Divergence, first_divergence
from kvpage.verify.reference import generate
from kvpage.verify.trace import EngineTracer, StepRecord

SUITES = ("prefix", "batching", "preemption", "failure")
BLOCK_SIZES = (8, 16)
MAX_STEPS = 3000


@dataclass(slots=True)
class RequestSpec:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrive_step: int = 0  # engine steps run before this request is added
    cache_salt: str | None = None
    timeout_s: float | None = None
    canary: tuple[int, ...] = ()


@dataclass(slots=True)
class Action:
    """Something done to the engine between steps, once `when(engine, step)` holds."""

    name: str
    when: Callable[[LLMEngine, int], bool]
    do: Callable[[LLMEngine], None]


@dataclass(slots=True)
class Case:
    suite: str
    name: str
    requests: list[RequestSpec]
    engine: dict = field(default_factory=dict)  # EngineConfig overrides
    actions: list[Action] = field(default_factory=list)
    expect_finish: dict[str, str] = field(default_factory=dict)  # request -> finish reason
    expect_hit: tuple[str, ...] = ()  # requests that must be served from the prefix cache
    expect_no_hit: tuple[str, ...] = ()  # requests that must not be (another namespace)
    expect_preemption: bool = False
    expect_counters: dict[str, int] = field(default_factory=dict)  # exact stats at the end

    @property
    def full_name(self) -> str:
        return f"{self.suite}/{self.name}"


@dataclass(slots=True)
class Failure:
    kind: str  # "divergence" | "canary" | "expectation" | "baseline" | "crash"
    message: str
    request_id: str | None = None
    divergence: Divergence | None = None

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "message": self.message,
            "request_id": self.request_id,
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
        }


@dataclass(slots=True)
class CaseResult:
    case: str
    suite: str
    failures: list[Failure]
    requests: int
    steps: int
    seconds: float

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def first_divergence(self) -> Divergence | None:
        return next((f.divergence for f in self.failures if f.divergence is not None), None)


class Runtime:
    """The model, its reference memo, and how to build an engine (mutants override it)."""

    def __init__(
        self,
        model,
        tokenizer,
        model_name: str,
        debug_checks: bool = True,
        engine_factory: Callable[[EngineConfig], LLMEngine] | None = None,
    ) -> None:
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.debug_checks = debug_checks
        self.engine_factory = engine_factory or (lambda cfg: LLMEngine(cfg, model, tokenizer))
        self._refs: dict[tuple, list[StepRecord]] = {}

    def make_engine(self, overrides: dict) -> LLMEngine:
        args = dict(model=self.model_name, debug_checks=self.debug_checks)
        args.update(overrides)
        return self.engine_factory(EngineConfig(**args))

    def reference(self, spec: RequestSpec, block_size: int) -> list[StepRecord]:
        ns = base_namespace(self.model, self.tokenizer, block_size, self.model_name)
        ns_hex = ns.with_salt(spec.cache_salt).digest().hex()
        key = (tuple(spec.prompt), spec.params, ns_hex)
        if key not in self._refs:
            out = generate(self.model, spec.prompt, spec.params, trace_as="ref", namespace=ns_hex)
            self._refs[key] = out.records
        return self._refs[key]


# --- running a case ------------------------------------------------------------------------
def run_case(case: Case, runtime: Runtime) -> CaseResult:
    start = time.perf_counter()
    failures: list[Failure] = []
    engine = None
    steps = 0
    try:
        engine = runtime.make_engine(case.engine)
        engine.tracer = EngineTracer(engine)
        finished, steps = _drive(engine, case)
        failures += _check_requests(case, runtime, engine, finished)
        failures += _check_expectations(case, engine, finished)
        failures += _check_baseline(engine)
    except Exception as err:  # a crash is a failure of the case, not of the verifier
        failures.append(Failure("crash", f"{type(err).__name__}: {err}"))
    return CaseResult(
        case.full_name, case.suite, failures, len(case.requests), steps, time.perf_counter() - start
    )


def _drive(engine: LLMEngine, case: Case):
    pending = sorted(case.requests, key=lambda r: r.arrive_step)
    actions = list(case.actions)
    finished: dict = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrive_step <= steps:
            spec = pending.pop(0)
            engine.add_request(
                spec.request_id,
                spec.prompt,
                spec.params,
                cache_salt=spec.cache_salt,
                timeout_s=spec.timeout_s,
            )
        for action in [a for a in actions if a.when(engine, steps)]:
            action.do(engine)
            actions.remove(action)
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
        if steps > MAX_STEPS:
            raise RuntimeError(f"no progress after {MAX_STEPS} steps")
    finished.update({o.request_id: o for o in engine.step() if o.finished})
    return finished, steps


def _check_requests(case: Case, runtime: Runtime, engine: LLMEngine, finished) -> list[Failure]:
    failures: list[Failure] = []
    block_size = engine.config.block_size
    refs: dict[str, list[StepRecord]] = {}
    for spec in case.requests:
        out = finished.get(spec.request_id)
        if out is None:
            failures.append(Failure("expectation", "request never finished", spec.request_id))
            continue
        ref = runtime.reference(spec, block_size)
        refs[spec.request_id] = ref
        cand = engine.tracer.records.get(spec.request_id, [])
        if out.outputs[0].finish_reason not in ("stop", "length"):
            ref = ref[: len(cand)]  # cut short on purpose: what it did produce must still match
        div = first_divergence(ref, cand)
        if div is not None:
            div.request_id = spec.request_id
            failures.append(
                Failure(
                    "divergence",
                    f"{spec.request_id} diverged at step {div.step} ({div.kind}: {div.detail})",
                    spec.request_id,
                    div,
                )
            )
    canaries = {s.request_id: s.canary for s in case.requests if s.canary}
    for leak in find_foreign_canaries(canaries, engine.tracer.records, refs):
        failures.append(Failure("canary", str(leak), leak.victim))
    return failures


def _check_expectations(case: Case, engine: LLMEngine, finished) -> list[Failure]:
    failures: list[Failure] = []
    for rid, reason in case.expect_finish.items():
        got = finished[rid].outputs[0].finish_reason if rid in finished else None
        if got != reason:
            failures.append(Failure("expectation", f"finish_reason {got}, expected {reason}", rid))
    for rid in case.expect_hit:
        if rid in finished and finished[rid].metrics.num_cached_tokens == 0:
            failures.append(Failure("expectation", "expected a prefix-cache hit, got none", rid))
    for rid in case.expect_no_hit:
        if rid in finished and finished[rid].metrics.num_cached_tokens > 0:
            failures.append(
                Failure(
                    "expectation",
                    "expected no prefix-cache hit, got "
                    f"({finished[rid].metrics.num_cached_tokens} tokens)",
                    rid,
                )
            )
    stats = engine.stats()
    if case.expect_preemption and stats["preemptions"] == 0:
        failures.append(Failure("expectation", "the case was built to preempt, but nothing was"))
    for name, value in case.expect_counters.items():
        if stats[name] != value:
            failures.append(
                Failure("expectation", f"stats[{name!r}] = {stats[name]}, expected {value}")
            )
    return failures


def _check_baseline(engine: LLMEngine) -> list[Failure]:
    """Idle engine: every block free or cached, each cached block indexed, nothing held (R21)."""
    s = engine.stats()
    problems = []
    if s["private_blocks"] or s["shared_blocks"] or s["evicting_blocks"] or s["restoring_blocks"]:
        problems.append(
            f"blocks still held: {s['private_blocks']} private, {s['shared_blocks']} "
            f"shared, {s['evicting_blocks']} evicting, {s['restoring_blocks']} restoring"
        )
    if s["free_blocks"] + s["cached_blocks"] != s["num_blocks"]:
        problems.append(
            f"free {s['free_blocks']} + cached {s['cached_blocks']} != {s['num_blocks']}"
        )
    if s["index_entries"] != s["cached_blocks"]:
        problems.append(
            f"index has {s['index_entries']} entries for {s['cached_blocks']} cached blocks"
        )
    if s["running"] or s["waiting"] or s["swapped"] or s["swap_space_used"]:
        problems.append("requests or swap space still held")
    if engine.cache.live_tables or engine.cache.inflight:
        problems.append("live tables or in-flight snapshots remain")
    return [Failure("baseline", p) for p in problems]


# --- building the cases ----------------------------------------------------------------------
class _Tokens:
    """Deterministic token material, avoiding special ids."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ids = list(range(3, min(vocab, 256)))

    def take(self, n: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _with_canaries(specs: list[RequestSpec], vocab: int, seed: int) -> list[RequestSpec]:
    """Put each request's canary at the end of its private tail (keeps shared prefixes intact)."""
    ids = list(range(3, min(vocab, 256)))
    canaries = make_canaries([s.request_id for s in specs], ids, seed)
    for s in specs:
        s.canary = canaries[s.request_id]
        s.prompt = s.prompt + list(s.canary)
    return specs


def prefix_cases(vocab: int, block_size: int) -> list[Case]:
    B = block_size
    t = _Tokens(vocab, seed=B)
    shared = t.take(3 * B + 1)
    groups = [("p0", 0), ("p1", B), ("p3", 3 * B), ("full+1", B + 1), ("full-1", B - 1)]
    specs = []
    for wave in range(2):
        for name, n in groups:
            specs.append(
                RequestSpec(
                    f"{name}.{wave}",
                    shared[:n] + t.take(5 + wave),
                    _greedy(16),
                    arrive_step=3 * wave,
                )
            )
    specs = _with_canaries(specs, vocab, seed=B)
    exact = [
        RequestSpec(f"exact2.{i}", shared[: 2 * B], _greedy(12), arrive_step=4 * i)
        for i in range(2)
    ]  # a fully cached prompt of exactly 2 blocks
    cases = [
        Case(
            "prefix",
            f"shared_prefixes_b{B}",
            specs + exact,
            dict(block_size=B, num_blocks=160),
            expect_hit=("p1.1", "p3.1", "full+1.1", "exact2.1"),
        )
    ]
    cases.append(_multi_turn_case(t, B))
    cases.append(_formats_case(t, B))
    cases.append(_tenant_case(t, B))
    cases.append(_many_distinct_case(t, B))
    cases.append(_evict_reuse_case(t, B))
    return cases


def _evict_reuse_case(t: _Tokens, B: int) -> Case:
    """X's prefix is cached, evicted under pressure and its blocks reused by fillers; Z then asks
    for X's prefix while the fillers still hold those blocks: it must miss, not read them."""
    prefix = t.take(2 * B)
    specs = [RequestSpec("X", prefix + t.take(3), _greedy(4))]
    # Two fillers take 10 of the 12 free blocks; the third needs 4, so X's 2 cached blocks are
    # evicted and handed to it. The first two finish fast, so Z is admitted while the third
    # still holds X's old blocks.
    sizes = ((4 * B + 1, 2), (4 * B + 1, 2), (3 * B + 1, 3 * B))
    specs += [
        RequestSpec(f"filler{i}", t.take(n), _greedy(out), arrive_step=8)
        for i, (n, out) in enumerate(sizes)
    ]
    specs.append(RequestSpec("Z", prefix + t.take(2), _greedy(4), arrive_step=9))
    return Case(
        "prefix",
        f"evict_reuse_b{B}",
        specs,
        dict(block_size=B, num_blocks=14),
        expect_no_hit=("Z",),
    )


def _multi_turn_case(t: _Tokens, B: int) -> Case:
    """Nested histories: turn k+1's prompt extends turn k's prompt and answer (radix reuse)."""
    system, history, specs = t.take(B + 3), [], []
    history = list(system)
    for turn in range(4):
        history = history + t.take(B // 2 + 3 * turn + 1)
        specs.append(RequestSpec(f"turn{turn}", list(history), _greedy(8), arrive_step=12 * turn))
        history = history + t.take(6)  # the "assistant answer" of this turn
    return Case(
        "prefix",
        f"multi_turn_b{B}",
        specs,
        dict(block_size=B, num_blocks=96),
        expect_hit=("turn1", "turn2", "turn3"),
    )


def _formats_case(t: _Tokens, B: int) -> Case:
    """Conflicting formats and topics; a block repeated at another depth (position alignment);
    a shared later block under different first blocks (chaining)."""
    json_head, prose_head, block_q, block_p = t.take(B), t.take(B), t.take(B), t.take(B)
    specs = [
        RequestSpec("json.a", json_head + block_q + t.take(4), _greedy(12)),
        RequestSpec("prose.a", prose_head + block_q + t.take(4), _greedy(12), arrive_step=3),
        RequestSpec("json.b", json_head + t.take(B + 3), _greedy(12), arrive_step=3),
        RequestSpec("q-first", block_q + block_p + t.take(3), _greedy(12), arrive_step=6),
        RequestSpec("p-then-q", block_p + block_q + t.take(2), _greedy(12), arrive_step=6),
        RequestSpec("q-again", block_q + t.take(5), _greedy(12), arrive_step=9),
    ]
    return Case(
        "prefix",
        f"formats_b{B}",
        specs,
        dict(block_size=B, num_blocks=96),
        expect_hit=("json.b", "q-again"),
    )


def _tenant_case(t: _Tokens, B: int) -> Case:
    prompt = t.take(3 * B + 2)
    specs = [
        RequestSpec("tenantA.1", prompt, _greedy(8), cache_salt="tenant-A"),
        RequestSpec("tenantA.2", prompt, _greedy(8), arrive_step=3, cache_salt="tenant-A"),
        RequestSpec("tenantB.1", prompt, _greedy(8), arrive_step=3, cache_salt="tenant-B"),
        RequestSpec("nosalt.1", prompt, _greedy(8), arrive_step=3),
    ]
    return Case(
        "prefix",
        f"tenants_b{B}",
        specs,
        dict(block_size=B, num_blocks=96),
        expect_hit=("tenantA.2",),
        expect_no_hit=("tenantB.1", "nosalt.1"),
    )


def _many_distinct_case(t: _Tokens, B: int) -> Case:
    """Many distinct published blocks, then distinct lookups: any fast-key collision that is
    served without its digest confirmed shows up as a step-0 divergence."""
    first = [RequestSpec(f"fill{i}", t.take(2 * B + 1), _greedy(2)) for i in range(24)]
    second = [
        RequestSpec(f"probe{i}", t.take(2 * B + 1), _greedy(4), arrive_step=6) for i in range(24)
    ]
    return Case(
        "prefix",
        f"many_distinct_b{B}",
        first + second,
        dict(block_size=B, num_blocks=256, max_num_batched_tokens=4096),
    )


def batching_cases(vocab: int) -> list[Case]:
    t = _Tokens(vocab, seed=101)
    long_prompt = RequestSpec("long", t.take(160), _greedy(8))
    # Several short prompts mid-prefill at once while others decode: chunk boundaries everywhere.
    shorts = [
        RequestSpec(f"short{i}", t.take(5 + i % 6), _greedy(40), arrive_step=1) for i in range(12)
    ]
    decode_heavy = Case(
        "batching",
        "decode_heavy_budget8",
        [long_prompt, *shorts],
        dict(block_size=8, num_blocks=128, max_num_batched_tokens=8),
    )
    specs = [
        RequestSpec(f"c{i}", t.take(20 + 13 * i), _greedy(24), arrive_step=i) for i in range(8)
    ]
    chunked = Case(
        "batching",
        "chunked_budget32",
        specs,
        dict(block_size=16, num_blocks=96, max_num_batched_tokens=32),
    )
    return [decode_heavy, chunked]


def _abc_script(t: _Tokens, mode: str) -> Case:
    """Seed 000 §9: A long prefill + short decode; B shares A's prefix and ends quickly; C long
    decode, preempted at its 8th token; B frees its private blocks; C resumes and must match."""
    B = 8
    prefix = t.take(5 * B)
    specs = [
        RequestSpec("A", prefix + t.take(6), _greedy(6)),
        RequestSpec("B", prefix[: 3 * B] + t.take(4), _greedy(3), arrive_step=2),
        RequestSpec("C", t.take(9), _greedy(40), arrive_step=2),
    ]
    specs = _with_canaries(specs, 256, seed=7)
    preempt = Action(
        "preempt C at token 8",
        lambda e, s: "C" in e.seqs,
        lambda e: e.force_preempt("C", after_tokens=8, resume_after_steps=6, mode=mode),
    )
    return Case(
        "preemption",
        f"abc_{mode}",
        specs,
        dict(block_size=B, num_blocks=16, preemption_mode=mode, swap_space_blocks=64),
        actions=[preempt],
        expect_preemption=True,
        expect_counters={"swap_ins": 1} if mode == "swap" else {"swap_outs": 0},
    )


def preemption_cases(vocab: int) -> list[Case]:
    t = _Tokens(vocab, seed=202)
    cases = [_abc_script(t, "swap"), _abc_script(t, "recompute")]
    shared = t.take(24)
    for mode in ("swap", "recompute"):
        specs = [
            RequestSpec(
                f"r{i}", shared[: 8 * (i % 3)] + t.take(6 + i), _greedy(32), arrive_step=i // 4
            )
            for i in range(12)
        ]
        cases.append(
            Case(
                "preemption",
                f"tiny_pool_{mode}",
                _with_canaries(specs, vocab, 9),
                dict(block_size=8, num_blocks=28, preemption_mode=mode, swap_space_blocks=128),
                expect_preemption=True,
            )
        )
    specs = [RequestSpec(f"f{i}", t.take(10 + 3 * i), _greedy(24)) for i in range(6)]
    plan = [
        ("f0", 0, 2, "swap"),
        ("f2", 7, 1, "recompute"),
        ("f4", 15, 3, "swap"),
        ("f5", 23, 1, "recompute"),
    ]
    actions = [
        Action(
            f"preempt {r} after {k}",
            lambda e, s: s == 0,
            lambda e, r=r, k=k, n=n, m=m: e.force_preempt(r, k, n, m),
        )
        for r, k, n, m in plan
    ]
    cases.append(
        Case(
            "preemption",
            "forced_schedule",
            specs,
            dict(block_size=8, num_blocks=64, swap_space_blocks=64),
            actions=actions,
            expect_preemption=True,
            expect_counters={"preemptions": 4},
        )
    )
    return cases


def _status(engine: LLMEngine, rid: str):
    seq = engine.seqs.get(rid)
    return None if seq is None else seq.status


def failure_cases(vocab: int) -> list[Case]:
    t = _Tokens(vocab, seed=303)
    cases = []
    specs = [RequestSpec(f"w{i}", t.take(12 + i), _greedy(20)) for i in range(5)]
    actions = [
        Action(
            "park w1 in swap",
            lambda e, s: s == 0,
            lambda e: e.force_preempt("w1", 3, 10_000, "swap"),
        ),
        Action(
            "abort waiting w4, running w0, swapped w1",
            lambda e, s: _status(e, "w1") is SeqStatus.SWAPPED,
            lambda e: [e.abort_request(r) for r in ("w4", "w0", "w1")],
        ),
    ]
    cases.append(
        Case(
            "failure",
            "abort_waiting_running_swapped",
            specs,
            dict(block_size=8, num_blocks=64, max_num_seqs=3, swap_space_blocks=64),
            actions=actions,
            expect_finish={"w4": "abort", "w0": "abort", "w1": "abort"},
            expect_counters={"aborts": 3, "swap_space_used": 0},
        )
    )
    slow = RequestSpec("slow", t.take(10), _greedy(2000), timeout_s=0.2)  # cannot finish in 0.2 s
    others = [RequestSpec(f"o{i}", t.take(9 + i), _greedy(16)) for i in range(3)]
    cases.append(
        Case(
            "failure",
            "timeout",
            [slow, *others],
            dict(block_size=8, num_blocks=300),  # room for all 2000 tokens: only the clock stops it
            expect_finish={"slow": "timeout"},
            expect_counters={"timeouts": 1},
        )
    )
    specs = [RequestSpec(f"s{i}", t.take(10 + i), _greedy(20)) for i in range(4)]
    actions = [
        Action(
            "fail the next swap write",
            lambda e, s: s == 0,
            lambda e: (e.inject_swap_failure(1), e.force_preempt("s1", 5, 2, "swap")),
        )
    ]
    cases.append(
        Case(
            "failure",
            "swap_write_failure",
            specs,
            dict(block_size=8, num_blocks=64, swap_space_blocks=64),
            actions=actions,
            expect_counters={"swap_failures": 1, "swap_outs": 0, "preemptions_recompute": 1},
        )
    )
    specs = [RequestSpec(f"c{i}", t.take(30 + i), _greedy(20)) for i in range(3)]
    actions = [
        Action(
            "preempt c0 by recompute",
            lambda e, s: s == 0,
            lambda e: e.force_preempt("c0", 4, 10_000, "recompute"),
        ),
        Action(
            "cancel c0's recompute",
            lambda e, s: _status(e, "c0") is SeqStatus.WAITING and e.seqs["c0"].num_preemptions,
            lambda e: e.abort_request("c0"),
        ),
    ]
    cases.append(
        Case(
            "failure",
            "cancel_recompute",
            specs,
            dict(block_size=8, num_blocks=64, enable_prefix_caching=False),
            actions=actions,
            expect_finish={"c0": "abort"},
        )
    )
    return cases


def build_suites(vocab: int, suites: tuple[str, ...] = SUITES) -> list[Case]:
    cases: list[Case] = []
    if "prefix" in suites:
        for block_size in BLOCK_SIZES:
            cases += prefix_cases(vocab, block_size)
    if "batching" in suites:
        cases += batching_cases(vocab)
    if "preemption" in suites:
        cases += preemption_cases(vocab)
    if "failure" in suites:
        cases += failure_cases(vocab)
    return cases
