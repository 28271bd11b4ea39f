"""A step's prefill chunks attend in groups of one shape (kvpage.model.prefill_groups): fresh and
cached-context chunks, adjacent and scattered in the packed batch, with and without a sliding
window, each row equal to a float64 softmax over exactly its own keys, in one SDPA call a group."""

from __future__ import annotations

import pytest
import torch

import kvpage.model.attention as attention
from kvpage.kv.format import kv_format
from kvpage.kv.storage import KVStorage
from kvpage.model.paged_attention import PagedAttention, PagedAttentionMetadata, PrefillChunk
from kvpage.model.prefill_groups import group_prefills

NB, B, H, KVH, D = 64, 4, 4, 2, 16
SCALE = D**-0.5
# (cached tokens, new tokens) per chunk, in batch order: two fresh chunks of 5 apart, two of
# 7 + 3 apart, two of 4 + 3 side by side, one of its own shape
CHUNKS = [(0, 5), (7, 3), (0, 5), (7, 3), (4, 3), (4, 3), (9, 6)]


def _step(seed: int):
    """A storage holding each chunk's cached context, the step's metadata and its new q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    storage = KVStorage(1, NB, B, KVH, D, kv_format("auto", torch.float32), "cpu")
    free = torch.randperm(NB * B, generator=gen).tolist()  # slots scattered over the pool
    prefills, new_slots, contexts, at = [], [], [], 0
    for cached, new in CHUNKS:
        ctx = [free.pop() for _ in range(cached + new)]
        k_c, v_c = torch.randn(2, cached, KVH, D, generator=gen)
        storage.write(0, torch.tensor(ctx[:cached], dtype=torch.long), k_c, v_c)
        slots = torch.tensor(ctx, dtype=torch.long) if cached else None
        prefills.append(PrefillChunk(at, at + new, slots))
        new_slots += ctx[cached:]
        contexts.append((k_c, v_c))
        at += new
    meta = PagedAttentionMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.long),
        cu_seqlens_q=[p.token_start for p in prefills] + [at],
        decode_rows=torch.empty(0, dtype=torch.long),
        decode_tables=torch.empty(0, 1, dtype=torch.long),
        decode_mask=torch.empty(0, 1, 1, B, dtype=torch.bool),
        prefills=prefills,
    )
    q = torch.randn(at, H, D, generator=gen)
    k, v = torch.randn(2, at, KVH, D, generator=gen)
    return storage, meta, (q, k, v), contexts


def _oracle(q, k, v, contexts, window):
    """Each chunk on its own, in float64: softmax over its cached keys and its causal own."""
    out, at = [], 0
    for (cached, new), (k_c, v_c) in zip(CHUNKS, contexts, strict=True):
        keys = torch.cat((k_c, k[at : at + new])).double().repeat_interleave(H // KVH, 1)
        vals = torch.cat((v_c, v[at : at + new])).double().repeat_interleave(H // KVH, 1)
        scores = torch.einsum("thd,shd->hts", q[at : at + new].double(), keys) * SCALE
        pos_q = torch.arange(cached, cached + new)[:, None]
        pos_k = torch.arange(cached + new)[None, :]
        allowed = pos_k <= pos_q
        if window is not None:
            allowed &= pos_k > pos_q - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", scores.softmax(-1), vals))
        at += new
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 4])
def test_grouped_prefill_rows_equal_each_chunk_alone(window, monkeypatch):
    storage, meta, (q, k, v), contexts = _step(seed=1)
    calls = []
    sdpa = attention.F.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        calls.append(query.shape[0])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted)
    out = PagedAttention(storage, meta).attend(0, q, k, v, SCALE, window)
    expect = _oracle(q, k, v, contexts, window)
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)
    assert sorted(calls) == [1, 2, 2, 2]  # one call per shape, batched over its chunks


def test_groups_keep_batch_rows_and_contexts_in_chunk_order():
    _, meta, _, _ = _step(seed=2)
    groups = group_prefills(meta.prefills, torch.device("cpu"))
    assert [g.count for g in groups] == [2, 2, 2, 1]
    fresh, cached, adjacent, single = groups
    assert fresh.context_slots is None
    assert torch.equal(fresh.rows, torch.tensor([0, 1, 2, 3, 4, 8, 9, 10, 11, 12]))
    first, second = meta.prefills[1], meta.prefills[3]
    assert torch.equal(cached.context_slots, torch.cat((first.context_slots, second.context_slots)))
    assert adjacent.rows == slice(16, 22)  # side by side: a view, no gather
    assert single.rows == slice(22, 28) and single.context_slots is meta.prefills[6].context_slots
