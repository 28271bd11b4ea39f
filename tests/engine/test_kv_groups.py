"""Per-layer-group KV (kvpage.cache.groups) against Hugging Face transformers: Gemma 3's
1 global : 2 local layers (window 12) in three groups, the local ones giving back the blocks their
window left, Qwen2's global layer 0 and window layer 1 (window 16), and Mistral's all-window
layers (one group). Greedy tokens equal HF generate's under
prefix caching, chunked prefill, a tight pool preempting by recompute or by swap, and forced
preemption of both kinds; the invariant checker runs after every step (debug_checks)."""

from __future__ import annotations

import pytest
import torch

from kvpage import LLMEngine, SamplingParams
from kvpage.cache.groups import NULL_BLOCK
from kvpage.config import EngineConfig
from kvpage.model import load_model

from ..model.hf_models import VOCAB, save_hf
from .test_differential import FORCED, MAX_TOKENS, _config, assert_idle_baseline, run_engine
from .workload import prefix_prompts

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK = 8
SCENARIOS = {
    "prefix_on": dict(enable_prefix_caching=True),
    "chunked_16": dict(max_num_batched_tokens=16),
    "pressure_recompute": dict(preemption_mode="recompute", pool="tight"),
    "pressure_swap": dict(preemption_mode="swap", pool="tight", swap_space_blocks=512),
    "forced": dict(preemption_mode="swap", swap_space_blocks=512, forced=True),
}


