"""Quantized KV in the engine (issue 14): the paged int8 / fp8 engine is token-identical to the
contiguous reference with the same K/V round trip (kvpage.verify.kv_oracle) under prefix hits,
chunked prefill and preemption by recompute and swap, block sizes 8 and 16; scales live and die
with their block generation; a block of one KV format is never served to another."""

from __future__ import annotations

import pytest
import torch

from kvpage import LLMEngine, SamplingParams
from kvpage.cache import KVCacheManager
from kvpage.cache.block_pool import BlockState
from kvpage.config import EngineConfig
from kvpage.engine.namespace import base_namespace
from kvpage.model import load_model
from kvpage.model.kv_format import kv_format
from kvpage.model.tokenizer import ByteTokenizer
from kvpage.verify.kv_oracle import RoundTrip, RoundTripKVCache
from kvpage.verify.reference import generate

from .test_differential import _config, assert_idle_baseline, run_engine
from .workload import prefix_prompts

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
SCENARIOS = {
    "prefix_hits": dict(enable_prefix_caching=True),
    "chunked_32": dict(max_num_batched_tokens=32),
    "pressure_recompute": dict(preemption_mode="recompute", pool="tight"),
    "pressure_swap": dict(preemption_mode="swap", pool="tight", swap_space_blocks=512),
}
MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)[0]


@pytest.fixture(scope="module")
def quantized_refs(model):
    memo: dict[tuple, list[int]] = {}

    def tokens(prompt: list[int], kv_cache_dtype: str) -> list[int]:
        key = (tuple(prompt), kv_cache_dtype)
        if key not in memo:
            memo[key] = generate(model, prompt, GREEDY, kv_cache_dtype=kv_cache_dtype).token_ids
        return memo[key]

    return tokens


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_tokens_equal_quantized_reference(kv_cache_dtype, scenario, block_size, model, quantized_refs):
    prompts = prefix_prompts(block_size, model.config.vocab_size, n=12, seed=3)
    spec = {**SCENARIOS[scenario], "kv_cache_dtype": kv_cache_dtype}
    engine = LLMEngine(_config(MODEL, block_size, prompts, spec), model, ByteTokenizer())
    outs = run_engine(engine, prompts, GREEDY)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        expected = quantized_refs(prompt, kv_cache_dtype)
        assert out.outputs[0].token_ids == expected, f"request {i} diverged ({scenario})"
    stats = engine.stats()
    if spec.get("pool"):
        assert stats["preemptions"] > 0, "the tight pool did not force any preemption"
        if spec["preemption_mode"] == "swap":
            assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
    if scenario == "prefix_hits":
        assert stats["prefix_hits"] > 0
    assert_idle_baseline(engine)


