"""Every rank's KV shard under tensor parallelism, on Llama GQA with 2 KV heads split
over 2 ranks (one KV head each): a KV patch (how the verifier plants its quantized-KV mutants)
acts on the workers' shards too, the scales rank 0 reads for the tracer are every rank's, and a
command larger than one broadcast frame reaches every rank whole.

The oracles are properties of the patched code, not the code itself: truncation never moves a
code away from zero and moves some toward it; one scale for all heads is one value across the
heads of a token; a doubled scale on rank 1 shows in rank 1's heads only; and layer 0's K/V
(embeddings only, so the same at TP=1 and TP=2 up to the matmul split) quantise to the same
scales as in a one-process engine."""

from __future__ import annotations

import os

import pytest
import torch

from kvpage import SamplingParams
from kvpage.config import EngineConfig
from kvpage.kv.storage import KVShard, SavedKV
from kvpage.parallel.group import FRAME_BYTES
from kvpage.reference.records import scale_digest
from kvpage.verify.mutants.quantized import int8_round_toward_zero, one_scale_for_all_heads

from .conftest import engine_for

PROMPT = list(range(10, 37))  # 27 tokens: 3 full blocks of 8 and a partial one
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _double_rank1_scales(shard: KVShard) -> None:
    """A corruption of rank 1's shard only (module level: the worker imports it by name)."""
    if shard.rank == 1:
        shard.storage.scales.mul_(2)


def _scale_by_torchrun_rank(shard: KVShard) -> None:
    """Scales times 1 + the RANK a torchrun-style launcher would have set in this process."""
    shard.storage.scales.mul_(1 + int(os.environ.get("RANK", "0")))


def _prefilled(engine, patch=None):
    """Patch (if any), prefill PROMPT in one step; (block ids, every rank's KV of them)."""
    if patch is not None:
        engine.patch_kv_shards(patch)
    engine.add_request("r", PROMPT, PARAMS)
    engine.step()
    ids = list(engine.seqs["r"].table.block_ids)
    return ids, engine.storage.read_blocks(ids)


@pytest.fixture(scope="module")
def config(hf_dirs):
    _, directory = hf_dirs["llama-gqa-8q-2kv"]
    return dict(model=str(directory), block_size=8, num_blocks=16, kv_cache_dtype="int8")


def _tp2(config) -> EngineConfig:
    return EngineConfig(**config, tensor_parallel_size=2)


def test_a_kv_patch_changes_every_ranks_codes(config):
    """int8_round_toward_zero on every rank: layer 0 (same inputs either way) keeps its scales
    and every code moves toward zero or stays, some on each rank's head."""
    with engine_for(_tp2(config)) as engine:
        _, plain = _prefilled(engine)
    with engine_for(_tp2(config)) as engine:
        _, trunc = _prefilled(engine, int8_round_toward_zero)
    assert torch.equal(trunc.scales[0], plain.scales[0])
    ok, cut = plain.data[0].to(torch.int16), trunc.data[0].to(torch.int16)  # (2, n, B, KVH, D)
    assert bool((cut.abs() <= ok.abs()).all())
    for head in range(ok.shape[3]):  # head 0 on rank 0, head 1 on rank 1
        assert bool((cut[..., head, :].abs() < ok[..., head, :].abs()).any()), head


def test_one_scale_for_all_heads_spans_the_ranks(config):
    """With the mutant, a token's scale is one value over both KV heads, so over both ranks
    (each holds one head, where a per-rank max would change nothing); without it, not."""
    with engine_for(_tp2(config)) as engine:
        _, plain = _prefilled(engine)
    with engine_for(_tp2(config)) as engine:
        _, one = _prefilled(engine, one_scale_for_all_heads)
    n = len(PROMPT)
    per_head = one.scales.flatten(2, 3)[:, :, :n]  # (L, 2, tokens, KVH)
    assert torch.equal(per_head[..., 0], per_head[..., 1])
    ok = plain.scales.flatten(2, 3)[:, :, :n]
    assert not torch.equal(ok[..., 0], ok[..., 1])
    # Layer 0 has the same K/V either way: its one scale is the larger of the two heads'.
    assert torch.equal(per_head[0, ..., 0], ok[0].amax(dim=-1))


def test_block_scales_are_every_ranks_and_see_rank1s(config):
    """What the tracer digests: every KV head's scales; layer 0's equal a one-process engine's
    (so the digests are comparable with a reference over the whole model), and a corruption
    of rank 1's shard alone changes rank 1's heads and the digest."""
    with engine_for(EngineConfig(**config)) as engine:
        ids, _ = _prefilled(engine)
        single = engine.storage.block_scales(ids)
    with engine_for(_tp2(config)) as engine:
        ids, _ = _prefilled(engine)
        before = engine.storage.block_scales(ids)
        engine.patch_kv_shards(_double_rank1_scales)
        after = engine.storage.block_scales(ids)
    assert before.shape == single.shape  # (L, 2, n, B, 2): both ranks' heads
    assert torch.equal(before[0], single[0])
    assert torch.equal(after[..., 0], before[..., 0])
    assert torch.equal(after[..., 1], before[..., 1] * 2)
    assert scale_digest(after[:, :, 0]) != scale_digest(before[:, :, 0])


def test_workers_see_the_variables_torchrun_sets(config, monkeypatch):
    """RANK in each worker's environment is its rank (rank 0, this process, sets none)."""
    monkeypatch.delenv("RANK", raising=False)
    with engine_for(_tp2(config)) as engine:
        ids, _ = _prefilled(engine)
        before = engine.storage.block_scales(ids)
        engine.patch_kv_shards(_scale_by_torchrun_rank)
        after = engine.storage.block_scales(ids)
    assert torch.equal(after[..., 0], before[..., 0])
    assert torch.equal(after[..., 1], before[..., 1] * 2)


def test_a_command_larger_than_one_frame_arrives_whole(config):
    """Random K/V for the whole pool written through a swap-in (float32: 64 KiB, four times one
    broadcast frame) and read back from every rank: every rank got every byte of its heads."""
    with engine_for(_tp2({**config, "kv_cache_dtype": "auto"})) as engine:
        ids = list(range(16))
        shape = engine.storage.read_blocks(ids).data.shape  # (L, 2, 16, B, KVH, D)
        data = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        assert data.numel() * data.element_size() > 2 * FRAME_BYTES
        engine.storage.write_blocks(ids, SavedKV(data, None))
        assert torch.equal(engine.storage.read_blocks(ids).data, data)
