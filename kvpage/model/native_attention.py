"""The paged decode kernel (native/paged_decode.cpp): built with the system C++ compiler at first
use, cached by source and flags, called through ctypes (kvpage.model.native_build).

Why native: a decode step's attention over gathered copies spent more time copying K/V (the block
gather, then a layout copy for the matmuls) than attending; the kernel reads each K/V row where it
lies in the pool, once. Why not a torch extension: the torch headers take a minute to compile on
two cores and need ninja; this is one C++ file with no torch dependency, built in under a second.
Without a compiler (or with KVPAGE_NATIVE=0) `available()` is False and callers keep the torch
path, which stays the one every test also runs."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

import kvpage.model.native_build as native_build  # not `from kvpage.model`: an import cycle

SOURCE = Path(__file__).parent / "native" / "paged_decode.cpp"
FLAGS = native_build.FLAGS
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# The kernel is instantiated for head_dim = 16 * C, C = 1..8 (a row in registers): 16..128.
HEAD_DIMS = tuple(range(16, 129, 16))


def available() -> bool:
    return _library() is not None


def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    return device.type == "cpu" and dtype in DTYPE_CODES and head_dim in HEAD_DIMS and available()


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native_build.load(SOURCE, "paged decode attention", _bind, flags=FLAGS)


def library() -> ctypes.CDLL | None:
    """The built kernels (None where they are not): their entry points, for tests that call them."""
    return _library()


def build(compiler: str) -> Path:
    """The shared library for this source, flags and CPU, compiled once into the cache dir."""
    return native_build.build(SOURCE, compiler, FLAGS)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvpage_scratch_floats.restype = i64
    lib.kvpage_scratch_floats.argtypes = [i64, i64, i64, i64]
    lib.kvpage_paged_decode.restype = None
    lib.kvpage_paged_decode.argtypes = [
        ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64,
        i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i64, ctypes.c_int,
    ]  # fmt: skip
    lib.kvpage_paged_write.restype = None
    lib.kvpage_paged_write.argtypes = [
        ctypes.c_int, ptr, ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, i64,
    ]  # fmt: skip
    return lib


@dataclass(slots=True)
class PagedDecode:
    """One step's decode batch for the kernel: block tables and context lengths, checked once
    here so that each layer's call does no per-call validation."""

    tables: torch.Tensor  # (S, max_blocks) int64, every id < num_blocks
    lens: torch.Tensor  # (S,) int64, 1 <= len <= max_blocks * block_size
    num_blocks: int
    block_size: int
    _scratch: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tables = self.tables.to(torch.int64).contiguous()
        self.lens = self.lens.to(torch.int64).contiguous()
        s, max_blocks = self.tables.shape
        if self.lens.shape != (s,):
            raise ValueError(f"lens {tuple(self.lens.shape)} does not match {s} block tables")
        if s and (int(self.tables.min()) < 0 or int(self.tables.max()) >= self.num_blocks):
            raise ValueError(f"a block table holds an id outside [0, {self.num_blocks})")
        if s and (int(self.lens.min()) < 1 or int(self.lens.max()) > max_blocks * self.block_size):
            raise ValueError(f"a context length is outside [1, {max_blocks * self.block_size}]")

    def window_starts(self, window: int) -> torch.Tensor:
        """Per sequence the first row a sliding window of `window` rows lets it see."""
        return (self.lens - window).clamp_(min=0).contiguous()

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        scale: float,
        starts: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: (S, H, D), each row's heads contiguous (rows may lie apart: a view of a fused qkv
        output); k_pool, v_pool: (num_blocks, B, KVH, D), the same strides, D contiguous ->
        (S, H, D), new or into `out` (the same layout rules as q). `starts` (S,) int64 from
        window_starts: attend to rows [start, len) only."""
        self._check(q, k_pool, v_pool)
        if starts is not None and (starts.dtype != torch.int64 or starts.shape != self.lens.shape):
            raise ValueError(f"starts must be ({self.lens.shape[0]},) int64")
        s, h, d = q.shape
        _, b, kvh, _ = k_pool.shape
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        elif out.shape != q.shape or out.dtype != q.dtype or not _rows_of_heads(out):
            raise ValueError(f"out {tuple(out.shape)} {out.stride()} for q {tuple(q.shape)}")
        threads = torch.get_num_threads()
        scratch, per_thread = self.scratch(h, kvh, d, b, threads)
        st = k_pool.stride()
        native_build.call(
            _library().kvpage_paged_decode, DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), k_pool.data_ptr(),
            v_pool.data_ptr(), st[0], st[1], st[2], self.tables.data_ptr(), self.lens.data_ptr(),
            None if starts is None else starts.data_ptr(), out.data_ptr(), out.stride(0),
            s, h, kvh, d, b, self.tables.shape[1], scale, scratch, per_thread, threads,
        )  # fmt: skip
        return out

    def scratch(
        self, heads: int, kv_heads: int, head_dim: int, block_size: int, threads: int
    ) -> tuple[int, int]:
        """The kernel's scratch for this step's tables on `threads` threads, kept between
        layers: (its address, floats per thread)."""
        max_len = self.tables.shape[1] * block_size
        per_thread = _library().kvpage_scratch_floats(heads, kv_heads, head_dim, max_len)
        if self._scratch is None or self._scratch.numel() < threads * per_thread:
            self._scratch = torch.empty(threads * per_thread, dtype=torch.float32)
        return self._scratch.data_ptr(), per_thread

    def _check(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        s, h, d = q.shape
        nb, b, kvh, kd = k_pool.shape
        if (nb, b) != (self.num_blocks, self.block_size) or kd != d or h % kvh:
            raise ValueError(f"pool {tuple(k_pool.shape)} does not fit q {tuple(q.shape)}")
        if s != self.tables.shape[0] or not _rows_of_heads(q):
            raise ValueError(f"q {tuple(q.shape)} {q.stride()}: one row of heads per block table")
        if v_pool.shape != k_pool.shape or v_pool.stride() != k_pool.stride():
            raise ValueError("K and V pools must have the same shape and strides")
        if k_pool.stride(3) != 1 or not (q.dtype == k_pool.dtype == v_pool.dtype):
            raise ValueError("head_dim must be contiguous and q, K, V of one dtype")
        if d not in HEAD_DIMS:
            raise ValueError(f"the kernel needs head_dim a multiple of 16 up to 128, not {d}")
        if q.dtype not in DTYPE_CODES or q.device.type != "cpu":
            raise ValueError(f"the kernel runs float32/bfloat16 on CPU, not {q.dtype} {q.device}")


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Where every layer's K and V pools lie in one KV pool tensor (layers, 2, blocks, B, KVH, D)
    of the model's dtype, checked once: the unchecked calls take addresses from it."""

    base: int  # the tensor's address
    layer_bytes: int  # from one layer's K pool to the next
    v_bytes: int  # from a layer's K pool to its V pool
    strides: tuple[int, int, int]  # block, token, head, in elements
    dtype_code: int
    block_size: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, data: torch.Tensor) -> PoolLayout:
        if data.dim() != 6 or data.shape[1] != 2 or data.stride(5) != 1:
            raise ValueError(f"a KV pool (layers, 2, blocks, B, KVH, D), not {tuple(data.shape)}")
        if data.dtype not in DTYPE_CODES or data.device.type != "cpu":
            raise ValueError(f"the kernels run float32/bfloat16 on CPU, not {data.dtype}")
        size = data.element_size()
        st = data.stride()
        return cls(
            data.data_ptr(), st[0] * size, st[1] * size, (st[2], st[3], st[4]),
            DTYPE_CODES[data.dtype], data.shape[3], data.shape[4], data.shape[5],
        )  # fmt: skip

    def addresses(self, layer: int) -> tuple[int, int]:
        k = self.base + layer * self.layer_bytes
        return k, k + self.v_bytes

    def write_unchecked(self, layer: int, k: int, v: int, row_stride: int, slots: int, n: int):
        """KVStorage.write's index_copy_ on raw addresses: n new rows of K and V (heads
        contiguous, row_stride elements apart) into `slots` (n int64, slot = block * B + offset)
        of the layer's pools. The caller checks the slots once per step (`check_slots`): the
        kernel writes where they say."""
        kp, vp = self.addresses(layer)
        native_build.call(
            _library().kvpage_paged_write, self.dtype_code, k, v, row_stride, kp, vp, *self.strides, slots, n, self.kv_heads,
            self.head_dim, self.block_size,
        )  # fmt: skip


def _rows_of_heads(t: torch.Tensor) -> bool:
    """(S, H, D) with each row's H * D values contiguous, rows at least that far apart."""
    _, h, d = t.shape
    return t.stride(2) == 1 and t.stride(1) == d and t.stride(0) >= h * d


def check_slots(slots: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every slot inside the pool (index_copy_ would raise; the native write must not run)."""
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise IndexError(f"a slot outside the pool of {num_blocks} x {block_size} rows")