def test_bfloat16_kv_under_a_float32_model_equals_its_reference(model, quantized_refs):
    prompts = prefix_prompts(8, model.config.vocab_size, n=6, seed=4)
    spec = {"preemption_mode": "swap", "pool": "tight", "kv_cache_dtype": "bfloat16"}
    engine = LLMEngine(_config(MODEL, 8, prompts, spec), model, ByteTokenizer())
    assert engine.storage.data.dtype == torch.bfloat16
    outs = run_engine(engine, prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == quantized_refs(prompt, "bfloat16")


def test_greedy_forks_copy_scales_on_write(model, quantized_refs):
    """n = 3 greedy samples share the prompt's partial block; each copy-on-write must carry the
    scales: every sample equals the reference."""
    engine = LLMEngine(EngineConfig(MODEL, block_size=8, num_blocks=32, kv_cache_dtype="int8",
                                    debug_checks=True), model, ByteTokenizer())
    prompt = list(range(40, 51))  # 11 tokens: the second block is partial
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("f", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert engine.stats()["cow_copies"] == 2
    expected = quantized_refs(prompt, "int8")
    assert [c.token_ids for c in outs[0].outputs] == [expected] * 3


def _scales_of_tokens(model, prompt: list[int]) -> torch.Tensor:
    """(L, 2, T, KVH) float16 scales the reference makes for `prompt`."""
    cache = RoundTripKVCache(model.config.num_layers, RoundTrip("int8"))
    with torch.inference_mode():
        ids = torch.tensor(prompt)
        model(ids, torch.arange(len(prompt)), cache)
    return cache.scales_of(0, len(prompt))


def test_scales_die_with_the_block_generation(model):
    """Freed blocks' scales are invalidated (zero); the next owner's blocks hold its own scales."""
    cfg = EngineConfig(MODEL, block_size=8, num_blocks=3, kv_cache_dtype="int8",
                       enable_prefix_caching=False, debug_checks=True)
    engine = LLMEngine(cfg, model, ByteTokenizer())
    pool, scales = engine.cache.pool, engine.storage.scales
    engine.add_request("a", list(range(60, 80)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert scales.abs().sum() == 0  # every block went FREE: nothing of "a" is left
    assert all(b.state is BlockState.FREE and b.generation == 1 for b in pool.blocks)
    prompt_b = list(range(90, 110))
    engine.add_request("b", prompt_b, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # b's prefill: blocks of generation 1 written again
    table = engine.seqs["b"].table
    assert all(pool.blocks[bid].generation == 1 for bid in table.block_ids)
    expected = _scales_of_tokens(model, prompt_b)  # (L, 2, 20, KVH)
    for j, bid in enumerate(table.block_ids):
        n = min(8, len(prompt_b) - 8 * j)
        got = scales[:, :, bid, :n].float()
        torch.testing.assert_close(got, expected[:, :, 8 * j : 8 * j + n].float(), rtol=1e-3, atol=0)


def test_kv_format_is_part_of_the_namespace(model):
    tok = ByteTokenizer()
    names = {}
    for name in ("auto", "bfloat16", "int8", "fp8_e4m3"):
        engine = LLMEngine(EngineConfig(MODEL, num_blocks=4, kv_cache_dtype=name), model, tok)
        ns = engine.namespace
        names[name] = ns.digest()
        fmt = kv_format(name, model.dtype)
        assert (ns.kv_dtype, ns.kv_layout_version) == (fmt.name, fmt.layout_version)
        assert ns == base_namespace(model, tok, 16, MODEL, fmt)  # what the verifier expects
    assert len(set(names.values())) == 4
    assert engine.namespace.kv_dtype == "float8_e4m3fn"


@pytest.mark.parametrize(("writer", "reader"), [("int8", "auto"), ("auto", "int8"),
                                                 ("int8", "fp8_e4m3")])
def test_a_block_of_one_kv_format_is_never_served_to_another(model, writer, reader):
    tok = ByteTokenizer()
    cache = KVCacheManager(16, 8, debug_checks=True)
    prompt = list(range(3, 3 + 33))  # 4 full blocks + 1 token

    def admit(seq_id: int, name: str) -> int:
        ns = base_namespace(model, tok, 8, MODEL, kv_format(name, model.dtype))
        chain = cache.new_key_chain(ns)
        chain.extend(prompt)
        table = cache.new_table(seq_id)
        hit = cache.acquire_prefix(table, chain, len(prompt))
        cache.append_slots(table, len(prompt) - hit)
        cache.publish_full_blocks(table, chain)
        cache.free_table(table)
        return hit

    assert admit(1, writer) == 0
    assert admit(2, reader) == 0  # same tokens, other KV format: a miss
    assert admit(3, writer) == 32  # the same format does hit (the test can fail)
    assert admit(4, reader) == 32  # the reader's own blocks, published at its first admission


def test_debug_checks_refuse_a_read_of_invalidated_scales(model):
    """With debug checks on, a step that would read slots whose scales were never written in
    the block's current generation (here: a swap-in that forgot them) raises at once."""
    from kvpage.errors import InvariantViolation
    from kvpage.verify.mutants.quantized import swap_in_without_scales

    cfg = EngineConfig(MODEL, block_size=8, num_blocks=32, kv_cache_dtype="int8",
                       preemption_mode="swap", swap_space_blocks=32, debug_checks=True)
    engine = LLMEngine(cfg, model, ByteTokenizer())
    engine.patch_kv_shards(swap_in_without_scales)
    engine.add_request("r", list(range(30, 50)), SamplingParams(max_tokens=12, ignore_eos=True))
    engine.force_preempt("r", after_tokens=3, resume_after_steps=1, mode="swap")
    with pytest.raises(InvariantViolation, match="scales nobody wrote"):
        for _ in range(40):
            engine.step()


def test_llm_takes_kv_cache_dtype(model, quantized_refs):
    from kvpage import LLM

    llm = LLM(MODEL, kv_cache_dtype="fp8_e4m3", num_blocks=64, block_size=8)
    assert llm.engine.storage.data.dtype == torch.uint8  # float8 codes kept as their bytes
    assert llm.engine.namespace.kv_dtype == "float8_e4m3fn"
    prompts = [list(range(10, 31)), list(range(10, 25))]  # a shared first block
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == quantized_refs(prompt, "fp8_e4m3")


def test_cached_blocks_keep_their_scales_until_evicted(model):
    """A published block outlives its request with its scales (a later hit reads them); evicting
    it frees it, and its scales go with that generation."""
    cfg = EngineConfig(MODEL, block_size=8, num_blocks=8, kv_cache_dtype="int8", debug_checks=True)
    engine = LLMEngine(cfg, model, ByteTokenizer())
    pool, scales = engine.cache.pool, engine.storage.scales
    engine.add_request("a", list(range(60, 80)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    cached = [b.block_id for b in pool.blocks if b.state is BlockState.CACHED]
    assert len(cached) == 2  # the two full prompt blocks; the partial tail was freed
    assert all(bool(scales[:, :, bid].ne(0).all()) for bid in cached)
    assert all(scales[:, :, b.block_id].abs().sum() == 0
               for b in pool.blocks if b.state is BlockState.FREE)
    evicted = engine.cache.evict(2)
    assert sorted(evicted) == sorted(cached)
    assert all(scales[:, :, bid].abs().sum() == 0 for bid in evicted)