class HFGreedy:
    """HF generate's greedy continuation of each prompt, computed once."""

    def __init__(self, name: str, directory) -> None:
        self.hf = save_hf(name, directory)
        self.directory = str(directory)
        self.model = load_model(self.directory)[0]
        self._done: dict[tuple[int, ...], list[int]] = {}

    def tokens(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._done:
            with torch.no_grad():
                out = self.hf.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=MAX_TOKENS,
                    min_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            self._done[key] = out[0, len(prompt) :].tolist()
        return self._done[key]


@pytest.fixture(scope="module")
def hf_greedy(tmp_path_factory):
    made: dict[str, HFGreedy] = {}

    def get(name: str) -> HFGreedy:
        if name not in made:
            made[name] = HFGreedy(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("name", ["gemma3", "qwen2-window", "mistral-window"])
def test_tokens_equal_hf(name, scenario, hf_greedy):
    oracle = hf_greedy(name)
    prompts = prefix_prompts(BLOCK, VOCAB, n=12)
    spec = SCENARIOS[scenario]
    engine = LLMEngine(_config(oracle.directory, BLOCK, prompts, spec), oracle.model)
    outs = run_engine(engine, prompts, GREEDY, FORCED[:2] if spec.get("forced") else ())
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.outputs[0].token_ids == oracle.tokens(prompt), f"request {i} ({scenario})"
    stats = engine.stats()
    # gemma3: 3 groups of one layer; qwen2: global 0, window 1; mistral: one window group 0
    assert engine.kv_layout.num_groups == {"gemma3": 3, "qwen2-window": 2}.get(name, 1)
    assert engine.cache.stats.window_frees > 0, "no window block was given back"
    if spec.get("pool"):
        assert stats["preemptions"] > 0, "the tight pool did not force any preemption"
        if spec["preemption_mode"] == "swap":
            assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
    if spec.get("forced"):
        preempted = {int(o.request_id) for o in outs if o.metrics.num_preemptions}
        assert {f[0] for f in FORCED[:2]} <= preempted
    if scenario == "prefix_on":
        assert stats["prefix_hits"] > 0
    assert_idle_baseline(engine)


def _held_per_group(engine: LLMEngine, request_id: str) -> list[int]:
    table = engine.seqs[request_id].table
    return [len(table.block_ids), *(sum(b != NULL_BLOCK for b in ids) for ids in table.groups[1:])]


def test_window_groups_hold_only_the_window_during_a_long_decode(hf_greedy):
    """One long decode: the global group holds every block, each local group at most the
    blocks its window spans, and the pool holds fewer pages than with one table for every layer
    (same memory); the tokens stay HF's."""
    oracle = hf_greedy("gemma3")
    prompt = prefix_prompts(BLOCK, VOCAB, n=1, seed=3)[0]
    window = oracle.model.config.layer_windows[0]
    span = -(-(window - 1) // BLOCK) + 1  # blocks a window of W keys can touch
    held = {}
    for grouped in (True, False):
        cfg = EngineConfig(
            model=oracle.directory, block_size=BLOCK, debug_checks=True, kv_layer_groups=grouped
        )
        engine = LLMEngine(cfg, oracle.model)
        engine.add_request("r", prompt, GREEDY)
        trace, tokens = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids if out.finished else tokens
            if engine.has_unfinished_requests():
                trace.append(_held_per_group(engine, "r"))
        assert tokens == oracle.tokens(prompt)
        held[grouped] = trace
    total = len(prompt) + MAX_TOKENS
    grouped, single = held[True][-1], held[False][-1]
    assert single == [-(-(total - 1) // BLOCK)]  # one table of every layer's block
    assert grouped[0] == single[0]  # the global group needs the whole prefix
    assert all(max(t[1:]) <= span for t in held[True][2:])  # past the prompt: the window only
    # Pages of one layer each, against blocks of all three layers: the same memory per unit.
    assert sum(grouped) < 3 * single[0] * 0.6


def test_layout_pages_are_one_group_each():
    """The storage holds `rows` layers per page; one model block of memory is 3 pages here."""
    from kvpage.cache.groups import kv_layout

    layout = kv_layout(3, (12, 12, None), True)
    assert [g.window for g in layout.groups] == [None, 12, 12]
    assert layout.layer_map == ((1, 0), (2, 0), (0, 0))
    assert layout.rows == 1 and layout.pages_per_block(3) == 3
    six = kv_layout(6, (8, 8, None, 8, 8, None), True)
    assert six.rows == 2 and [g.layers for g in six.groups] == [(2, 5), (0, 1), (3, 4)]
    assert kv_layout(3, (12, 12, None), False).num_groups == 1
    assert kv_layout(2, (12, 12), True).num_groups == 1


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_per_group_equals_the_round_trip_reference(kv_cache_dtype, hf_greedy):
    """Scales live per page: copied on CoW, swapped with their page, invalidated when a window
    group gives its page back; tokens equal the contiguous reference with the same round trip."""
    from kvpage.reference.generator import generate

    oracle = hf_greedy("gemma3")
    prompts = prefix_prompts(BLOCK, VOCAB, n=8, seed=1)
    spec = dict(SCENARIOS["pressure_swap"], kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(_config(oracle.directory, BLOCK, prompts, spec), oracle.model)
    outs = run_engine(engine, prompts, GREEDY)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        ref = generate(oracle.model, prompt, GREEDY, kv_cache_dtype=kv_cache_dtype).token_ids
        assert out.outputs[0].token_ids == ref, f"request {i}"
    stats = engine.stats()
    assert stats["swap_outs"] > 0 and engine.cache.stats.window_frees > 0
    assert_idle_baseline(engine)


def test_trace_records_every_groups_view(hf_greedy):
    """The tracer's view of a step: group 0's table, and per extra group its window, layers,
    window start and only the entries it still holds — within the window, never the freed."""
    from kvpage.verify.trace import EngineTracer

    oracle = hf_greedy("gemma3")
    engine = LLMEngine(EngineConfig(model=oracle.directory, block_size=BLOCK), oracle.model)
    tracer = EngineTracer(engine)
    engine.add_observer(tracer)
    prompt = prefix_prompts(BLOCK, VOCAB, n=1, seed=4)[0]
    engine.add_request("r", prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    records = tracer.records["r"]
    assert [r.chosen_token for r in records] == oracle.tokens(prompt)
    last = records[-1].view
    context = len(prompt) + MAX_TOKENS - 1  # the last step's keys
    assert len(last.entries) == -(-context // BLOCK)
    assert [(g.group, g.window, g.layers) for g in last.groups] == [(1, 12, (0,)), (2, 12, (1,))]
    for g in last.groups:
        assert g.window_start == context - 12
        first = g.window_start // BLOCK
        assert [e.logical for e in g.entries] == list(range(first, len(last.entries)))
        assert not {e.physical for e in g.entries} & {e.physical for e in last.entries}
