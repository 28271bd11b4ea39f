"""An all-windowed model (Mistral with `sliding_window` on every layer) gives back the blocks
its window left (kvpage.cache.groups: a window group 0), against Hugging Face transformers:
greedy tokens equal HF generate's under prefix caching with hits past the window edge, chunked
prefill, a tight pool preempting by swap and by recompute, forced preemption; n > 1 samples
(copy-on-write) and int8 KV equal the contiguous reference; a long decode holds only the
window's blocks. The invariant checker runs after every step (debug_checks)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvpage import LLMEngine, SamplingParams
from kvpage.cache.groups import NULL_BLOCK
from kvpage.config import EngineConfig
from kvpage.engine.events import EngineObserver, PrefixHit
from kvpage.reference.generator import generate

from ..model.hf_models import VOCAB
from .test_differential import FORCED, MAX_TOKENS, _config, assert_idle_baseline, run_engine
from .test_kv_groups import SCENARIOS, hf_greedy  # noqa: F401  (the fixture)

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK = 8
MODEL = "mistral-window"  # tests/model/hf_models.py: sliding_window=24 on both layers
WINDOW = 24
SHARED = 7 * BLOCK + 3  # a shared prefix well past the window: hits need only its tail


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of one long shared prefix and a tail of 1..2B-1 tokens (a hit of up to 7 blocks,
    the window needing only its last 3)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(SHARED)]
    cut = [SHARED, 5 * BLOCK + 1, 4 * BLOCK]  # hits of 7, 5 and 3 blocks
    return [
        shared[: cut[i % 3]] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 2 * BLOCK))]
        for i in range(n)
    ]


class _Hits(EngineObserver):
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def on_event(self, event) -> None:
        if isinstance(event, PrefixHit):
            self.tokens.append(event.token_count)


def _engine(directory: str, prompts: list[list[int]], spec: dict, model) -> LLMEngine:
    """test_differential's config, a "tight" pool tighter still: freeing makes a third of the
    unfreed need roomy, so two prompts' prefills and a window each (preemption must happen)."""
    cfg = _config(directory, BLOCK, prompts, spec)
    if spec.get("pool"):
        prefill = max(-(-len(p) // BLOCK) for p in prompts)
        cfg = dataclasses.replace(cfg, num_blocks=prefill + 2 * (WINDOW // BLOCK + 2))
    return LLMEngine(cfg, model)


def _held(engine: LLMEngine) -> list[int]:
    return [t.num_held() for t in engine.cache.live_tables.values()]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_all_window_tokens_equal_hf(scenario, hf_greedy):  # noqa: F811
    oracle = hf_greedy(MODEL)
    assert oracle.model.config.layer_windows == (WINDOW, WINDOW)
    prompts = _prompts(12)
    spec = SCENARIOS[scenario]
    engine = _engine(oracle.directory, prompts, spec, oracle.model)
    hits = _Hits()
    engine.add_observer(hits)
    outs = run_engine(engine, prompts, GREEDY, FORCED[:2] if spec.get("forced") else ())
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.outputs[0].token_ids == oracle.tokens(prompt), f"request {i} ({scenario})"
    assert engine.kv_layout.groups[0].window == WINDOW and engine.cache.windows == (WINDOW,)
    stats = engine.stats()
    assert stats["window_frees"] > 0, "the window gave nothing back"
    if spec.get("pool"):
        assert stats["preemptions"] > 0, "the tight pool did not force any preemption"
        if spec["preemption_mode"] == "swap":
            assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
    if scenario == "prefix_on":  # a hit past the window edge: its head served as NULL
        assert max(hits.tokens) >= 7 * BLOCK > WINDOW + BLOCK, hits.tokens
    assert_idle_baseline(engine)


def test_all_window_decode_holds_only_the_window(hf_greedy):  # noqa: F811
    """One long decode: the blocks held go down to the window's span and stay there; with
    kv_layer_groups off the same run holds every block; the tokens are HF's either way."""
    oracle = hf_greedy(MODEL)
    prompt = _prompts(1, seed=5)[0]
    bound = WINDOW // BLOCK + 2
    trace = {}
    for grouped in (True, False):
        cfg = EngineConfig(
            model=oracle.directory, block_size=BLOCK, debug_checks=True, kv_layer_groups=grouped
        )
        engine = LLMEngine(cfg, oracle.model)
        engine.add_request("r", prompt, GREEDY)
        held, tokens = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids if out.finished else tokens
            held += _held(engine)
        assert tokens == oracle.tokens(prompt)
        trace[grouped] = (held, engine.stats()["window_frees"])
    (on, frees_on), (off, frees_off) = trace[True], trace[False]
    total = -(-(len(prompt) + MAX_TOKENS - 1) // BLOCK)
    assert off[-1] == total and frees_off == 0  # one plain table: nothing given back
    assert frees_on > 0 and max(on[1:]) <= bound < total  # after the prompt: the window only
    assert on[0] > on[-1], "the blocks held did not go down"


def test_all_window_parallel_samples_equal_the_reference(hf_greedy):  # noqa: F811
    """n > 1: the samples share the prompt's blocks, copy the partial last one on their first
    write, and each trims its own table; sample i equals the reference run alone."""
    oracle = hf_greedy(MODEL)
    params = SamplingParams(n=3, temperature=0.8, top_k=40, seed=11, max_tokens=40, ignore_eos=True)
    prompts = [p for p in _prompts(3, seed=2) if len(p) % BLOCK][:2]
    cfg = EngineConfig(model=oracle.directory, block_size=BLOCK, num_blocks=96, debug_checks=True)
    engine = LLMEngine(cfg, oracle.model)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out
    for i, p in enumerate(prompts):
        for c in final[i].outputs:
            want = generate(oracle.model, p, params.for_sample(c.index)).token_ids
            assert c.token_ids == want, f"request {i} sample {c.index}"
    stats = engine.stats()
    assert stats["cow_copies"] > 0 and stats["window_frees"] > 0
    assert_idle_baseline(engine)


def test_all_window_int8_kv_equals_the_round_trip_reference(hf_greedy):  # noqa: F811
    """int8 KV: a trimmed page's scales are invalidated, a swapped one travels with its scales;
    tokens equal the contiguous reference with the same round trip."""
    oracle = hf_greedy(MODEL)
    prompts = _prompts(8, seed=1)
    spec = dict(SCENARIOS["pressure_swap"], kv_cache_dtype="int8", enable_prefix_caching=True)
    engine = _engine(oracle.directory, prompts, spec, oracle.model)
    outs = run_engine(engine, prompts, GREEDY)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        ref = generate(oracle.model, prompt, GREEDY, kv_cache_dtype="int8").token_ids
        assert out.outputs[0].token_ids == ref, f"request {i}"
    stats = engine.stats()
    assert stats["swap_outs"] > 0 and stats["window_frees"] > 0 and stats["prefix_hits"] > 0
    assert_idle_baseline(engine)


def test_a_hit_past_the_window_holds_only_the_window():
    """The hybrid rule for group 0: a hit of h blocks takes only the blocks the window needs at
    h (NULL before them), even when the head is still cached."""
    from kvpage.cache.groups import kv_layout
    from kvpage.cache.manager import KVCacheManager
    from kvpage.cache.namespace import CacheNamespace

    layout = kv_layout(2, (WINDOW, WINDOW), True)
    m = KVCacheManager(64, BLOCK, debug_checks=True, layout=layout)
    ns = CacheNamespace("m", "t", block_size=BLOCK)
    tokens = list(range(3, 3 + 8 * BLOCK + 2))
    a = m.new_table(1)
    chain = m.new_key_chain(ns)
    chain.extend(tokens)
    m.acquire_prefix(a, chain, len(tokens))
    m.append_slots(a, len(tokens))
    m.publish_full_blocks(a, chain)
    m.free_table(a)
    b = m.new_table(2)
    got = m.acquire_prefix(b, chain, len(tokens))
    lo = (got - WINDOW + 1) // BLOCK
    assert got == 8 * BLOCK
    assert b.block_ids[:lo] == [NULL_BLOCK] * lo and NULL_BLOCK not in b.block_ids[lo:]
    m.append_slots(b, len(tokens) - got)
    m.free_table(b)
    m.check_invariants()
