"""The native paged decode kernel against float64 SDPA over the same blocks gathered in torch."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from kvpage import LLM, SamplingParams
from kvpage.model import native_attention, native_build
from kvpage.model.decode_attention import decode_attention
from kvpage.model.native_attention import PagedDecode
from kvpage.model.native_build import NativeBuildError

pytestmark = pytest.mark.skipif(
    not native_attention.available(), reason="needs a C++ compiler"
)  # the machine kind CI runs on has g++: this never skips there


def _case(seed, dtype, seqs=5, heads=4, kv_heads=2, head_dim=16, block=8, num_blocks=40):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, num_blocks, block, kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.randint(1, 6 * block, (seqs,), generator=g)
    lens[0] = 1  # one token of context
    lens[1] = 2 * block  # exactly full blocks
    max_blocks = int(-(-lens.max() // block)) + 1  # one padding block at least
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens])
    tables[2, :2] = tables[3, :2]  # a shared prefix: two sequences read the same blocks
    q = torch.randn(seqs, heads, head_dim, generator=g).to(dtype)
    return q, pool, tables, lens


def _reference(q, pool, tables, lens, scale, window=None):
    s, max_blocks = tables.shape
    _, nb, b, kvh, d = pool.shape
    k = pool[0][tables.reshape(-1)].view(s, max_blocks * b, kvh, d).transpose(1, 2).double()
    v = pool[1][tables.reshape(-1)].view(s, max_blocks * b, kvh, d).transpose(1, 2).double()
    keys = torch.arange(max_blocks * b)[None, :]
    mask = keys < lens[:, None]
    if window is not None:
        mask &= keys >= lens[:, None] - window
    mask = mask.view(s, 1, 1, -1)
    out = F.scaled_dot_product_attention(
        q.double().unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block",
    [(4, 2, 16, 8), (4, 4, 32, 16), (8, 1, 64, 4), (6, 2, 96, 16), (2, 1, 128, 32), (3, 3, 48, 5)]
    # group sizes 4, 6 (no kernel of its own) and 8 at head_dim 128 (too many for the registers)
    + [(8, 2, 64, 16), (12, 2, 32, 16), (16, 2, 128, 16)],
)
def test_kernel_matches_float64_sdpa(dtype, heads, kv_heads, head_dim, block):
    """Within torch's default tolerance for the dtype (bfloat16: rtol 1.6e-2, atol 1e-5)."""
    for seed in range(3):
        q, pool, tables, lens = _case(seed, dtype, heads=heads, kv_heads=kv_heads,
                                      head_dim=head_dim, block=block)  # fmt: skip
        kernel = PagedDecode(tables, lens, pool.shape[1], block)
        out = kernel(q, pool[0], pool[1], head_dim**-0.5)
        assert out.dtype == dtype and out.shape == q.shape
        ref = _reference(q, pool, tables, lens, head_dim**-0.5)
        torch.testing.assert_close(out, ref.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 8, 13, 1000])
def test_a_sliding_window_attends_to_the_last_rows_only(dtype, window):
    """Windows shorter than some contexts, starting mid-block and on a block edge."""
    for seed in range(3):
        q, pool, tables, lens = _case(seed, dtype)
        kernel = PagedDecode(tables, lens, pool.shape[1], 8)
        out = kernel(q, pool[0], pool[1], 0.25, kernel.window_starts(window))
        ref = _reference(q, pool, tables, lens, 0.25, window)
        torch.testing.assert_close(out, ref.to(dtype))


def test_scores_far_below_the_maximum_weigh_as_in_float64():
    """Scores 0 to 150 below the maximum (exact integers, so only exp and the sums can err),
    across 16-token tiles and ragged tails: the kernel's exp in the underflow range too."""
    q, pool, tables, lens = _case(7, torch.float32, heads=2, kv_heads=1, head_dim=32, block=16)
    lens[:] = torch.tensor([1, 17, 31, 33, 47])
    q = torch.zeros_like(q)
    q[..., 0] = 1.0
    offsets = torch.randint(-150, 1, pool.shape[1:3], generator=torch.Generator().manual_seed(3))
    pool[0, ..., 0] = offsets.float().view(*pool.shape[1:3], 1)
    kernel = PagedDecode(tables, lens, pool.shape[1], pool.shape[2])
    out = kernel(q, pool[0], pool[1], 1.0)
    torch.testing.assert_close(out, _reference(q, pool, tables, lens, 1.0).float())


def test_kernel_reads_the_pool_in_place_with_its_strides():
    """The engine's pool is (L, 2, NB, B, KVH, D): a layer's K is a strided view, not a copy."""
    q, pool, tables, lens = _case(7, torch.float32)
    layers = torch.stack((torch.zeros_like(pool), pool))  # layer 1 is the real one
    kernel = PagedDecode(tables, lens, pool.shape[1], pool.shape[2])
    out = kernel(q, layers[1, 0], layers[1, 1], 0.25)
    torch.testing.assert_close(
        out.double(), _reference(q, pool, tables, lens, 0.25), atol=1e-5, rtol=0
    )


