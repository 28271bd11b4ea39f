"""Bugs planted in a copy of vLLM 0.32.0's `vllm/v1/core` (the installed package is never
touched): each is one realistic slip in its prefix-cache Python, an exact text edit that fails
loudly if vLLM's code moved, and the suite of `kvpage audit` that must report it.

- salt_dropped: the cache salt is left out of the first block's hash extra keys, so every
  tenant's salt hashes alike -> timing: "shared across tenants".
- parent_dropped: a block's hash no longer chains its parent's -> a block after a different
  prefix is a hit -> prefix: isolation failure.
- hit_one_block_too_many: a lookup that stops at a miss counts the last hit block once more ->
  cached tokens above what was shared (an accounting anomaly) and wrong KV for that block ->
  prefix: isolation failure (with the phantom hit as evidence).
- touch_requeues_held: a hit takes every hit block off the free queue, held or free -> the
  first hit on a block another running request holds (not on the queue) raises in the engine
  core, which dies -> the server fails under cache sharing. (A bug that left a hit block *on*
  the queue crashed only when the pool happened to cycle back to it within one audit: CI saw a
  run without the crash, so the planted crash is one every concurrent shared prefix reaches.)
- miss_counted_as_hit: a lookup whose first block misses counts the pool's null block as a hit
  -> every request, a fresh one under a fresh salt included, is served 32 "cached" tokens of
  never-written KV: cold and warm answers agree (both wrong), so only the phantom-hit accounting
  and `--reference-model` see it -> "reference" (with the accounting anomaly)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path


class PlantFailed(RuntimeError):
    """The text to replace is not in this vLLM's file (its code changed)."""


@dataclass(frozen=True, slots=True)
class Plant:
    name: str
    file: str  # relative to vllm/v1/core
    old: str
    new: str
    caught_by: str  # what the audit must report: a suite name, or "server failed"
    bug: str


PLANTS = {
    p.name: p
    for p in (
        Plant(
            "salt_dropped",
            "kv_cache_utils.py",
            "        if (start_token_idx == 0 and request.cache_salt)\n",
            "        if (start_token_idx == 0 and request.cache_salt and False)  # PLANTED\n",
            "timing",
            "cache_salt left out of the block hash",
        ),
        Plant(
            "parent_dropped",
            "kv_cache_utils.py",
            "    if not parent_block_hash:\n        parent_block_hash = NONE_HASH\n",
            "    parent_block_hash = NONE_HASH  # PLANTED: the parent is not chained\n",
            "prefix",
            "a block's hash ignores its parent's",
        ),
        Plant(
            "hit_one_block_too_many",
            "single_type_kv_cache_manager.py",
            "            cached_block = block_pool.get_cached_block(block_hash, kv_cache_group_ids)\n"
            "            if not cached_block:\n"
            "                break\n",
            "            cached_block = block_pool.get_cached_block(block_hash, kv_cache_group_ids)\n"
            "            if not cached_block:\n"
            "                if computed_blocks[0]:  # PLANTED: the last hit counted twice\n"
            "                    for computed in computed_blocks:\n"
            "                        computed.append(computed[-1])\n"
            "                break\n",
            "prefix",
            "a cache hit counted one block too many",
        ),
        Plant(
            "touch_requeues_held",
            "block_pool.py",
            "            if block.ref_cnt == 0 and not block.is_null:\n"
            "                self.free_block_queue.remove(block)\n"
            "            block.ref_cnt += 1\n",
            "            if not block.is_null:  # PLANTED: held blocks taken off the queue too\n"
            "                self.free_block_queue.remove(block)\n"
            "            block.ref_cnt += 1\n",
            "server failed",
            "a hit takes a block another request holds off the free queue",
        ),
        Plant(
            "miss_counted_as_hit",
            "single_type_kv_cache_manager.py",
            "            cached_block = block_pool.get_cached_block(block_hash, kv_cache_group_ids)\n"
            "            if not cached_block:\n"
            "                break\n",
            "            cached_block = block_pool.get_cached_block(block_hash, kv_cache_group_ids)\n"
            "            if not cached_block and not computed_blocks[0]:  # PLANTED: a miss hits\n"
            "                cached_block = [block_pool.null_block] * len(kv_cache_group_ids)\n"
            "            if not cached_block:\n"
            "                break\n",
            "reference",
            "a first-block miss counted as a hit on the null block",
        ),
    )
}


def planted_core(installed: Path, plant: Plant, into: Path) -> Path:
    """A copy of the installed vllm/v1/core with `plant` applied; returns the copy's folder."""
    core = into / "core"
    shutil.rmtree(core, ignore_errors=True)
    shutil.copytree(installed, core, ignore=shutil.ignore_patterns("__pycache__"))
    path = core / plant.file
    text = path.read_text()
    if text.count(plant.old) != 1:
        raise PlantFailed(f"{plant.name}: expected text found {text.count(plant.old)}x in {path}")
    path.write_text(text.replace(plant.old, plant.new))
    return core
