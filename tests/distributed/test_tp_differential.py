"""Tensor parallel = one process: TP=2 over gloo gives the same greedy tokens as TP=1
and as the Hugging Face model, and logits within 1e-4 of TP=1, on Llama GQA (8 q / 2 kv heads:
one kv head per rank), Llama MHA and GPT-2, in one schedule that has prefix hits, chunked
prefill, swap preemption under a tight pool, forced recompute and swap preemptions, and a
parallel-sampling request whose fork copies a shared block (CoW on every rank)."""

from __future__ import annotations

import pytest
import torch

from kvpage import SamplingParams
from kvpage.config import EngineConfig
from kvpage.engine.events import EngineObserver
from kvpage.model.decode_tape import Tape
from kvpage.model.kernels import bound_with
from kvpage.verify.driver import StepDriver
from tests.engine.workload import prefix_prompts

from .conftest import TP_MODELS, engine_for

BLOCK = 8
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
FORK = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=2, temperature=1.0, seed=7)
# (request, after this many outputs, resume after steps, mode)
FORCED = [("1", 2, 2, "recompute"), ("3", 0, 1, "swap"), ("4", 5, 2, "swap")]  # first wave


class LogitsRecorder(EngineObserver):
    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def on_sampled(self, batch, logits, tokens) -> None:
        for row, item in enumerate(batch.sample_seqs):
            seq = item.seq
            self.rows[(f"{seq.request_id}#{seq.sample_index}", len(seq.output_ids))] = logits[
                row
            ].clone()


def _run(config: EngineConfig, prompts):
    with engine_for(config) as engine:
        recorder = LogitsRecorder()
        engine.add_observer(recorder)
        half = len(prompts) // 2
        pending = [(str(i), p, GREEDY) for i, p in enumerate(prompts)]
        pending.append(("fork", prompts[0][: BLOCK + 3], FORK))
        for rid, prompt, params in pending[:half]:
            engine.add_request(rid, prompt, params)
        driver = StepDriver(engine)
        for rid, after, resume, mode in FORCED:
            driver.force_preempt(rid, after, resume, mode)
        outs, steps = {}, 0
        while engine.has_unfinished_requests() or steps < 3:
            if steps == 2:  # the second wave can hit the blocks the first one published
                for rid, prompt, params in pending[half:]:
                    engine.add_request(rid, prompt, params)
            outs.update({o.request_id: o for o in driver.step() if o.finished})
            steps += 1
            assert steps < 2000, "no progress"
        return outs, recorder.rows, engine.stats()


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# Gemma 3's window groups give blocks back (kvpage.cache.groups), which moves its schedule: at 16
# blocks its fork's samples are both swapped out before either writes (no copy-on-write).
POOL = {"gemma3": 12}
WINDOWED = ("mistral-window", "qwen2-window", "gemma3")
TAPED = ("llama-gqa-8q-2kv", "llama-mha")  # at least these: a head size the native decode takes


def _config(directory, num_blocks: int = 16, **kw) -> dict:
    return dict(
        model=str(directory),
        block_size=BLOCK,
        num_blocks=num_blocks,  # well under what all requests need at once: preemption must happen
        max_num_batched_tokens=24,  # prompts up to 37 tokens: chunked prefill
        preemption_mode="swap",
        debug_checks=True,
        **kw,
    )


def _assert_same_tokens(name: str, tp_out, ref_out, stats) -> None:
    assert stats["prefix_hits"] > 0 and stats["swap_outs"] > 0 and stats["cow_copies"] > 0, stats
    assert stats["preemptions_recompute"] > 0 and stats["preemptions_swap"] > 0, stats
    assert set(tp_out) == set(ref_out)
    for rid, out in tp_out.items():
        got = [c.token_ids for c in out.outputs]
        assert got == [c.token_ids for c in ref_out[rid].outputs], f"{name}: request {rid}"
        assert all(c.finish_reason == "length" for c in out.outputs)


@pytest.mark.parametrize("name", TP_MODELS)
def test_tp2_equals_tp1_and_hf(name, hf_dirs, monkeypatch):
    hf_model, directory = hf_dirs[name]
    prompts = prefix_prompts(BLOCK, hf_model.config.vocab_size, n=10, seed=3)
    config = _config(directory, POOL.get(name, 16))
    replays = []  # decode steps replayed from a tape (TP: rank 0's, the all-reduce included)
    replay = Tape.replay
    monkeypatch.setattr(Tape, "replay", lambda self: replays.append(1) or replay(self))
    ref_out, ref_logits, _ = _run(EngineConfig(**config), prompts)
    tp1_replays, replays[:] = len(replays), []
    tp_out, tp_logits, stats = _run(EngineConfig(**config, tensor_parallel_size=2), prompts)
    # A shard takes the tape wherever the whole model does (its rows and head size allow it).
    assert (len(replays) > 0) == (tp1_replays > 0), f"{name}: {len(replays)} vs {tp1_replays}"
    assert tp1_replays > 0 or name not in TAPED, f"{name}: no decode step replayed"

    _assert_same_tokens(name, tp_out, ref_out, stats)
    if name in WINDOWED:  # every window group gives blocks back, Mistral's all-window one too
        assert stats["window_frees"] > 0, f"{name}: no window block given back"
    for i, prompt in enumerate(prompts):
        expected = _hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert tp_out[str(i)].outputs[0].token_ids == expected, f"{name}: request {i} vs HF"
    assert tp_logits.keys() == ref_logits.keys()
    diff = max((tp_logits[k] - ref_logits[k]).abs().max().item() for k in ref_logits)
    assert diff <= 1e-4, f"{name}: logits differ by {diff}"


def test_tp2_int8_kv_equals_tp1_int8(hf_dirs):
    """Quantized KV: each rank keeps the scales of its own KV heads; they are copied on CoW,
    travel through swap and are invalidated on free on every rank."""
    hf_model, directory = hf_dirs["llama-gqa-8q-2kv"]
    prompts = prefix_prompts(BLOCK, hf_model.config.vocab_size, n=10, seed=3)
    config = _config(directory, kv_cache_dtype="int8")
    ref_out, _, _ = _run(EngineConfig(**config), prompts)
    tp_out, _, stats = _run(EngineConfig(**config, tensor_parallel_size=2), prompts)
    _assert_same_tokens("int8", tp_out, ref_out, stats)


def test_the_ranks_bind_as_the_engine_asks(hf_dirs, monkeypatch):
    """EngineConfig.fast_paths_off reaches the shards: rank 0's shard and the workers' spec
    are bound without the tape, and no decode step replays one."""
    replays = []
    replay = Tape.replay
    monkeypatch.setattr(Tape, "replay", lambda self: replays.append(1) or replay(self))
    _, directory = hf_dirs["llama-gqa-8q-2kv"]
    config = EngineConfig(**_config(directory), tensor_parallel_size=2,
                          fast_paths_off=("decode_plan",))  # fmt: skip
    with engine_for(config) as engine:
        workers = engine.tp.workers
        assert not workers.kernels.on("decode_plan")
        assert bound_with(workers.model) == workers.kernels
        engine.add_request("0", list(range(3, 20)), GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
    assert replays == []
