"""Paged attention (R2, R10): one step's packed batch of prefill chunks and decode tokens, reading and
writing KV through block tables into a pre-allocated pool.

Per layer: the new tokens' K/V are written through `slot_mapping` (slot = block * B + offset), then
decode tokens (one query each) attend in one batched SDPA over their gathered contexts, and each
prefill chunk attends causally to its cached prefix and to itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.model.attention import causal_attention, causal_mask, masked_attention


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


def validate_cu_seqlens(cu_seqlens: list[int], num_tokens: int) -> None:
    """R10: strictly increasing (no zero-length sequence), starts at 0, ends at the token count."""
    if not cu_seqlens or cu_seqlens[0] != 0 or cu_seqlens[-1] != num_tokens:
        raise ValueError(f"cu_seqlens {cu_seqlens} must run from 0 to the token count {num_tokens}")
    if any(b <= a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False)):
        raise ValueError(f"cu_seqlens {cu_seqlens} must be strictly increasing (no empty sequence)")


class KVStorage:
    """The pool's tensors: K and V per layer, (num_blocks, block_size, KVH, D) each, in one
    allocation (L, 2, num_blocks, B, KVH, D). Zero-initialised: padded gathers must read finite
    values, since a masked-out NaN still poisons SDPA's weighted sum."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.data = torch.zeros(
            num_layers,
            2,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )
        self._workspace = torch.empty(0, dtype=dtype, device=device)  # decode gather buffers

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_blocks * B, KVH, D) views of one layer's K and V."""
        kv = self.data[layer]
        return kv[0].flatten(0, 1), kv[1].flatten(0, 1)

    def gather_blocks(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks through padded block tables (S, max_blocks), as
        (S, KVH, max_blocks * B, D) views. Copies whole blocks (one index per block, not per
        token) into buffers reused across layers and steps, so a decode step allocates nothing.
        Two dim-0 selects, not one over the (2, NB, ...) layer: on an idle CPU the dim-0 copy is
        the parallel one (one dim-1 select measured 1.5x slower in bench/decode_profile.py)."""
        s, nb = tables.shape
        kv = self.data[layer]  # (2, NB, B, KVH, D)
        shape = (s * nb, *kv.shape[2:])
        need = 2 * s * nb * kv[0, 0].numel()
        if self._workspace.numel() < need:
            self._workspace = torch.empty(int(need * 1.25), dtype=kv.dtype, device=kv.device)
        half = need // 2
        k_buf = self._workspace[:half].view(shape)
        v_buf = self._workspace[half:need].view(shape)
        flat = tables.reshape(-1)
        torch.index_select(kv[0], 0, flat, out=k_buf)
        torch.index_select(kv[1], 0, flat, out=v_buf)
        ctx = nb * self.block_size
        return (
            k_buf.view(s, ctx, *kv.shape[3:]).transpose(1, 2),
            v_buf.view(s, ctx, *kv.shape[3:]).transpose(1, 2),
        )

    def copy_block(self, src: int, dst: int) -> None:
        self.data[:, :, dst].copy_(self.data[:, :, src])

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """(L, 2, n, B, KVH, D) copy of the given blocks, on the CPU."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        return self.data.index_select(2, index).cpu()

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, index, blocks.to(self.data.device))


class PagedAttention:
    """The AttentionBackend of one engine step."""

    def __init__(self, storage: KVStorage, meta: PagedAttentionMetadata) -> None:
        self.storage = storage
        self.meta = meta

    def attend(self, layer: int, q, k, v, scale: float) -> torch.Tensor:
        # q: (N, H, D); k, v: (N, KVH, D)
        k_flat, v_flat = self.storage.flat(layer)  # (P, KVH, D), P = num_blocks * B
        k_flat.index_copy_(0, self.meta.slot_mapping, k)
        v_flat.index_copy_(0, self.meta.slot_mapping, v)
        if self.meta.decode_only:
            return self._decode(q, layer, scale)
        out = torch.empty_like(q)
        if self.meta.decode_rows.numel():
            out[self.meta.decode_rows] = self._decode(q[self.meta.decode_rows], layer, scale)
        for chunk in self.meta.prefills:
            rows = slice(chunk.token_start, chunk.token_end)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], chunk, k_flat, v_flat, scale)
        return out

    def _decode(self, q_d, layer: int, scale: float) -> torch.Tensor:
        """q_d: (Sd, H, D), one query per decode sequence -> (Sd, H, D)."""
        k_d, v_d = self.storage.gather_blocks(layer, self.meta.decode_tables)  # (Sd, KVH, C, D)
        # enable_gqa, not G query rows per KV head: the grouped form measured slower (1.36 vs
        # 0.93 ms a layer at batch 32 in bench/decode_profile.py, idle machine, 2 threads).
        out = torch.nn.functional.scaled_dot_product_attention(
            q_d.unsqueeze(2),  # (Sd, H, 1, D)
            k_d,
            v_d,
            attn_mask=self.meta.decode_mask,
            scale=scale,
            enable_gqa=q_d.shape[1] != k_d.shape[1],
        )  # (Sd, H, 1, D)
        return out.squeeze(2)

    def _prefill(self, q, k, v, chunk: PrefillChunk, k_flat, v_flat, scale: float):
        if chunk.context_slots is None:  # nothing cached before it: no gather needed
            return causal_attention(q, k, v, scale)
        k_ctx = k_flat[chunk.context_slots]  # (ctx, KVH, D)
        v_ctx = v_flat[chunk.context_slots]
        mask = causal_mask(q.shape[0], k_ctx.shape[0], q.device)
        return masked_attention(q, k_ctx, v_ctx, mask, scale)
