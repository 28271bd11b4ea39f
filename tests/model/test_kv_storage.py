"""The paged KV store in each format (issue 14): a write returns what a read will see; the scales
live beside their block (invalidated on free, copied on CoW, carried by swap); the memory a block
takes; `auto` adds no work."""

from __future__ import annotations

import pytest
import torch

from kvpage.engine.swap import SwapSpace
from kvpage.model.kv_format import kv_format
from kvpage.model.paged_attention import KVStorage

L, NB, B, KVH, D = 2, 6, 4, 2, 16


def _storage(name: str) -> KVStorage:
    return KVStorage(L, NB, B, KVH, D, kv_format(name, torch.float32), "cpu")


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, KVH, D, generator=gen), torch.randn(n, KVH, D, generator=gen) * 4


def _write_block(st: KVStorage, block: int, seed: int, layer: int = 0):
    slots = torch.arange(block * B, (block + 1) * B)
    return st.write(layer, slots, *_kv(B, seed))


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "bfloat16", "auto"])
def test_reads_return_exactly_what_the_write_returned(name):
    st = _storage(name)
    slots = torch.tensor([5, 0, 13, 7, 2])  # any order, across blocks
    k, v = _kv(5, 0)
    k_w, v_w = st.write(1, slots, k, v)
    k_r, v_r = st.read_slots(1, slots)
    assert torch.equal(k_r, k_w) and torch.equal(v_r, v_w)
    # the padded block gather sees the same values at the same positions
    tables = torch.tensor([[1, 3], [0, 0]])  # (S, max_blocks)
    k_g, v_g = st.gather_blocks(1, tables)  # (S, KVH, 2B, D)
    assert torch.equal(k_g[0, :, 1], k_w[0])  # slot 5 = block 1, offset 1
    assert torch.equal(v_g[0, :, B + 1], v_w[2])  # slot 13 = block 3, offset 1
    assert torch.equal(k_g[1, :, 2], k_w[4])  # slot 2 = block 0, offset 2
    if name == "auto":
        assert k_w is k and v_w is v  # the model's own dtype: no round trip, no copy
        assert st.scales is None and st.data.dtype == torch.float32
    else:
        assert not torch.equal(k_w, k)


def test_scales_are_per_token_and_head_beside_the_block():
    st = _storage("int8")
    assert st.scales.shape == (L, 2, NB, B, KVH) and st.scales.dtype == torch.float16
    k, v = _kv(B, 3)
    _write_block(st, 2, 3, layer=1)
    expect_k = (k.abs().amax(-1) / 127).half()
    assert torch.equal(st.scales[1, 0, 2], expect_k)
    assert torch.equal(st.scales[1, 1, 2], (v.abs().amax(-1) / 127).half())
    assert st.scales[0].abs().sum() == 0 and st.scales[1, :, 1].abs().sum() == 0  # untouched


def test_invalidate_zeroes_one_blocks_scales_only():
    st = _storage("int8")
    _write_block(st, 1, 0)
    _write_block(st, 2, 1)
    before = st.scales[:, :, 2].clone()
    st.invalidate(1)
    assert st.scales[:, :, 1].abs().sum() == 0
    assert torch.equal(st.scales[:, :, 2], before)
    k, _ = st.read_slots(0, torch.arange(B, 2 * B))
    assert torch.all(k == 0)  # a read of a freed block sees nothing of its last owner


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_copy_block_carries_data_and_scales(name):
    st = _storage(name)
    k_w, v_w = _write_block(st, 1, 4)
    _write_block(st, 4, 5)  # something else in the destination first
    st.copy_block(1, 4)
    k, v = st.read_slots(0, torch.arange(4 * B, 5 * B))
    assert torch.equal(k, k_w) and torch.equal(v, v_w)
    assert torch.equal(st.scales[:, :, 4], st.scales[:, :, 1])


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "auto"])
def test_swap_out_and_in_carries_scales(name):
    st = _storage(name)
    written = [_write_block(st, b, 10 + b) for b in (0, 3)]
    space = SwapSpace(capacity_blocks=4)
    space.write(7, st.read_blocks([0, 3]))
    assert space.used_blocks == 2
    for b in (0, 3):  # the blocks are freed and reused by someone else
        st.invalidate(b)
        _write_block(st, b, 99)
    saved = space.take(7)
    assert space.used_blocks == 0 and saved.num_blocks == 2
    st.write_blocks([5, 2], saved)
    for (k_w, v_w), dst in zip(written, (5, 2), strict=True):
        k, v = st.read_slots(0, torch.arange(dst * B, (dst + 1) * B))
        assert torch.equal(k, k_w) and torch.equal(v, v_w)


@pytest.mark.parametrize(("head_dim", "ratio"), [(16, 64 / 18), (32, 128 / 34), (64, 256 / 66)])
def test_a_quantized_block_takes_at_most_a_3_5th_of_a_float32_one(head_dim, ratio):
    f32 = KVStorage.bytes_per_block(2, 16, 2, head_dim, kv_format("auto", torch.float32))
    assert f32 == 2 * 2 * 16 * 2 * head_dim * 4
    for name in ("int8", "fp8_e4m3"):
        q = KVStorage.bytes_per_block(2, 16, 2, head_dim, kv_format(name, torch.float32))
        assert f32 / q == pytest.approx(ratio) and f32 / q >= 3.5
        st = KVStorage(2, 3, 16, 2, head_dim, kv_format(name, torch.float32), "cpu")
        assert st.nbytes == 3 * q


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_appending_to_a_partial_block_never_requantises_its_tokens(name):
    """The partial-block rule: per-token scales, so a block written in one go and the same block
    written as 3 + 1 + 4 tokens (chunked prefill, then decode steps) hold the same bytes."""
    whole, pieces = _storage(name), _storage(name)
    k, v = _kv(2 * B, 7)
    whole.write(0, torch.arange(B, 3 * B), k, v)
    for lo, hi in ((0, 3), (3, 4), (4, 2 * B)):
        pieces.write(0, torch.arange(B + lo, B + hi), k[lo:hi], v[lo:hi])
        if hi < 2 * B:  # what is already there does not move when more arrives
            assert torch.equal(pieces.data[0, :, 1:3].flatten(1, 2)[:, :hi],
                               whole.data[0, :, 1:3].flatten(1, 2)[:, :hi])
    assert torch.equal(pieces.data, whole.data) and torch.equal(pieces.scales, whole.scales)
