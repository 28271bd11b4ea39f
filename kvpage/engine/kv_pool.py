"""How big the engine's KV pool is, and the pool of a one-process engine (under tensor
parallelism each worker holds its shard: kvpage.parallel.executor)."""

from __future__ import annotations

from kvpage.cache.block_table import blocks_for
from kvpage.cache.groups import KVLayout
from kvpage.config import EngineConfig, ModelConfig
from kvpage.kv.format import KVFormat
from kvpage.kv.storage import KVStorage
from kvpage.model.base import CausalLM

DEFAULT_KV_CACHE_MEMORY = 512 * 2**20


def num_kv_blocks(
    config: EngineConfig, mcfg: ModelConfig, max_model_len: int, fmt: KVFormat
) -> int:
    """Whole-model blocks: as configured, else as many as kv_cache_memory holds, else enough
    for max_num_seqs requests of max_model_len tokens within DEFAULT_KV_CACHE_MEMORY."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = KVStorage.bytes_per_block(
        mcfg.num_layers, config.block_size, mcfg.num_kv_heads, mcfg.head_dim, fmt
    )
    if config.kv_cache_memory is not None:
        return max(1, config.kv_cache_memory // per_block)
    by_memory = DEFAULT_KV_CACHE_MEMORY // per_block
    by_workload = config.max_num_seqs * blocks_for(max_model_len, config.block_size)
    return max(1, min(by_memory, by_workload))


def local_storage(
    model: CausalLM, layout: KVLayout, num_pages: int, block_size: int, fmt: KVFormat
) -> KVStorage:
    mcfg = model.config
    return KVStorage(
        layout.rows, num_pages, block_size, mcfg.num_kv_heads, mcfg.head_dim, fmt, model.device
    )
