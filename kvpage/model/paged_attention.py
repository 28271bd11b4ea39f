"""Paged attention: one step's packed batch of prefill chunks and decode tokens, reading and
writing KV through block tables into a pre-allocated pool.

Per layer: the new tokens' K/V are written through `slot_mapping` (slot = block * B + offset), then
decode tokens (one query each) attend in one batched SDPA over their gathered contexts, and each
prefill chunk attends causally to its cached prefix and to itself (chunks of one shape in one
call: kvpage.model.prefill_groups).

Per-layer-group KV (kvpage.cache.groups): the metadata carries one view per group, and
`paged_backend` sends each layer to its group's view, at the layer's row of the group's pages."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kvpage.model.native_attention as native_attention  # not `from kvpage.model`: a cycle
from kvpage.kv.storage import KVStorage
from kvpage.model.attention import causal_mask, masked_attention, windowed_causal_attention
from kvpage.model.decode_attention import decode_attention
from kvpage.model.kernels import KernelChoice
from kvpage.model.prefill_groups import PrefillGroup, group_prefills


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # rows [token_start, token_end) of the packed batch
    token_end: int
    context_slots: torch.Tensor | None  # (ctx,) slots of the whole context, chunk included;
    # None when the chunk is the whole context (a fresh prompt): it attends to its own K/V


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Built once per step by the runner; every layer reads the same view."""

    slot_mapping: torch.Tensor  # (N,) long
    cu_seqlens_q: list[int]  # (S+1,) no zero-length entries; last == N
    decode_rows: torch.Tensor  # (Sd,) rows of decode tokens
    decode_tables: torch.Tensor  # (Sd, max_blocks) long, block tables padded with block 0
    decode_mask: torch.Tensor  # (Sd, 1, 1, max_blocks * B) bool, True = real context
    prefills: list[PrefillChunk]
    # Every row is a decode token, in row order (decode_rows == arange(N)): attention runs on q
    # as it is, with no row gather or scatter.
    decode_only: bool = False
    decode_lens: torch.Tensor | None = None  # (Sd,) long context lengths: the native kernel's
    # Layer groups 1.. (this view is group 0's) and layer -> (group, row); empty: one group,
    # row = layer.
    groups: list[PagedAttentionMetadata] = field(default_factory=list)
    layer_map: tuple[tuple[int, int], ...] = ()


def paged_backend(storage: KVStorage, meta: PagedAttentionMetadata):
    """The step's attention backend: plain for one group, per group otherwise."""
    if not meta.groups:
        return PagedAttention(storage, meta)
    return GroupedAttention(storage, meta)


def validate_cu_seqlens(cu_seqlens: list[int], num_tokens: int) -> None:
    """Strictly increasing (no zero-length sequence), starts at 0, ends at the token count: an
    off-by-one layout would shift a sequence onto its neighbour's tokens."""
    if not cu_seqlens or cu_seqlens[0] != 0 or cu_seqlens[-1] != num_tokens:
        raise ValueError(f"cu_seqlens {cu_seqlens} must run from 0 to the token count {num_tokens}")
    if any(b <= a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False)):
        raise ValueError(f"cu_seqlens {cu_seqlens} must be strictly increasing (no empty sequence)")


