"""Quantized-KV mutants: five ways a quantized pool goes wrong while every block
table, generation and prefix key is right. Each patches a `KVStorage` through a named seam (write,
store, quantize, copy_block, write_blocks, invalidate, rounding) on every rank's KV shard
(`LLMEngine.patch_kv_shards`: under tensor parallelism the workers apply the same function to
their own shards). On an unquantized pool the patched paths are never taken, so a divergence
appears only on the quantized path and the gate attributes it to quantized_kv
(kvpage.verify.suites re-runs the case unquantized)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpage.config import ModelConfig
from kvpage.engine.engine import LLMEngine
from kvpage.kv.format import SCALE_DTYPE, SCALE_MAX, SCALE_MIN
from kvpage.kv.storage import KVShard
from kvpage.verify.mutants.base import Mutant, bind, replace

QUANTIZED_SUITES = ("prefix:int8", "batching:int8", "preemption:int8", "parallel:int8")


def scale_from_previous_generation(shard: KVShard) -> None:
    """Scales are kept per slot 'until invalidated' to save recomputing them, but a freed block's
    scales are never invalidated: a reused block's tokens are read with the scales its previous
    generation wrote (the codes are this generation's)."""
    bind(shard.storage, "invalidate", lambda self, block_id: None)

    def store(self, layer, slots, codes, scales):
        self.data[layer].flatten(1, 2).index_copy_(1, slots, codes.view(self.data.dtype))
        stored = self.scales[layer].flatten(1, 2)  # (2, P, KVH)
        kept = stored.index_select(1, slots)
        fresh = kept.eq(0).all(dim=-1, keepdim=True)  # a slot never written keeps nothing
        stored.index_copy_(1, slots, torch.where(fresh, scales, kept))

    bind(shard.storage, "store", store)


def cow_copies_data_not_scale(shard: KVShard) -> None:
    """Copy-on-write copies the block's codes but not its scales: the private copy dequantises
    with whatever scales the new block had (none: its previous generation's were invalidated)."""

    def copy_block(self, src, dst):
        self.data[:, :, dst].copy_(self.data[:, :, src])

    bind(shard.storage, "copy_block", copy_block)


def one_scale_for_all_heads(shard: KVShard) -> None:
    """One scale per token for all kv-heads (max over heads and head_dim), stored into every
    head's slot, while the layout says one per head: the small heads lose their precision. All
    heads of the model: under tensor parallelism the max is taken over every rank's heads (one
    all-reduce), so the bug is the same at any split, one KV head per rank included."""

    def quantize(self, kv):
        amax = kv.float().abs().amax(dim=(-2, -1), keepdim=True)  # (2, N, 1, 1) this rank's heads
        if shard.all_reduce_max is not None:
            amax = shard.all_reduce_max(amax.contiguous())  # every rank quantizes every layer
        amax = amax.expand(*kv.shape[:-1], 1)
        scales = (amax[..., 0] / self.format.qmax).clamp(SCALE_MIN, SCALE_MAX).to(SCALE_DTYPE)
        y = kv.float() / scales.float().unsqueeze(-1)
        if self.format.storage_dtype == torch.int8:
            codes = self.rounding(y).clamp(-self.format.qmax, self.format.qmax).to(torch.int8)
        else:
            codes = y.clamp(-self.format.qmax, self.format.qmax).to(self.format.storage_dtype)
        return codes, scales

    bind(shard.storage, "quantize", quantize)


def _one_kv_head(cfg: ModelConfig) -> str | None:
    if cfg.num_kv_heads == 1:
        return "the model has one KV head: one scale for all heads is that head's own scale"
    return None


def _on_every_rank(patch: Callable[[KVShard], None]) -> Callable[[LLMEngine], None]:
    """A mutant's `apply` that plants `patch` in every rank's KV shard."""
    return lambda engine: engine.patch_kv_shards(patch)


def swap_in_without_scales(shard: KVShard) -> None:
    """Swap-in copies the saved codes back but not the saved scales: the restored blocks keep
    the scales their slots had (zero after invalidation) instead of the request's own."""

    def write_blocks(self, block_ids, blocks):
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, index, blocks.data.to(self.data.device))

    bind(shard.storage, "write_blocks", write_blocks)


def int8_round_toward_zero(shard: KVShard) -> None:
    """The engine's int8 quantiser truncates (rounds toward zero) instead of rounding to nearest:
    every code is biased toward zero by half a step on average. The reference still rounds."""
    replace(shard.storage, "rounding", torch.trunc)


QUANTIZED_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "scale_from_previous_generation",
        "a reused block is read with the scales of its previous generation",
        "quantized_kv",
        _on_every_rank(scale_from_previous_generation),
        suites=("preemption:int8", "prefix:int8"),
        kv_cache_dtype="int8",
    ),
    Mutant(
        "cow_copies_data_not_scale",
        "copy-on-write copies a block's codes but not its scales",
        "quantized_kv",
        _on_every_rank(cow_copies_data_not_scale),
        suites=("parallel:int8",),
        kv_cache_dtype="int8",
    ),
    Mutant(
        "one_scale_for_all_heads",
        "one scale per token for all kv-heads where the layout says one per head",
        "quantized_kv",
        _on_every_rank(one_scale_for_all_heads),
        suites=QUANTIZED_SUITES,
        kv_cache_dtype="int8",
        not_applicable_on=_one_kv_head,
    ),
    Mutant(
        "swap_in_without_scales",
        "swap-in restores the codes but leaves the slots' old scales",
        "quantized_kv",
        _on_every_rank(swap_in_without_scales),
        suites=("preemption:int8",),
        kv_cache_dtype="int8",
    ),
    Mutant(
        "int8_round_toward_zero",
        "the engine's int8 quantiser rounds toward zero, not to nearest",
        "quantized_kv",
        _on_every_rank(int8_round_toward_zero),
        suites=QUANTIZED_SUITES,
        kv_cache_dtype="int8",
    ),
)
