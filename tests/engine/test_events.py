"""One event stream out of the engine: every event kind, observed from a real engine
run through `engine.add_observer`, names the request and sample (not only the sequence id), the
tenant (the request's cache salt) and the namespace digest; counts agree with the engine's stats.
And nothing outside kvpage/engine and kvpage/cache assigns engine, scheduler or cache attributes."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

import kvpage
from kvpage import LLMEngine, SamplingParams
from kvpage.config import EngineConfig
from kvpage.engine import events as ev
from kvpage.engine.events import EngineObserver
from kvpage.model import load_model
from kvpage.verify.cases.policy import policy_cases
from kvpage.verify.driver import StepDriver
from kvpage.verify.trace import EngineTracer

from .test_differential import assert_idle_baseline
from .workload import prefix_prompts

MODEL = "builtin:tiny-llama"
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


class Recorder(EngineObserver):
    def __init__(self) -> None:
        self.events: list[ev.EngineEvent] = []

    def on_event(self, event: ev.EngineEvent) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL)


def _engine(tiny, **kw) -> tuple[LLMEngine, Recorder]:
    args = dict(model=MODEL, block_size=16, num_blocks=64, debug_checks=True)
    args.update(kw)
    engine = LLMEngine(EngineConfig(**args), *tiny)
    recorder = Recorder()
    engine.add_observer(recorder)
    return engine, recorder


def _drive(engine: LLMEngine, max_steps: int = 2000) -> dict:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("engine did not finish")


def _ns(engine: LLMEngine, salt: str | None) -> str:
    return engine.namespace.with_salt(salt).digest().hex()


def _prompts(n: int, seed: int) -> list[list[int]]:
    return prefix_prompts(16, 258, n=n, seed=seed)


# --- prefix hit ----------------------------------------------------------------------------------
def test_prefix_hit_names_request_tenant_and_namespace(tiny):
    engine, rec = _engine(tiny)
    shared = _prompts(8, seed=1)[2][:48]  # three full blocks
    engine.add_request("first", shared + [5, 6], PARAMS, cache_salt="tenant-a")
    _drive(engine)
    engine.add_request("other-tenant", shared + [7], PARAMS, cache_salt="tenant-b")
    engine.add_request("again", shared + [8, 9, 10], PARAMS, cache_salt="tenant-a")
    _drive(engine)
    (hit,) = rec.of(ev.PrefixHit)  # tenant-b's lookup of the same text is a miss
    assert (hit.request_id, hit.sample_id, hit.tenant) == ("again", "again", "tenant-a")
    assert hit.namespace == _ns(engine, "tenant-a") != _ns(engine, "tenant-b")
    assert hit.token_count == 48 and len(hit.blocks_hit) == 3 and hit.last_block_full
    assert hit.first_admission and not hit.capped and hit.prompt_tokens == 51
    assert len(bytes.fromhex(hit.prefix_digest)) == 32
    assert engine.stats()["prefix_hits"] == hit.token_count


def test_prefix_hits_reported_once_per_final_admission(tiny):
    """Re-prefills after recompute report their hits too (first_admission False); the counted
    ones add up to prefix_hits, and failed admission attempts report nothing."""
    prompts = _prompts(12, seed=2)
    engine, rec = _engine(tiny, num_blocks=20, preemption_mode="recompute")
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True))
    done = _drive(engine)
    hits = rec.of(ev.PrefixHit)
    first = [h for h in hits if h.first_admission]
    assert engine.stats()["preemptions_recompute"] > 0
    assert sum(h.token_count for h in first) == engine.stats()["prefix_hits"] > 0
    assert sum(o.metrics.num_cached_tokens for o in done.values()) == engine.stats()["prefix_hits"]
    assert len({h.request_id for h in first}) == len(first)  # one per request
    assert any(not h.first_admission for h in hits)


# --- copy-on-write -------------------------------------------------------------------------------
def test_cow_copy_of_forked_samples(tiny):
    engine, rec = _engine(tiny, block_size=8)
    prompt = _prompts(2, seed=3)[1][:13]  # a partial last block: each sample copies it
    engine.add_request("par", prompt, SamplingParams(n=3, max_tokens=6, ignore_eos=True))
    _drive(engine)
    copies = rec.of(ev.CowCopy)
    assert copies and len(copies) == engine.stats()["cow_copies"]
    assert {c.request_id for c in copies} == {"par"}
    assert {c.sample_id for c in copies} <= {"par#0", "par#1", "par#2"}
    assert all(c.logical_block == 1 and c.src_block != c.dst_block for c in copies)
    finished = rec.of(ev.Finished)
    assert sorted(f.sample_id for f in finished) == ["par#0", "par#1", "par#2"]


# --- preemption, swap out and in -----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempt_in_both_modes(tiny, mode):
    engine, rec = _engine(tiny, swap_space_blocks=64)
    prompts = _prompts(3, seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, PARAMS, cache_salt="t")
    driver = StepDriver(engine)
    driver.force_preempt("r1", after_tokens=3, resume_after_steps=2, mode=mode)
    _drive(driver)
    (pre,) = rec.of(ev.Preempted)
    assert (pre.request_id, pre.mode, pre.requested_mode, pre.tenant) == ("r1", mode, mode, "t")
    assert pre.blocks and len(pre.blocks) == len(pre.generations)
    outs, ins = rec.of(ev.SwappedOut), rec.of(ev.SwappedIn)
    if mode == "recompute":
        assert not outs and not ins
        return
    (out,), (back,) = outs, ins
    assert out.request_id == back.request_id == "r1" and out.namespace == _ns(engine, "t")
    assert out.blocks == pre.blocks and out.num_tokens == back.num_tokens > 0
    assert back.latency_s > 0 and len(back.blocks) == len(out.blocks)
    kinds = [e.kind for e in rec.events if e.sample_id == "r1"]
    assert kinds.index("swap_out") < kinds.index("preempt") < kinds.index("swap_in")


def test_swap_falls_back_to_recompute(tiny):
    engine, rec = _engine(tiny, swap_space_blocks=64, preemption_mode="swap")
    for i, p in enumerate(_prompts(2, seed=5)):
        engine.add_request(f"r{i}", p, PARAMS)
    driver = StepDriver(engine)
    driver.fail_swap_writes(1)
    driver.force_preempt("r0", after_tokens=2, resume_after_steps=1, mode="swap")
    _drive(driver)
    (pre,) = rec.of(ev.Preempted)
    assert (pre.mode, pre.requested_mode) == ("recompute", "swap")
    assert not rec.of(ev.SwappedOut)


# --- free, finish, abort, timeout ----------------------------------------------------------------
def test_free_and_finish_reasons(tiny, references):
    engine, rec = _engine(tiny)
    prompts = _prompts(3, seed=6)
    tokens = references(MODEL).tokens(prompts[0], PARAMS)
    at = next(i for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    engine.add_request(
        "stops", prompts[0], SamplingParams(max_tokens=12, stop_token_ids=[tokens[at]])
    )
    engine.add_request("runs", prompts[1], PARAMS)
    engine.add_request("aborted", prompts[2], PARAMS)
    engine.step()
    engine.step()
    held = list(engine.seqs["aborted"].table.block_ids)
    assert engine.abort_request("aborted")
    _drive(engine)
    finish = {f.request_id: f for f in rec.of(ev.Finished)}
    assert {r: f.reason for r, f in finish.items()} == {
        "stops": "stop",
        "runs": "length",
        "aborted": "abort",
    }
    assert finish["stops"].num_output_tokens == at + 1 and finish["runs"].num_output_tokens == 12
    frees = {f.request_id: f for f in rec.of(ev.Freed)}
    assert frees["aborted"].reason == "abort" and list(frees["aborted"].blocks) == held
    assert all(f.blocks for f in frees.values())
    (abort,) = rec.of(ev.Aborted)
    assert abort.request_id == "aborted" and abort.samples == ("aborted",)
    assert_idle_baseline(engine)


def test_abort_of_one_sample_and_timeout(tiny):
    engine, rec = _engine(tiny, block_size=8)
    prompts = _prompts(2, seed=7)
    engine.add_request("par", prompts[0], SamplingParams(n=2, max_tokens=20, ignore_eos=True))
    slow = SamplingParams(max_tokens=200, ignore_eos=True)
    engine.add_request("slow", prompts[1], slow, cache_salt="t", timeout_s=0.05)
    for _ in range(3):
        engine.step()
    assert engine.abort_request("par#1")
    time.sleep(0.06)
    _drive(engine)
    (abort,) = rec.of(ev.Aborted)
    assert (abort.request_id, abort.sample_id, abort.samples) == ("par", "par#1", ("par#1",))
    (timeout,) = rec.of(ev.TimedOut)
    assert (timeout.request_id, timeout.tenant, timeout.samples) == ("slow", "t", ("slow",))
    assert timeout.overdue_s > 0
    reasons = {f.sample_id: f.reason for f in rec.of(ev.Finished)}
    assert reasons == {"par#0": "length", "par#1": "abort", "slow": "timeout"}
    assert_idle_baseline(engine)


# --- corruption ----------------------------------------------------------------------------------
def test_corruption_names_the_request_whose_lookup_found_it(tiny):
    """8-bit fast keys (the policy suite's narrow_fast_keys workload): fast keys collide below
    the root, the digest check refuses them, and each refusal is an event naming the request."""
    (case,) = [c for c in policy_cases(tiny[0].config.vocab_size) if c.name == "narrow_fast_keys"]
    engine, rec = _engine(tiny, **case.engine)
    pending = sorted(case.requests, key=lambda s: s.arrive_step)
    steps = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrive_step <= steps:
            spec = pending.pop(0)
            engine.add_request(spec.request_id, spec.prompt, spec.params, cache_salt="t")
        engine.step()
        steps += 1
    bad = rec.of(ev.CacheCorruption)
    assert bad and len(bad) == engine.stats()["corruptions"]
    ids = {s.request_id for s in case.requests}
    assert all(e.request_id in ids and e.tenant == "t" for e in bad)
    assert all(e.namespace == _ns(engine, "t") and e.wanted_digest != e.found_digest for e in bad)
    assert all(e.depth >= 1 for e in bad)  # the shared first block is genuinely shared


# --- the observer interface ----------------------------------------------------------------------
def test_observers_attach_and_detach(tiny):
    engine, rec = _engine(tiny)
    assert engine.tracer is None
    tracer = EngineTracer(engine)
    engine.add_observer(tracer)
    assert engine.tracer is tracer
    engine.remove_observer(rec)
    engine.add_request("x", _prompts(1, seed=8)[0], PARAMS)
    _drive(engine)
    assert not rec.events and len(tracer.records["x"]) == PARAMS.max_tokens


def test_tracer_implements_every_hook():
    """The tracer cannot subclass EngineObserver (the reference imports its module and must reach
    no engine code), so it must define every hook itself."""
    hooks = {n for n in vars(EngineObserver) if n.startswith("on_")}
    assert hooks <= {n for n in vars(EngineTracer) if callable(getattr(EngineTracer, n))}
    assert EngineTracer.traces_steps


def test_every_event_kind_is_distinct():
    kinds = [
        c.kind for c in vars(ev).values() if isinstance(c, type) and issubclass(c, ev.EngineEvent)
    ]
    kinds.remove("")  # the base class
    assert len(kinds) == len(set(kinds)) == 10


# --- nobody else reaches in ----------------------------------------------------------------------
ROOT = Path(kvpage.__file__).parent
OWNERS = ("engine", "cache")  # packages that may set their own attributes
SEAMS = ("verify/mutants",)  # mutants patch through bind/replace/plant, which check the seam
WATCHED = {"engine", "_engine", "scheduler", "cache", "executor", "runner", "sampler", "storage"}


def _chain(node: ast.AST) -> set[str]:
    """Every name along `a.b.c` (for `a.b.c.d = ...`, the object assigned on is `a.b.c`)."""
    names = set()
    while isinstance(node, ast.Attribute):
        names.add(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.add(node.id)
    return names


def _reaches_in(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and _chain(target.value) & WATCHED:
                lines.append(node.lineno)
        if isinstance(node, ast.Call):
            args = [node.func, *node.args]
            uses_setattr = any(isinstance(a, ast.Name) and a.id == "setattr" for a in args)
            on_engine = any(_chain(a) & WATCHED for a in args if not isinstance(a, ast.Name))
            if uses_setattr and on_engine:
                lines.append(node.lineno)
    return sorted(lines)


def _sources():
    for path in sorted([*ROOT.rglob("*.py"), *(ROOT.parent / "bench").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if rel.startswith(OWNERS) or rel.startswith(SEAMS):
            continue
        yield rel, path


def test_nothing_outside_the_engine_assigns_its_attributes():
    found = [
        f"{rel}:{line}"
        for rel, path in _sources()
        for line in _reaches_in(ast.parse(path.read_text()))
    ]
    assert not found, f"engine/scheduler/cache attributes assigned from outside: {found}"


def test_the_check_sees_what_it_should():
    bad = "engine.cache.enable_prefix_caching = False\nsetattr(engine.scheduler, 'x', 1)\n"
    bad += "state.loop.call(setattr, state.loop.engine.scheduler, 'x', 1)\nengine.tracer = t\n"
    assert _reaches_in(ast.parse(bad)) == [1, 2, 3, 4]
    fine = "self.engine = engine\nengine.set_preemption(False)\nx = engine.cache.stats\n"
    assert _reaches_in(ast.parse(fine)) == []
    assert len(list(_sources())) > 40