class PagedAttention:
    """The AttentionBackend of one engine step."""

    def __init__(self, storage: KVStorage, meta: PagedAttentionMetadata) -> None:
        self.storage = storage
        self.meta = meta
        self._native: native_attention.PagedDecode | None = None  # built at the first decode
        self._window_masks: dict[int, torch.Tensor] = {}  # window -> decode mask, per step
        self._window_starts: dict[int, torch.Tensor] = {}  # window -> the kernel's first rows
        self._prefill_masks: dict[tuple, torch.Tensor] = {}  # (T, S, window) -> causal mask
        self._prefill_groups: list[PrefillGroup] | None = None  # built at the first layer
        self._pool: native_attention.PoolLayout | None | bool = False  # False: not yet looked at
        self.native_allowed = True  # the model's bound choice (kernels_off)

    def kernels_off(self, choice: KernelChoice) -> None:
        """The model was bound without the paged decode kernel (kvpage.model.kernels): keep to
        torch's attention this step. Called by the model's forward only then."""
        self.native_allowed = choice.on("paged_decode")

    def attend(self, layer: int, q, k, v, scale: float, window: int | None = None) -> torch.Tensor:
        # q: (N, H, D); k, v: (N, KVH, D). From here on k and v are what the pool holds for
        # the new tokens (unchanged in the model's own dtype, round-tripped otherwise).
        k, v = self._write(layer, k, v)
        if self.meta.decode_only:
            return self._decode(q, layer, scale, window)
        out = torch.empty_like(q)
        if self.meta.decode_rows.numel():
            decoded = self._decode(q[self.meta.decode_rows], layer, scale, window)
            out[self.meta.decode_rows] = decoded
        for group in self.prefill_groups():
            rows = group.rows
            out[rows] = self._prefill(q[rows], k[rows], v[rows], group, layer, scale, window)
        return out

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """KVStorage.write, or the native write where the pool holds the model's dtype and k
        and v are rows of heads one stride apart (slots checked once per step)."""
        pool = self.prepare_write(k.dtype)
        if pool is None or not _rows_alike(k, v):
            return self.storage.write(layer, self.meta.slot_mapping, k, v)
        pool.write_unchecked(layer, k.data_ptr(), v.data_ptr(), k.stride(0),
                             self._slots.data_ptr(), k.shape[0])  # fmt: skip
        return k, v

    def prepare_write(self, dtype: torch.dtype) -> native_attention.PoolLayout | None:
        """The pool's layout for the native KV write this step, or None (KVStorage.write):
        looked at once per step, the slots checked then."""
        if self._pool is False:
            storage, slots = self.storage, self.meta.slot_mapping
            native = self.native_allowed and storage.use_native and native_attention.available()
            # A write replaced on this storage (a planted fault: tests/distributed) stays the seam.
            native = native and "write" not in vars(storage)
            if not native or storage.data.dtype != dtype or slots.device.type != "cpu":
                self._pool = None
            else:
                self._slots = slots.to(torch.int64).contiguous()
                native_attention.check_slots(self._slots, storage.num_blocks, storage.block_size)
                self._pool = native_attention.PoolLayout.of(storage.data)
        return self._pool

    def _decode(self, q_d, layer: int, scale: float, window: int | None) -> torch.Tensor:
        """q_d: (Sd, H, D), one query per decode sequence -> (Sd, H, D)."""
        native = self.native_decode(q_d)
        if native is not None:  # reads the blocks in the pool, no gather; rows may lie apart
            k_pool, v_pool = self.storage.layer_pools(layer)
            starts = None if window is None else self.window_starts(native, window)
            return native(q_d, k_pool, v_pool, scale, starts)
        windowed = window is not None and self._window_cuts(window)
        k_d, v_d = self.storage.gather_blocks(layer, self.meta.decode_tables)  # (Sd, KVH, C, D)
        mask = self._window_mask(window) if windowed else self.meta.decode_mask
        return decode_attention(q_d, k_d, v_d, mask, scale)

    def window_starts(self, native: native_attention.PagedDecode, window: int) -> torch.Tensor:
        """Per sequence the first row a window of `window` lets it see, once per step (a
        decode tape recomputes them into this tensor)."""
        starts = self._window_starts.get(window)
        if starts is None:
            starts = self._window_starts[window] = native.window_starts(window)
        return starts

    def _window_cuts(self, window: int) -> bool:
        """Whether some decode context is longer than the window (else the window is moot)."""
        return self._window_mask(window) is not self.meta.decode_mask

    def _window_mask(self, window: int) -> torch.Tensor:
        """The decode mask less the keys before each sequence's window: a query at position
        len - 1 sees keys len - W .. len - 1. Built once per step and window."""
        mask = self._window_masks.get(window)
        if mask is None:
            lens = self.meta.decode_lens
            if lens is None:  # metadata made without lengths: the real-context mask has them
                lens = self.meta.decode_mask.flatten(1).sum(-1)
            if int(lens.max()) <= window:
                mask = self.meta.decode_mask
            else:
                width = self.meta.decode_mask.shape[-1]
                keys = torch.arange(width, device=lens.device)
                inside = keys[None, :] >= (lens - window)[:, None]  # (Sd, C)
                mask = self.meta.decode_mask & inside[:, None, None, :]
            self._window_masks[window] = mask
        return mask

    def native_decode(self, q_d: torch.Tensor) -> native_attention.PagedDecode | None:
        """The step's native decode kernel for queries like q_d (None: the torch path)."""
        if not self.native_allowed:
            return None
        if self._native is None:
            if not self.storage.use_native or self.meta.decode_lens is None:
                return None
            if not native_attention.supports(q_d.dtype, q_d.device, q_d.shape[-1]):
                return None
            self._native = native_attention.PagedDecode(
                self.meta.decode_tables,
                self.meta.decode_lens,
                self.storage.num_blocks,
                self.storage.block_size,
            )
        return self._native

    def prefill_groups(self) -> list[PrefillGroup]:
        if self._prefill_groups is None:
            device = self.meta.slot_mapping.device
            self._prefill_groups = group_prefills(self.meta.prefills, device)
        return self._prefill_groups

    def _prefill(self, q, k, v, group: PrefillGroup, layer: int, scale: float, window):
        """q: (n * T, H, D), k, v: (n * T, KVH, D) of a group's n chunks -> (n * T, H, D)."""
        q = group.split(q)
        if group.context_slots is None:  # nothing cached before them: no gather needed
            out = windowed_causal_attention(q, group.split(k), group.split(v), scale, window)
            return out.flatten(0, 1)
        k_ctx, v_ctx = self.storage.read_slots(layer, group.context_slots)  # (n * S, KVH, D)
        k_ctx, v_ctx = group.split(k_ctx), group.split(v_ctx)
        out = masked_attention(q, k_ctx, v_ctx, self._prefill_mask(q, k_ctx, window), scale)
        return out.flatten(0, 1)

    def _prefill_mask(self, q: torch.Tensor, k_ctx: torch.Tensor, window: int | None):
        """The causal mask of T queries over S keys, built once per step for every layer (a
        shared-prefix step runs ~60 chunks a layer, and the mask is 4 torch ops)."""
        key = (q.shape[-3], k_ctx.shape[-3], window)
        mask = self._prefill_masks.get(key)
        if mask is None:
            mask = self._prefill_masks[key] = causal_mask(*key[:2], q.device, window)
        return mask


def _rows_alike(k: torch.Tensor, v: torch.Tensor) -> bool:
    """(N, KVH, D) k and v, each row's heads contiguous, one row stride."""
    if k.dim() != 3 or k.stride() != v.stride() or k.shape != v.shape or k.dtype != v.dtype:
        return False
    _, h, d = k.shape
    return k.stride(2) == 1 and k.stride(1) == d and k.stride(0) >= h * d


class GroupedAttention:
    """Each layer attends through its own group's view (tables, slots) at its row of the pages:
    one PagedAttention per group, sharing the storage."""

    def __init__(self, storage: KVStorage, meta: PagedAttentionMetadata) -> None:
        self.layer_map = meta.layer_map
        self.backends = [PagedAttention(storage, m) for m in (meta, *meta.groups)]

    def kernels_off(self, choice: KernelChoice) -> None:
        for backend in self.backends:
            backend.kernels_off(choice)

    def attend(self, layer: int, q, k, v, scale: float, window: int | None = None) -> torch.Tensor:
        group, row = self.layer_map[layer]
        return self.backends[group].attend(row, q, k, v, scale, window)