def test_padding_never_leaks_into_the_result():
    """Block-table padding and the tail of the last block hold garbage; it must not count."""
    q, pool, tables, lens = _case(3, torch.float32)
    kernel = PagedDecode(tables, lens, pool.shape[1], pool.shape[2])
    clean = kernel(q, pool[0], pool[1], 0.25)
    dirty = pool.clone()
    for s, n in enumerate(lens.tolist()):
        b = pool.shape[2]
        first_unused = n // b
        dirty[:, tables[s, first_unused], n % b :] = 1e4  # beyond the context in its last block
        dirty[:, tables[s, first_unused + 1 :]] = float("nan")
    shared = {int(x) for s, n in enumerate(lens.tolist()) for x in tables[s, : -(-n // b)]}
    for block_id in shared:  # blocks some other sequence reads stay as they were
        dirty[:, block_id] = pool[:, block_id]
    torch.testing.assert_close(kernel(q, dirty[0], dirty[1], 0.25), clean, atol=0, rtol=0)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda t, n: (t.fill_(40), n), "outside"),
        (lambda t, n: (t, n.fill_(0)), "context length"),
        (lambda t, n: (t, n.fill_(10_000)), "context length"),
        (lambda t, n: (t, n[:-1]), "does not match"),
    ],
)
def test_bad_tables_are_refused_before_the_kernel_runs(mutate, match):
    _, pool, tables, lens = _case(0, torch.float32)
    tables, lens = mutate(tables.clone(), lens.clone())
    with pytest.raises(ValueError, match=match):
        PagedDecode(tables, lens, pool.shape[1], pool.shape[2])


def test_bad_operands_are_refused():
    q, pool, tables, lens = _case(0, torch.float32)
    kernel = PagedDecode(tables, lens, pool.shape[1], pool.shape[2])
    with pytest.raises(ValueError, match="one dtype"):
        kernel(q.bfloat16(), pool[0], pool[1], 1.0)
    with pytest.raises(ValueError, match="same shape and strides"):
        kernel(
            q, pool[0], pool[1].contiguous().transpose(0, 1).contiguous().transpose(0, 1)[:, :], 1.0
        )
    with pytest.raises(ValueError, match="does not fit"):
        kernel(q, pool[0][:-1], pool[1][:-1], 1.0)
    for head_dim in (8, 144):
        with pytest.raises(ValueError, match="multiple of 16 up to 128"):
            q7 = torch.randn(q.shape[0], 4, head_dim)
            p7 = torch.randn(2, pool.shape[1], pool.shape[2], 2, head_dim)
            kernel(q7, p7[0], p7[1], 1.0)
    assert not native_attention.supports(torch.float32, torch.device("cpu"), 144)


def test_a_broken_source_is_a_build_error_with_the_compiler_output(tmp_path, monkeypatch):
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(native_attention, "SOURCE", bad)
    monkeypatch.setenv("KVPAGE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(NativeBuildError, match="failed"):
        native_attention.build("g++")
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))  # nothing half-written kept


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("KVPAGE_NATIVE", "0")
    native_attention._library.cache_clear()
    try:
        assert not native_attention.available()
    finally:
        monkeypatch.delenv("KVPAGE_NATIVE")
        native_attention._library.cache_clear()
    assert native_attention.available()


def _run(llm, prompts):
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_decodes_the_same_with_and_without_the_kernel():
    """Prefix hits, several blocks of context, a batch: the torch gather path and the kernel
    give the same tokens and the same logprobs (within float32 accumulation order)."""
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33, 40)] + [list(range(3, 3 + 33))]
    runs = []
    for native in (True, False):
        llm = LLM("builtin:tiny-llama", block_size=8, num_blocks=96, debug_checks=True)
        llm.engine.runner.storage.use_native = native
        runs.append(_run(llm, prompts))
    for with_kernel, torch_path in zip(*runs, strict=True):
        assert with_kernel.token_ids == torch_path.token_ids
        torch.testing.assert_close(
            torch.tensor(with_kernel.token_logprobs), torch.tensor(torch_path.token_logprobs),
            atol=1e-5, rtol=0,
        )  # fmt: skip


def test_grouped_matmul_attention_matches_float64_sdpa():
    """The torch decode path of 16-bit models (the kernel's fallback), within the error bound of
    its two bfloat16 roundings."""
    for seed in range(3):
        q, pool, tables, lens = _case(seed, torch.bfloat16, heads=8, kv_heads=2)
        s, mb = tables.shape
        _, nb, b, kvh, d = pool.shape
        k = pool[0][tables.reshape(-1)].view(s, mb * b, kvh, d).transpose(1, 2)
        v = pool[1][tables.reshape(-1)].view(s, mb * b, kvh, d).transpose(1, 2)
        mask = (torch.arange(mb * b)[None, :] < lens[:, None]).view(s, 1, 1, -1)
        out = decode_attention(q, k, v, mask, 0.25)
        ref = _reference(q, pool, tables, lens, 0.25)
        # Rounding the weights (each off by <= eps/2 relative) moves a convex combination of V
        # rows by <= eps/2 * max|V|, rounding the output by <= eps/2 * |out| <= eps/2 * max|V|.
        bound = torch.finfo(torch.bfloat16).eps * pool[1].abs().max().item()
        torch.testing.assert_close(out.double(), ref, atol=bound, rtol=0)


def test_a_changed_header_beside_the_source_is_a_new_build(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPAGE_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cpp"
    source.write_text('#include "width.h"\nextern "C" int width() { return WIDTH; }\n')
    header = tmp_path / "width.h"
    header.write_text("#define WIDTH 8\n")
    first = native_build.build(source, "g++")
    assert ctypes.CDLL(str(first)).width() == 8
    header.write_text("#define WIDTH 16\n")  # the source itself unchanged
    second = native_build.build(source, "g++")
    assert second != first and ctypes.CDLL(str(second)).width() == 16
    assert native_build.build(source, "g++") == second  # and cached again
