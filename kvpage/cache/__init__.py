"""Paged KV cache core: pure data structures, no tensors; what the
tensors must do leaves it as block operations.

The engine talks to `KVCacheManager`; the other names are exported for tests and tools.
"""

from kvpage.cache.block_ops import BlockOp, CopyBlock, InvalidateBlock, SwapIn, SwapOut
from kvpage.cache.block_pool import LEGAL_TRANSITIONS, Block, BlockPool, BlockState, CacheUsage
from kvpage.cache.block_table import BlockTable, SnapshotEntry, TableSnapshot
from kvpage.cache.invariants import check_invariants
from kvpage.cache.key_chain import BlockKey, BlockKeyChain
from kvpage.cache.manager import KVCacheManager
from kvpage.cache.namespace import CacheNamespace, canonical_config
from kvpage.cache.prefix_index import DigestMismatch, IndexEntry, PrefixIndex
from kvpage.cache.stats import CacheStats

__all__ = [
    "LEGAL_TRANSITIONS",
    "Block",
    "BlockOp",
    "BlockKey",
    "BlockKeyChain",
    "BlockPool",
    "BlockState",
    "BlockTable",
    "CacheNamespace",
    "CacheStats",
    "CacheUsage",
    "CopyBlock",
    "DigestMismatch",
    "InvalidateBlock",
    "SwapIn",
    "SwapOut",
    "IndexEntry",
    "KVCacheManager",
    "PrefixIndex",
    "SnapshotEntry",
    "TableSnapshot",
    "canonical_config",
    "check_invariants",
]
