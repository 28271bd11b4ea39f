"""Chained block keys carried on a sequence as it grows.

key_{-1} = namespace digest; digest_i = SHA-256(domain, digest_{i-1}, tokens of block i). A block's key
therefore covers every token from position 0 to the block's end, never just its own tokens, and
only full blocks get a key. `extend` hashes only newly completed blocks, so growing a sequence costs
O(new tokens), never a whole-prompt rehash. The fast key (for the index dict) is the digest's first
64 bits, masked to `fast_key_bits` (narrowed in tests to force collisions).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from kvpage.errors import InvalidRequest

_DOMAIN = b"kvpage.cache.block.v1"


@dataclass(frozen=True, slots=True)
class BlockKey:
    fast: int
    digest: bytes  # 32 bytes


def chain_digest(prev: bytes, tokens: list[int]) -> bytes:
    try:
        payload = array("q", tokens).tobytes()  # fixed 8 bytes per token: no boundary ambiguity
    except (TypeError, OverflowError) as e:
        raise InvalidRequest(f"token ids must be 64-bit ints: {e}") from e
    return hashlib.sha256(_DOMAIN + prev + payload).digest()


class BlockKeyChain:
    def __init__(self, namespace_digest: bytes, block_size: int, fast_key_bits: int = 64):
        if not 1 <= fast_key_bits <= 64:
            raise ValueError(f"fast_key_bits must be in 1..64, got {fast_key_bits}")
        if len(namespace_digest) != 32:
            raise ValueError("namespace_digest must be a 32-byte SHA-256 digest")
        self.namespace_digest = namespace_digest
        self.block_size = block_size
        self.fast_key_bits = fast_key_bits
        self._mask = (1 << fast_key_bits) - 1
        self.keys: list[BlockKey] = []
        self.num_tokens = 0
        self._pending: list[int] = []  # tokens of the current partial block

    def extend(self, token_ids: Iterable[int]) -> int:
        """Append tokens; returns how many new full-block keys were computed."""
        before = len(self.keys)
        bs = self.block_size
        toks = token_ids if isinstance(token_ids, list) else list(token_ids)
        i = 0
        while i < len(toks):
            take = bs - len(self._pending)
            self._pending.extend(toks[i : i + take])
            i += take
            if len(self._pending) == bs:
                self._close_block()
        self.num_tokens = len(self.keys) * bs + len(self._pending)
        return len(self.keys) - before

    def copy(self) -> BlockKeyChain:
        """Independent chain with the same tokens so far (for a forked sequence)."""
        twin = BlockKeyChain(self.namespace_digest, self.block_size, self.fast_key_bits)
        twin.keys = list(self.keys)
        twin.num_tokens = self.num_tokens
        twin._pending = list(self._pending)
        return twin

    def block_digest(self, parent: bytes, tokens: list[int]) -> bytes:
        """The key of a block whose prefix's key is `parent` (the namespace digest for the first
        block): it covers every token from position 0 to the block's end."""
        return chain_digest(parent, tokens)

    def _close_block(self) -> None:
        prev = self.keys[-1].digest if self.keys else self.namespace_digest
        digest = self.block_digest(prev, self._pending)
        fast = int.from_bytes(digest[:8], "little") & self._mask
        self.keys.append(BlockKey(fast, digest))
        self._pending = []
