"""The KV pool's tensors: K and V of every layer in one pre-allocated allocation,
written through slot mappings, read back in the compute dtype as stored, copied per block
(copy-on-write), moved to and from the swap space, and invalidated when a block is freed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpage.errors import InvariantViolation
from kvpage.kv.format import SCALE_DTYPE, KVFormat, dequantize, quantize


@dataclass(slots=True)
class SavedKV:
    """Blocks copied out of the pool (swap): their K/V and, for a scaled layout, their scales.
    A scale is part of the block it belongs to: it leaves and comes back with it."""

    data: torch.Tensor  # (L, 2, n, B, KVH, D) in the pool's element dtype
    scales: torch.Tensor | None  # (L, 2, n, B, KVH) float16, or None for a plain layout

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]


@dataclass(slots=True)
class KVShard:
    """One rank's KV pool shard as a patch applied on every rank sees it
    (LLMEngine.patch_kv_shards): its storage, and how to reach the other ranks' shards."""

    storage: KVStorage
    rank: int = 0
    world_size: int = 1
    # In-place elementwise max of a same-shaped tensor over every rank; None in one process.
    all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None


class KVStorage:
    """The pool's tensors: K and V per layer, (num_blocks, block_size, KVH, D) each, in one
    allocation (L, 2, num_blocks, B, KVH, D), in the format's stored dtype; for a quantized format
    also `scales` (L, 2, num_blocks, B, KVH) float16 (kvpage.kv.format). Zero-initialised:
    padded gathers must read finite values, since a masked-out NaN still poisons SDPA's weighted
    sum (a zero scale dequantises to zero, also finite).

    Every read returns K/V in the compute dtype as stored (dequantised, or widened from a cast),
    including the step's own new tokens, so all attention sees exactly what the pool holds."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        fmt: KVFormat,
        device: str | torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.format = fmt
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=_element_dtype(fmt), device=device)
        self.scales = (
            torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if fmt.quantized else None
        )
        self.rounding = torch.round  # int8 codes: round half to even (a seam for the mutants)
        # Decode reads blocks in place with the native kernel when the pool holds the compute
        # dtype as is; off: the gather + torch attention path (tests run both).
        self.use_native = not (fmt.quantized or fmt.cast_only)
        self._workspace = torch.empty(0, dtype=fmt.compute_dtype, device=device)
        self._buffers: dict[str, torch.Tensor] = {}  # quantized gathers: codes, scales, values

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, fmt: KVFormat) -> int:
        per_token_head = head_dim * fmt.storage_dtype.itemsize
        if fmt.quantized:
            per_token_head += SCALE_DTYPE.itemsize
        return 2 * num_layers * block_size * num_kv_heads * per_token_head

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    # --- writes ------------------------------------------------------------------------------
    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V (N, KVH, D) at `slots` (N,); returns them as a read of the
        pool would see them (the round trip through the stored format)."""
        kv = self.data[layer].flatten(1, 2)  # (2, P, KVH, D), P = num_blocks * B
        if self.format.quantized:
            codes, scales = self.quantize(torch.stack((k, v)))  # (2, N, KVH, D), (2, N, KVH)
            self.store(layer, slots, codes, scales)
            deq = dequantize(codes, scales, self.format.compute_dtype)
            return deq[0], deq[1]
        if self.format.cast_only:
            k, v = k.to(self.format.storage_dtype), v.to(self.format.storage_dtype)
        kv[0].index_copy_(0, slots, k)
        kv[1].index_copy_(0, slots, v)
        dtype = self.format.compute_dtype
        return k.to(dtype), v.to(dtype)  # no copy when the format is the model dtype

    def quantize(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize(kv, self.format, self.rounding)

    def store(self, layer: int, slots: torch.Tensor, codes, scales) -> None:
        """Codes (2, N, KVH, D) and their scales (2, N, KVH) into the slots, together."""
        self.data[layer].flatten(1, 2).index_copy_(1, slots, codes.view(self.data.dtype))
        self.scales[layer].flatten(1, 2).index_copy_(1, slots, scales)

    def invalidate(self, block_id: int) -> None:
        """A freed block's scales die with its generation: zeroed, so a read of a slot nobody
        wrote since can never dequantise the previous owner's K/V."""
        if self.scales is not None:
            self.scales[:, :, block_id].zero_()

    def check_written(self, block_ids: tuple[int, ...], num_tokens: int, who: str = "") -> None:
        """Debug check: the first `num_tokens` slots of the table hold scales of the current
        generation (a written scale is >= 2^-14; an invalidated one is 0)."""
        if self.scales is None:
            return
        for j, bid in enumerate(block_ids):
            n = min(self.block_size, num_tokens - j * self.block_size)
            if n <= 0:
                return
            if bid < 0:  # a window group gave it back (kvpage.cache.groups): nothing reads it
                continue
            if not bool(self.scales[:, :, bid, :n].ne(0).all()):
                raise InvariantViolation(
                    f"{who} block[{j}]={bid}: a read of {n} tokens finds scales nobody wrote "
                    "in this generation"
                )

    # --- reads -------------------------------------------------------------------------------
    def layer_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pools as they lie, (num_blocks, B, KVH, D) each: no copy."""
        return self.data[layer, 0], self.data[layer, 1]

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (ctx, KVH, D) of the given slots, in the compute dtype."""
        # Two dim-0 selects, as gather_blocks: a shared-prefix step reads 31 x 544 slots a
        # layer, which one dim-1 select over (2, slots, ...) copied 1.8x slower in float32 and
        # bfloat16 (bench/kv_read_slots.py, 2 threads).
        pool, dtype = self.data[layer], self.format.compute_dtype
        k, v = (pool[i].flatten(0, 1).index_select(0, slots) for i in (0, 1))
        if self.format.quantized:
            scales = self.scales[layer]  # (2, NB, B, KVH)
            k, v = (
                dequantize(self._codes(x), scales[i].flatten(0, 1).index_select(0, slots), dtype)
                for i, x in enumerate((k, v))
            )
        elif self.format.cast_only:
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    def gather_blocks(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks through padded block tables (S, max_blocks), as
        (S, KVH, max_blocks * B, D) views. Copies whole blocks (one index per block, not per
        token) into buffers reused across layers and steps, so a decode step allocates nothing.
        Two dim-0 selects, not one over the (2, NB, ...) layer: on an idle CPU the dim-0 copy is
        the parallel one (one dim-1 select measured 1.5x slower in bench/decode_profile.py)."""
        if self.format.quantized or self.format.cast_only:
            return self._gather_converted(layer, tables)
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
        return self._as_context(k_buf, s), self._as_context(v_buf, s)

    def _gather_converted(self, layer: int, tables: torch.Tensor):
        """The same gather for a stored dtype other than the compute dtype: codes (and scales)
        of whole blocks, then one conversion into a reused compute-dtype buffer."""
        s, nb = tables.shape
        flat = tables.reshape(-1)
        kv = self.data[layer]  # (2, NB, B, KVH, D)
        codes = self._buffer("codes", (2, s * nb, *kv.shape[2:]), kv.dtype)
        torch.index_select(kv, 1, flat, out=codes)
        if self.format.quantized:
            sc = self.scales[layer]  # (2, NB, B, KVH)
            scales = self._buffer("scales", (2, s * nb, *sc.shape[2:]), sc.dtype)
            torch.index_select(sc, 1, flat, out=scales)
            values = self._buffer("values", codes.shape, torch.float32)
            values.copy_(self._codes(codes))
            scales32 = self._buffer("scales32", scales.shape, torch.float32)
            values.mul_(scales32.copy_(scales).unsqueeze(-1))  # = kv_format.dequantize
            if values.dtype != self.format.compute_dtype:
                values = values.to(self.format.compute_dtype)
        else:
            values = self._buffer("values", codes.shape, self.format.compute_dtype)
            values.copy_(codes)
        return self._as_context(values[0], s), self._as_context(values[1], s)

    def _as_context(self, blocks: torch.Tensor, s: int) -> torch.Tensor:
        """(S * nb, B, KVH, D) -> (S, KVH, nb * B, D)"""
        return blocks.view(s, -1, *blocks.shape[2:]).transpose(1, 2)

    def _codes(self, raw: torch.Tensor) -> torch.Tensor:
        """Pool elements as codes: float8 is kept as its bytes (CPU index_copy has no float8)."""
        return (
            raw.view(self.format.storage_dtype) if raw.dtype != self.format.storage_dtype else raw
        )

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        need = 1
        for n in shape:
            need *= n
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < need:
            buf = torch.empty(int(need * 1.25), dtype=dtype, device=self.data.device)
            self._buffers[name] = buf
        return buf[:need].view(shape)

    # --- whole blocks (CoW, swap) ------------------------------------------------------------
    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: the data and its scales, together."""
        self.data[:, :, dst].copy_(self.data[:, :, src])
        if self.scales is not None:
            self.scales[:, :, dst].copy_(self.scales[:, :, src])

    def block_scales(self, block_ids: list[int]) -> torch.Tensor | None:
        """The scales (L, 2, n, B, KVH) of the given blocks over every KV head (a tensor-parallel
        pool gathers every rank's heads); None for a layout without scales."""
        if self.scales is None:
            return None
        index = torch.tensor(block_ids, dtype=torch.long, device=self.scales.device)
        return self.scales.index_select(2, index).cpu()

    def read_blocks(self, block_ids: list[int]) -> SavedKV:
        """A CPU copy of the given blocks, scales included."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        scales = None if self.scales is None else self.scales.index_select(2, index).cpu()
        return SavedKV(self.data.index_select(2, index).cpu(), scales)

    def write_blocks(self, block_ids: list[int], blocks: SavedKV) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, index, blocks.data.to(self.data.device))
        if self.scales is not None:
            self.scales.index_copy_(2, index, blocks.scales.to(self.data.device))


def _element_dtype(fmt: KVFormat) -> torch.dtype:
    """float8 codes live in a uint8 pool (their bytes): CPU index_copy has no float8 kernel."""
    return (
        torch.uint8 if fmt.storage_dtype.is_floating_point and fmt.quantized else fmt.storage_dtype
    )
